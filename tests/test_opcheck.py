"""torch.library.opcheck (schema, autograd registration, fake tensor, AOT dispatch with dynamic shapes)."""
import pytest
import torch

from lora_ops import testing

from conftest import case_generator

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _sgmv_problem(device):
    gen = case_generator(0)
    token_lora = testing.random_token_slots(10, [0, 2, -1], gen)
    return testing.make_sgmv(token_lora, num_slots=3, K=16, N=24, max_rank=4, dtype=torch.float32, device=device,
                             gen=gen, ranks=[4, 1, 3], slice_offsets=[0, 16, 24])


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_sgmv(device):
    p = _sgmv_problem(device)
    torch.library.opcheck(torch.ops.lora_ops.sgmv.default, p.args())


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_grouped_gemm(device):
    gen = case_generator(1)
    token_lora = testing.random_token_slots(12, [0, 1], gen)
    for accumulate in (True, False):
        p = testing.make_grouped_gemm(token_lora, num_groups=2, K=16, N=8, dtype=torch.float32, device=device, gen=gen,
                                      n_sizes=[8, 3], accumulate=accumulate)
        torch.library.opcheck(torch.ops.lora_ops.grouped_gemm.default, p.args())


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_build_segments(device):
    token_lora = torch.tensor([1, 0, -1, 1, 3], dtype=torch.int32, device=device)
    torch.library.opcheck(torch.ops.lora_ops.build_segments.default, (token_lora, 3))
