"""torch.compile traces straight through the ops: fullgraph (no graph break), dynamic batch (no recompiles)."""
import pytest
import torch
import torch._dynamo.testing

import lora_ops
from lora_ops import testing

from conftest import case_generator


class TinyMultiLoRA(torch.nn.Module):
    """Base linear + per-token LoRA delta: build_segments once, then one sgmv."""

    def __init__(self, K=32, N=24, L=4, R=8, dtype=torch.float32):
        super().__init__()
        g = case_generator(0)
        self.base = torch.nn.Linear(K, N, bias=False, dtype=dtype)
        self.register_buffer("lora_a", torch.randn(L, 2 * R, K, generator=g).to(dtype) / K ** 0.5)
        self.register_buffer("lora_b", torch.randn(L, N, R, generator=g).to(dtype) / R ** 0.5)
        self.register_buffer("ranks", torch.tensor([8, 3, 0, 5], dtype=torch.int32))
        self.register_buffer("scales", torch.tensor([0.5, 1.0, 2.0, 1.5]))
        self.num_slots = L
        self.offsets = [0, N // 2, N]

    def forward(self, x, token_lora):
        seg = lora_ops.build_segments(token_lora, self.num_slots)
        y = self.base(x)
        lora_ops.sgmv(y, x, self.lora_a, self.lora_b, seg.seg_indptr, seg.seg_lora, seg.token_indices,
                      self.ranks, self.scales, self.offsets, 0.5)
        return torch.relu(y)


def _run(device, mode=None):
    torch._dynamo.reset()
    model = TinyMultiLoRA().to(device)
    counter = torch._dynamo.testing.CompileCounterWithBackend("inductor")
    compiled = torch.compile(model, backend=counter, fullgraph=True, dynamic=True) if mode is None else \
        torch.compile(model, fullgraph=True, dynamic=True, mode=mode)
    gen = case_generator(1)
    for T in (3, 7, 12):
        x = torch.randn(T, 32, generator=gen).to(device)
        token_lora = testing.random_token_slots(T, [0, 1, -1, 3], gen).to(device)
        with torch.no_grad():  # the ops have no backward: with grad mode on, they refuse the base layer's weight
            for _ in range(2 if mode else 1):  # reduce-overhead records a graph on the second call
                got = compiled(x, token_lora)
            want = model(x, token_lora)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    return counter


def test_compile_fullgraph_dynamic_no_recompile():
    counter = _run("cpu")
    assert counter.frame_count == 1, f"recompiled: {counter.frame_count} frames"


@pytest.mark.gpu
def test_compile_cuda_and_reduce_overhead():
    counter = _run("cuda")
    assert counter.frame_count == 1
    _run("cuda", mode="reduce-overhead")
