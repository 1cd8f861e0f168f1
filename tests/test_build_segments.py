import pytest
import torch

import lora_ops.ops as ops
from lora_ops import backends, reference, testing

from conftest import case_generator


@pytest.mark.parametrize("T,num_slots,adapters", [
    (0, 4, []), (1, 1, [0]), (37, 8, [0, 3, 7, -1, 8, 100]), (1000, 32, list(range(0, 32, 3)) + [-1]),
    (5000, 3, [2, -7]), (64, 0, [0, -1]),
    (16384, 32, list(range(32)) + [-1]), (20000, 700, list(range(0, 700, 7)) + [700]),  # CUDA: 16 and 20 CTAs
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


INT32_MIN, INT32_MAX = -2 ** 31, 2 ** 31 - 1


@pytest.mark.gpu
@pytest.mark.parametrize("T,num_slots,kind", [
    (1, 32, "random"), (31, 32, "random"), (129, 32, "random"),  # 128..1024 threads, one CTA
    (1023, 32, "random"), (1024, 32, "random"), (1025, 32, "random"), (2049, 32, "random"),  # chunk edges
    (16383, 32, "random"), (16385, 32, "random"),  # more than one counting step of 16 tokens per thread
    (32769, 32, "random"), (70000, 32, "random"),  # 32 CTAs: several batches per warp
    (20000, 32, "one"), (20000, 32, "none"), (5000, 32, "extremes"), (3000, 0, "random"),
    (20000, "last_replicated", "random"), (20000, "first_single", "random"),  # 32 count copies, then one
    (20000, 3000, "random"), (20000, 10239, "random"),  # fewer placing warps; an A100's largest slot count
])
def test_cuda_build_segments_edges(T, num_slots, kind):
    """The CUDA kernel's edges (a chunk of ~1024 tokens per CTA, at most 32 CTAs; 128 to 1024 threads; 32 copies
    of each count while they fit the device's shared memory (597 slots on an H200), one beyond; fewer placing warps with many slots) against the CPU kernel, which
    the test above checks against the reference. The output memory is poisoned first: an unwritten entry shows."""
    if backends.cuda_served_by.get("build_segments") != "cuda":
        pytest.skip("the CUDA build_segments kernel is not built")
    gen = case_generator(f"{T},{num_slots},{kind}")
    if isinstance(num_slots, str):  # where the device's shared memory stops holding 32 copies of every count
        last = testing.cuda_build_segments_max_slots(32)
        num_slots = last if num_slots == "last_replicated" else last + 1
    if kind == "random":
        token_lora = torch.randint(-2, num_slots + 2, (T,), generator=gen, dtype=torch.int32)
    elif kind == "one":  # every token in one bucket: stability across all CTAs and warps
        token_lora = torch.full((T,), 7, dtype=torch.int32)
    elif kind == "none":
        token_lora = torch.full((T,), -1, dtype=torch.int32)
    else:
        picks = torch.tensor([INT32_MIN, -1, 0, num_slots - 1, num_slots, INT32_MAX], dtype=torch.int32)
        token_lora = picks[torch.randint(0, len(picks), (T,), generator=gen)]
    want = ops.build_segments(token_lora, num_slots)
    token_lora_gpu = token_lora.cuda()
    # The outputs reuse memory filled with -7: in a private pool, blocks of the outputs' sizes are allocated in the
    # outputs' order, poisoned, and freed just before the call (the pool holds nothing else to hand out).
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        poison = [torch.full((n,), -7, dtype=torch.int32, device="cuda") for n in (T, num_slots + 1, num_slots)]
        spans = [(t.data_ptr(), t.data_ptr() + 4 * t.numel()) for t in poison]
        del poison
        got = ops.build_segments(token_lora_gpu, num_slots)
    for g in got:  # an empty output (no slots) has no memory to poison
        assert g.numel() == 0 or any(lo <= g.data_ptr() < hi for lo, hi in spans), "an output missed the poison"
    again = ops.build_segments(token_lora_gpu, num_slots)
    for name, g, a, w in zip(("token_indices", "seg_indptr", "seg_lora"), got, again, want):
        assert torch.equal(g.cpu(), w), name
        assert torch.equal(a, g), name + " differs between two calls"
