"""Typed public wrappers around torch.ops.lora_ops.* (schemas in csrc/bindings.cpp).

Each wrapper is one call into the C++-defined op, so the eager overhead stays near the bare op's (~2 µs).
Shapes: T rows (tokens), K input features, N output features, L adapter slots, R max rank, S slices.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import torch

_sgmv = torch.ops.lora_ops.sgmv.default
_lora_expand = torch.ops.lora_ops.lora_expand.default
_grouped_gemm = torch.ops.lora_ops.grouped_gemm.default
_build_segments = torch.ops.lora_ops.build_segments.default
_fold_linear = torch.ops.lora_ops.fold_linear.default
_lora_linear = torch.ops.lora_ops.lora_linear.default


class Segments(NamedTuple):
    """Rows grouped by adapter slot, as produced by :func:`build_segments`.

    token_indices [T] int32: rows sorted by slot (stable), rows without a valid slot last.
    seg_indptr [G+1] int32: segment g covers token_indices[seg_indptr[g]:seg_indptr[g+1]].
    seg_lora [G] int32: the slot of each segment.

    Any index values are memory-safe (docs/design.md §2). Segment g covers positions [m_g, m_{g+1}) with
    m_i = max over j ≤ i of clamp(seg_indptr[j], 0, P): reversed or overlapping ranges are empty or cut, never
    covered twice. int64 values beyond int32 behave as their true values (they saturate, never wrap).
    LORA_OPS_DEBUG=1 raises on any value that would be skipped or clamped instead.
    """

    token_indices: torch.Tensor
    seg_indptr: torch.Tensor
    seg_lora: torch.Tensor


def sgmv(y: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
         seg_indptr: torch.Tensor, seg_lora: torch.Tensor, token_indices: Optional[torch.Tensor] = None,
         lora_ranks: Optional[torch.Tensor] = None, lora_scales: Optional[torch.Tensor] = None,
         slice_offsets: Optional[Sequence[int]] = None, scale: float = 1.0) -> None:
    """Fused LoRA delta, in place: for each row t of a segment with slot l and each slice s,
    ``y[t, off_s:off_s+1] += scale · lora_scales[l] · (x[t] · A[l, s·R : s·R + r_l]ᵀ) · B[l, off_s:off_s+1, :r_l]ᵀ``.

    y [T, N] (x's dtype or float32, unit column stride), x [T, K] (fp16/bf16/fp32),
    lora_a [L, S·R, K], lora_b [L, N, R] (x's dtype, unit last stride), seg_indptr [G+1], seg_lora [G],
    token_indices [P] (rows of the positions; default: position p is row p), lora_ranks [L] int (true ranks
    r_l ≤ R, only those are read), lora_scales [L] float32 (any stride), slice_offsets S+1 ints from 0 to N
    (default [0, N]). Slots outside [0, L) and out-of-range rows are skipped; the intermediate is float32 and stays
    on chip. K = 0 leaves y bitwise unchanged, whatever the scales. Metadata rules: see :class:`Segments`.
    """
    _sgmv(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales, slice_offsets, scale)


def lora_expand(y: torch.Tensor, h: torch.Tensor, lora_b: torch.Tensor, seg_indptr: Optional[torch.Tensor],
                seg_lora: torch.Tensor, token_indices: Optional[torch.Tensor] = None,
                lora_ranks: Optional[torch.Tensor] = None, lora_scales: Optional[torch.Tensor] = None,
                slice_offsets: Optional[Sequence[int]] = None, scale: float = 1.0) -> None:
    """The expand half of sgmv, in place, with h computed elsewhere: for each row t of a segment with slot l and
    each slice s, ``y[t, off_s:off_s+1] += scale · lora_scales[l] · h[t, l, s·R : s·R + r_l] · B[l, off_s:off_s+1, :r_l]ᵀ``.

    h [T, L, S·R] (lora_b's dtype or float32, unit last stride, any other strides): row t's rank vector for every
    slot, e.g. the extra columns of a base GEMM whose weight is [W; A of every slot] viewed as [T, L, S·R], or one
    window per row broadcast over the slots with a zero stride. lora_b [L, N, R]; the other arguments as sgmv's.

    The rows form: with ``seg_indptr=None`` every position is a segment of its own and ``seg_lora`` [P] holds each
    position's slot (P = len(token_indices), else T), e.g. the per-token slots as they are: nothing needs sorting,
    and the CUDA kernels read each row's slot instead of walking the segments. Given build_segments' order
    (``token_indices`` from it, ``seg_lora = token_lora[token_indices]``, as the serving layer's fold route passes
    it), the rows of one slot sit side by side and the CUDA runs kernel reads each slot's B once per run of rows.
    """
    _lora_expand(y, h, lora_b, seg_indptr, seg_lora, token_indices, lora_ranks, lora_scales, slice_offsets, scale)


def grouped_gemm(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, seg_indptr: torch.Tensor,
                 seg_weight: torch.Tensor, token_indices: Optional[torch.Tensor] = None,
                 n_sizes: Optional[torch.Tensor] = None, k_sizes: Optional[torch.Tensor] = None,
                 alpha: float = 1.0, accumulate: bool = True) -> None:
    """Segmented matmul, in place: ``y[t, :n_l] = (accumulate ? y[t, :n_l] : 0) + alpha · x[t, :k_l] · w[l, :n_l, :k_l]ᵀ``.

    y [T, N] (w's dtype or float32), x [T, K] (w's dtype or float32), w [L, N, K] (nn.Linear layout per group,
    unit last stride), n_sizes/k_sizes [L] int (per-group sizes, default N and K). Columns ≥ n_l are untouched.
    An empty reduction (k_l = 0) contributes exactly zero whatever alpha is: the covered rows' first n_l columns
    become (accumulate ? y : 0). Metadata rules: see :class:`Segments`.
    """
    _grouped_gemm(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes, alpha, accumulate)


def build_segments(token_lora: torch.Tensor, num_slots: int) -> Segments:
    """Group rows by slot on the device with fixed-size outputs (CUDA-graph capturable, no host sync).

    token_lora [T] int: each row's slot; values outside [0, num_slots) mean no LoRA (sorted last, uncovered).
    Returns Segments(token_indices [T], seg_indptr [num_slots+1], seg_lora = arange(num_slots)).
    """
    return Segments(*_build_segments(token_lora, num_slots))


def fold_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None,
                seg_indptr: Optional[torch.Tensor] = None, slot_rows: int = 0) -> torch.Tensor:
    """``x · weightᵀ (+ bias)``, as ``torch.nn.functional.linear`` (its arguments, errors and gradient, and the
    slot windows' own errors below): the fold route's GEMM against a module's ``[W; A of every slot]``, whose extra
    columns are the slots' h for :func:`lora_expand`. On CUDA sm_90 at decode sizes (up to 64 tokens, fp16/bf16,
    contiguous x, n and k multiples of 8, 16-byte aligned rows, no bias, no gradient wanted) it runs a CUTLASS GEMM,
    equal to cuBLAS's up to rounding, that lets the lora_expand launched after it start before it ends
    (programmatic dependent launch); elsewhere, and on every other backend, ``at::linear`` (which also gives the
    gradient wherever one is wanted).

    With the step's ``seg_indptr`` (:func:`build_segments`', [num_slots + 1]) and ``slot_rows`` (S·R, the rows of
    weight per slot), weight's last num_slots·slot_rows rows are the slots' windows, and the output columns of a
    slot no row uses (``seg_indptr[s + 1] <= seg_indptr[s]``) are unspecified: the CUTLASS kernel skips the tiles
    that hold only such rows, so that a step reads the A of the adapters present, not of every slot (at::linear
    computes them). The other slots' columns are the product for an ascending seg_indptr (build_segments'); other
    values are memory-safe and only choose which windows are computed.
    """
    return _fold_linear(x, weight, bias, seg_indptr, slot_rows)


def lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                token_slot: torch.Tensor, lora_scales: Optional[torch.Tensor] = None,
                slice_offsets: Optional[Sequence[int]] = None, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """A whole multi-LoRA linear layer: ``x · weightᵀ (+ bias)`` plus each row's LoRA delta, with the rank vector h
    rounded to x's dtype (the kext route). For row t of x with slot l = token_slot[t] and each slice s:
    ``y[t, off_s:off_s+1] += h[t, s] · lora_b[l, off_s:off_s+1, :]ᵀ`` with
    ``h[t, s] = round(lora_scales[l] · x[t] · lora_a[l, s·R : (s+1)·R]ᵀ)`` (float32 sums, rounded once). A row whose
    slot is outside [0, L) gets the base product only.

    x [..., K] (fp16/bf16/fp32; T rows), weight [N, K], lora_a [L, S·R, K], lora_b [L, N, R] (x's dtype, unit last
    stride), token_slot [T] int32/int64, lora_scales [L] float32 (default ones), slice_offsets S+1 ints from 0 to N
    (default [0, N]), bias [N] (x's dtype). Returns y [..., N] in x's dtype. Every slot's window is R wide: a
    smaller rank is zeros in lora_a's rows and lora_b's columns past it, as the adapter pool stores them (there is
    no ranks argument: unlike sgmv, the cost is R's, not the true rank's). A and B must be finite in every slot: the
    GEMM multiplies each row's zeros by the B of every slot in a 64-column block it reads, and 0 · inf is NaN.

    On CUDA sm_90 at decode sizes (T ≤ 128, fp16/bf16, contiguous x, K a multiple of 64 of at least 64 × the GEMM's
    pipeline stages, L·R and the slice bounds multiples of 64, S ≤ 4, L ≤ 64, and lora_b a view of an [N, L·R]
    matrix: ``lora_b.stride(0) == R``, each row's slots side by side) it is two launches: a shrink that writes h, and
    one GEMM ``[x | h] · [weight | B]ᵀ`` that reads x and weight while the shrink runs (programmatic dependent launch)
    and skips the 64-column blocks of B whose slots no row uses. Elsewhere the same computation composed of torch
    ops (with h rounded the same way). Deterministic; no host sync; any token_slot values are memory-safe.
    """
    return _lora_linear(x, weight, lora_a, lora_b, token_slot, lora_scales, slice_offsets, bias)
