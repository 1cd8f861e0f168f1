"""Triton backend: the three ops with exactly the op signatures, for any tensors Triton can address
(CUDA/ROCm GPUs, and CPU tensors under TRITON_INTERPRET=1).

Arguments are checked by the same C++ routine as every other backend (torch.ops.lora_ops._check_*), which also
returns the index tensors in the kernels' form (int32, contiguous, int64 values saturated: one conversion for all
backends); then a kernel config is picked from a small table by shape class: no autotuning inside a serving process.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch
import triton

from .kernels import (build_segments_kernel, grouped_gemm_kernel, lora_expand_kernel, lora_expand_rows_kernel,
                      sgmv_kernel)

_check_sgmv = torch.ops.lora_ops._check_sgmv.default
_check_lora_expand = torch.ops.lora_ops._check_lora_expand.default
_check_grouped_gemm = torch.ops.lora_ops._check_grouped_gemm.default
_check_build_segments = torch.ops.lora_ops._check_build_segments.default
_MAX_SLICES = 8
_MAX_GRID_COLUMNS = 65535  # CUDA's limit on a grid's second dimension
_MAX_BLOCK = 1 << 20  # Triton's largest block, in elements


def _check_launchable(op: str, grid, N: int, R: int, block: int) -> None:
    """The Triton kernels loop neither over column programs nor over the rank: where a launch would pass CUDA's
    grid limit or Triton's largest block, a ValueError naming the size, instead of a launch or compile error that
    names nothing (the C++ kernels loop, and take these sizes)."""
    if grid[1] > _MAX_GRID_COLUMNS:
        raise ValueError(f"lora_ops.{op} (Triton): y's N = {N} columns need {grid[1]} column programs, more than "
                         f"CUDA's {_MAX_GRID_COLUMNS}")
    if block > _MAX_BLOCK:
        raise ValueError(f"lora_ops.{op} (Triton): the rank R = {R} needs a block of {block} elements, more than "
                         f"Triton's {_MAX_BLOCK}")

# Programs to aim for: enough to cover an H100/H200-class GPU about twice.
_TARGET_PROGRAMS = 264


def tile_bound(positions: int, segments: int, block_m: int) -> int:
    """Upper bound on the tiles of block_m positions over all segments, from host-known sizes only."""
    return max(1, min(positions, triton.cdiv(positions, block_m) + segments))


def sgmv_config(positions: int, segments: int, width: int, max_rank: int, fp32: bool) -> dict:
    """Kernel config by shape class (no autotuning in a serving process; table from benchmarks/triton_sweep.py).

    Each program shrinks its tile over all of K, then expands into 1/N_SPLITS of a slice's columns: splitting the
    columns buys parallelism at the price of re-reading A (from L2) per split."""
    block_m = 16 if positions <= 256 else 64
    tiles = tile_bound(positions, segments, block_m)
    splits = 1
    while splits < 16 and tiles * splits * 2 <= _TARGET_PROGRAMS and width // (splits * 2) >= 256:
        splits *= 2
    block_r = max(16, triton.next_power_of_2(max_rank))
    # The A tile is BLOCK_K x BLOCK_R and the B tile BLOCK_R x BLOCK_N, each pipelined in stages: keep both
    # within the shared memory (fp32 rank 256 with 128 columns needed 280 KB of the H200's 227 KB).
    budget = 8192 if fp32 else 32768
    block_k = max(32, min(256 if block_m == 16 else 64, budget // block_r))
    block_n = max(32, min(128, budget // block_r)) if fp32 else 128
    return dict(BLOCK_M=block_m, BLOCK_K=block_k, BLOCK_N=block_n, N_SPLITS=splits, num_warps=4)


def sgmv(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices=None, lora_ranks=None, lora_scales=None,
         slice_offsets: Optional[Sequence[int]] = None, scale: float = 1.0) -> None:
    seg_indptr, seg_lora, token_indices, lora_ranks = _check_sgmv(
        y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales, slice_offsets)
    launch_sgmv(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                slice_offsets, scale)


def launch_sgmv(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
                slice_offsets, scale, config: Optional[dict] = None) -> None:
    """sgmv without the argument checks: index tensors already int32 and contiguous (as _check_sgmv returns
    them); `config` overrides the shape-class table (for tuning sweeps)."""
    T, K = x.shape
    N = y.shape[1]
    offsets = list(slice_offsets) if slice_offsets is not None else [0, N]
    S = len(offsets) - 1
    R = lora_a.shape[1] // S
    G = seg_lora.shape[0]
    positions = token_indices.shape[0] if token_indices is not None else T
    # K = 0 included: an empty reduction contributes exactly zero whatever the scales (y bitwise unchanged).
    if T == 0 or G == 0 or R == 0 or N == 0 or K == 0:
        return
    cfg = config or sgmv_config(positions, G, max(b - a for a, b in zip(offsets, offsets[1:])), R,
                                x.dtype == torch.float32)
    offsets += [N] * (_MAX_SLICES + 1 - len(offsets))
    grid = (tile_bound(positions, G, cfg["BLOCK_M"]), S * cfg["N_SPLITS"])
    block_r = max(16, triton.next_power_of_2(R))
    _check_launchable("sgmv", grid, N, R, block_r * max(cfg["BLOCK_K"], cfg["BLOCK_N"]))
    sgmv_kernel[grid](
        y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
        T, K, lora_a.shape[0], R, positions, G, y.stride(0), x.stride(0), lora_a.stride(0), lora_a.stride(1),
        lora_b.stride(0), lora_b.stride(1), lora_scales.stride(0) if lora_scales is not None else 0, float(scale),
        *offsets,
        HAS_IDX=token_indices is not None, HAS_RANKS=lora_ranks is not None, HAS_SCALES=lora_scales is not None,
        IEEE=x.dtype == torch.float32, BLOCK_R=block_r, SCAN=_scan_width(G), **cfg)


def expand_config(positions: int, segments: int, max_rank: int, fp32: bool) -> dict:
    """lora_expand's config: sgmv's tiles without the shrink, one BLOCK_N column block per program. A column split
    re-reads nothing here, and at decode sizes the cost is each program's chain of dependent loads, not their
    number."""
    cfg = sgmv_config(positions, segments, 0, max_rank, fp32)
    del cfg["BLOCK_K"]
    return cfg


def lora_expand(y, h, lora_b, seg_indptr, seg_lora, token_indices=None, lora_ranks=None, lora_scales=None,
                slice_offsets: Optional[Sequence[int]] = None, scale: float = 1.0) -> None:
    seg_indptr, seg_lora, token_indices, lora_ranks = _check_lora_expand(
        y, h, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales, slice_offsets)
    T, N = y.shape
    R = lora_b.shape[2]
    offsets = list(slice_offsets) if slice_offsets is not None else [0, N]
    S = len(offsets) - 1
    G = seg_lora.shape[0]
    positions = token_indices.shape[0] if token_indices is not None else T
    if T == 0 or G == 0 or R == 0 or N == 0:
        return
    if seg_indptr is None:
        _lora_expand_rows(y, h, lora_b, seg_lora, token_indices, lora_ranks, lora_scales, offsets, scale)
        return
    cfg = expand_config(positions, G, R, lora_b.dtype == torch.float32)
    cfg["N_SPLITS"] = triton.cdiv(max(b - a for a, b in zip(offsets, offsets[1:])), cfg["BLOCK_N"])
    offsets += [N] * (_MAX_SLICES + 1 - len(offsets))
    grid = (tile_bound(positions, G, cfg["BLOCK_M"]), S * cfg["N_SPLITS"])
    block_r = max(16, triton.next_power_of_2(R))
    _check_launchable("lora_expand", grid, N, R, block_r * cfg["BLOCK_N"])
    lora_expand_kernel[grid](
        y, h, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales,
        T, lora_b.shape[0], R, positions, G, y.stride(0), h.stride(0), h.stride(1), lora_b.stride(0),
        lora_b.stride(1), lora_scales.stride(0) if lora_scales is not None else 0, float(scale), *offsets,
        HAS_IDX=token_indices is not None, HAS_RANKS=lora_ranks is not None, HAS_SCALES=lora_scales is not None,
        IEEE=lora_b.dtype == torch.float32, BLOCK_R=block_r, SCAN=_scan_width(G), **cfg)


def _lora_expand_rows(y, h, lora_b, slots, token_indices, lora_ranks, lora_scales, offsets, scale):
    """The rows form: one program per (position, slice x column block), BLOCK_N x BLOCK_R of B per step."""
    block_r = max(16, triton.next_power_of_2(lora_b.shape[2]))
    block_n = max(32, min(256, 4096 // block_r))
    n_splits = triton.cdiv(max(b - a for a, b in zip(offsets, offsets[1:])), block_n)
    S = len(offsets) - 1
    offsets = offsets + [y.shape[1]] * (_MAX_SLICES + 1 - len(offsets))
    grid = (slots.shape[0], S * n_splits)
    _check_launchable("lora_expand", grid, y.shape[1], lora_b.shape[2], block_r * block_n)
    lora_expand_rows_kernel[grid](
        y, h, lora_b, slots, token_indices, lora_ranks, lora_scales, y.shape[0], lora_b.shape[0], lora_b.shape[2],
        y.stride(0), h.stride(0), h.stride(1), lora_b.stride(0), lora_b.stride(1),
        lora_scales.stride(0) if lora_scales is not None else 0, float(scale), *offsets,
        HAS_IDX=token_indices is not None, HAS_RANKS=lora_ranks is not None, HAS_SCALES=lora_scales is not None,
        N_SPLITS=n_splits, BLOCK_R=block_r, BLOCK_N=block_n)


def _scan_width(segments: int) -> int:
    return min(1024, max(16, triton.next_power_of_2(segments)))


def grouped_gemm_config(positions: int, N: int, K: int, x_bytes: int, w_bytes: int, smem_bytes: int) -> dict:
    """grouped_gemm's config by shape class (table from benchmarks/triton_sweep.py --op grouped_gemm on the H200,
    lora_ops/triton/NOTES.md). Past 256 positions: the LoRA shrink (n <= 16) takes K steps of 128 (40.1 -> 35.3 µs),
    the LoRA expand (k <= 16) 64-column blocks (132 -> 123 µs), and a GEMM with n >= 256 and 16-bit inputs 128 x 256
    tiles of 8 warps (424 -> 631 TFLOP/s at 8x512x4096x4096). Each only where its 3 stages of an x tile and a w
    tile (x_bytes, w_bytes per element) fit the device's shared memory, smem_bytes."""
    cfg = dict(BLOCK_M=16 if positions <= 256 else 64, BLOCK_N=min(128, max(16, triton.next_power_of_2(N))),
               BLOCK_K=min(64, max(16, triton.next_power_of_2(K))), num_warps=4)
    if positions <= 256:
        return cfg
    if N <= 16:
        tuned = dict(cfg, BLOCK_K=min(128, max(16, triton.next_power_of_2(K))), num_stages=3)
    elif K <= 16:
        tuned = dict(cfg, BLOCK_N=64, num_stages=3)
    elif N >= 256 and K >= 64 and x_bytes == w_bytes == 2:
        tuned = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
    else:
        return cfg
    stages = tuned["num_stages"] * tuned["BLOCK_K"] * (tuned["BLOCK_M"] * x_bytes + tuned["BLOCK_N"] * w_bytes)
    return tuned if stages <= smem_bytes else cfg


def device_index(device: torch.device) -> int:
    """A CUDA device's index (the current device for a bare "cuda")."""
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.lru_cache(maxsize=None)
def _smem_optin(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).shared_memory_per_block_optin


def grouped_gemm(y, x, w, seg_indptr, seg_weight, token_indices=None, n_sizes=None, k_sizes=None,
                 alpha: float = 1.0, accumulate: bool = True) -> None:
    seg_indptr, seg_weight, token_indices, n_sizes, k_sizes = _check_grouped_gemm(
        y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes)
    launch_grouped_gemm(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes, alpha, accumulate)


def launch_grouped_gemm(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes, alpha, accumulate,
                        config: Optional[dict] = None) -> None:
    """grouped_gemm without the argument checks (index tensors as _check_grouped_gemm returns them); `config`
    overrides the shape-class table (for tuning sweeps)."""
    T, K = x.shape
    N = y.shape[1]
    G = seg_weight.shape[0]
    positions = token_indices.shape[0] if token_indices is not None else T
    if T == 0 or G == 0 or N == 0:
        return
    # Under the interpreter (CPU tensors) shared memory does not bound a tile.
    smem = _smem_optin(device_index(x.device)) if x.device.type == "cuda" else 1 << 30
    cfg = config or grouped_gemm_config(positions, N, K, x.element_size(), w.element_size(), smem)
    grid = (tile_bound(positions, G, cfg["BLOCK_M"]), triton.cdiv(N, cfg["BLOCK_N"]))
    _check_launchable("grouped_gemm", grid, N, 0, cfg["BLOCK_K"] * cfg["BLOCK_N"])
    grouped_gemm_kernel[grid](
        y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes,
        T, N, K, w.shape[0], positions, G, y.stride(0), x.stride(0), w.stride(0), w.stride(1), float(alpha),
        HAS_IDX=token_indices is not None, HAS_N=n_sizes is not None, HAS_K=k_sizes is not None,
        ACCUMULATE=bool(accumulate), X_F32=x.dtype != w.dtype, IEEE=w.dtype == torch.float32,
        SCAN=_scan_width(G), **cfg)


def build_segments(token_lora: torch.Tensor, num_slots: int):
    token_lora = _check_build_segments(token_lora, num_slots)
    T = token_lora.shape[0]
    opts = dict(dtype=torch.int32, device=token_lora.device)
    token_indices = torch.empty(T, **opts)
    seg_indptr = torch.empty(num_slots + 1, **opts)
    seg_lora = torch.empty(num_slots, **opts)
    block_t = min(1024, max(16, triton.next_power_of_2(max(T, 1))))
    build_segments_kernel[(num_slots + 1,)](token_lora, token_indices, seg_indptr, seg_lora, T, num_slots,
                                            BLOCK_T=block_t, num_warps=4)
    return token_indices, seg_indptr, seg_lora
