"""The Ascend backend (csrc/ascend) on the CPU model of the AscendC API, through its whole host path.

lora_ops._ascend_model is a test-only library built by setup.py: csrc/ascend's registration, launchers, tiling and
kernels compiled with g++ against the CPU model and stand-ins for torch_npu/ACL, registered as the
lora_ops_ascend_model::* ops on CPU tensors. The grids are those of the CPU, CUDA and Triton tests (tests/grid.py),
checked against lora_ops/reference.py; lora_expand runs tests/test_lora_expand.py's whole grid (its `impl`
"ascend-model"). Nothing here ran on an NPU.
"""
import zlib

import pytest
import torch

from lora_ops import reference, testing

from conftest import ascend_model
from grid import GG_CASES, SGMV_CASES

ascend = ascend_model()

DTYPES = [torch.float16, torch.bfloat16]


def _sgmv_problem(name, dtype, y_dtype=None):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    token_lora, kw = SGMV_CASES[name](gen)
    kw.setdefault("num_slots", 6)
    if y_dtype is not None:
        kw["y_dtype"] = y_dtype
    return testing.make_sgmv(token_lora, dtype=dtype, device="cpu", gen=gen, **kw)


def _check_sgmv(problem, dtype):
    before = problem.y.clone()
    ref = reference.sgmv(*problem.args())
    ascend.sgmv(*problem.args())
    return testing.check_against_reference(problem.y, before, ref, dtype)


def _check_grouped_gemm(problem, dtype):
    before = problem.y.clone()
    ref = reference.grouped_gemm(*problem.args())
    ascend.grouped_gemm(*problem.args())
    return testing.check_against_reference(problem.y, before, ref, dtype)


@pytest.mark.parametrize("op", ["sgmv", "lora_expand", "grouped_gemm", "build_segments"])
def test_test_ops_have_the_real_schemas(op):
    real = str(getattr(torch.ops.lora_ops, op).default._schema)
    assert str(getattr(ascend, op).default._schema) == real.replace("lora_ops::", "lora_ops_ascend_model::")


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("name", list(SGMV_CASES))
def test_sgmv_parity(name, dtype):
    """float32 x: h stays fp32, through the block's GM tile and back into L1 (csrc/ascend/NOTES.md)."""
    assert _check_sgmv(_sgmv_problem(name, dtype), dtype) == ""


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_sgmv_float32_y(dtype):
    assert _check_sgmv(_sgmv_problem("slices_gqa", dtype, torch.float32), dtype) == ""


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_sgmv_garbage_metadata(dtype):
    """Out-of-range indptr, rows outside [0, T), huge slots, ranks outside [0, R]: skipped or clamped."""
    gen = torch.Generator().manual_seed(5)
    T = 16
    problem = testing.make_sgmv(torch.zeros(T, dtype=torch.int32), num_slots=3, K=20, N=12, max_rank=4,
                                dtype=dtype, device="cpu", gen=gen)
    problem.token_indices = torch.tensor([3, -5, 7, T + 7, 1, 2, 1 << 30, 9, 0, 4, 5, 6, 8, 10, 11, 12],
                                         dtype=torch.int32)
    problem.seg_indptr = torch.tensor([-4, 3, 1, 9, 1 << 30], dtype=torch.int32)
    problem.seg_lora = torch.tensor([0, 1, -1, 2], dtype=torch.int32)
    problem.lora_ranks = torch.tensor([4, 99, -3], dtype=torch.int32)
    assert _check_sgmv(problem, dtype) == ""
    problem.seg_lora = torch.tensor([1 << 30, -(1 << 30), 7, 3], dtype=torch.int32)
    assert _check_sgmv(problem, dtype) == ""


@pytest.mark.parametrize("dtypes", [(torch.bfloat16, torch.float16), (torch.float32, torch.float32)], ids=str)
def test_sgmv_int64_indices_and_per_token_routing(dtypes):
    problem = _sgmv_problem("mixed_ranks", dtypes[0])
    problem.seg_indptr, problem.seg_lora = problem.seg_indptr.long(), problem.seg_lora.long()
    problem.token_indices, problem.lora_ranks = problem.token_indices.long(), problem.lora_ranks.long()
    assert _check_sgmv(problem, dtypes[0]) == ""
    gen = torch.Generator().manual_seed(11)
    token_lora = testing.random_token_slots(19, [0, 1, -1, 3], gen)
    problem = testing.make_sgmv(token_lora, num_slots=4, K=24, N=20, max_rank=8, dtype=dtypes[1], device="cpu",
                                gen=gen, gathered=False)
    problem.seg_indptr = torch.arange(20, dtype=torch.int32)
    problem.seg_lora = token_lora
    assert _check_sgmv(problem, dtypes[1]) == ""


@pytest.mark.parametrize("dtype", DTYPES + [torch.float32], ids=str)
@pytest.mark.parametrize("name", list(GG_CASES))
def test_grouped_gemm_parity(name, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    token_lora, kw = GG_CASES[name](gen)
    kw.setdefault("num_groups", 5)
    problem = testing.make_grouped_gemm(token_lora, dtype=dtype, device="cpu", gen=gen, **kw)
    assert _check_grouped_gemm(problem, dtype) == ""


@pytest.mark.parametrize("num_slots", [0, 1, 7, 40])
def test_build_segments_matches_reference(num_slots):
    gen = torch.Generator().manual_seed(num_slots)
    token_lora = torch.randint(-2, num_slots + 3, (301,), generator=gen, dtype=torch.int32)
    token_lora[:2] = torch.tensor([1 << 30, -(1 << 30)])
    for got, want in zip(ascend.build_segments(token_lora, num_slots), reference.build_segments(token_lora, num_slots)):
        assert torch.equal(got, want)


def test_shared_argument_checks_run_first():
    """A bad argument fails with the same message as on every backend (csrc/common/checks.cpp)."""
    problem = _sgmv_problem("basic", torch.float16)
    bad = problem.lora_b[:, :-1]
    with pytest.raises(ValueError, match="lora_b must be \\[L, N, R\\]"):
        ascend.sgmv(problem.y, problem.x, problem.lora_a, bad, problem.seg_indptr, problem.seg_lora)


@pytest.mark.parametrize("x_row_stride", [40, 70000], ids=["runs", "stride_past_a_dma"])
@pytest.mark.parametrize("gathered", [True, False], ids=["gathered", "grouped"])
def test_x_rows_by_runs_and_one_at_a_time(gathered, x_row_stride):
    """x's rows enter L1 by one DMA per run of consecutive rows where the row stride is a DMA's source stride (at
    most 65535 elements), by one DMA a row past it (kernel_common.h GatherToL1): runs of 1 to 9 rows, either way,
    for sgmv (fp16, and float32 x whose h comes back through GM) and grouped_gemm (also float32 x split hi + lo)."""
    gen = torch.Generator().manual_seed(x_row_stride)
    token_lora = torch.tensor([0] * 9 + [1, 0, 2, 2, 1, 1, 0, 0, 0, 2, -1, 1, 0, 2, 2, 2, 1, 0, 0, 1, 2, 0, 1],
                              dtype=torch.int32)
    if not gathered:
        token_lora = token_lora.sort(stable=True).values
    K = 24
    wide = lambda x: torch.full((x.shape[0], x_row_stride), float("nan"), dtype=x.dtype).index_copy_(
        1, torch.arange(K), x)[:, :K]
    for dtype in (torch.float16, torch.float32):
        problem = testing.make_sgmv(token_lora, num_slots=3, K=K, N=20, max_rank=8, dtype=dtype, device="cpu",
                                    gen=gen, gathered=gathered)
        problem.x = wide(problem.x)
        assert problem.x.stride(0) == x_row_stride
        assert _check_sgmv(problem, dtype) == ""
    for x_dtype in (torch.bfloat16, torch.float32):
        problem = testing.make_grouped_gemm(token_lora, num_groups=3, K=K, N=20, dtype=torch.bfloat16,
                                            x_dtype=x_dtype, device="cpu", gen=gen, gathered=gathered)
        problem.x = wide(problem.x)
        assert _check_grouped_gemm(problem, torch.bfloat16) == ""
