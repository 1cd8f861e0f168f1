"""lora_expand against the float64 oracle on every backend, the Ascend one on its CPU model included: the sgmv
parity grid with a random h in place of the shrink (every slot's window, or one window per row broadcast over the
slots), float32 or half h, NaN in h past each slot's rank, garbage metadata, determinism, opcheck, argument errors,
and compile; each in the segment form and in the rows form (no seg_indptr: each position's slot)."""

import re

import pytest
import torch
import torch._dynamo.testing

import lora_ops
from lora_ops import backends, op_table, reference, testing

from conftest import (ASCEND_MODEL_IMPL, IMPLS, Impl, case_generator, cuda_kernel_names, late_copy, repeat_runs,
                      use_impl)
from grid import SGMV_CASES, SGMV_LARGE_CASES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(params=IMPLS + [ASCEND_MODEL_IMPL])
def impl(request):
    yield from use_impl(request.param)


# rows: each row's slot as given (no token_indices); sorted_rows: the rows form in build_segments' order (token_indices
# and each position's slot), as the fold route passes it on CUDA
FORMS = ["segments", "rows", "sorted_rows"]


def _problem(case, impl, dtype, key, h_fp32=False, broadcast=False, form="segments"):
    """sgmv's problem of the case, with h [T, L, S·R] in place of x and lora_a; in the rows forms the rows' slots
    (seg_lora [T], no seg_indptr; no token_indices, or build_segments' order) in place of the segments."""
    gen = case_generator(f"lora_expand-{key}")
    token_lora, kw = case(gen)
    kw.setdefault("num_slots", 6)
    p = testing.make_sgmv(token_lora, dtype=dtype, device=impl.device, gen=gen, **kw)
    T, (L, SR, _) = p.x.shape[0], p.lora_a.shape
    h_dtype = torch.float32 if h_fp32 else dtype
    if broadcast:  # one window per row, the same for every slot: a zero slot stride
        h = torch.randn(T, 1, SR, generator=gen).to(h_dtype).to(impl.device).expand(T, L, SR)
    else:
        h = torch.randn(T, L, SR, generator=gen).to(h_dtype).to(impl.device)
    scale = p.scale if p.scale != 1.0 else 0.625
    if form == "rows":
        return (p.y, h, p.lora_b, None, token_lora.to(impl.device), None, p.lora_ranks, p.lora_scales,
                p.slice_offsets, scale)
    if form == "sorted_rows":
        order = reference.build_segments(token_lora.cpu(), L)[0]
        return (p.y, h, p.lora_b, None, token_lora.cpu()[order].to(impl.device), order.to(impl.device),
                p.lora_ranks, p.lora_scales, p.slice_offsets, scale)
    return (p.y, h, p.lora_b, p.seg_indptr, p.seg_lora, p.token_indices, p.lora_ranks, p.lora_scales,
            p.slice_offsets, scale)


def _run_and_check(impl, args, dtype):
    """'' if y matches the oracle and nothing else in y's storage (row padding, h beside it) changed."""
    y = args[0]
    before, around = y.clone(), testing.storage_snapshot(y)
    ref = reference.lora_expand(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    impl.module.lora_expand(*args)
    return testing.check_against_reference(y, before, ref, dtype) or testing.check_outside_view(y, around)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SGMV_CASES))
def test_lora_expand_parity(impl, name, dtype, form):
    if dtype not in impl.dtypes:
        pytest.skip(f"{impl.name} is tested in {impl.dtypes} only")
    assert _run_and_check(impl, _problem(SGMV_CASES[name], impl, dtype, name, form=form), dtype) == ""


@pytest.mark.parametrize("variant", ["h_fp32", "broadcast"])
def test_lora_expand_h_layouts(impl, variant):
    _check_h_layout(variant)(impl, impl.dtypes[-1])


def test_lora_expand_folded_gemm_layout(impl):
    """h as the extra columns of a base GEMM against [W; A of every slot]: y and h are views of one output."""
    dtype = impl.dtypes[0]
    gen = case_generator("lora_expand-folded")
    T, K, N, L, S, R = 11, 24, 40, 4, 2, 8
    token_lora = testing.random_token_slots(T, [0, 3, -1, 1], gen)
    w_cat = torch.randn(N + L * S * R, K, generator=gen).to(dtype).to(impl.device)
    x = torch.randn(T, K, generator=gen).to(dtype).to(impl.device)
    lora_b = torch.randn(L, N, R, generator=gen).to(dtype).to(impl.device)
    seg = lora_ops.build_segments(token_lora.to(impl.device), L)
    out = x @ w_cat.t()
    args = (out[:, :N], out[:, N:].view(T, L, S * R), lora_b, seg.seg_indptr, seg.seg_lora, seg.token_indices,
            None, None, [0, 25, N], 1.0)
    before_h = out[:, N:].clone()
    assert _run_and_check(impl, args, dtype) == ""
    assert torch.equal(out[:, N:], before_h)  # h, beside y in the same rows, is left alone


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SGMV_LARGE_CASES))
def test_lora_expand_parity_large(impl, name, dtype, form):
    if impl.device != "cuda":
        pytest.skip("GPU-sized case")
    assert _run_and_check(impl, _problem(SGMV_LARGE_CASES[name], impl, dtype, name, form=form), dtype) == ""


def test_lora_expand_garbage_metadata(impl):
    """Out-of-range and overlapping indptr, rows outside [0, T), huge slots (int64 too): skipped or clamped."""
    _check_garbage_metadata(impl, impl.dtypes[0])


def _check_garbage_metadata(impl, dtype):
    args = list(_problem(SGMV_CASES["basic"], impl, dtype, key="garbage"))
    dev = impl.device
    T = args[0].shape[0]
    args[5] = torch.tensor([3, -5, 7, T + 7, 1, 2, 1 << 30] + list(range(8, T)), dtype=torch.int32, device=dev)
    args[3] = torch.tensor([-4, 3, 1, 9, 2, 1 << 30, 5], dtype=torch.int32, device=dev)
    args[4] = torch.tensor([0, 1, -1, 2, 4, 1], dtype=torch.int32, device=dev)
    args[6] = torch.tensor([16, 99, -3, 4, 7, 2], dtype=torch.int32, device=dev)
    assert _run_and_check(impl, tuple(args), dtype) == ""
    args[4] = torch.tensor([1 << 40, -(1 << 40), 7, 3, 2 ** 32, 0], dtype=torch.int64, device=dev)
    assert _run_and_check(impl, tuple(args), dtype) == ""


def test_lora_expand_rows_form_garbage_metadata(impl):
    """The rows form: slots outside [0, L) (int64 beyond int32 too) and rows outside [0, T) are skipped."""
    _check_rows_garbage_metadata(impl, impl.dtypes[0])


def _check_rows_garbage_metadata(impl, dtype):
    args = list(_problem(SGMV_CASES["basic"], impl, dtype, key="rows-garbage", form="rows"))
    dev, T, L = impl.device, args[0].shape[0], args[2].shape[0]
    slots = [(-5, L, 1 << 30, 0, 1, L - 1)[t % 6] for t in range(T)]
    args[4] = torch.tensor(slots, dtype=torch.int32, device=dev)
    assert _run_and_check(impl, tuple(args), dtype) == ""
    args[4] = torch.tensor([(1 << 40, -(1 << 40), 2 ** 32, 1)[t % 4] for t in range(T)], dtype=torch.int64,
                           device=dev)
    assert _run_and_check(impl, tuple(args), dtype) == ""
    # positions naming rows through token_indices: some outside [0, T), the rest a permutation of a subset; fewer
    # positions than rows, then more (P != T: a backend that counted T positions would read or skip the wrong ones)
    for rows in ([3, -5, T + 7, 1 << 30, 0] + list(range(T - 1, 10, -1)),
                 [3, -5, T + 7, 1 << 30, 0] + list(range(T - 1, 4, -1)) + [T + i for i in range(1, 11)]):
        assert len(rows) != T
        args[5] = torch.tensor(rows, dtype=torch.int32, device=dev)
        args[4] = torch.tensor([(0, 2, 1, -1, 3)[p % 5] for p in range(len(rows))], dtype=torch.int32, device=dev)
        assert _run_and_check(impl, tuple(args), dtype) == ""


def test_lora_expand_rank0_slot_ignores_its_scale(impl):
    """A rank-0 slot is skipped, so even a NaN scale on it leaves its rows bitwise unchanged."""
    _check_rank0_slot_ignores_its_scale(impl, impl.dtypes[0])


def test_cpu_lora_expand_multiplies_the_dot_by_the_coefficient():
    """scale * lora_scales[l] multiplies h . B^T, as in the oracle: a coefficient past float32's range (the kernels
    form it in float32, design.md) is an inf that gives each output the infinity of its dot's sign (the oracle's,
    in float64, is finite), where scaling h first would sum +inf and -inf into NaN (design.md: kernels that scale h
    first give non-finite rows either way, so this is the CPU's)."""
    gen = torch.Generator().manual_seed(47)
    y, h, b = torch.zeros(3, 8), torch.randn(3, 2, 4, generator=gen), torch.randn(2, 8, 4, generator=gen)
    args = (y, h, b, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
    kwargs = dict(lora_scales=torch.tensor([1.0, 1e38]), scale=10.0)
    ref = reference.lora_expand(*args, **kwargs)
    lora_ops.ops.lora_expand(*args, **kwargs)
    assert y.isinf().all() and torch.equal(y.sign().double(), ref.sign())


def _check_rank0_slot_ignores_its_scale(impl, dtype, form="segments"):
    args = list(_problem(SGMV_CASES["mixed_ranks"], impl, dtype, key="rank0", form=form))  # slot 2 has rank 0
    args[7] = args[7].clone()
    args[7][2] = float("nan")
    assert _run_and_check(impl, tuple(args), dtype) == ""


# Beyond the parity grid: ranks that end inside a 16-column step and cross the kernels' 128-column h chunk, and a
# pool of 100 slots (the CUDA positions kernel looks the ranks of slots below 64 up with its walk, the rest after).
PAST_RANK_CASES = {
    "slices_gqa": SGMV_CASES["slices_gqa"],  # ranks 8, 2, 8, 5, 0, 1 of 8
    "rank_160": lambda g: (testing.random_token_slots(45, [0, 1, 2, 4, 5], g),
                           dict(K=24, N=40, max_rank=160, ranks=[160, 130, 7, 0, 129, 17])),
}
MANY_SLOTS = lambda g: (testing.random_token_slots(48, [3, 40, 63, 64, 99, -1], g),
                        dict(K=32, N=72, max_rank=16, num_slots=100, slice_offsets=[0, 40, 72],
                             ranks=[7 * i % 17 for i in range(100)]))  # slot l's rank differs from l +- 32's


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("case", list(PAST_RANK_CASES))
def test_lora_expand_reads_nothing_past_the_rank(impl, case, form):
    """h and B past a slot's rank (never written by a shrink of that rank, nor by the pool) may hold anything:
    NaN there changes nothing."""
    _check_reads_nothing_past_the_rank(impl, impl.dtypes[0], case, form)


def _check_reads_nothing_past_the_rank(impl, dtype, case="slices_gqa", form="segments"):
    args = list(_problem(PAST_RANK_CASES[case], impl, dtype, key=f"past-rank-{case}", form=form))
    h, lora_b, max_rank = args[1], args[2], args[2].shape[2]
    for slot, rank in enumerate(args[6].tolist()):
        lora_b[slot, :, rank:] = float("nan")
        for s in range(h.shape[2] // max_rank):
            h[:, slot, s * max_rank + rank:(s + 1) * max_rank] = float("nan")
    assert _run_and_check(impl, tuple(args), dtype) == ""


@pytest.mark.parametrize("form", FORMS)
def test_lora_expand_many_slots(impl, form):
    """A 100-slot pool with rows on slots below 32, 32-63 and from 64 up, and rows with no LoRA."""
    _check_many_slots(impl, impl.dtypes[-1], form)


def _check_many_slots(impl, dtype, form="segments"):
    assert _run_and_check(impl, _problem(MANY_SLOTS, impl, dtype, key="many-slots", form=form), dtype) == ""


@pytest.mark.parametrize("form", FORMS)
def test_lora_expand_deterministic(impl, form):
    dtype = impl.dtypes[-1]
    args = _problem(SGMV_CASES["mixed_ranks"], impl, dtype, key="determinism", form=form)
    def run():
        y = args[0].clone()
        impl.module.lora_expand(y, *args[1:])
        return y
    outs = repeat_runs(impl, run)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def _check_h_layout(variant, form="segments"):
    def check(impl, dtype):
        args = _problem(SGMV_CASES["slices_gqa"], impl, dtype, key="layouts", h_fp32=variant == "h_fp32",
                        broadcast=variant == "broadcast", form=form)
        assert _run_and_check(impl, args, dtype) == ""
    return check


def _check_other_slots_b_stays_out(impl, dtype):
    """Rows of three slots side by side (build_segments' order), slot 1's B all inf: slot 1's rows take whatever
    inf gives, and every other row stays exact. The runs kernel multiplies a slot's B with the h of each of its
    warp's 8 rows (zeros for rows of other slots): 0 · inf is NaN, which must not reach them."""
    case = lambda g: (testing.random_token_slots(45, [0, 1, 2], g), dict(K=16, N=72, max_rank=16, num_slots=4))
    args = list(_problem(case, impl, dtype, key="inf-neighbour", form="sorted_rows"))
    args[2][1] = float("inf")
    y = args[0]
    before = y.clone()
    impl.module.lora_expand(*args)
    sorted_slots, order = args[4].cpu(), args[5].cpu()
    clean = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
    clean[0] = before.cpu()
    clean[4] = torch.where(sorted_slots == 1, -1, sorted_slots)  # the oracle of the other rows
    ref = reference.lora_expand(*clean)
    others = order[sorted_slots != 1].long()
    assert testing.check_against_reference(y[others], before[others], ref[others], dtype) == ""


EDGE_CHECKS = {"garbage_metadata": _check_garbage_metadata, "rank0": _check_rank0_slot_ignores_its_scale,
               "past_rank": _check_reads_nothing_past_the_rank, "many_slots": _check_many_slots,
               "past_rank_160": lambda impl, dtype: _check_reads_nothing_past_the_rank(impl, dtype, "rank_160"),
               "h_fp32": _check_h_layout("h_fp32"), "h_broadcast": _check_h_layout("broadcast"),
               "rows_garbage_metadata": _check_rows_garbage_metadata,
               "rows_rank0": lambda impl, dtype: _check_rank0_slot_ignores_its_scale(impl, dtype, "rows"),
               "rows_past_rank_160": lambda impl, dtype: _check_reads_nothing_past_the_rank(impl, dtype, "rank_160",
                                                                                            "rows"),
               "rows_many_slots": lambda impl, dtype: _check_many_slots(impl, dtype, "rows"),
               "rows_past_rank": lambda impl, dtype: _check_reads_nothing_past_the_rank(impl, dtype, "slices_gqa",
                                                                                        "rows"),
               "rows_h_fp32": _check_h_layout("h_fp32", "rows"),
               "sorted_rows_past_rank": lambda impl, dtype: _check_reads_nothing_past_the_rank(
                   impl, dtype, "slices_gqa", "sorted_rows"),
               "sorted_rows_past_rank_160": lambda impl, dtype: _check_reads_nothing_past_the_rank(
                   impl, dtype, "rank_160", "sorted_rows"),
               "sorted_rows_other_slots_b": _check_other_slots_b_stays_out}


def _edge_check_form(name: str) -> str:
    """The lora_expand form an edge check passes (its name's prefix)."""
    return "sorted_rows" if name.startswith("sorted_rows_") else "rows" if name.startswith("rows_") else "segments"


# The rows and runs kernels serve the rows forms only, the segments kernel the segment form only: forced on the
# other form they leave the automatic choice, which the other kernels' runs already cover
# (test_lora_expand_cuda_kernel_choice checks that fallback).
ROWS_KERNELS = ("rows", "runs")
KERNEL_FORMS = [(k, f) for k in ("positions", "tiles", "segments") + ROWS_KERNELS for f in FORMS
                if (f == "segments") == (k not in ROWS_KERNELS) or k in ("positions", "tiles")]


@pytest.mark.gpu
@pytest.mark.parametrize("kernel,form", KERNEL_FORMS, ids=[f"{k}-{f}" for k, f in KERNEL_FORMS])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(SGMV_CASES) + list(SGMV_LARGE_CASES) + list(EDGE_CHECKS))
def test_lora_expand_each_cuda_kernel(name, dtype, kernel, form, monkeypatch):
    """Every CUDA expand kernel over the whole grid, not only where the automatic choice (by positions) puts
    them; a forced kernel also bypasses the op table. The rows and runs kernels serve the rows forms, the segments
    kernel the segment form, with fp16/bf16 B and h, ranks in fours and even slices (the rest falls back to the
    automatic choice)."""
    if backends.cuda_served_by.get("lora_expand") != "cuda":
        pytest.skip("the CUDA lora_expand kernels are not built")
    monkeypatch.setenv("LORA_OPS_CUDA_EXPAND_KERNEL", kernel)
    cuda = Impl("cuda", "cuda", lora_ops.ops, DTYPES)
    if name in EDGE_CHECKS:
        if form != next(f for k, f in KERNEL_FORMS if k == kernel):
            pytest.skip("the edge checks name their form: they run once per kernel")
        if (kernel, _edge_check_form(name)) not in KERNEL_FORMS:
            pytest.skip("the forced kernel does not serve this edge check's form (the automatic choice would run)")
        EDGE_CHECKS[name](cuda, dtype)
        return
    case = {**SGMV_CASES, **SGMV_LARGE_CASES}[name]
    assert _run_and_check(cuda, _problem(case, cuda, dtype, name, form=form), dtype) == ""


def _runs_instance(name: str) -> tuple:
    """(kSteps; kPipeline: 0 None, 1 Copy; kPositions) of an expand_runs_kernel<TB, TH, TY, kSteps, kPipeline,
    kPositions> that ran, from its demangled name ("...1, (lora_ops::cuda::(anonymous namespace)::RunsPipeline)1, 8>(...")."""
    found = re.search(r"(\d), \([\w:() ]*RunsPipeline\)(\d), (\d+)>", name)
    assert found, name
    return tuple(int(v) for v in found.groups())


def _skip_without_early_launch():
    """The CUDA expand kernels, sm_90 (programmatic dependent launch) and Triton (late_copy)."""
    if backends.cuda_served_by.get("lora_expand") != "cuda":
        pytest.skip("the CUDA lora_expand kernels are not built")
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs sm_90")
    pytest.importorskip("triton")


def _cuda_kernels_run(args, name: str = "") -> list | None:
    """The lora_ops CUDA kernels whose names hold name that one lora_expand call on args runs (the op table off);
    None where the profiler sees nothing (under compute-sanitizer: conftest.cuda_kernel_names), so that the callers
    skip their checks of which kernel ran, and keep their checks of what it computed."""
    with op_table.disabled():
        _, ran = cuda_kernel_names(lambda: lora_ops.ops.lora_expand(*args))
    return sorted(k for k in ran if "lora_ops::cuda::" in k and name in k) if ran else None


@pytest.mark.gpu
@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("forced", [None, "positions", "tiles", "rows", "runs", "segments"])
@pytest.mark.parametrize("T", [8, 11, 12, 40, 200])
def test_lora_expand_cuda_kernel_choice(T, forced, form, monkeypatch):
    """Where the tensor-core kernels serve (bf16 here) the automatic choice runs the segments kernel on the segment
    form; on the rows form, the runs kernel in build_segments' order from 2 positions per pool slot (6 slots here:
    from 12), else the rows kernel. A forced kernel runs whatever the size, "rows" and "runs" only on the rows forms,
    "segments" only on the segment form (so the per-kernel tests above test what they say)."""
    if backends.cuda_served_by.get("lora_expand") != "cuda":
        pytest.skip("the CUDA lora_expand kernels are not built")
    if forced:
        monkeypatch.setenv("LORA_OPS_CUDA_EXPAND_KERNEL", forced)
    expected = forced
    if form == "segments" and forced in (None, "segments") + ROWS_KERNELS:
        expected = "segments"
    elif forced in (None, "segments"):
        expected = "runs" if form == "sorted_rows" and T >= 2 * 6 else "rows"
    cuda = Impl("cuda", "cuda", lora_ops.ops, DTYPES)
    case = lambda g: (testing.random_token_slots(T, [0, 2, 5], g), dict(K=32, N=300, max_rank=16))
    args = _problem(case, cuda, torch.bfloat16, key=f"choice-{T}", form=form)
    ran = _cuda_kernels_run(args, "expand_")
    if ran is not None:
        assert ran and all(f"expand_{expected}_kernel" in k for k in ran), ran


@pytest.mark.gpu
@pytest.mark.parametrize("T", [40, 200])
@pytest.mark.parametrize("form", ["rows", "segments"])
@pytest.mark.parametrize("dtype,N", [(torch.float32, 300), (torch.bfloat16, 301)], ids=["fp32", "odd_width"])
def test_lora_expand_fallback_kernel(dtype, N, form, T):
    """What the tensor-core kernels cannot take (fp32 B; a slice of odd width) runs the positions kernel: in the
    rows form at any number of positions (the segment-tile kernel would make a tile of every row), in the segment
    form up to 64 positions and the segment-tile kernel beyond."""
    if backends.cuda_served_by.get("lora_expand") != "cuda":
        pytest.skip("the CUDA lora_expand kernels are not built")
    cuda = Impl("cuda", "cuda", lora_ops.ops, DTYPES)
    case = lambda g: (testing.random_token_slots(T, [0, 2, 5], g), dict(K=32, N=N, max_rank=16))
    args = _problem(case, cuda, dtype, key=f"fallback-{N}-{T}", form=form)
    before = args[0].clone()
    ref = reference.lora_expand(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    ran = _cuda_kernels_run(args, "expand_")
    expected = "tiles" if form == "segments" and T > 64 else "positions"
    if ran is not None:
        assert ran and all(f"expand_{expected}_kernel" in k for k in ran), ran
    assert testing.check_against_reference(args[0], before, ref, dtype) == ""


@pytest.mark.gpu
@pytest.mark.parametrize("h_scale", [1.0, 1e-4, 3e4])
@pytest.mark.parametrize("form", ["rows", "segments"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_lora_expand_float32_h_on_tensor_cores_with_bf16_b(dtype, form, h_scale):
    """float32 h with bf16 B runs the tensor-core kernels, h split into bf16 hi + lo parts: within the float32
    output's tolerance at any scale of h, ranks below the pool's in and across 16-rank steps, NaN in h past each
    slot's rank never read. With fp16 B the SIMT kernels keep it (fp16 hi + lo would overflow past 65504 and lose
    small h's lo part to subnormals). The decode sgmv's float32 split partials stay on the SIMT kernels (slower
    on these, H200)."""
    if backends.cuda_served_by.get("lora_expand") != "cuda":
        pytest.skip("the CUDA lora_expand kernels are not built")
    cuda = Impl("cuda", "cuda", lora_ops.ops, DTYPES)
    ranks = [32, 0, 13, 0, 0, 20]
    case = lambda g: (testing.random_token_slots(40, [0, 2, 5], g), dict(K=32, N=256, max_rank=32, ranks=ranks,
                                                                         y_dtype=torch.float32))
    args = list(_problem(case, cuda, dtype, key=f"f32h-{form}", h_fp32=True, form=form))
    args[0].zero_()  # y is the product alone: y ~ 1 would round a product ~ 1e-4 past the tolerance on any backend
    h = args[1]
    h.mul_(h_scale)
    for slot, rank in enumerate(ranks):
        h[:, slot, rank:] = float("nan")
    before = args[0].clone()
    ref = reference.lora_expand(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in args])
    ran = _cuda_kernels_run(args)
    if dtype == torch.bfloat16:
        expected = ("expand_segments_kernel",) if form == "segments" else ("expand_rows_kernel", "expand_runs_kernel")
    else:
        expected = ("expand_positions_kernel", "expand_tiles_kernel")
    assert ran is None or any(k in e for e in ran for k in expected), ran
    assert testing.check_against_reference(args[0], before, ref, dtype) == ""


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck_lora_expand(device, form):
    args = _problem(SGMV_CASES["slices_gqa"], Impl("x", device, lora_ops.ops, DTYPES), torch.float32, key="opcheck",
                    form=form)
    torch.library.opcheck(torch.ops.lora_ops.lora_expand.default, args)


def _args(**change):
    a = dict(y=torch.randn(4, 12), h=torch.randn(4, 3, 4), lora_b=torch.randn(3, 12, 4),
             seg_indptr=torch.tensor([0, 2, 4], dtype=torch.int32), seg_lora=torch.tensor([0, 2], dtype=torch.int32))
    a.update(change)
    return a


@pytest.mark.parametrize("change,exc,msg", [
    (dict(h=torch.randn(4, 12)), ValueError, r"h must be 3-D \[T, L, S\*R\]"),
    (dict(h=torch.randn(4, 2, 4)), ValueError, r"h must be \[T, L, S\*R\] with T = y.size\(0\) = 4, L = lora_b.size\(0\) = 3"),
    (dict(h=torch.randn(4, 3, 8)), ValueError, r"h must be .* and S\*R = 4, got shape \[4, 3, 8\]"),
    (dict(h=torch.randn(4, 3, 4, dtype=torch.float64)), TypeError, r"h must be float32 or lora_b's dtype \(Float\)"),
    (dict(h=torch.randn(4, 4, 3).transpose(1, 2)), ValueError, r"h must have unit stride in its last dimension"),
    (dict(lora_b=torch.randn(3, 11, 4)), ValueError, r"lora_b must be \[L, N, R\] with N = y.size\(1\) = 12"),
    (dict(y=torch.randn(4, 12, dtype=torch.float16)), TypeError, r"y must be float32 or lora_b's dtype"),
    (dict(h=torch.randn(4, 3, 4).to("meta")), ValueError, r"h is on meta but y is on cpu"),
    (dict(lora_ranks=torch.zeros(2, dtype=torch.int32)), ValueError, r"lora_ranks must have 3 entries"),
    (dict(seg_indptr=None), ValueError,
     r"seg_lora must have 4 entries \(one per row without seg_indptr: y.size\(0\)\)"),
    (dict(seg_indptr=None, seg_lora=torch.zeros(4, dtype=torch.int32), token_indices=torch.arange(3)), ValueError,
     r"seg_lora must have 3 entries \(one per position without seg_indptr: len\(token_indices\)\)"),
    (dict(seg_indptr=None, seg_lora=torch.zeros(4)), TypeError, r"seg_lora must be int32 or int64"),
])
def test_lora_expand_argument_error(change, exc, msg):
    mods = [lora_ops.ops]
    if "triton" not in lora_ops.backends.unavailable:
        import lora_ops.triton as lt
        mods.append(lt)
    for mod in mods:
        with pytest.raises(exc, match=r"lora_ops\.lora_expand: " + msg):
            mod.lora_expand(**_args(**change))


def test_lora_expand_compiles_without_breaks_or_recompiles():
    torch._dynamo.reset()
    L, S, R, K, N = 4, 2, 8, 16, 24
    w_cat = torch.randn(N + L * S * R, K)
    lora_b = torch.randn(L, N, R)
    ranks = torch.tensor([8, 3, 0, 5], dtype=torch.int32)

    def folded_layer(x, token_lora):
        seg = lora_ops.build_segments(token_lora, L)
        out = x @ w_cat.t()
        y = out[:, :N]
        h = out[:, N:].view(x.shape[0], L, S * R)
        lora_ops.lora_expand(y, h, lora_b, seg.seg_indptr, seg.seg_lora, seg.token_indices, ranks, None, [0, 10, N],
                             0.5)
        lora_ops.lora_expand(y, h, lora_b, None, token_lora, None, ranks, None, [0, 10, N], 0.25)  # the rows form
        return y * 2

    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(folded_layer, backend=counter, fullgraph=True, dynamic=True)
    gen = case_generator("lora_expand-compile")
    for T in (3, 7, 12):
        x = torch.randn(T, K, generator=gen)
        token_lora = testing.random_token_slots(T, [0, 1, -1, 3], gen)
        torch.testing.assert_close(compiled(x, token_lora), folded_layer(x, token_lora), rtol=1e-5, atol=1e-5)
    assert counter.frame_count == 1


@pytest.mark.gpu
@pytest.mark.parametrize("written", ["token_indices", "slots", "ranks", "scales"])
@pytest.mark.parametrize("kernel,T", [("rows", 32), ("runs", 64), ("rows", 4 * 65535 + 8), ("runs", 4096),
                                      ("runs", 16384)])
def test_metadata_written_after_an_early_trigger_is_the_one_used(kernel, T, written, monkeypatch):
    """The rows and runs kernels guess each position's row, slot, rank and scale before the programmatic-launch
    wait and check the guess after it (lora_expand_rows.cu). Here the kernel right before the op lets it launch at
    once and writes one metadata tensor ~100 us later, so the guesses are stale (another order of the rows, other
    slots or none, ranks 0, other scales): y must be the product of the metadata as written, bitwise the same
    call's without the race. At 16384 positions and more each CTA takes two 128-column passes (N = 256 past one
    wave of one-pass CTAs), and at 4 * 65535 + 8 positions the rows kernel's grid (65535 groups of 4 warps) leaves its
    first warps a second position after a redo. The runs kernel runs pipelined where its grid fits at once: on 4
    positions a warp at 64, on 8 at 4096 (where only the grid of 8 fits), and not at 16384."""
    _skip_without_early_launch()
    monkeypatch.setenv("LORA_OPS_CUDA_EXPAND_KERNEL", kernel)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    gen = case_generator(f"late-metadata-{kernel}-{written}")
    L, N, R = 6, 256, 16
    h = torch.randn(T, L, R, generator=gen).to(torch.bfloat16).cuda()
    lora_b = (torch.randn(L, N, R, generator=gen) / 4).to(torch.bfloat16).cuda()
    y0 = torch.randn(T, N, generator=gen).to(torch.bfloat16).cuda()
    token_lora = torch.randint(0, L, (T,), generator=gen, dtype=torch.int32)
    order = torch.sort(token_lora, stable=True)[1].int()  # build_segments' order: every slot is valid
    final = {"token_indices": order, "slots": token_lora[order.long()],
             "ranks": torch.randint(1, R + 1, (L,), generator=gen, dtype=torch.int32),
             "scales": torch.rand(L, generator=gen) + 0.5}
    stale = {"token_indices": torch.randperm(T, generator=gen).int(),
             "slots": torch.where(torch.arange(T) % 2 == 0, -1, (final["slots"] + 1) % L).int(),
             "ranks": torch.zeros(L, dtype=torch.int32), "scales": -final["scales"]}
    argument = {"slots": 4, "token_indices": 5, "ranks": 6, "scales": 7}  # of lora_expand

    def args(meta, device="cuda"):
        return (y0.clone().to(device), h.to(device), lora_b.to(device), None, meta["slots"].to(device),
                meta["token_indices"].to(device), meta["ranks"].to(device), meta["scales"].to(device))

    expected = args(final)
    ran = _cuda_kernels_run(expected, f"expand_{kernel}_kernel")
    assert ran is None or len(ran) == 1, ran
    if ran and kernel == "runs":  # pipelined (3 CTAs per SM) where its one-pass grid (column blocks x groups of 4 warps)
        # fits, on 4 positions a warp where that grid fits
        fits = {p: (N // 128) * -(-T // (4 * p)) <= 3 * sms for p in (4, 8)}
        pipeline = (1, 4) if fits[4] else (1, 8) if fits[8] else (0, 8)
        assert _runs_instance(ran[0])[1:] == pipeline, ran
    expected = args(final)
    with op_table.disabled():
        lora_ops.ops.lora_expand(*expected)
    # The oracle on the first and last positions (the whole batch where it is small): those rows' y, h and
    # metadata as a batch of their own.
    at = torch.cat([torch.arange(min(T, 64)), torch.arange(max(min(T, 64), T - 64), T)])
    rows = order[at].long()
    ref = reference.lora_expand(y0[rows].cpu(), h[rows].cpu(), lora_b.cpu(), None, final["slots"][at],
                                torch.arange(len(at), dtype=torch.int32), final["ranks"], final["scales"])
    assert ((expected[0][rows].cpu().double() - ref).norm() / ref.norm()).item() < 1e-2
    written_final = final[written].cuda()
    for _ in range(3):
        call = args({k: (stale if k == written else final)[k] for k in final})
        with op_table.disabled():
            late_copy()(written_final, call[argument[written]])
            lora_ops.ops.lora_expand(*call)
        assert torch.equal(call[0], expected[0]), f"a stale guess of {written} reached y"


# (max rank, N, pool slots, the runs kernel's (kSteps, kPipeline, kPositions) on 132 SMs) for 96 positions
MANY_RUNS_CASES = [(16, 328, 40, (1, 1, 4)), (16, 12872, 40, (1, 1, 8)), (64, 328, 40, (4, 0, 4)),
                   (64, 12872, 40, (4, 0, 8)), (48, 328, 40, (4, 0, 4)), (64, 328, 24, (2, 0, 8))]


@pytest.mark.gpu
@pytest.mark.parametrize("R, N, L, instance", MANY_RUNS_CASES,
                         ids=[f"r{c[0]}-{c[1]}-L{c[2]}" for c in MANY_RUNS_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_runs_kernels_with_many_runs_a_warp(dtype, R, N, L, instance, monkeypatch):
    """96 rows on L slots in build_segments' order (runs of ~2.4 rows on 40 slots: a warp's 4 or 8 positions span
    1-4 or 3-8 runs), true ranks 1-R (the checked loads), a last pass of 72 columns, slots past the pool and rows
    of none: the runs kernel named by its instantiation, against the oracle. At rank 16 the pipelined kernel, on 4
    positions a warp where that grid fits at once (N = 328: 3 column blocks x 6 groups), on 8 where only that one
    fits (N = 12872: 101 column blocks x 6 groups of 4-position warps is 606 CTAs, past an H200's 396 at 3 per SM;
    x 3 groups is 303). At ranks 33-64 with fewer than 3 positions a pool slot (96 on 40), 64 ranks a trip, on 4
    positions a warp where that grid fits at once (2 per SM: N = 328), else on 8 (N = 12872); with more (96 on 24),
    two 32-rank trips on 8."""
    if backends.cuda_served_by.get("lora_expand") != "cuda":
        pytest.skip("the CUDA lora_expand kernels are not built")
    monkeypatch.setenv("LORA_OPS_CUDA_EXPAND_KERNEL", "runs")
    gen = case_generator(f"many-runs-{R}-{N}-{L}-{dtype}")
    T = 96
    slots = torch.randint(-1, L + 2, (T,), generator=gen, dtype=torch.int32)  # -1 and past the pool: no slot
    order = torch.sort(slots, stable=True)[1].int()
    ranks = torch.randint(1, R + 1, (L,), generator=gen, dtype=torch.int32)
    ranks[int(slots[(slots >= 0) & (slots < L)][0])] = R  # a slot in use at the pool's rank (R = 16, 64: a whole
    # trip, whose loads are unchecked)
    args = [torch.randn(T, N, generator=gen).to(dtype), torch.randn(T, L, R, generator=gen).to(dtype),
            (torch.randn(L, N, R, generator=gen) / 4).to(dtype), None, slots[order.long()], order,
            ranks, torch.rand(L, generator=gen) + 0.5]
    on_gpu = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    before = on_gpu[0].clone()
    ran = _cuda_kernels_run(on_gpu, "expand_runs_kernel")
    assert ran is None or len(ran) == 1, ran
    if ran and torch.cuda.get_device_properties(0).multi_processor_count == 132:  # the grids' sizes above
        assert _runs_instance(ran[0]) == instance, ran
    on_gpu[0] = before.clone()
    with op_table.disabled():
        lora_ops.ops.lora_expand(*on_gpu)
    ref = reference.lora_expand(*args)
    assert testing.check_against_reference(on_gpu[0], before, ref, dtype) == ""


# (max rank, pool slots, the segments kernel's kSteps) for 96 positions
SEGMENTS_STEPS_CASES = [(64, 40, 2), (48, 24, 2), (16, 40, 1)]


@pytest.mark.gpu
@pytest.mark.parametrize("R, L, steps", SEGMENTS_STEPS_CASES, ids=[f"r{c[0]}-L{c[1]}" for c in SEGMENTS_STEPS_CASES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_segments_kernel_rank_steps(dtype, R, L, steps):
    """The segment form's 96 positions on L slots (segments of ~2.4 rows on 40 slots), true ranks 1-R (the checked
    loads), a last pass of 72 columns (N = 328), slots past the pool and rows of none: the segments kernel named by
    its rank steps, against the oracle: two 32-rank steps a trip from a pool rank of 32 (one 64-rank trip, as the
    runs kernel takes with few rows a slot, was slower here with true ranks below the pool's: NOTES.md, session 50),
    one below."""
    if backends.cuda_served_by.get("lora_expand") != "cuda":
        pytest.skip("the CUDA lora_expand kernels are not built")
    gen = case_generator(f"segments-steps-{R}-{L}-{dtype}")
    T, N = 96, 328
    token_lora = torch.randint(-1, L + 2, (T,), generator=gen, dtype=torch.int32)  # -1 and past the pool: no slot
    seg = lora_ops.build_segments(token_lora.cuda(), L)
    ranks = torch.randint(1, R + 1, (L,), generator=gen, dtype=torch.int32)
    ranks[int(token_lora[(token_lora >= 0) & (token_lora < L)][0])] = R  # a slot in use at the pool's rank
    args = [torch.randn(T, N, generator=gen).to(dtype), torch.randn(T, L, R, generator=gen).to(dtype),
            (torch.randn(L, N, R, generator=gen) / 4).to(dtype), seg.seg_indptr.cpu(), seg.seg_lora.cpu(),
            seg.token_indices.cpu(), ranks, torch.rand(L, generator=gen) + 0.5]
    on_gpu = [a.cuda() for a in args]
    before = on_gpu[0].clone()
    ran = _cuda_kernels_run(on_gpu, "expand_segments_kernel")
    if ran is not None:
        found = len(ran) == 1 and re.search(r"expand_segments_kernel<[^<>]*, (\d)>", ran[0])
        assert found and int(found.group(1)) == steps, ran
    on_gpu[0] = before.clone()
    with op_table.disabled():
        lora_ops.ops.lora_expand(*on_gpu)
    ref = reference.lora_expand(*args)
    assert testing.check_against_reference(on_gpu[0], before, ref, dtype) == ""
