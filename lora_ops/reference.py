"""Float64 oracle for the ops, written straight from docs/design.md §2.

Plain PyTorch, slow and obvious on purpose: every backend test and every benchmark correctness check compares
against these functions. They return new tensors (float64 for the matmul ops) instead of mutating.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch


def _segment_rows(seg_indptr, seg_slot, token_indices, num_rows, num_slots):
    """Yield (slot, rows) for every segment that names a valid slot, with the §2 skip/clamp rules applied.

    Values are used as they are (int64 included: the backends' saturation to int32 gives the same result).
    Segment g covers positions [m_g, m_{g+1}) with m_i = max over j <= i of clamp(indptr[j], 0, P): a running
    maximum, so reversed or overlapping ranges are empty or cut and no position is covered twice. Without
    seg_indptr (lora_expand's rows form) position p is segment p, of slot seg_slot[p]."""
    slots = seg_slot.tolist()
    indptr = seg_indptr.tolist() if seg_indptr is not None else list(range(len(slots) + 1))
    idx = token_indices.tolist() if token_indices is not None else None
    positions = len(idx) if idx is not None else num_rows
    end = min(max(indptr[0], 0), positions)
    for g, slot in enumerate(slots):
        start, end = end, max(end, min(max(indptr[g + 1], 0), positions))
        if not 0 <= slot < num_slots:
            continue
        rows = [idx[p] if idx is not None else p for p in range(start, end)]
        rows = [t for t in rows if 0 <= t < num_rows]
        if rows:
            yield slot, rows


def sgmv(y, x, lora_a, lora_b, seg_indptr, seg_lora, token_indices=None, lora_ranks=None, lora_scales=None,
         slice_offsets: Optional[Sequence[int]] = None, scale: float = 1.0) -> torch.Tensor:
    """Return y (float64) after `y += scale · lora_scales[l] · (x · A_l,sᵀ) · B_l,sᵀ` per row and slice."""
    out = y.detach().to(torch.float64).clone()
    num_slots, sr, k = lora_a.shape
    n = lora_b.shape[1]
    if k == 0:  # an empty reduction contributes exactly zero, whatever the scales: y unchanged
        return out
    offsets = list(slice_offsets) if slice_offsets is not None else [0, n]
    num_slices = len(offsets) - 1
    max_rank = sr // num_slices
    a64, b64, x64 = lora_a.double(), lora_b.double(), x.double()
    for slot, rows in _segment_rows(seg_indptr, seg_lora, token_indices, x.shape[0], num_slots):
        rank = max_rank if lora_ranks is None else min(max(int(lora_ranks[slot]), 0), max_rank)
        if rank == 0:
            continue
        coef = scale * (1.0 if lora_scales is None else float(lora_scales[slot]))
        xr = x64[rows]
        for s in range(num_slices):
            lo, hi = offsets[s], offsets[s + 1]
            h = xr @ a64[slot, s * max_rank:s * max_rank + rank].T
            out[rows, lo:hi] += coef * (h @ b64[slot, lo:hi, :rank].T)
    return out


def lora_expand(y, h, lora_b, seg_indptr, seg_lora, token_indices=None, lora_ranks=None, lora_scales=None,
                slice_offsets: Optional[Sequence[int]] = None, scale: float = 1.0) -> torch.Tensor:
    """Return y (float64) after `y[t, off_s:off_s+1] += scale · lora_scales[l] · h[t, l, s·R : s·R + r_l] ·
    B[l, off_s:off_s+1, :r_l]ᵀ` per row t of a segment with slot l, and slice s."""
    out = y.detach().to(torch.float64).clone()
    num_slots, n, max_rank = lora_b.shape
    offsets = list(slice_offsets) if slice_offsets is not None else [0, n]
    h64, b64 = h.double(), lora_b.double()
    for slot, rows in _segment_rows(seg_indptr, seg_lora, token_indices, y.shape[0], num_slots):
        rank = max_rank if lora_ranks is None else min(max(int(lora_ranks[slot]), 0), max_rank)
        if rank == 0:  # skips the slot, whatever its scale (not NaN * 0)
            continue
        coef = scale * (1.0 if lora_scales is None else float(lora_scales[slot]))
        for s in range(len(offsets) - 1):
            lo, hi = offsets[s], offsets[s + 1]
            window = h64[rows, slot, s * max_rank:s * max_rank + rank]
            out[rows, lo:hi] += coef * (window @ b64[slot, lo:hi, :rank].T)
    return out


def grouped_gemm(y, x, w, seg_indptr, seg_weight, token_indices=None, n_sizes=None, k_sizes=None,
                 alpha: float = 1.0, accumulate: bool = True) -> torch.Tensor:
    """Return y (float64) after `y[t, :n_l] = (accumulate ? y : 0) + alpha · x[t, :k_l] · w[l, :n_l, :k_l]ᵀ`."""
    out = y.detach().to(torch.float64).clone()
    num_groups, n, k = w.shape
    w64, x64 = w.double(), x.double()
    for slot, rows in _segment_rows(seg_indptr, seg_weight, token_indices, x.shape[0], num_groups):
        n_l = n if n_sizes is None else min(max(int(n_sizes[slot]), 0), n)
        k_l = k if k_sizes is None else min(max(int(k_sizes[slot]), 0), k)
        kept = out[rows, :n_l] if accumulate else 0
        # An empty reduction (k_l = 0) contributes exactly zero, whatever alpha is (not alpha · 0).
        out[rows, :n_l] = kept + alpha * (x64[rows, :k_l] @ w64[slot, :n_l, :k_l].T) if k_l > 0 else kept
    return out


def build_segments(token_lora: torch.Tensor, num_slots: int):
    """Stable grouping of rows by slot: (token_indices [T], seg_indptr [num_slots+1], seg_lora [num_slots])."""
    slots = token_lora.tolist()
    order = [t for s in range(num_slots) for t, v in enumerate(slots) if v == s]
    order += [t for t, v in enumerate(slots) if not 0 <= v < num_slots]
    counts = [sum(1 for v in slots if v == s) for s in range(num_slots)]
    indptr = [0]
    for c in counts:
        indptr.append(indptr[-1] + c)
    dev = token_lora.device
    return (torch.tensor(order, dtype=torch.int32, device=dev),
            torch.tensor(indptr, dtype=torch.int32, device=dev),
            torch.arange(num_slots, dtype=torch.int32, device=dev))


def fold_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x · weightᵀ (+ bias) in float64, any leading dims of x (F.linear's semantics)."""
    out = x.detach().to(torch.float64) @ weight.detach().to(torch.float64).t()
    return out + bias.detach().to(torch.float64) if bias is not None else out


def lora_linear(x, weight, lora_a, lora_b, token_slot, lora_scales=None, slice_offsets: Optional[Sequence[int]] = None,
                bias=None) -> torch.Tensor:
    """x · weightᵀ (+ bias) + each row's LoRA delta in float64, x [..., K]: for row t with slot l in [0, L) and
    slice s, ``y[t, off_s:off_s+1] += lora_scales[l] · (x[t] · A[l, s·R:(s+1)·R]ᵀ) · B[l, off_s:off_s+1]ᵀ``
    (h exact: the op rounds it to x's dtype)."""
    x2 = x.detach().reshape(math.prod(x.shape[:-1]), x.shape[-1]).to(torch.float64)  # K = 0 too
    out = fold_linear(x2, weight, bias)
    num_slots, sr, _ = lora_a.shape
    n = lora_b.shape[1]
    offsets = list(slice_offsets) if slice_offsets is not None else [0, n]
    rank = sr // (len(offsets) - 1)
    a64, b64 = lora_a.double(), lora_b.double()
    for t, slot in enumerate(token_slot.tolist()):
        if not 0 <= slot < num_slots:
            continue
        coef = 1.0 if lora_scales is None else float(lora_scales[slot])
        for s in range(len(offsets) - 1):
            lo, hi = offsets[s], offsets[s + 1]
            h = coef * (x2[t] @ a64[slot, s * rank:(s + 1) * rank].T)
            out[t, lo:hi] += b64[slot, lo:hi] @ h
    return out.reshape(*x.shape[:-1], n)
