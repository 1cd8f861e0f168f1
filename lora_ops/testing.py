"""Random problem generators and the oracle comparison, shared by the tests and `python -m lora_ops.bench`.

Inputs are scaled so the LoRA delta is O(1) like y itself: x ~ N(0,1), A ~ N(0,1)/√K, B ~ N(0,1)/√R.
With `pad`, x and the weights are strided views into larger NaN-filled tensors (row padding, pool slices), so
a kernel that assumes a contiguous layout, or lets a neighbouring element into its result, fails.
The values are drawn on the generator's device (the bench draws its many input sets on the GPU).
"""
from __future__ import annotations

import dataclasses
from typing import List, Optional, Sequence

import torch

from . import reference

# Relative tolerance (docs/design.md §5) by the dtype that rounds the result. The oracle takes the inputs' exact values,
# so an input's dtype rounds nothing itself: what rounds is the float32 accumulation and the store into y (plus,
# for a half-precision y, one rounding of sgmv's intermediate to y's precision, below y's own rounding).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# A float32 y from half-precision inputs is bounded by the float32 accumulation alone: the products are exact, but
# tensor cores may truncate their float32 sums (simulated: round-toward-zero adds of 16-product steps over
# K = 4096 give 6e-6). Rounding the intermediate to fp16 once costs about 2e-4 (bf16: 2e-3): this bound fails it.
HALF_INPUTS_FLOAT32_OUTPUT_TOLERANCE = 5e-5


def tolerance(inputs_dtype, output_dtype) -> float:
    """Relative tolerance of an op's output against the oracle, from the dtypes that round it."""
    if output_dtype != torch.float32:
        return TOLERANCE[output_dtype]
    return TOLERANCE[torch.float32] if inputs_dtype == torch.float32 else HALF_INPUTS_FLOAT32_OUTPUT_TOLERANCE


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


def drawn_sizes(num_tokens: int, num_adapters: int, gen: torch.Generator) -> List[int]:
    """Tokens per adapter as a serving batch has them: one each (the first num_tokens where there are fewer), then
    each other token on an adapter drawn at random, so the sizes are uneven (random_token_slots' default is as even
    as possible, which puts a run of rows of one slot at every multiple of the size in build_segments' order)."""
    sizes = [int(i < num_tokens) for i in range(num_adapters)]
    rest = num_tokens - sum(sizes)
    if rest > 0:
        drawn = torch.bincount(torch.randint(num_adapters, (rest,), generator=gen), minlength=num_adapters)
        sizes = [n + int(d) for n, d in zip(sizes, drawn)]
    return sizes


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


def padded(values: torch.Tensor, pad: int, device) -> torch.Tensor:
    """`values` on `device` as a view into a NaN-filled tensor `pad` elements larger on both sides of every
    dimension (pad 0: a plain contiguous copy). Every stride then differs from the contiguous one (a weight
    becomes a slice of a pool, e.g. lora_b[:, off:off+N]) except the last, which stays 1 as the contract asks."""
    if pad == 0:
        return values.to(device)
    big = torch.full([s + 2 * pad for s in values.shape], float("nan"), dtype=values.dtype, device=device)
    view = big[tuple(slice(pad, pad + s) for s in values.shape)]
    view.copy_(values)
    return view


def make_sgmv(token_lora: torch.Tensor, *, num_slots: int, K: int, N: int, max_rank: int, dtype, device,
              gen: torch.Generator, gathered: bool = True, ranks: Optional[Sequence[int]] = None,
              scales: bool = True, slice_offsets: Optional[Sequence[int]] = None, y_dtype=None,
              y_col_pad: int = 0, scale: float = 1.0, pad: int = 0) -> SgmvProblem:
    T = token_lora.shape[0]
    S = 1 if slice_offsets is None else len(slice_offsets) - 1
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device=gen.device)
    x = padded(rnd(T, K).to(dtype), pad, device)
    lora_a = padded((rnd(num_slots, S * max_rank, K) / K ** 0.5).to(dtype), pad, device)
    lora_b = padded((rnd(num_slots, N, max_rank) / max_rank ** 0.5).to(dtype), pad, device)
    # y_col_pad > 0: y is a column slice of a wider tensor (row stride > N), made on the device
    y_full = rnd(T, N + y_col_pad).to(y_dtype or dtype).to(device)
    idx, indptr, seg = segments_for(token_lora, num_slots, gathered)
    ranks_t = torch.tensor(ranks, dtype=torch.int32) if ranks is not None else None
    scales_t = (torch.rand(num_slots, generator=gen, device=gen.device) * 2 + 0.5) if scales else None
    to = lambda t: None if t is None else t.to(device)
    return SgmvProblem(y_full[:, y_col_pad // 2: y_col_pad // 2 + N], x, lora_a, lora_b, to(indptr), to(seg),
                       to(idx), to(ranks_t), to(scales_t),
                       list(slice_offsets) if slice_offsets is not None else None, scale)


def make_grouped_gemm(token_lora: torch.Tensor, *, num_groups: int, K: int, N: int, dtype, device,
                      gen: torch.Generator, gathered: bool = True, x_dtype=None, y_dtype=None,
                      n_sizes: Optional[Sequence[int]] = None, k_sizes: Optional[Sequence[int]] = None,
                      alpha: float = 1.0, accumulate: bool = True, pad: int = 0) -> GroupedGemmProblem:
    T = token_lora.shape[0]
    rnd = lambda *shape: torch.randn(*shape, generator=gen, device=gen.device)
    x = padded(rnd(T, K).to(x_dtype or dtype), pad, device)
    w = padded((rnd(num_groups, N, K) / K ** 0.5).to(dtype), pad, device)
    y = rnd(T, N).to(y_dtype or dtype)
    idx, indptr, seg = segments_for(token_lora, num_groups, gathered)
    to = lambda t: None if t is None else t.to(device)
    as_t = lambda v: None if v is None else torch.tensor(v, dtype=torch.int32)
    return GroupedGemmProblem(y.to(device), x, w, to(indptr), to(seg), to(idx), to(as_t(n_sizes)),
                              to(as_t(k_sizes)), alpha, accumulate)


def capture_grouped_gemm(op, problem, y: torch.Tensor) -> "torch.cuda.CUDAGraph":
    """A CUDA graph of op(*problem.args(y)): one call on a scratch copy of y first, on a side stream outside the
    capture (it sets kernel attributes, which a capture cannot), then the captured call."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op(*problem.args(y.clone()))
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(*problem.args(y))
    return graph


def cuda_build_segments_max_slots(count_copies: int) -> int:
    """The most slots the CUDA build_segments kernel holds on the current device with `count_copies` (32 or 1)
    copies of each count: the opt-in shared memory less its static warp_total[32], over the int32 words per bucket
    (counts [2][copies], a cursor per placing warp (16 with 32 copies: 512-thread CTAs; at least 1 otherwise), the
    start), less the no-LoRA bucket."""
    budget = torch.cuda.get_device_properties(torch.cuda.current_device()).shared_memory_per_block_optin - 4 * 32
    warps = 16 if count_copies == 32 else 1
    return budget // (4 * (2 * count_copies + warps + 1)) - 1


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double().to(ref.device), ref.double()
    denom = ref.norm().item()
    diff = (out - ref).norm().item()
    return diff / denom if denom > 0 else diff


def check_against_reference(out: torch.Tensor, before: torch.Tensor, ref: torch.Tensor, inputs_dtype) -> str:
    """'' if `out` matches the float64 oracle `ref`, else a description of the mismatch.

    Elements the oracle leaves alone must be bitwise unchanged (NaN poison included); the written ones must
    carry no NaN and their change (out - before) must match the oracle's within tolerance(inputs_dtype, out.dtype)
    (inputs_dtype: the weights' dtype). One exception: a finite element of a row the oracle changes elsewhere may
    move by at most the tolerance times that row's largest change. There the exact sum cancelled (bf16 products
    can sum to exactly 0, so the oracle adds 0) while a kernel's rounding left a residue; such an element counts
    as written, with an expected change of 0. Compared on the oracle's device: a bench output of 16384 × 4096
    takes seconds on the host."""
    out, before = out.to(ref.device), before.to(ref.device)
    before64 = before.double()
    left_alone = (ref == before64) | (ref.isnan() & before64.isnan())
    touched = ~left_alone
    base = torch.where(before64.isnan(), torch.zeros_like(before64), before64)
    tol = tolerance(inputs_dtype, out.dtype)
    moved = left_alone & _bits_differ(out, before)  # bitwise, NaN too
    if moved.any() and out.dim() == 2:
        row_change = torch.where(touched, ref - base, 0).abs().amax(dim=1, keepdim=True)
        residue = moved & before64.isfinite() & ((out.double() - before64).abs() <= tol * row_change)
        moved, touched = moved & ~residue, touched | residue
    if moved.any():
        return f"{int(moved.sum())} elements outside the LoRA rows/columns changed"
    if touched.any():
        if out[touched].isnan().any():
            return f"{int(out[touched].isnan().sum())} written elements are NaN (unwritten or poisoned)"
        err = relative_error((out.double() - base)[touched], (ref - base)[touched])
        if err > tol:
            return f"relative error {err:.3e} > {tol:.0e} ({inputs_dtype} inputs, {out.dtype} output)"
        rows = _rows_off(torch.where(touched, out.double() - base, 0), torch.where(touched, ref - base, 0),
                         torch.where(touched, base, 0), out.dtype)
        if rows:
            return f"{rows} rows are off by more than half of their change (all rows together: {err:.1e})"
    return ""


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits_differ(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Per element of a and b (one shape and dtype): whether their bits differ (NaN payloads and -0.0 included)."""
    bits = _BITS[a.element_size()]
    return a.view(bits) != b.view(bits)


def _rows_off(got: torch.Tensor, want: torch.Tensor, base: torch.Tensor, dtype) -> int:
    """Rows of a 2-D output whose change is off by more than half of the oracle's, among those whose change stands
    well above the output's own rounding: one norm over all rows hides a few wrong ones (one unwritten row of 16384
    is 0.8%)."""
    if got.dim() != 2:
        return 0
    want_norm = want.norm(dim=1)
    significant = want_norm > 16 * torch.finfo(dtype).eps * base.norm(dim=1)
    return int((significant & ((got - want).norm(dim=1) > 0.5 * want_norm)).sum())


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """A flat tensor of t's dtype over all of t's storage."""
    flat = torch.empty(0, dtype=t.dtype, device=t.device)
    return flat.set_(t.untyped_storage(), 0, (t.untyped_storage().nbytes() // t.element_size(),))


def storage_snapshot(t: torch.Tensor) -> torch.Tensor:
    """A copy of the whole storage under the view t (for check_outside_view)."""
    return _whole_storage(t).clone()


def check_outside_view(t: torch.Tensor, snapshot: torch.Tensor) -> str:
    """'' if no element of t's storage outside the view t changed bitwise since storage_snapshot(t) (e.g. the
    columns around a column slice y), else a description."""
    flat = _whole_storage(t)
    inside = torch.zeros(flat.numel(), dtype=torch.bool, device=t.device)
    inside.as_strided(t.shape, t.stride(), t.storage_offset()).fill_(True)
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    changed = int(((flat.view(bits) != snapshot.view(bits)) & ~inside).sum())
    return f"{changed} elements outside the view (row padding, neighbouring columns) changed" if changed else ""


def run_and_check(op, problem) -> str:
    """Run `op` (an sgmv or grouped_gemm entry point, by the problem's type) on `problem` in place: '' if y matches
    the float64 oracle and nothing else in y's storage (padding, neighbouring columns) changed, else why not."""
    if isinstance(problem, SgmvProblem):
        oracle, inputs_dtype = reference.sgmv, problem.lora_a.dtype
    else:
        oracle, inputs_dtype = reference.grouped_gemm, problem.w.dtype
    before, around = problem.y.clone(), storage_snapshot(problem.y)
    ref = oracle(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in problem.args()])
    op(*problem.args())
    return check_against_reference(problem.y, before, ref, inputs_dtype) or check_outside_view(problem.y, around)
