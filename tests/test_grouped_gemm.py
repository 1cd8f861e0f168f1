import pytest
import torch

from lora_ops import testing

from conftest import case_generator, gpu_where_present, repeat_runs, triton_backend
from grid import GG_CASES, GG_LARGE_CASES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _problem(case, impl, dtype, key):
    gen = case_generator(key)
    token_lora, kw = case(gen)
    kw.setdefault("num_groups", 5)
    problem = testing.make_grouped_gemm(token_lora, dtype=dtype, device=impl.device, gen=gen, **kw)
    if not problem.accumulate:
        problem.y.fill_(float("nan"))  # poison: every element the op must write starts as NaN
    return problem


def _run_and_check(impl, problem):
    return testing.run_and_check(impl.module.grouped_gemm, problem)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(GG_CASES))
def test_grouped_gemm_parity(impl, name, dtype):
    if dtype not in impl.dtypes:
        pytest.skip(f"{impl.name} is tested in {impl.dtypes} only")
    assert _run_and_check(impl, _problem(GG_CASES[name], impl, dtype, key=name)) == ""


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(GG_LARGE_CASES))
def test_grouped_gemm_parity_large(impl, name, dtype):
    if impl.device != "cuda":
        pytest.skip("GPU-sized case")
    assert _run_and_check(impl, _problem(GG_LARGE_CASES[name], impl, dtype, key=name)) == ""


def test_grouped_gemm_strided_y_column_slice(impl):
    """y as a column slice of a wider tensor, w as a slice of a pool: both valid without copies, and the columns
    around y's slice stay bitwise untouched."""
    dtype = impl.dtypes[0]
    gen = case_generator(2)
    token_lora = testing.random_token_slots(17, [0, 1], gen)
    problem = testing.make_grouped_gemm(token_lora, num_groups=2, K=24, N=40, dtype=dtype, device=impl.device, gen=gen)
    problem.y = torch.randn(17, 64, generator=gen).to(dtype).to(impl.device)[:, 8:24]
    problem.w = problem.w[:, 10:26]
    assert _run_and_check(impl, problem) == ""


def test_grouped_gemm_garbage_metadata(impl):
    check_garbage_metadata(impl, k_sizes=True)
    check_garbage_metadata(impl, k_sizes=False)


def check_garbage_metadata(impl, k_sizes: bool):
    """Out-of-range rows, slots, sizes and a non-monotonic seg_indptr are skipped or clamped (k_sizes=False: every
    group's K is the whole K, the input CUDA's split-K shrink can take)."""
    dtype = impl.dtypes[0]
    gen = case_generator(8)
    problem = testing.make_grouped_gemm(torch.zeros(10, dtype=torch.int32), num_groups=2, K=16, N=12, dtype=dtype,
                                        device=impl.device, gen=gen)
    dev = impl.device
    problem.token_indices = torch.tensor([2, -1, 100, 3, 4, 5, 6, 7, 8, 9], dtype=torch.int32, device=dev)
    problem.seg_indptr = torch.tensor([-7, 4, 2, 1 << 30], dtype=torch.int32, device=dev)
    problem.seg_weight = torch.tensor([1, 0, -1], dtype=torch.int32, device=dev)
    problem.n_sizes = torch.tensor([1 << 30, -2], dtype=torch.int32, device=dev)
    problem.k_sizes = torch.tensor([-1, 1 << 30], dtype=torch.int32, device=dev) if k_sizes else None
    assert _run_and_check(impl, problem) == ""


def test_grouped_gemm_deterministic(impl):
    dtype = impl.dtypes[-1]
    problem = _problem(GG_CASES["n_k_sizes"], impl, dtype, key=4)
    def run():
        y = problem.y.clone()
        impl.module.grouped_gemm(*problem.args(y))
        return y
    outs = repeat_runs(impl, run)
    assert all(torch.equal(outs[0], o) for o in outs[1:])


def test_triton_grouped_gemm_config_classes():
    """The Triton table's shape classes (benchmarks/triton_sweep.py): each tuned tile only past 256 positions and
    where its stages fit the device's shared memory; otherwise the default tile."""
    config = triton_backend().grouped_gemm_config
    h200, sm86 = 227 * 1024, 99 * 1024
    default = dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=4)
    big = dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, num_warps=8, num_stages=3)
    assert config(4096, 4096, 4096, 2, 2, h200) == big
    assert config(4096, 4096, 4096, 2, 2, sm86) == default  # 144 KB of stages: the default's 72 KB fits
    assert config(4096, 4096, 4096, 4, 2, h200) == default  # fp32 x (split hi + lo) keeps the default
    assert config(256, 4096, 4096, 2, 2, h200) == dict(default, BLOCK_M=16)
    assert config(16384, 16, 4096, 2, 2, h200) == dict(BLOCK_M=64, BLOCK_N=16, BLOCK_K=128, num_warps=4,
                                                       num_stages=3)
    assert config(16384, 4096, 16, 4, 2, h200) == dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=16, num_warps=4,
                                                       num_stages=3)


@gpu_where_present
@pytest.mark.parametrize("tile", ["big", "shrink", "expand"])
def test_triton_grouped_gemm_tuned_tiles_match_the_oracle(tile):
    """Each tuned tile of the Triton table on a problem of its class (fp32 under the interpreter, bf16 on a GPU;
    the GPU grid's shrink_n16/expand_k16/odd_gemm reach them through the table), forced through
    launch_grouped_gemm's config: ragged groups, partial tiles, n/k sizes, rows without a group."""
    module = triton_backend()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = case_generator(f"tuned-{tile}")
    token_lora = testing.random_token_slots(300, [0, 1, 2, -1], gen)
    N, K = {"big": (300, 70), "shrink": (16, 200), "expand": (300, 16)}[tile]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32  # the tiles are sized for 16-bit inputs
    problem = testing.make_grouped_gemm(token_lora, num_groups=3, K=K, N=N, dtype=dtype, device=device, gen=gen,
                                        n_sizes=[N, N - 3, 5], k_sizes=[K, K - 1, 7])
    cfg = module.grouped_gemm_config(problem.token_indices.shape[0], N, K, 2, 2, 1 << 30)
    assert cfg["num_stages"] == 3 and (tile != "big" or cfg["BLOCK_N"] == 256)

    def run(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes, alpha, accumulate):
        module.launch_grouped_gemm(y, x, w, seg_indptr, seg_weight, token_indices, n_sizes, k_sizes, alpha,
                                   accumulate, config=cfg)

    assert testing.run_and_check(run, problem) == ""
