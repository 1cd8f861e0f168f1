"""Random problem generators and the oracle comparison, shared by the tests and `python -m lora_ops.bench`.

Inputs are scaled so the LoRA delta is O(1) like y itself: x ~ N(0,1), A ~ N(0,1)/√K, B ~ N(0,1)/√R.
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch

from . import reference

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


@dataclasses.dataclass
class SgmvProblem:
    y: torch.Tensor
    x: torch.Tensor
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    seg_indptr: torch.Tensor
    seg_lora: torch.Tensor
    token_indices: Optional[torch.Tensor] = None
    lora_ranks: Optional[torch.Tensor] = None
    lora_scales: Optional[torch.Tensor] = None
    slice_offsets: Optional[List[int]] = None
    scale: float = 1.0

    def args(self, y=None):
        return (self.y if y is None else y, self.x, self.lora_a, self.lora_b, self.seg_indptr, self.seg_lora,
                self.token_indices, self.lora_ranks, self.lora_scales, self.slice_offsets, self.scale)


@dataclasses.dataclass
class GroupedGemmProblem:
    y: torch.Tensor
    x: torch.Tensor
    w: torch.Tensor
    seg_indptr: torch.Tensor
    seg_weight: torch.Tensor
    token_indices: Optional[torch.Tensor] = None
    n_sizes: Optional[torch.Tensor] = None
    k_sizes: Optional[torch.Tensor] = None
    alpha: float = 1.0
    accumulate: bool = True

    def args(self, y=None):
        return (self.y if y is None else y, self.x, self.w, self.seg_indptr, self.seg_weight, self.token_indices,
                self.n_sizes, self.k_sizes, self.alpha, self.accumulate)


def random_token_slots(num_tokens: int, adapters: Sequence[int], gen: torch.Generator,
                       sizes: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Each token's slot, adapters spread randomly over the batch (continuous batching, not contiguous).

    sizes: tokens per adapter (must sum to num_tokens); default: as even as possible."""
    adapters = list(adapters)
    if sizes is None:
        base, extra = divmod(num_tokens, max(len(adapters), 1))
        sizes = [base + (i < extra) for i in range(len(adapters))]
    slots = torch.cat([torch.full((n,), a, dtype=torch.int32) for a, n in zip(adapters, sizes)]) if adapters \
        else torch.empty(0, dtype=torch.int32)
    return slots[torch.randperm(num_tokens, generator=gen)]


def segments_for(token_lora: torch.Tensor, num_slots: int, gathered: bool):
    """(token_indices or None, seg_indptr, seg_lora) for a per-token slot vector.

    gathered: build_segments' layout (rows reached through token_indices). Otherwise the rows are assumed to be
    grouped already and one segment is made per run of equal slots (no token_indices)."""
    if gathered:
        return reference.build_segments(token_lora.cpu(), num_slots)
    slots = token_lora.tolist()
    indptr, seg = [0], []
    for t, s in enumerate(slots):
        if t == 0 or s != slots[t - 1]:
            if t > 0:
                indptr.append(t)
            seg.append(s)
    if slots:
        indptr.append(len(slots))
    return None, torch.tensor(indptr, dtype=torch.int32), torch.tensor(seg, dtype=torch.int32)


def make_sgmv(token_lora: torch.Tensor, *, num_slots: int, K: int, N: int, max_rank: int, dtype, device,
              gen: torch.Generator, gathered: bool = True, ranks: Optional[Sequence[int]] = None,
              scales: bool = True, slice_offsets: Optional[Sequence[int]] = None, y_dtype=None,
              y_col_pad: int = 0, scale: float = 1.0) -> SgmvProblem:
    T = token_lora.shape[0]
    S = 1 if slice_offsets is None else len(slice_offsets) - 1
    rnd = lambda *shape: torch.randn(*shape, generator=gen)
    x = rnd(T, K).to(dtype)
    lora_a = (rnd(num_slots, S * max_rank, K) / K ** 0.5).to(dtype)
    lora_b = (rnd(num_slots, N, max_rank) / max_rank ** 0.5).to(dtype)
    # y_col_pad > 0: y is a column slice of a wider tensor (row stride > N), made on the device
    y_full = rnd(T, N + y_col_pad).to(y_dtype or dtype).to(device)
    idx, indptr, seg = segments_for(token_lora, num_slots, gathered)
    ranks_t = torch.tensor(ranks, dtype=torch.int32) if ranks is not None else None
    scales_t = (torch.rand(num_slots, generator=gen) * 2 + 0.5) if scales else None
    to = lambda t: None if t is None else t.to(device)
    return SgmvProblem(y_full[:, y_col_pad // 2: y_col_pad // 2 + N], x.to(device), lora_a.to(device),
                       lora_b.to(device), to(indptr), to(seg), to(idx), to(ranks_t), to(scales_t),
                       list(slice_offsets) if slice_offsets is not None else None, scale)


def make_grouped_gemm(token_lora: torch.Tensor, *, num_groups: int, K: int, N: int, dtype, device,
                      gen: torch.Generator, gathered: bool = True, x_dtype=None, y_dtype=None,
                      n_sizes: Optional[Sequence[int]] = None, k_sizes: Optional[Sequence[int]] = None,
                      alpha: float = 1.0, accumulate: bool = True) -> GroupedGemmProblem:
    T = token_lora.shape[0]
    rnd = lambda *shape: torch.randn(*shape, generator=gen)
    x = rnd(T, K).to(x_dtype or dtype)
    w = (rnd(num_groups, N, K) / K ** 0.5).to(dtype)
    y = rnd(T, N).to(y_dtype or dtype)
    idx, indptr, seg = segments_for(token_lora, num_groups, gathered)
    to = lambda t: None if t is None else t.to(device)
    as_t = lambda v: None if v is None else torch.tensor(v, dtype=torch.int32)
    return GroupedGemmProblem(y.to(device), x.to(device), w.to(device), to(indptr), to(seg), to(idx),
                              to(as_t(n_sizes)), to(as_t(k_sizes)), alpha, accumulate)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().cpu(), ref.double().cpu()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def check_against_reference(out: torch.Tensor, before: torch.Tensor, ref: torch.Tensor, dtype) -> str:
    """'' if `out` matches the float64 oracle `ref`, else a description of the mismatch.

    Elements the oracle leaves alone must be bitwise unchanged (NaN poison included); the written ones must
    carry no NaN and their change (out - before) must match the oracle's within the dtype's tolerance."""
    out, before, ref = out.cpu(), before.cpu(), ref.cpu()
    before64 = before.double()
    touched = ~((ref == before64) | (ref.isnan() & before64.isnan()))
    if not torch.equal(out[~touched].view(torch.uint8), before[~touched].view(torch.uint8)):  # bitwise, NaN too
        return f"{int((out[~touched] != before[~touched]).sum())} elements outside the LoRA rows/columns changed"
    if touched.any():
        if out[touched].isnan().any():
            return f"{int(out[touched].isnan().sum())} written elements are NaN (unwritten or poisoned)"
        base = torch.where(before64.isnan(), torch.zeros_like(before64), before64)
        err = relative_error((out.double() - base)[touched], (ref - base)[touched])
        if err > TOLERANCE[dtype]:
            return f"relative error {err:.3e} > {TOLERANCE[dtype]:.0e}"
    return ""
