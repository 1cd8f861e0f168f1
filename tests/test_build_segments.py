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
@pytest.mark.parametrize("T,num_slots,kind,offset", [
    (1, 32, "random", 0), (31, 32, "random", 0), (127, 32, "random", 0),  # one partial counting tile, 128 threads
    (128, 32, "random", 0), (129, 32, "random", 0), (257, 32, "random", 0), (511, 32, "random", 0),  # 128..512 thr
    (512, 32, "random", 0), (513, 32, "random", 0), (1023, 32, "random", 0), (1025, 32, "random", 0),  # chunk edges
    (4095, 32, "random", 0), (4096, 32, "random", 0), (4097, 32, "random", 0),
    (16383, 32, "random", 0), (16384, 32, "random", 0),  # 32 CTAs, one counting step of 8 tiles per warp
    (16385, 32, "random", 0), (32769, 32, "random", 0),  # more steps; chunks of 640 and 1152: several batches
    (65536, 32, "random", 0), (70000, 32, "random", 0),
    (129, 32, "random", 1), (4099, 32, "random", 2), (16385, 32, "random", 3),  # not 16-byte aligned: scalar loads
    (20000, 32, "one", 0), (20000, 32, "none", 0), (5000, 32, "extremes", 0), (3000, 0, "random", 0),
    (20000, "last_replicated", "random", 0), (20000, "first_single", "random", 0),  # 32 count copies, then one
    (20000, 3000, "random", 0), (20000, 10239, "random", 0),  # fewer placing warps; an A100's largest slot count
])
def test_cuda_build_segments_edges(T, num_slots, kind, offset):
    """The CUDA kernel's edges (chunks of ~512 tokens, whole 128-token counting tiles, at most 32 CTAs; 128 to 512
    threads; 16-byte loads where token_lora is aligned, else scalar ones; 32 copies of each count while they fit
    the device's shared memory, one beyond; fewer placing warps with many slots) against the CPU kernel, which the
    test above checks against the reference. The output memory is poisoned first: an unwritten entry shows."""
    if backends.cuda_served_by.get("build_segments") != "cuda":
        pytest.skip("the CUDA build_segments kernel is not built")
    gen = case_generator(f"{T},{num_slots},{kind},{offset}")
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
    # A view `offset` int32 into a fresh (512-byte aligned) allocation.
    token_lora_gpu = torch.cat([torch.zeros(offset, dtype=torch.int32), token_lora]).cuda()[offset:]
    assert token_lora_gpu.data_ptr() % 16 == 4 * offset
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
