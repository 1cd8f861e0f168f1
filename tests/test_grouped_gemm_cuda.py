"""The CUDA grouped_gemm kernels, each forced with LORA_OPS_CUDA_GG_KERNEL over the whole parity grid, and the
cases the grid does not reach: rows that are not 16-byte aligned (element-wise staging), an empty reduction with a
NaN alpha, fp32 x with half weights at fp32 accuracy, bitwise determinism and CUDA-graph replay.

`mma`: the 128 x 128 tile kernel for every input; `skinny`: the expand kernel where K <= 128, else the narrow
tiles of the tile kernel (several column tiles where N > 128; up to N = 32 with 16-byte aligned x and w rows
staged through each thread's pieces); `sm90`: the sm_90a CUTLASS kernel where it can take
the input (contiguous segments, 16-byte aligned fp16/bf16 tensors: few of this grid's cases), the automatic choice
elsewhere (test_grouped_gemm_sm90.py covers its own grid); `split`: the split-K shrink and its sum where they can
take the input (N <= 128, x and w of one dtype, no k_sizes), the automatic choice elsewhere; `lora`: lora_expand's
tensor-core segments kernel where it can take the input (K <= 128 in fours, accumulate, no n_sizes, 16-bit w),
the automatic choice elsewhere."""

import pytest
import torch

import lora_ops
from lora_ops import backends, testing

import grid
import test_grouped_gemm as gg
from conftest import Impl, cuda_kernel_names, misaligned
from grid import GG_CASES, GG_LARGE_CASES

pytestmark = pytest.mark.gpu

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(params=["mma", "skinny", "sm90", "split", "lora"])
def kernel(request, monkeypatch):
    if backends.cuda_served_by.get("grouped_gemm") != "cuda":
        pytest.skip("the CUDA grouped_gemm kernels are not built")
    monkeypatch.setenv("LORA_OPS_CUDA_GG_KERNEL", request.param)
    return request.param


def _cuda(dtype):
    return Impl("cuda", "cuda", lora_ops.ops, (dtype,))


def _check(problem, dtype):
    return testing.run_and_check(lora_ops.ops.grouped_gemm, problem)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(GG_CASES) + list(GG_LARGE_CASES) + ["garbage_metadata"])
def test_each_kernel_over_the_grid(kernel, name, dtype):
    if name == "garbage_metadata":
        gg.test_grouped_gemm_garbage_metadata(_cuda(dtype))  # runs in the Impl's only dtype, with and without k_sizes
        return
    problem = gg._problem({**GG_CASES, **GG_LARGE_CASES}[name], _cuda(dtype), dtype, key=name)
    assert _check(problem, dtype) == ""


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K, N", [(72, 200), (264, 40), (264, 24), (264, 200)],
                         ids=["short_k", "few_cols", "rank_cols", "general"])
@pytest.mark.parametrize("which", ["x", "w", "y"])
@pytest.mark.parametrize("k_sizes", [True, False], ids=["k_sizes", "no_k_sizes"])
def test_unaligned_rows_take_element_loads(kernel, dtype, K, N, which, k_sizes):
    """Shapes whose rows are whole 16-byte vectors, with one tensor's base pointer off by one element (without
    k_sizes the split-K shrink can take them)."""
    gen = torch.Generator().manual_seed(K + N)
    token_lora = testing.random_token_slots(300, [0, 1, 2, -1], gen)
    problem = testing.make_grouped_gemm(token_lora, num_groups=3, K=K, N=N, dtype=dtype, device="cuda", gen=gen,
                                        n_sizes=[N, N // 2, 9], k_sizes=[K, 40, K - 3] if k_sizes else None)
    setattr(problem, which, misaligned(getattr(problem, which)))
    assert _check(problem, dtype) == ""


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("K, k_sizes", [(24, [0, 0, 0]), (300, [0, 0, 0]), (0, [0, 0, 0]), (0, None)],
                         ids=["k24", "k300", "k0", "k0_no_k_sizes"])
@pytest.mark.parametrize("accumulate", [False, True])
def test_empty_reduction_contributes_exactly_zero(kernel, dtype, K, k_sizes, accumulate):
    """k_l = 0 (or K = 0): y[t, :n_l] becomes 0 (accumulate=False) or stays bitwise as it was, even with alpha NaN
    (without k_sizes the split-K shrink can take it)."""
    gen = torch.Generator().manual_seed(5)
    n_sizes = [20, 7, 13]
    token_lora = testing.random_token_slots(40, [0, 1, 2, -1], gen)
    problem = testing.make_grouped_gemm(token_lora, num_groups=3, K=K, N=20, dtype=dtype, device="cuda", gen=gen,
                                        n_sizes=n_sizes, k_sizes=k_sizes, alpha=float("nan"), accumulate=accumulate)
    expected = problem.y.clone()
    if not accumulate:
        for slot, n_l in enumerate(n_sizes):
            expected[(token_lora == slot).nonzero().flatten().cuda(), :n_l] = 0
    lora_ops.ops.grouped_gemm(*problem.args())
    assert torch.equal(problem.y.view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("w_dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("K, N", [(16, 4096), (100, 300), (1000, 16), (1000, 777)],
                         ids=["expand", "short_k", "shrink", "general"])
def test_fp32_x_with_half_w_keeps_fp32_accuracy(kernel, w_dtype, K, N):
    """The fp32 intermediate of a shrink meets the fp32 tolerance (x split hi + lo on the tensor cores)."""
    gen = torch.Generator().manual_seed(K * N)
    token_lora = testing.random_token_slots(300, [0, 1, 2], gen)
    problem = testing.make_grouped_gemm(token_lora, num_groups=3, K=K, N=N, dtype=w_dtype, device="cuda", gen=gen,
                                        x_dtype=torch.float32, y_dtype=torch.float32)
    assert _check(problem, torch.float32) == ""


@pytest.mark.parametrize("name", ["odd_gemm", "shrink_4096", "expand_4096"])
def test_bitwise_deterministic(kernel, name):
    problem = gg._problem(GG_LARGE_CASES[name], _cuda(torch.bfloat16), torch.bfloat16, key=f"{name}-7")
    outs = []
    for _ in range(3):
        y = problem.y.clone()
        lora_ops.ops.grouped_gemm(*problem.args(y))
        outs.append(y)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


@pytest.mark.parametrize("name", ["odd_gemm", "expand_4096"])
def test_cuda_graph_replay(kernel, name):
    """Captured once (no host sync, no host read of device metadata), replayed on fresh y values."""
    dtype = torch.bfloat16
    problem = gg._problem(GG_LARGE_CASES[name], _cuda(dtype), dtype, key=f"{name}-11")
    y = problem.y.clone()
    graph = testing.capture_grouped_gemm(lora_ops.ops.grouped_gemm, problem, y)
    fresh = torch.randn(y.shape, generator=torch.Generator().manual_seed(3)).to(dtype).cuda()
    y.copy_(fresh)
    graph.replay()
    expected = fresh.clone()
    lora_ops.ops.grouped_gemm(*problem.args(expected))
    assert torch.equal(y, expected)


def _decode_shrink(T, K, x_dtype=None, k_sizes=False):
    gen = torch.Generator().manual_seed(T + K)
    token_lora = testing.random_token_slots(T, list(range(0, 32, 3)), gen)
    return testing.make_grouped_gemm(token_lora, num_groups=32, K=K, N=16, dtype=torch.bfloat16, device="cuda",
                                     gen=gen, x_dtype=x_dtype, n_sizes=[16 - g % 5 for g in range(32)],
                                     k_sizes=[K - g % 3 for g in range(32)] if k_sizes else None, alpha=0.5,
                                     accumulate=True)


KERNEL_NAMES = {"split": ("sgmv_shrink", "grouped_gemm_split_sum_kernel"),
                "tile": ("grouped_gemm_tile_kernel",), "expand": ("grouped_gemm_expand_kernel",),
                "lora": ("expand_segments_kernel",)}


def _assert_only_kind_ran(check, expected):
    """check() reports no mismatch with the op table off, running the kernels of KERNEL_NAMES[expected] and none of
    another kind's (which kernels ran is not checked under compute-sanitizer: conftest.cuda_kernel_names)."""
    from lora_ops import op_table
    with op_table.disabled():
        report, names = cuda_kernel_names(check)
    assert report == ""
    if not names:
        return
    ran = {k for k in names if "lora_ops::cuda::" in k}
    assert all(any(n in k for k in ran) for n in KERNEL_NAMES[expected]), ran
    others = [n for kind, kernels in KERNEL_NAMES.items() if kind != expected for n in kernels]
    assert not any(n in k for n in others for k in ran), ran


@pytest.mark.parametrize("T, K, x_dtype, k_sizes, expected", [
    (32, 4096, None, False, "split"), (256, 1000, None, False, "split"), (257, 4096, None, False, "tile"),
    (32, 128, None, False, "expand"), (32, 256, None, False, "tile"), (32, 4096, torch.float32, False, "tile"),
    (32, 4096, None, True, "tile")],
    ids=["decode", "256_positions", "257_positions", "k128", "k256_one_chunk", "fp32_x", "k_sizes"])
def test_decode_shrink_takes_the_split_kernels(T, K, x_dtype, k_sizes, expected, monkeypatch):
    """The automatic choice for N <= 128: the split-K shrink and its sum up to 256 positions where K > 128 splits
    into two or more chunks (one CTA per tile walking all of K took ~116 us per decode-step linear layer on the
    H200), with x and w of one dtype and no k_sizes; the narrow tiles otherwise; the expand kernel for K <= 128."""
    if backends.cuda_served_by.get("grouped_gemm") != "cuda":
        pytest.skip("the CUDA grouped_gemm kernels are not built")
    monkeypatch.delenv("LORA_OPS_CUDA_GG_KERNEL", raising=False)
    _assert_only_kind_ran(lambda: _check(_decode_shrink(T, K, x_dtype, k_sizes), torch.bfloat16), expected)


def test_decode_shrink_graph_replay():
    """The split path captured once (its partials from the caching allocator, the sum a programmatically dependent
    launch), replayed on fresh y values, equals an eager call bit for bit."""
    if backends.cuda_served_by.get("grouped_gemm") != "cuda":
        pytest.skip("the CUDA grouped_gemm kernels are not built")
    problem = _decode_shrink(32, 4096)
    y = problem.y.clone()
    graph = testing.capture_grouped_gemm(lora_ops.ops.grouped_gemm, problem, y)
    fresh = torch.randn(y.shape, generator=torch.Generator().manual_seed(5)).to(y.dtype).cuda()
    y.copy_(fresh)
    graph.replay()
    expected = fresh.clone()
    lora_ops.ops.grouped_gemm(*problem.args(expected))
    assert torch.equal(y, expected)


@pytest.mark.parametrize("T, K, x_dtype, n_sizes, accumulate, expected", [
    (32, 16, None, False, True, "lora"), (32, 16, torch.float32, False, True, "lora"),
    (256, 64, None, False, True, "lora"), (257, 16, None, False, True, "expand"), (32, 16, None, True, True, "expand"),
    (32, 16, None, False, False, "expand"), (32, 18, None, False, True, "expand")],
    ids=["decode", "fp32_x", "256_positions", "257_positions", "n_sizes", "overwrite", "k_not_in_fours"])
def test_decode_expand_takes_lora_expands_kernel(T, K, x_dtype, n_sizes, accumulate, expected, monkeypatch):
    """The automatic choice for K <= 128 (the LoRA expand): lora_expand's segments kernel up to 256 positions
    where it can take the call (y +=, every group's N, K in fours; fp32 x split hi + lo), with each group's k_sizes
    as its rank; the staging expand kernel otherwise (17.0 us against Triton's 6.1 for 32 single rows, H200)."""
    if backends.cuda_served_by.get("grouped_gemm") != "cuda":
        pytest.skip("the CUDA grouped_gemm kernels are not built")
    monkeypatch.delenv("LORA_OPS_CUDA_GG_KERNEL", raising=False)
    gen = torch.Generator().manual_seed(T + K)
    token_lora = testing.random_token_slots(T, list(range(0, 32, 3)), gen)
    problem = testing.make_grouped_gemm(token_lora, num_groups=32, K=K, N=512, dtype=torch.bfloat16, device="cuda",
                                        gen=gen, x_dtype=x_dtype, y_dtype=torch.float32 if x_dtype else None,
                                        n_sizes=[512 - 8 * (g % 5) for g in range(32)] if n_sizes else None,
                                        k_sizes=[K - 4 * (g % 3) for g in range(32)], alpha=0.5,
                                        accumulate=accumulate)
    _assert_only_kind_ran(lambda: _check(problem, x_dtype or torch.bfloat16), expected)


@pytest.mark.parametrize("x_dtype", [None, torch.float32], ids=["bf16_x", "fp32_x"])
def test_lora_path_sizes_and_empty_reductions(x_dtype, monkeypatch):
    """lora_expand's kernels as grouped_gemm's LoRA expand (forced): k_sizes out of range clamp as the oracle's (-1
    and 0 add nothing, 2^30 is all of K, 13 ends inside a 4-element group), and with a NaN alpha the groups whose
    reduction is empty leave y exactly as it was (the rest become NaN, as alpha * x . w is)."""
    if backends.cuda_served_by.get("grouped_gemm") != "cuda":
        pytest.skip("the CUDA grouped_gemm kernels are not built")
    monkeypatch.setenv("LORA_OPS_CUDA_GG_KERNEL", "lora")
    gen = torch.Generator().manual_seed(21)
    token_lora = testing.random_token_slots(40, [0, 1, 2, 3, 4], gen)
    sizes = [-1, 1 << 30, 0, 13, 8]
    problem = testing.make_grouped_gemm(token_lora, num_groups=5, K=32, N=512, dtype=torch.bfloat16, device="cuda",
                                        gen=gen, x_dtype=x_dtype, k_sizes=sizes, alpha=0.5, accumulate=True)
    report, names = cuda_kernel_names(lambda: _check(problem, x_dtype or torch.bfloat16))
    assert report == ""
    assert any("expand_segments_kernel" in k for k in names) or not names, "the lora path did not run"
    problem.alpha = float("nan")
    y = problem.y.clone()
    lora_ops.ops.grouped_gemm(*problem.args(y))
    empty = torch.isin(token_lora, torch.tensor([0, 2])).cuda()
    assert torch.equal(y[empty], problem.y[empty])
    assert y[~empty].isnan().all()


# LoRA shrinks the narrow tiles' pieces stage (K > 128, N <= 32, 16-byte rows): K tails inside a piece, per-group
# k_l and n_l, gathered and contiguous rows, invalid slots, w a slice of a NaN-padded pool, fp32 x (32-element K
# steps: a 16-column w tile has pieces in half the threads), fp32 y, overwrite with alpha. Over the three dtypes they
# run each of the 18 pieces kernels: (x, w, y) of (w, w, w), (w, w, fp32), (fp32, w, w), (fp32, w, fp32) for a
# 16-bit w and fp32 throughout, at 16 and 32 columns.
PIECES_CASES = {
    "rank16_tails": lambda g: (grid._slots(g, 300, [0, 1, 2, -1]), dict(K=1000, N=16, num_groups=3,
                                                                         y_dtype=torch.float32, n_sizes=[16, 8, 5],
                                                                         k_sizes=[1000, 333, 130])),
    "rank32_overwrite": lambda g: (grid._slots(g, 260, [0, 2, 3]), dict(K=520, N=32, num_groups=4,
                                                                        accumulate=False, alpha=0.5)),
    "rank32_fp32_y": lambda g: (grid._slots(g, 200, [0, 1]), dict(K=296, N=32, num_groups=2, y_dtype=torch.float32,
                                                                 n_sizes=[32, 17])),
    "rank24_bad_slots_fp32_x": lambda g: (grid._grouped_runs([(0, 70), (-1, 9), (2, 65), (5, 12), (1, 3)]),
                                          dict(K=264, N=24, num_groups=3, gathered=False, x_dtype=torch.float32)),
    "rank20_fp32_x_and_y": lambda g: (grid._slots(g, 140, [0, 2]), dict(K=200, N=20, num_groups=3,
                                                                       x_dtype=torch.float32,
                                                                       y_dtype=torch.float32)),
    "rank8_padded_pool": lambda g: (grid._slots(g, 200, [1, 3]), dict(K=392, N=8, num_groups=4, pad=8,
                                                                     n_sizes=[8, 8, 3, 8])),
    "rank12_fp32_x": lambda g: (grid._slots(g, 150, [0, 1]), dict(K=1000, N=12, num_groups=2,
                                                                 x_dtype=torch.float32, k_sizes=[1000, 136])),
    "rank16_fp32_x_and_y": lambda g: (grid._slots(g, 150, [0, 1]), dict(K=1000, N=16, num_groups=2,
                                                                       x_dtype=torch.float32,
                                                                       y_dtype=torch.float32, k_sizes=[1000, 136])),
}


def _pieces_ran(names):
    """Whether a narrow tile kernel staged by pieces ran (the kernel's last template argument: true, mangled Lb1E)."""
    tiles = [n for n in names if "grouped_gemm_tile_kernel" in n]
    return any("true>" in n or "Lb1E" in n for n in tiles)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(PIECES_CASES))
def test_narrow_pieces_stage_lora_shrinks(name, dtype, monkeypatch):
    """The narrow tiles' pieces on the shapes they take, against the oracle with poisoned outputs; the profiler shows
    the pieces' kernel ran (launched only where the rows are aligned, it stages by pieces alone)."""
    if backends.cuda_served_by.get("grouped_gemm") != "cuda":
        pytest.skip("the CUDA grouped_gemm kernels are not built")
    monkeypatch.setenv("LORA_OPS_CUDA_GG_KERNEL", "skinny")
    problem = gg._problem(PIECES_CASES[name], _cuda(dtype), dtype, key=name)
    report, names = cuda_kernel_names(lambda: _check(problem, dtype))
    assert report == ""
    assert _pieces_ran(names) or not names, names


@pytest.mark.parametrize("which", ["x", "w"])
def test_pieces_leave_unaligned_rows_to_the_tile_staging(which, monkeypatch):
    """x or w whose rows are not 16-byte aligned take the narrow kernel without pieces (cp.async of 16 bytes needs
    aligned sources), and the result is right."""
    if backends.cuda_served_by.get("grouped_gemm") != "cuda":
        pytest.skip("the CUDA grouped_gemm kernels are not built")
    monkeypatch.setenv("LORA_OPS_CUDA_GG_KERNEL", "skinny")
    problem = gg._problem(PIECES_CASES["rank16_tails"], _cuda(torch.bfloat16), torch.bfloat16, key="rank16_tails")
    setattr(problem, which, misaligned(getattr(problem, which)))
    report, names = cuda_kernel_names(lambda: _check(problem, torch.bfloat16))
    assert report == ""
    assert any("grouped_gemm_tile_kernel" in n for n in names) or not names, names
    assert not _pieces_ran(names), names


def test_wider_narrow_tiles_keep_the_tile_staging(monkeypatch):
    """From 33 columns the narrow tiles stage through stage_tile (the pieces' row addresses would spill there)."""
    if backends.cuda_served_by.get("grouped_gemm") != "cuda":
        pytest.skip("the CUDA grouped_gemm kernels are not built")
    monkeypatch.setenv("LORA_OPS_CUDA_GG_KERNEL", "skinny")
    case = lambda g: (grid._slots(g, 200, [0, 1]), dict(K=520, N=48, num_groups=2, y_dtype=torch.float32))
    problem = gg._problem(case, _cuda(torch.bfloat16), torch.bfloat16, key="rank48")
    report, names = cuda_kernel_names(lambda: _check(problem, torch.bfloat16))
    assert report == ""
    assert any("grouped_gemm_tile_kernel" in n for n in names) or not names, names
    assert not _pieces_ran(names), names
