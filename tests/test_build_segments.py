import pytest
import torch

from lora_ops import reference, testing

from conftest import case_generator


@pytest.mark.parametrize("T,num_slots,adapters", [
    (0, 4, []), (1, 1, [0]), (37, 8, [0, 3, 7, -1, 8, 100]), (1000, 32, list(range(0, 32, 3)) + [-1]),
    (5000, 3, [2, -7]), (64, 0, [0, -1]),
    (16384, 32, list(range(32)) + [-1]), (20000, 700, list(range(0, 700, 7)) + [700]),  # CUDA: 16-CTA clusters
])
def test_build_segments_matches_reference(impl, T, num_slots, adapters):
    if T > 5000 and impl.device != "cuda":
        pytest.skip("GPU-sized case")
    gen = case_generator(T + num_slots)
    token_lora = testing.random_token_slots(T, adapters, gen) if adapters else torch.empty(0, dtype=torch.int32)
    got = impl.module.build_segments(token_lora.to(impl.device), num_slots)
    want = reference.build_segments(token_lora, num_slots)
    for name, g, w in zip(("token_indices", "seg_indptr", "seg_lora"), got, want):
        assert g.dtype == torch.int32 and g.device.type == impl.device, name
        assert torch.equal(g.cpu(), w), name


def test_build_segments_int64_input(impl):
    token_lora = torch.tensor([2, 0, 2, 1, -1, 0], dtype=torch.int64)
    got = impl.module.build_segments(token_lora.to(impl.device), 3)
    assert got[0].cpu().tolist() == [1, 5, 3, 0, 2, 4]
    assert got[1].cpu().tolist() == [0, 2, 3, 5]
    assert got[2].cpu().tolist() == [0, 1, 2]
