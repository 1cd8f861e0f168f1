import zlib

import pytest
import torch

from lora_ops import reference, testing

from grid import GG_CASES, GG_LARGE_CASES

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _problem(case, impl, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    token_lora, kw = case(gen)
    kw.setdefault("num_groups", 5)
    problem = testing.make_grouped_gemm(token_lora, dtype=dtype, device=impl.device, gen=gen, **kw)
    if not problem.accumulate:
        problem.y.fill_(float("nan"))  # poison: every element the op must write starts as NaN
    return problem


def _run_and_check(impl, problem, dtype):
    before = problem.y.clone()
    ref = reference.grouped_gemm(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in problem.args()])
    impl.module.grouped_gemm(*problem.args())
    return testing.check_against_reference(problem.y, before, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(GG_CASES))
def test_grouped_gemm_parity(impl, name, dtype):
    if dtype not in impl.dtypes:
        pytest.skip(f"{impl.name} is tested in {impl.dtypes} only")
    assert _run_and_check(impl, _problem(GG_CASES[name], impl, dtype, seed=zlib.crc32(name.encode())), dtype) == ""


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(GG_LARGE_CASES))
def test_grouped_gemm_parity_large(impl, name, dtype):
    if impl.device != "cuda":
        pytest.skip("GPU-sized case")
    assert _run_and_check(impl, _problem(GG_LARGE_CASES[name], impl, dtype, seed=zlib.crc32(name.encode())), dtype) == ""


def test_grouped_gemm_strided_y_column_slice(impl):
    """y as a column slice of a wider tensor, w as a slice of a pool: both valid without copies."""
    dtype = impl.dtypes[0]
    gen = torch.Generator().manual_seed(2)
    token_lora = testing.random_token_slots(17, [0, 1], gen)
    problem = testing.make_grouped_gemm(token_lora, num_groups=2, K=24, N=40, dtype=dtype, device=impl.device, gen=gen)
    wide = torch.randn(17, 64, generator=gen).to(dtype).to(impl.device)
    problem.y = wide[:, 8:24]
    problem.w = problem.w[:, 10:26]
    before_wide = wide.clone()
    ref = reference.grouped_gemm(*[a.cpu() if isinstance(a, torch.Tensor) else a for a in problem.args()])
    impl.module.grouped_gemm(*problem.args())
    assert testing.check_against_reference(problem.y, before_wide[:, 8:24], ref, dtype) == ""
    assert torch.equal(wide[:, :8], before_wide[:, :8]) and torch.equal(wide[:, 24:], before_wide[:, 24:])


def test_grouped_gemm_garbage_metadata(impl):
    dtype = impl.dtypes[0]
    gen = torch.Generator().manual_seed(8)
    problem = testing.make_grouped_gemm(torch.zeros(10, dtype=torch.int32), num_groups=2, K=16, N=12, dtype=dtype,
                                        device=impl.device, gen=gen)
    dev = impl.device
    problem.token_indices = torch.tensor([2, -1, 100, 3, 4, 5, 6, 7, 8, 9], dtype=torch.int32, device=dev)
    problem.seg_indptr = torch.tensor([-7, 4, 2, 1 << 30], dtype=torch.int32, device=dev)
    problem.seg_weight = torch.tensor([1, 0, -1], dtype=torch.int32, device=dev)
    problem.n_sizes = torch.tensor([1 << 30, -2], dtype=torch.int32, device=dev)
    problem.k_sizes = torch.tensor([-1, 1 << 30], dtype=torch.int32, device=dev)
    assert _run_and_check(impl, problem, dtype) == ""


def test_grouped_gemm_deterministic(impl):
    dtype = impl.dtypes[-1]
    problem = _problem(GG_CASES["n_k_sizes"], impl, dtype, seed=4)
    outs = []
    for _ in range(3):
        y = problem.y.clone()
        impl.module.grouped_gemm(*problem.args(y))
        outs.append(y)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
