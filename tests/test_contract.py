"""Contract rules of docs/design.md §2 that issue 9 made precise, on every backend (the `impl` fixture):

- int64 index values saturate to int32 (they behave as their true values), never wrap;
- segment g covers [m_g, m_{g+1}), m_i = max over j <= i of clamp(seg_indptr[j], 0, P) (a running maximum);
- strided / expanded lora_scales are read through their strides;
- an empty reduction contributes exactly zero, whatever the scales;
- the Meta kernels run the host checks (mixed devices, fake tensors, torch.compile, export).

Each test compares with an expectation that does not depend on the rule under test where it can (the oracle
follows the same rules, so a backend and the oracle could agree on a wrong rule)."""
import pytest
import torch

import lora_ops
from lora_ops import reference, testing

BIG = 2 ** 32  # wraps to 0 in int32; 2**32 + k wraps to k


def i32(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int32, device=device)


def i64(values, device="cpu"):
    return torch.tensor(values, dtype=torch.int64, device=device)


def _sgmv_inputs(impl, gen, T=6, K=16, N=12, L=3, R=4):
    dtype = impl.dtypes[0]
    rnd = lambda *shape: torch.randn(*shape, generator=gen).to(dtype).to(impl.device)
    return rnd(T, N), rnd(T, K), rnd(L, R, K) / 4, rnd(L, N, R) / 2


def _sgmv_expect(impl, y, x, a, b, *meta, **kw):
    """Run sgmv on `impl` with the given metadata; return (y after, y before)."""
    before = y.clone()
    impl.module.sgmv(y, x, a, b, *meta, **kw)
    return y, before


def _cpu(args):
    return [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]


# ---- int64 metadata saturates ----

def test_int64_slot_beyond_int32_is_skipped(impl):
    """Slot 2^32 is outside [0, L): the segment is skipped (it used to wrap to slot 0)."""
    gen = torch.Generator().manual_seed(1)
    y, x, a, b = _sgmv_inputs(impl, gen)
    out, before = _sgmv_expect(impl, y, x, a, b, i64([0, 6], impl.device), i64([BIG], impl.device))
    assert torch.equal(out, before)


def test_int64_token_index_beyond_int32_is_skipped(impl):
    """token_indices = 2^32 + 3 names no row (it used to update row 3); the other rows match the oracle."""
    gen = torch.Generator().manual_seed(2)
    y, x, a, b = _sgmv_inputs(impl, gen)
    dev = impl.device
    meta = (i64([0, 3], dev), i64([1], dev), i64([BIG + 3, 0, 1], dev))
    ref = reference.sgmv(*_cpu((y, x, a, b) + meta))
    out, before = _sgmv_expect(impl, y, x, a, b, *meta)
    assert torch.equal(out[2:], before[2:])  # rows 2..5 (row 3 included) untouched
    assert testing.check_against_reference(out, before, ref, impl.dtypes[0]) == ""


def test_int64_indptr_and_ranks_saturate(impl):
    """seg_indptr 2^32 + 2 clamps to P (not 2); rank 2^32 + 1 clamps to R (not 1); -2^32 + 1 to 0 (not 1)."""
    gen = torch.Generator().manual_seed(3)
    y, x, a, b = _sgmv_inputs(impl, gen)
    dev = impl.device
    ranks = i64([BIG + 1, -BIG + 1, 4], dev)
    meta = (i64([0, BIG + 2, BIG + 2, 6], dev), i64([0, 1, 2], dev), None, ranks)
    # The same call with the true values written small: rank R for slot 0, rank 0 for slot 1, all 6 rows.
    same = (i32([0, 6, 6, 6]), i32([0, 1, 2]), None, i32([4, 0, 4]))
    ref = reference.sgmv(*_cpu((y, x, a, b) + same))
    out, before = _sgmv_expect(impl, y, x, a, b, *meta)
    assert testing.check_against_reference(out, before, ref, impl.dtypes[0]) == ""
    assert not torch.equal(out, before)


def test_int64_group_sizes_saturate(impl):
    """n_sizes = 2^32 + 2 writes all N columns (it used to write 2); k_sizes = 2^32 + 1 reads all of K."""
    dtype = impl.dtypes[0]
    gen = torch.Generator().manual_seed(4)
    problem = testing.make_grouped_gemm(torch.zeros(5, dtype=torch.int32), num_groups=2, K=16, N=12, dtype=dtype,
                                        device=impl.device, gen=gen, gathered=False, accumulate=False)
    problem.y.fill_(float("nan"))
    problem.n_sizes = i64([BIG + 2, 3], impl.device)
    problem.k_sizes = i64([BIG + 1, 3], impl.device)
    ref = reference.grouped_gemm(*_cpu(problem.args(problem.y)))
    ref_small = reference.grouped_gemm(*_cpu(problem.args(problem.y))[:6], None, None, problem.alpha, False)
    assert torch.equal(ref, ref_small)  # the oracle uses the true values: all of N and K
    before = problem.y.clone()
    impl.module.grouped_gemm(*problem.args())
    assert not problem.y.isnan().any()
    assert testing.check_against_reference(problem.y, before, ref, dtype) == ""


def test_int64_build_segments_saturates(impl):
    """A slot of 2^32 is "no LoRA" (it used to land in slot 0), as is -2^32 + 1 (it used to be slot 1)."""
    token_lora = i64([BIG, 1, -BIG + 1, 0], impl.device)
    idx, indptr, seg = impl.module.build_segments(token_lora, 2)
    assert indptr.tolist() == [0, 1, 2]
    assert idx.tolist() == [3, 1, 0, 2]
    idx, indptr, _ = impl.module.build_segments(i64([BIG], impl.device), 1)
    assert indptr.tolist() == [0, 0]


def test_check_op_returns_kernel_index_tensors():
    """The one int64 -> int32 conversion serves the Triton backend too; int32 contiguous input is not copied."""
    y, x, a, b = torch.randn(4, 8), torch.randn(4, 8), torch.randn(2, 4, 8), torch.randn(2, 8, 4)
    indptr, slots = i32([0, 4]), i64([BIG])
    out = torch.ops.lora_ops._check_sgmv(y, x, a, b, indptr, slots, i64([-BIG, 2 ** 40, 3, 1]), None)
    assert out[0].data_ptr() == indptr.data_ptr()
    assert out[1].dtype == torch.int32 and out[1].tolist() == [2 ** 31 - 1]
    assert out[2].tolist() == [-2 ** 31, 2 ** 31 - 1, 3, 1] and out[3] is None
    strided = i32([5, 0, 6, 0, 7, 0])[::2]
    out = torch.ops.lora_ops._check_grouped_gemm(y, x, torch.randn(3, 8, 8), i32([0, 1, 2, 4]), strided,
                                                 None, strided, None)
    assert out[1].is_contiguous() and out[1].tolist() == [5, 6, 7] and out[3].tolist() == [5, 6, 7]
    assert torch.ops.lora_ops._check_build_segments(i64([-BIG, 1]), 2).tolist() == [-2 ** 31, 1]


# ---- lora_scales strides ----

@pytest.mark.parametrize("layout", ["expanded", "strided"])
def test_strided_lora_scales(impl, layout):
    """lora_scales read through its stride: expand(3) of one element (stride 0), and a [::2] view."""
    gen = torch.Generator().manual_seed(5)
    y, x, a, b = _sgmv_inputs(impl, gen)
    dev = impl.device
    if layout == "expanded":  # the elements after the one viewed hold other values: reading past it shows
        scales = torch.tensor([3.0, 100.0, 200.0], device=dev)[:1].expand(3)
    else:
        scales = torch.tensor([1.0, 9.0, 2.0, 9.0, 3.0, 9.0], device=dev)[::2]
    meta = (i32([0, 2, 4, 6], dev), i32([2, 1, 0], dev), None, None, scales)
    ref = reference.sgmv(*_cpu((y, x, a, b) + meta[:4] + (scales.contiguous(),)))
    out, before = _sgmv_expect(impl, y, x, a, b, *meta)
    assert testing.check_against_reference(out, before, ref, impl.dtypes[0]) == ""


# ---- overlapping / reversed segments: the running-maximum rule ----

def test_running_max_oracle():
    """The oracle's segment walk itself: bounds m = [0, 3, 3, 3, 3, 3, 3, 3, 3, 4, 5, 6] for the issue's example."""
    tok = [-1, -1, -1, 0, 1, 2]
    ip = [0, 3] * 4 + [3, 4, 5, 6]
    got = list(reference._segment_rows(i32(ip), torch.zeros(11, dtype=torch.int32), i32(tok), 3, 1))
    assert got == [(0, [0]), (0, [1]), (0, [2])]
    # [4, 2) is empty, [2, 6) starts below the running maximum and is cut to [4, 6), [6, 1) and [1, 3) are empty.
    got = list(reference._segment_rows(i32([0, 4, 2, 6, 1, 3]), i32([0, 1, 2, 3, 4]), None, 8, 5))
    assert got == [(0, [0, 1, 2, 3]), (2, [4, 5])]


def test_overlapping_segments_issue_example(impl):
    """The issue's example: 4 overlapping copies of [0, 3) over invalid rows must not push the valid rows of
    the last 3 segments past the tile bound: rows 0, 1, 2 are all updated."""
    gen = torch.Generator().manual_seed(6)
    y, x, a, b = _sgmv_inputs(impl, gen, T=3, L=1)
    dev = impl.device
    tok, ip, sl = i32([-1, -1, -1, 0, 1, 2], dev), i32([0, 3] * 4 + [3, 4, 5, 6], dev), torch.zeros(11, dtype=torch.int32, device=dev)
    ref = reference.sgmv(*_cpu((y, x, a, b, i32([0, 3]), i32([0]))))  # each row once with slot 0
    out, before = _sgmv_expect(impl, y, x, a, b, ip, sl, tok)
    assert (out != before).any(dim=1).tolist() == [True, True, True]
    assert testing.check_against_reference(out, before, ref, impl.dtypes[0]) == ""


@pytest.mark.parametrize("op", ["sgmv", "grouped_gemm"])
def test_overlapping_segments_cover_each_position_once(impl, op):
    """Overlapping ranges over VALID rows: every position is covered once, by the first segment reaching it
    (before, the CPU backend added the delta twice and Triton/CUDA dropped rows past the tile bound)."""
    dtype = impl.dtypes[0]
    gen = torch.Generator().manual_seed(7)
    dev = impl.device
    T, L = 40, 3
    # Segments: [0, 20) slot 0; [20, 0), [0, 20), [20, 10) (empty: below the running max); [10, 40) cut to
    # [20, 40) slot 2; then [40, 0), [0, 40) five times, [40, 40), [40, 5): all empty.
    ip = i32([0, 20, 0, 20, 10, 40] + [0, 40] * 5 + [40, 5], dev)
    sl = i32([0, 1, 1, 1, 2] + [1, 0] * 6, dev)
    same = (i32([0, 20, 40]), i32([0, 2]))  # the equivalent disjoint metadata
    if op == "sgmv":
        y, x, a, b = _sgmv_inputs(impl, gen, T=T, L=L)
        ref = reference.sgmv(*_cpu((y, x, a, b) + same))
        out, before = _sgmv_expect(impl, y, x, a, b, ip, sl)
    else:
        problem = testing.make_grouped_gemm(torch.zeros(T, dtype=torch.int32), num_groups=L, K=16, N=12, dtype=dtype,
                                            device=dev, gen=gen, gathered=False)
        ref = reference.grouped_gemm(*_cpu(problem.args())[:3], *same)
        out, before = problem.y, problem.y.clone()
        impl.module.grouped_gemm(problem.y, problem.x, problem.w, ip, sl)
    assert testing.check_against_reference(out, before, ref, dtype) == ""


def test_many_overlapping_segments_with_token_indices(impl):
    """More overlapping segments than positions, over a permutation: the walk stays within P + G work and every
    valid row is updated exactly once."""
    dtype = impl.dtypes[0]
    gen = torch.Generator().manual_seed(8)
    dev = impl.device
    T = 70
    y, x, a, b = _sgmv_inputs(impl, gen, T=T, L=2)
    perm = torch.randperm(T, generator=gen).to(torch.int32)
    # 100 segments of slot 1 alternating [0, 0) and [0, 70): only the first [0, 70) covers anything.
    ip = i32([0] + [T] * 100, dev)
    ip[1::2] = 0
    ip[-1] = T
    sl = torch.ones(100, dtype=torch.int32, device=dev)
    ref = reference.sgmv(*_cpu((y, x, a, b, i32([0, T]), i32([1]), perm)))
    out, before = _sgmv_expect(impl, y, x, a, b, ip, sl, perm.to(dev))
    assert testing.check_against_reference(out, before, ref, dtype) == ""


# ---- empty reductions ----

def test_sgmv_k0_nan_scale_leaves_y_bitwise(impl):
    """K = 0: y bitwise unchanged, even with NaN scales and -0.0 in y (0 · NaN and -0.0 + 0 would show)."""
    dtype = impl.dtypes[0]
    dev = impl.device
    y = torch.randn(4, 8, dtype=dtype, device=dev)
    y[0, :4] = -0.0
    before = y.clone()
    impl.module.sgmv(y, torch.zeros(4, 0, dtype=dtype, device=dev), torch.zeros(2, 4, 0, dtype=dtype, device=dev),
                     torch.randn(2, 8, 4, dtype=dtype, device=dev), i32([0, 4], dev), i32([1], dev),
                     lora_scales=torch.full((2,), float("nan"), device=dev), scale=float("inf"))
    assert torch.equal(y.view(torch.uint8), before.view(torch.uint8))


def test_sgmv_no_columns_allocates_nothing_by_rank(impl):
    """N = 0: nothing to write; an expanded lora_a (stride 0) whose R of 2^30 costs no memory must not make the call
    allocate by R (the CPU kernel's scratch is R floats a row)."""
    dtype, dev = impl.dtypes[0], impl.device
    R, K = 1 << 30, 8
    y = torch.empty(4, 0, dtype=dtype, device=dev)
    a = torch.zeros(1, 1, K, dtype=dtype, device=dev).expand(2, R, K)
    b = torch.empty(2, 0, R, dtype=dtype, device=dev)
    impl.module.sgmv(y, torch.randn(4, K, dtype=dtype, device=dev), a, b, i32([0, 4], dev), i32([1], dev))
    assert y.shape == (4, 0)


@pytest.mark.parametrize("accumulate", [True, False])
def test_grouped_gemm_empty_reduction_is_zero(impl, accumulate):
    """k_l = 0 with a NaN alpha: the covered rows' first n_l columns become (accumulate ? y : 0), bitwise."""
    dtype = impl.dtypes[0]
    dev = impl.device
    gen = torch.Generator().manual_seed(9)
    y = torch.randn(6, 8, generator=gen).to(dtype).to(dev)
    y[1, :] = -0.0
    before = y.clone()
    x, w = torch.randn(6, 5, dtype=dtype, device=dev), torch.randn(2, 8, 5, dtype=dtype, device=dev)
    impl.module.grouped_gemm(y, x, w, i32([0, 4], dev), i32([1], dev), n_sizes=i32([8, 3], dev),
                             k_sizes=i32([5, 0], dev), alpha=float("nan"), accumulate=accumulate)
    expect = before.clone()
    if not accumulate:
        expect[:4, :3] = 0
    assert torch.equal(y.view(torch.uint8), expect.view(torch.uint8))
    ref = reference.grouped_gemm(*_cpu((before, x, w, i32([0, 4]), i32([1]), None, i32([8, 3]), i32([5, 0]))),
                                 alpha=float("nan"), accumulate=accumulate)
    assert torch.equal(ref, expect.double().cpu())


def test_grouped_gemm_k0_nan_alpha(impl):
    """K = 0 for every group: with accumulate y stays bitwise; without, its covered rows become 0."""
    dtype = impl.dtypes[0]
    dev = impl.device
    for accumulate in (True, False):
        y = torch.randn(4, 8, dtype=dtype, device=dev)
        before = y.clone()
        impl.module.grouped_gemm(y, torch.zeros(4, 0, dtype=dtype, device=dev),
                                 torch.zeros(2, 8, 0, dtype=dtype, device=dev), i32([0, 3], dev), i32([0], dev),
                                 alpha=float("nan"), accumulate=accumulate)
        expect = before.clone()
        if not accumulate:
            expect[:3] = 0
        assert torch.equal(y, expect)


def test_reference_sgmv_k0():
    y = torch.randn(3, 4)
    out = reference.sgmv(y, torch.zeros(3, 0), torch.zeros(1, 2, 0), torch.randn(1, 4, 2), i32([0, 3]), i32([0]),
                         lora_scales=torch.tensor([float("nan")]))
    assert torch.equal(out, y.double())


def test_the_oracle_check_finds_one_unwritten_row_among_many():
    """The check every parity test uses: one row of 16384 left unwritten is 0.8% over all rows, under bf16's 1e-2,
    so each row is checked on its own too; a correct bf16 output passes."""
    gen = torch.Generator().manual_seed(0)
    before = torch.randn(16384, 64, generator=gen).bfloat16()
    ref = before.double() + torch.randn(16384, 64, generator=gen).double()
    out = ref.bfloat16()
    assert testing.check_against_reference(out, before, ref, torch.bfloat16) == ""
    out[7] = before[7]
    assert "1 rows are off by more than half" in testing.check_against_reference(out, before, ref, torch.bfloat16)


# ---- the Meta kernels run the host checks ----

def _sgmv_args(device, **change):
    args = dict(y=torch.zeros(4, 8), x=torch.zeros(4, 8), lora_a=torch.zeros(3, 4, 8), lora_b=torch.zeros(3, 8, 4),
                seg_indptr=torch.zeros(2, dtype=torch.int32), seg_lora=torch.zeros(1, dtype=torch.int32))
    args.update(change)
    return {k: v.to(device) for k, v in args.items()}


def _gg_args(device, **change):
    args = dict(y=torch.zeros(4, 8), x=torch.zeros(4, 6), w=torch.zeros(2, 8, 6),
                seg_indptr=torch.zeros(2, dtype=torch.int32), seg_weight=torch.zeros(1, dtype=torch.int32))
    args.update(change)
    return {k: v.to(device) for k, v in args.items()}


def test_meta_kernel_checks_devices():
    """A call mixing cpu and meta dispatches to Meta, which now names the mismatch instead of doing nothing."""
    args = _sgmv_args("cpu")
    args["x"] = args["x"].to("meta")
    with pytest.raises(ValueError, match=r"lora_ops\.sgmv: x is on meta but y is on cpu"):
        lora_ops.sgmv(**args)
    args = _gg_args("cpu")
    args["seg_weight"] = args["seg_weight"].to("meta")
    with pytest.raises(ValueError, match=r"lora_ops\.grouped_gemm: seg_weight is on meta but y is on cpu"):
        lora_ops.grouped_gemm(**args)


@pytest.mark.parametrize("op,change,msg", [
    ("sgmv", dict(lora_b=torch.zeros(3, 9, 4)), r"lora_b must be \[L, N, R\] with N = y.size\(1\) = 8"),
    ("sgmv", dict(seg_lora=torch.zeros(2, dtype=torch.int32)), r"seg_lora must have 1 entries"),
    ("sgmv", dict(lora_a=torch.zeros(3, 4, 8, dtype=torch.float16)), r"lora_a must have x's dtype Float"),
    ("sgmv", dict(y=torch.zeros(8, 4).t()), r"y must have unit stride in its last dimension"),
    ("grouped_gemm", dict(w=torch.zeros(2, 8, 5)), r"w must be \[L, N, K\]"),
    ("grouped_gemm", dict(n_sizes=torch.zeros(3, dtype=torch.int32)), r"n_sizes must have 2 entries"),
])
def test_meta_kernel_checks_shapes(op, change, msg):
    make = _sgmv_args if op == "sgmv" else _gg_args
    with pytest.raises((ValueError, TypeError), match=rf"lora_ops\.{op}: " + msg):
        getattr(lora_ops, op)(**make("meta", **change))
    getattr(lora_ops, op)(**make("meta"))  # the valid call passes


def test_meta_build_segments_checks():
    with pytest.raises(ValueError, match=r"num_slots must be >= 0, got -1"):
        lora_ops.build_segments(torch.zeros(3, dtype=torch.int32, device="meta"), -1)
    with pytest.raises(TypeError, match=r"token_lora must be int32 or int64, got Float"):
        lora_ops.build_segments(torch.zeros(3, device="meta"), 2)


def test_meta_int32_extent():
    """Sizes the int32 metadata is compared with must fit int32 (checked on meta: no memory needed)."""
    args = _sgmv_args("meta", x=torch.zeros(2 ** 31, 8, device="meta"), y=torch.zeros(2 ** 31, 8, device="meta"))
    with pytest.raises(ValueError, match=r"x.size\(0\) = 2147483648 exceeds the int32 index range"):
        lora_ops.sgmv(**args)
    args = _sgmv_args("meta", token_indices=torch.zeros(2 ** 31, dtype=torch.int32, device="meta"))
    with pytest.raises(ValueError, match=r"len\(token_indices\) = 2147483648 exceeds the int32 index range"):
        lora_ops.sgmv(**args)


def test_fake_tensor_mode_checks():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        args = _sgmv_args("cpu", lora_b=torch.zeros(3, 8, 5))
        with pytest.raises(ValueError, match=r"lora_ops\.sgmv: lora_b must be \[L, N, R\] with R = lora_a.size\(1\) / S = 4"):
            lora_ops.sgmv(**args)


def _sgmv_then_double(y, x, a, b, ip, sl):
    lora_ops.sgmv(y, x, a, b, ip, sl)
    return y * 2


@pytest.mark.parametrize("dynamic", [False, True])
def test_compile_reports_argument_errors(dynamic):
    """torch.compile traces through the Meta kernel: a wrong shape is an error at trace time, naming lora_b
    (TorchRuntimeError: raised while tracing with fake tensors, not by the CPU kernel when the graph runs)."""
    torch._dynamo.reset()
    args = _sgmv_args("cpu", lora_b=torch.zeros(3, 9, 4))
    with pytest.raises(torch._dynamo.exc.TorchRuntimeError,
                       match=r"lora_ops\.sgmv: lora_b must be \[L, N, R\] with N = y.size\(1\)"):
        torch.compile(_sgmv_then_double, fullgraph=True, dynamic=dynamic)(*args.values())


class _SgmvModule(torch.nn.Module):
    def forward(self, y, x, a, b, ip, sl):
        return _sgmv_then_double(y, x, a, b, ip, sl)


def test_export_reports_argument_errors_and_keeps_dynamic_rows():
    args = _sgmv_args("cpu", lora_b=torch.zeros(3, 9, 4))
    with pytest.raises(ValueError, match=r"lora_ops\.sgmv: lora_b must be \[L, N, R\]"):
        torch.export.export(_SgmvModule(), tuple(args.values()))
    T = torch.export.Dim("T")  # the checks add no guard that would pin the number of rows
    ep = torch.export.export(_SgmvModule(), tuple(_sgmv_args("cpu").values()),
                             dynamic_shapes=({0: T}, {0: T}, None, None, None, None))
    assert "lora_ops.sgmv" in ep.graph_module.code
