import pytest
import torch

from lora_ops import testing

from conftest import case_generator
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
    dtype = impl.dtypes[0]
    gen = case_generator(8)
    problem = testing.make_grouped_gemm(torch.zeros(10, dtype=torch.int32), num_groups=2, K=16, N=12, dtype=dtype,
                                        device=impl.device, gen=gen)
    dev = impl.device
    problem.token_indices = torch.tensor([2, -1, 100, 3, 4, 5, 6, 7, 8, 9], dtype=torch.int32, device=dev)
    problem.seg_indptr = torch.tensor([-7, 4, 2, 1 << 30], dtype=torch.int32, device=dev)
    problem.seg_weight = torch.tensor([1, 0, -1], dtype=torch.int32, device=dev)
    problem.n_sizes = torch.tensor([1 << 30, -2], dtype=torch.int32, device=dev)
    problem.k_sizes = torch.tensor([-1, 1 << 30], dtype=torch.int32, device=dev)
    assert _run_and_check(impl, problem) == ""


def test_grouped_gemm_deterministic(impl):
    dtype = impl.dtypes[-1]
    problem = _problem(GG_CASES["n_k_sizes"], impl, dtype, key=4)
    outs = []
    for _ in range(3):
        y = problem.y.clone()
        impl.module.grouped_gemm(*problem.args(y))
        outs.append(y)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
