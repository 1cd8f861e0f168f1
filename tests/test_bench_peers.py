"""The bench's vLLM peer (lora_ops.bench.peers): its layout of a pool and its calls against the float64 oracle, through
a stand-in of vLLM's ops by their documented semantics (every run), and through vLLM's own kernels where the peer is
built (scripts/make_vllm_peer.sh; on the CPU in fp16 under Triton's interpreter, whose bf16 loads are wrong)."""
import pytest
import torch

from lora_ops import reference, testing
from lora_ops.bench import ops, peers

from test_bench import _replay_eagerly


class _Meta:
    def prepare_tensors(self, token_slot):
        self.slots = token_slot.clone()

    def meta_args(self, token_nums, specialize):
        # vLLM's seven: the mapping, then tensors the stand-in does not read
        return (self.slots[:token_nums],) + (None,) * 6


class VllmSemantics:
    """vLLM's LoRAKernelMeta, lora_shrink and lora_expand by their docstrings, in float64: shrink writes buffer[s, t] =
    scaling · x_t · A_s[slot_t]ᵀ (rows without an adapter: 0), expand adds buffer[s, t] · B_s[slot_t]ᵀ into y's
    columns of slice s, the slices side by side from offset_start. Counts its calls."""

    def __init__(self):
        self.shrinks = 0
        self.LoRAKernelMeta = type("LoRAKernelMeta", (), {"make": staticmethod(lambda loras, tokens, device: _Meta())})

    def lora_shrink(self, x, lora_a, buffer, slots, *rest):
        *_, scaling = rest
        self.shrinks += 1
        buffer.zero_()
        for s, a in enumerate(lora_a):
            for t, slot in enumerate(slots.tolist()):
                if slot >= 0:
                    buffer[s, t] = (scaling * x[t].double() @ a[slot].double().t()).float()

    def lora_expand(self, buffer, lora_b, y, slots, *rest, offset_start, add_inputs):
        assert add_inputs
        col = offset_start
        for s, b in enumerate(lora_b):
            n = b.shape[1]
            for t, slot in enumerate(slots.tolist()):
                if slot >= 0:
                    delta = buffer[s, t].double() @ b[slot].double().t()
                    y[t, col:col + n] = (y[t, col:col + n].double() + delta).to(y.dtype)
            col += n


def _problem(dtype, device):
    """Three slices of a pool whose adapters have rank 8 of its 16, per-slot scales, a scale of 0.5 and rows
    without an adapter."""
    case = ops.Case(12, 3, 8, K=64, N=48, slices=3, pool_rank=16, pool_slots=4)
    pb = ops.Problem(case, dtype, device, seed=3)
    pb.p.scale = 0.5
    pb.token_lora[::5] = -1
    return pb


def _check(pb, dtype):
    y = pb.p.y.clone()
    ops.vllm(pb, y)
    # the oracle's segments from the slots as changed
    seg = reference.build_segments(pb.token_lora.cpu(), pb.case.pool_slots)
    p = pb.p
    ref = reference.sgmv(p.y, p.x, p.lora_a, p.lora_b, *[t.to(p.x.device) for t in seg[1:]], seg[0].to(p.x.device),
                         p.lora_ranks, p.lora_scales, pb.offsets, p.scale)
    return testing.check_against_reference(y, p.y, ref, dtype)


def test_vllm_layout_and_calls_give_the_oracles_delta(monkeypatch):
    """vLLM's layout of the pool (rows past an adapter's rank zeroed, each adapter's scale in its B) and the
    add_lora_linear calls give lora_ops' result, through the stand-in."""
    fake = VllmSemantics()
    monkeypatch.setattr(peers, "vllm_ops", lambda: (fake, ""))
    pb = _problem(torch.float32, "cpu")
    assert _check(pb, torch.float32) == ""
    assert fake.shrinks == 1
    pb.peer.clear()
    pb.p.lora_a[:, 8:16] += 1  # the pool's rows past the adapters' rank 8 of slice 0: not part of them
    assert _check(pb, torch.float32) == ""


def test_the_decode_step_times_the_peer_after_a_whole_eager_step(monkeypatch):
    """The decode step's vllm route: checked against the oracle like the routes, its whole step run once eagerly
    before the capture (vLLM fills its pointer tables on first use), its metadata made outside the step."""
    fake = VllmSemantics()
    seen = []
    decode_step = _replay_eagerly(monkeypatch, on_capture=lambda calls: seen.append((len(calls), fake.shrinks)))
    monkeypatch.setattr(decode_step, "routes", lambda: {"sgmv-cpu": ("sgmv", torch.ops.lora_ops.sgmv.default),
                                                        "vllm": ("peer", fake)})
    model = decode_step.ModelShape("tiny", hidden=64, q=64, kv=32, intermediate=128, layers=3)
    records, failures = [], []
    decode_step.bench_step(model, decode_step.Step(T=6, adapters=3, rank=4), "cpu", records, failures, print)
    assert not failures
    assert [r["backend"] for r in records] == ["base", "sgmv-cpu", "vllm"]
    assert all(r["err"] < 2e-2 for r in records)
    # the base's capture, the sgmv route's (build_segments and 12 modules), the peer's: 12 modules, after the whole
    # step and the first layer again ran eagerly
    assert seen[-1] == (12, 12 + 4)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_vllm_peer_matches_the_oracle(device, dtype):
    """vLLM's own kernels through the peer, where it is built."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the peer's kernels run on the GPU where there is one")
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter loads bf16 wrongly (vLLM's shrink gave values of ~1e10)")
    if peers.vllm_ops()[0] is None:
        pytest.skip(peers.vllm_ops()[1])
    assert _check(_problem(dtype, device), dtype) == ""
