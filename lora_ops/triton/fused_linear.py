"""A linear layer with its multi-LoRA delta in the same kernel, for decode: no separate expand.

`linear_lora(y, x, w, bias, lora_a, lora_b, token_lora, ...)` writes, per row t with slot l = token_lora[t] and
slice s (docs/design.md §2's sgmv, routed per token as in BGMV):

    y[t] = x[t]·Wᵀ + bias  +  scale · lora_scales[l] · (x[t]·A[l, s·R : s·R + r_l]ᵀ) · B[l, off_s:off_{s+1}, :r_l]ᵀ

in two kernels:

1. `lora_shrink_kernel`: h[t, :] = x[t]·A[slot_t]ᵀ in float32, one program per (slot, row tile, K split); a
   program whose slot no row of its tile uses leaves at once, so only the adapters present are read, each once
   per row tile. K splits are summed in split order by the last split to arrive (`_sum_parts`).
2. `linear_lora_kernel`: per output tile, parts that stream K-chunks of W (a skinny GEMM, the base cost) and one
   LoRA part that adds h·Bᵀ as extra "K" steps over the pool's slots: step j covers slots [l0, l0 + G) × their
   ranks, its left operand is each row's h window where the row's slot is that slot (else 0) and its right one
   B[slot, tile columns, :rank], loaded only for slots that a row of the tile uses. The parts' float32 results
   are summed in part order by the last part to arrive, which adds the bias and stores y once.

On sm_90 the linear kernel is launched with programmatic dependent launch: its W parts stream while the shrink
runs, and only the LoRA part waits for h (gdc_wait). Reductions are in a fixed order (no floating-point atomics),
so results are bitwise deterministic; the arrival counters are integers that the last part resets to 0, so the
calls need no memset and are CUDA-graph safe. The counters are per device: calls must not run concurrently on
two streams of one device.
"""
from __future__ import annotations

import functools
from typing import Dict, Optional, Sequence, Tuple

import torch
import triton
import triton.language as tl
try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
    _HAS_GDC = True
except ImportError:  # Triton before 3.4 (no grid dependency control): launched without PDL, these never run
    gdc_launch_dependents = gdc_wait = None
    _HAS_GDC = False

from . import device_index
from .kernels import _dot_f32_lhs, _pick

_MAX_SLICES = 8
_TARGET_PROGRAMS = 264  # two per SM of an H100/H200
_SHRINK_K_CHUNK = 512   # K per shrink program: 1 adapter still spreads over K / 512 programs


@triton.jit
def _sum_parts(acc, ws_tile, counter_ptr, part, PARTS: tl.constexpr, BLOCK_A: tl.constexpr,
               BLOCK_B: tl.constexpr):
    """Store this part's float32 tile in the workspace, count the arrival; the last part to arrive gets
    (True, the sum of all PARTS tiles in part order) and resets the counter; the others get (False, 0)."""
    offs = tl.arange(0, BLOCK_A)[:, None] * BLOCK_B + tl.arange(0, BLOCK_B)[None, :]
    tl.store(ws_tile + part * (BLOCK_A * BLOCK_B) + offs, acc)
    tl.debug_barrier()  # every thread's partial is written before the (release) arrival
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    last = arrived == PARTS - 1
    total = tl.zeros((BLOCK_A, BLOCK_B), dtype=tl.float32)
    if last:
        for p in tl.static_range(PARTS):  # fixed order: the same bits whatever order the parts arrived in
            total += tl.load(ws_tile + p * (BLOCK_A * BLOCK_B) + offs, cache_modifier=".cg")
        tl.atomic_xchg(counter_ptr, 0)  # ready for the next call (or graph replay)
    return last, total


@triton.jit
def lora_shrink_kernel(h_ptr, x_ptr, a_ptr, token_lora_ptr, ranks_ptr, ws_ptr, counters_ptr,
                       T, K, L, R, SR, h_stride, x_stride, a_s0, a_s1,
                       HAS_RANKS: tl.constexpr, IEEE: tl.constexpr, USE_PDL: tl.constexpr, SPLIT_K: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_SR: tl.constexpr):
    """Program (slot l, row tile, K split): h[t, j] = x[t]·A[l, j]ᵀ for the tile's rows t on slot l and the
    columns j = s·R + r with r < rank_l. Nothing else of h is written (the linear kernel reads nothing else)."""
    if USE_PDL:
        gdc_launch_dependents()  # the linear kernel may start streaming W now
    pid = tl.program_id(0)
    split = pid % SPLIT_K
    group = pid // SPLIT_K
    m_tiles = tl.cdiv(T, BLOCK_M)
    slot = group // m_tiles
    rows = (group % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = rows < T
    mine = rmask & (tl.load(token_lora_ptr + rows, mask=rmask, other=-1) == slot)
    rank = R
    if HAS_RANKS:
        rank = tl.minimum(tl.maximum(tl.load(ranks_ptr + slot), 0), R)
    # Every split of (slot, tile) takes the same exit, so the arrival count stays consistent.
    if (tl.max(mine.to(tl.int32), axis=0) == 0) | (rank == 0):
        return
    jj = tl.arange(0, BLOCK_SR)
    live = (jj < SR) & (jj % R < rank)
    chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_begin = split * chunk
    k_end = tl.minimum(k_begin + chunk, K)
    rows64 = rows.to(tl.int64)
    # x[rows on slot l] · A[l]ᵀ: A[l] as the weight of a linear chunk, its rows j the output columns
    acc = _linear_chunk(x_ptr, a_ptr + slot.to(tl.int64) * a_s0, rows64, mine, jj.to(tl.int64), live, k_begin, k_end,
                        x_stride, a_s1, IEEE, BLOCK_M, BLOCK_SR, BLOCK_K)
    if SPLIT_K > 1:
        last, acc = _sum_parts(acc, ws_ptr + group.to(tl.int64) * (SPLIT_K * BLOCK_M * BLOCK_SR),
                               counters_ptr + group, split, SPLIT_K, BLOCK_M, BLOCK_SR)
        if not last:
            return
    tl.store(h_ptr + rows64[:, None] * h_stride + jj[None, :], acc, mask=mine[:, None] & live[None, :])


@triton.jit
def _linear_chunk(x_ptr, w_ptr, rows64, rmask, nn64, nmask, k_begin, k_end, x_stride, w_stride,
                  IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """x[rows, k_begin:k_end] · W[nn, k_begin:k_end]ᵀ in float32."""
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        kk = k0 + offs_k
        kmask = kk < k_end
        xt = tl.load(x_ptr + rows64[:, None] * x_stride + kk[None, :], mask=rmask[:, None] & kmask[None, :],
                     other=0.0)
        wt = tl.load(w_ptr + nn64[None, :] * w_stride + kk[:, None], mask=kmask[:, None] & nmask[None, :],
                     other=0.0)
        if IEEE:
            acc += tl.dot(xt, wt, input_precision="ieee")
        else:
            acc += tl.dot(xt, wt)
    return acc


@triton.jit
def _lora_delta(h_ptr, b_ptr, token_lora_ptr, ranks_ptr, scales_ptr, rows64, rmask, nn, nmask, L, R, h_stride,
                b_s0, b_s1, scales_stride, scale, num_slices, o0, o1, o2, o3, o4, o5, o6, o7, o8,
                HAS_RANKS: tl.constexpr, HAS_SCALES: tl.constexpr, USE_PDL: tl.constexpr, IEEE: tl.constexpr,
                H_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    """The tile's LoRA delta, float32: coef_t · h[t, s·R : s·R + r_l] · B[l, tile columns of slice s, :r_l]ᵀ,
    as one step of BLOCK_R ranks per slot (4 slots a step took 255 registers a thread with spills on sm_90a, and
    this part's register count is the whole kernel's; one slot takes 128, none spilled). Per-row slot, rank and coefficient are loaded once; inside the
    loop only h and B are loaded (masked loads, nothing else carried between pipeline stages: registers), B only
    for slots present in the tile and ranks below theirs. A row has one slot, so its coefficient scales its row
    of the sum once, after the loop. H_SPLIT: h enters the dot as hi + lo halves (float32-accurate, for a float32
    y); else rounded once to B's dtype, below a half-precision y's own rounding (as the CUDA sgmv does)."""
    slot = tl.load(token_lora_ptr + rows64, mask=rmask, other=-1)
    valid = rmask & (slot >= 0) & (slot < L)
    slot = tl.where(valid, slot, -1).to(tl.int32)  # an int64 slot past int32 becomes -1, never a valid one
    rank = tl.zeros((BLOCK_M,), dtype=tl.int32) + R
    if HAS_RANKS:
        rank = tl.minimum(tl.maximum(tl.load(ranks_ptr + slot, mask=valid, other=0), 0), R).to(tl.int32)
    rank = tl.where(valid, rank, 0)  # a row without LoRA takes no step and gets exactly 0 below
    coef = tl.zeros((BLOCK_M,), dtype=tl.float32) + scale
    if HAS_SCALES:
        coef = coef * tl.load(scales_ptr + slot.to(tl.int64) * scales_stride, mask=valid, other=1.0)
    if USE_PDL:
        gdc_wait()  # h is the shrink kernel's output
    r = tl.arange(0, BLOCK_R)
    nn64 = nn.to(tl.int64)
    n_first = tl.min(nn, axis=0)
    n_last = tl.max(tl.where(nmask, nn, n_first), axis=0)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for s in range(num_slices):
        lo = _pick(s, o0, o1, o2, o3, o4, o5, o6, o7, o8)
        hi = _pick(s + 1, o0, o1, o2, o3, o4, o5, o6, o7, o8)
        if (lo < hi) & (lo <= n_last) & (hi > n_first):  # the tile holds columns of slice s
            cols = nmask & (nn >= lo) & (nn < hi)
            h_base = h_ptr + rows64[:, None] * h_stride + (s * R + r)[None, :]
            for l in range(0, L):
                lk = l + tl.zeros((BLOCK_R,), dtype=tl.int32)  # the step's slot, per rank column
                takes = (slot[:, None] == lk[None, :]) & (r[None, :] < rank[:, None])  # [BLOCK_M, BLOCK_R]
                present = tl.max(takes.to(tl.int32), axis=0) > 0  # a row of the tile has slot l, rank > r
                hv = tl.load(h_base, mask=takes, other=0.0)
                bt = tl.load(b_ptr + lk.to(tl.int64)[:, None] * b_s0 + nn64[None, :] * b_s1 + r[:, None],
                             mask=present[:, None] & cols[None, :], other=0.0)
                if IEEE | H_SPLIT:
                    acc += _dot_f32_lhs(hv, bt, IEEE)
                else:
                    acc += tl.dot(hv.to(bt.dtype), bt)
    # Rows without a slot or of a rank-0 slot took no step: exactly 0, not 0 · coef (coef may be inf or NaN).
    return tl.where((rank > 0)[:, None], acc * coef[:, None], 0.0)


@triton.jit
def linear_lora_kernel(y_ptr, x_ptr, w_ptr, bias_ptr, h_ptr, b_ptr, token_lora_ptr, ranks_ptr, scales_ptr,
                       ws_ptr, counters_ptr,
                       T, N, K, L, R, y_stride, x_stride, w_stride, h_stride, b_s0, b_s1, scales_stride, scale,
                       num_slices, o0, o1, o2, o3, o4, o5, o6, o7, o8,
                       HAS_BIAS: tl.constexpr, HAS_LORA: tl.constexpr, HAS_RANKS: tl.constexpr,
                       HAS_SCALES: tl.constexpr, USE_PDL: tl.constexpr, IEEE: tl.constexpr, H_SPLIT: tl.constexpr,
                       SPLIT_K: tl.constexpr, PARTS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """Program (output tile, part): part 0 is the LoRA delta when HAS_LORA, the others K-chunks of x·Wᵀ
    (PARTS = SPLIT_K + HAS_LORA). Parts of one tile are adjacent programs, the row tiles of one column block
    adjacent tiles (they read the same W columns at about the same time)."""
    pid = tl.program_id(0)
    part = pid % PARTS
    tile = pid // PARTS
    m_tiles = tl.cdiv(T, BLOCK_M)
    rows = (tile % m_tiles) * BLOCK_M + tl.arange(0, BLOCK_M)
    nn = (tile // m_tiles) * BLOCK_N + tl.arange(0, BLOCK_N)
    rmask = rows < T
    nmask = nn < N
    rows64 = rows.to(tl.int64)
    split = part - (PARTS - SPLIT_K)
    if split < 0:
        acc = _lora_delta(h_ptr, b_ptr, token_lora_ptr, ranks_ptr, scales_ptr, rows64, rmask, nn, nmask, L, R,
                          h_stride, b_s0, b_s1, scales_stride, scale, num_slices, o0, o1, o2, o3, o4, o5, o6, o7,
                          o8, HAS_RANKS, HAS_SCALES, USE_PDL, IEEE, H_SPLIT, BLOCK_M, BLOCK_N, BLOCK_R)
    else:
        chunk = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
        k_begin = split * chunk
        acc = _linear_chunk(x_ptr, w_ptr, rows64, rmask, nn.to(tl.int64), nmask, k_begin,
                            tl.minimum(k_begin + chunk, K), x_stride, w_stride, IEEE, BLOCK_M, BLOCK_N, BLOCK_K)
    if PARTS > 1:
        last, acc = _sum_parts(acc, ws_ptr + tile.to(tl.int64) * (PARTS * BLOCK_M * BLOCK_N), counters_ptr + tile,
                               part, PARTS, BLOCK_M, BLOCK_N)
        if not last:
            return
    if HAS_BIAS:
        acc += tl.load(bias_ptr + nn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows64[:, None] * y_stride + nn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & nmask[None, :])


# ---- host side ----

def linear_config(T: int, N: int, K: int, fp32: bool) -> dict:
    """Tiles for a skinny GEMM that streams W once (decode: T <= 128): BLOCK_M covers the rows (two row tiles
    past 64, adjacent in the grid so that the second reads W from L2), 64 columns per tile, 128-deep K steps in 4
    stages (24 KB a stage at BLOCK_M = 32), 3 at BLOCK_M = 64 (32 KB a stage): two programs fit an SM either way.
    K is split until there are about two W programs per SM (each split at least 4 K steps)."""
    block_m = min(64, max(16, triton.next_power_of_2(max(T, 1))))
    block_k = 32 if fp32 else 128  # fp32 tiles (ieee) stay small: the interpreter and fp32 are for correctness
    tiles = triton.cdiv(T, block_m) * triton.cdiv(N, 64)
    split_k = max(1, min(triton.cdiv(_TARGET_PROGRAMS, tiles), K // (4 * block_k)))
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=block_k, SPLIT_K=split_k, num_warps=4,
                num_stages=2 if fp32 else (4 if block_m <= 32 else 3))


def shrink_config(T: int, K: int, fp32: bool) -> dict:
    """(slot, row tile) programs, each split into K chunks of ~512 so that one adapter still spreads over many."""
    block_k = 32 if fp32 else 128
    return dict(BLOCK_M=min(64, max(16, triton.next_power_of_2(max(T, 1)))), BLOCK_K=block_k,
                SPLIT_K=max(1, triton.cdiv(K, _SHRINK_K_CHUNK)), num_warps=4, num_stages=3)


_counter_pool: Dict[Tuple[str, torch.device], torch.Tensor] = {}


def _counters(purpose: str, device: torch.device, count: int) -> torch.Tensor:
    """Zeroed int32 arrival counters that the kernels leave at zero, kept per device and purpose. Made (or grown)
    outside CUDA-graph capture only: a capture would record the zero fill without running it."""
    key = (purpose, device)
    have = _counter_pool.get(key)
    if have is None or have.numel() < count:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(f"lora_ops.linear_lora: its {purpose} arrival counters ({count}) must be allocated "
                               "before CUDA-graph capture: call it once eagerly with the largest shape first")
        have = torch.zeros(max(count, 1 << 14), dtype=torch.int32, device=device)
        _counter_pool[key] = have
    return have


@functools.lru_cache(maxsize=None)
def _pdl_capable(device_index: int) -> bool:
    return torch.cuda.get_device_capability(device_index)[0] >= 9


def _use_pdl(device: torch.device, pdl: Optional[bool]) -> bool:
    if device.type != "cuda" or not _HAS_GDC:  # the interpreter has no grid dependency control
        return False
    capable = _pdl_capable(device_index(device))
    return capable if pdl is None else (pdl and capable)


def _fail(exc, msg):
    raise exc(f"lora_ops.linear_lora: {msg}")


def _check(y, x, w, bias, lora_a, lora_b, token_lora, lora_ranks, lora_scales, slice_offsets):
    """The host checks of linear_lora's arguments; returns the slice offsets as a list."""
    for name, t, dims in (("y", y, 2), ("x", x, 2), ("w", w, 2), ("lora_a", lora_a, 3), ("lora_b", lora_b, 3),
                          ("token_lora", token_lora, 1)):
        if not isinstance(t, torch.Tensor) or t.dim() != dims:
            _fail(ValueError, f"{name} must be a {dims}-D tensor, got "
                              f"{tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__}")
    T, K = x.shape
    N = w.shape[0]
    L, SR, _ = lora_a.shape
    R = lora_b.shape[2]
    if w.shape[1] != K:
        _fail(ValueError, f"w must be [N, K] with K = x.size(1) = {K}, got {list(w.shape)}")
    if list(y.shape) != [T, N]:
        _fail(ValueError, f"y must be [T, N] = [{T}, {N}] (x.size(0), w.size(0)), got {list(y.shape)}")
    if bias is not None and list(bias.shape) != [N]:
        _fail(ValueError, f"bias must be [N] = [{N}], got {list(bias.shape)}")
    if list(lora_b.shape[:2]) != [L, N]:
        _fail(ValueError, f"lora_b must be [L, N, R] with L = lora_a.size(0) = {L}, N = {N}, got "
                          f"{list(lora_b.shape)}")
    offsets = list(slice_offsets) if slice_offsets is not None else [0, N]
    S = len(offsets) - 1
    if not 1 <= S <= _MAX_SLICES or offsets[0] != 0 or offsets[-1] != N or \
            any(a > b for a, b in zip(offsets, offsets[1:])):
        _fail(ValueError, f"slice_offsets must be 2..{_MAX_SLICES + 1} non-decreasing entries from 0 to N = {N}, "
                          f"got {offsets}")
    if list(lora_a.shape[1:]) != [S * R, K]:
        _fail(ValueError, f"lora_a must be [L, S*R, K] = [{L}, {S * R}, {K}] (S = {S} slices, R = lora_b.size(2)"
                          f" = {R}), got {list(lora_a.shape)}")
    if token_lora.shape[0] != T:
        _fail(ValueError, f"token_lora must have T = x.size(0) = {T} entries, got {token_lora.shape[0]}")
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        _fail(TypeError, f"x must be float16, bfloat16 or float32, got {x.dtype}")
    for name, t in (("w", w), ("lora_a", lora_a), ("lora_b", lora_b), ("bias", bias)):
        if t is not None and t.dtype != x.dtype:
            _fail(TypeError, f"{name} must have x's dtype ({x.dtype}), got {t.dtype}")
    if y.dtype not in (x.dtype, torch.float32):
        _fail(TypeError, f"y must be float32 or x's dtype ({x.dtype}), got {y.dtype}")
    for name, t in (("token_lora", token_lora), ("lora_ranks", lora_ranks)):
        if t is not None and t.dtype not in (torch.int32, torch.int64):
            _fail(TypeError, f"{name} must be int32 or int64, got {t.dtype}")
    if lora_ranks is not None and list(lora_ranks.shape) != [L]:
        _fail(ValueError, f"lora_ranks must have {L} entries (one per slot), got {list(lora_ranks.shape)}")
    if lora_scales is not None and (lora_scales.dtype != torch.float32 or list(lora_scales.shape) != [L]):
        _fail(ValueError, f"lora_scales must be float32 with {L} entries, got {lora_scales.dtype} "
                          f"{list(lora_scales.shape)}")
    for name, t in (("y", y), ("w", w), ("bias", bias), ("lora_a", lora_a), ("lora_b", lora_b),
                    ("token_lora", token_lora), ("lora_ranks", lora_ranks), ("lora_scales", lora_scales)):
        if t is not None and t.device != x.device:
            _fail(ValueError, f"{name} is on {t.device} but x is on {x.device}")
    for name, t in (("y", y), ("x", x), ("w", w), ("bias", bias), ("lora_a", lora_a), ("lora_b", lora_b)):
        if t is not None and t.numel() > 0 and t.stride(-1) != 1:
            _fail(ValueError, f"{name} must have unit stride in its last dimension, got strides {t.stride()}")
    for name, t in (("token_lora", token_lora), ("lora_ranks", lora_ranks)):
        if t is not None and t.numel() > 1 and t.stride(0) != 1:
            _fail(ValueError, f"{name} must be contiguous, got stride {t.stride(0)}")
    if max(T, N, K, L, S * R) >= 1 << 31:
        _fail(ValueError, f"sizes must fit int32: T = {T}, N = {N}, K = {K}, L = {L}, S*R = {S * R}")
    return offsets


def linear_lora(y, x, w, bias, lora_a, lora_b, token_lora, lora_ranks=None, lora_scales=None,
                slice_offsets: Optional[Sequence[int]] = None, scale: float = 1.0, *, pdl: Optional[bool] = None,
                linear_cfg: Optional[dict] = None, shrink_cfg: Optional[dict] = None) -> None:
    """y = x·wᵀ + bias + each row's LoRA delta (module docstring), the slot of row t being token_lora[t] (outside
    [0, L): no LoRA). lora_a [L, S·R, K], lora_b [L, N, R], ranks/scales/slice_offsets/scale as in sgmv.
    pdl: programmatic dependent launch (default: on sm_90+). linear_cfg / shrink_cfg override linear_config /
    shrink_config (tests and tuning)."""
    offsets = _check(y, x, w, bias, lora_a, lora_b, token_lora, lora_ranks, lora_scales, slice_offsets)
    T, K = x.shape
    N = y.shape[1]
    if T == 0 or N == 0:
        return
    L, SR, _ = lora_a.shape
    R = lora_b.shape[2]
    has_lora = K > 0 and R > 0 and L > 0  # an empty reduction adds exactly nothing, whatever the scales
    fp32 = x.dtype == torch.float32
    lin_cfg = linear_cfg or linear_config(T, N, K, fp32)
    shrink_cfg = shrink_cfg or shrink_config(T, K, fp32)
    # One allocation for both workspaces: under PDL the linear kernel runs while the shrink still uses its own.
    n_shrink = shrink_workspace_size(T, L, SR, shrink_cfg) if has_lora else 0
    ws = torch.empty(n_shrink + linear_workspace_size(T, N, has_lora, lin_cfg), dtype=torch.float32,
                     device=x.device)
    h = torch.empty(T, SR if has_lora else 0, dtype=torch.float32, device=x.device)
    if has_lora:
        launch_shrink(h, x, lora_a, token_lora, lora_ranks, R, ws[:n_shrink], shrink_cfg)
    launch_linear(y, x, w, bias, h, lora_b, token_lora, lora_ranks, lora_scales, offsets, scale, has_lora,
                  ws[n_shrink:], lin_cfg, pdl=pdl)


def linear(y, x, w, bias=None, *, config: Optional[dict] = None) -> None:
    """y = x·wᵀ + bias by the linear kernel without its LoRA part: the skinny GEMM alone (to compare with cuBLAS)."""
    lora_b = x.new_empty(0, y.shape[1], 0)
    no_slots = torch.empty(x.shape[0], dtype=torch.int32, device=x.device)
    _check(y, x, w, bias, x.new_empty(0, 0, x.shape[1]), lora_b, no_slots, None, None, None)
    if y.numel() == 0:
        return
    cfg = config or linear_config(x.shape[0], y.shape[1], x.shape[1], x.dtype == torch.float32)
    ws = torch.empty(linear_workspace_size(x.shape[0], y.shape[1], False, cfg), dtype=torch.float32, device=x.device)
    launch_linear(y, x, w, bias, x.new_empty(x.shape[0], 0, dtype=torch.float32), lora_b, no_slots, None, None,
                  [0, y.shape[1]], 1.0, False, ws, cfg)


def lora_shrink(h, x, lora_a, token_lora, lora_ranks, R: int) -> None:
    """The shrink alone, as linear_lora runs it (for timing its part): h [T, S·R] float32, contiguous."""
    T, K = x.shape
    L, SR, _ = lora_a.shape
    cfg = shrink_config(T, K, x.dtype == torch.float32)
    ws = torch.empty(shrink_workspace_size(T, L, SR, cfg), dtype=torch.float32, device=x.device)
    launch_shrink(h, x, lora_a, token_lora, lora_ranks, R, ws, cfg)


def shrink_workspace_size(T: int, L: int, SR: int, cfg: dict) -> int:
    """float32 elements of the shrink's K-split partials: a tile per (slot, row tile, split)."""
    if cfg["SPLIT_K"] == 1:
        return 0
    return L * triton.cdiv(T, cfg["BLOCK_M"]) * cfg["SPLIT_K"] * cfg["BLOCK_M"] * _rank_block(SR)


def linear_workspace_size(T: int, N: int, has_lora: bool, cfg: dict) -> int:
    """float32 elements of the linear kernel's partials: a tile per (output tile, part)."""
    parts = cfg["SPLIT_K"] + has_lora
    if parts == 1:
        return 0
    return triton.cdiv(T, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]) * parts * cfg["BLOCK_M"] * cfg["BLOCK_N"]


def _rank_block(width: int) -> int:
    """The power-of-2 block (at least 16, the dot's minimum) that covers `width` ranks (S·R in the shrink)."""
    return max(16, triton.next_power_of_2(width))


def launch_shrink(h, x, lora_a, token_lora, lora_ranks, R: int, ws, cfg: dict) -> None:
    """h[t, s·R + r] = x[t]·A[token_lora[t], s·R + r]ᵀ (float32) for r < rank; no argument checks. ws: at least
    shrink_workspace_size float32 elements, not in use by a kernel that may still run."""
    T, K = x.shape
    L, SR, _ = lora_a.shape
    groups = L * triton.cdiv(T, cfg["BLOCK_M"])
    lora_shrink_kernel[(groups * cfg["SPLIT_K"],)](
        h, x, lora_a, token_lora, lora_ranks, ws, _counters("shrink", x.device, groups), T, K, L, R, SR,
        h.stride(0), x.stride(0), lora_a.stride(0), lora_a.stride(1), HAS_RANKS=lora_ranks is not None,
        IEEE=x.dtype == torch.float32, USE_PDL=_use_pdl(x.device, None), BLOCK_SR=_rank_block(SR), **cfg)


def launch_linear(y, x, w, bias, h, lora_b, token_lora, lora_ranks, lora_scales, offsets: Sequence[int],
                  scale: float, has_lora: bool, ws, cfg: dict, *, pdl: Optional[bool] = None) -> None:
    """y = x·wᵀ + bias (+ the LoRA delta from h when has_lora; without it, the plain skinny GEMM); no argument
    checks. ws: at least linear_workspace_size float32 elements."""
    T, K = x.shape
    N = y.shape[1]
    L, _, R = lora_b.shape
    tiles = triton.cdiv(T, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])
    parts = cfg["SPLIT_K"] + has_lora
    padded = list(offsets) + [N] * (_MAX_SLICES + 1 - len(offsets))
    use_pdl = has_lora and _use_pdl(x.device, pdl)
    linear_lora_kernel[(tiles * parts,)](
        y, x, w, bias, h, lora_b, token_lora, lora_ranks, lora_scales, ws, _counters("linear", x.device, tiles),
        T, N, K, L, R, y.stride(0), x.stride(0), w.stride(0), h.stride(0), lora_b.stride(0), lora_b.stride(1),
        lora_scales.stride(0) if lora_scales is not None else 0, float(scale), len(offsets) - 1, *padded,
        HAS_BIAS=bias is not None, HAS_LORA=has_lora, HAS_RANKS=lora_ranks is not None,
        HAS_SCALES=lora_scales is not None, USE_PDL=use_pdl, IEEE=x.dtype == torch.float32,
        H_SPLIT=y.dtype == torch.float32, PARTS=parts, BLOCK_R=_rank_block(R),
        **({"launch_pdl": True} if use_pdl else {}), **cfg)
