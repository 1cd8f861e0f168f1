"""The bench's vLLM peer (lora_ops.bench.peers): its layout of a pool and its calls against the float64 oracle, through
a stand-in of vLLM's ops by their documented semantics (every run), and through vLLM's own kernels where the peer is
built (scripts/make_vllm_peer.sh; on the CPU in fp16 under Triton's interpreter, whose bf16 tl.dot is wrong)."""
import sys
import types

import pytest
import torch

from lora_ops import reference, testing
from lora_ops.bench import ops, peers, report

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


def _problem(dtype, device, T=12, slices=3, N=48, offsets=None):
    """Slices of a pool whose adapters have rank 8 of its 16, per-slot scales, a scale of 0.5 and rows without an
    adapter; `offsets`: the slices' own widths (qkv-like), instead of equal ones."""
    case = ops.Case(T, 3, 8, K=64, N=N, slices=slices, pool_rank=16, pool_slots=4)
    pb = ops.Problem(case, dtype, device, seed=3)
    pb.p.scale = 0.5
    pb.token_lora[::5] = -1
    if offsets is not None:
        pb.offsets = pb.p.slice_offsets = offsets
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


def _tiny_step(decode_step, monkeypatch, peer, parts=False):
    monkeypatch.setattr(decode_step, "routes", lambda: {"sgmv-cpu": ("sgmv", torch.ops.lora_ops.sgmv.default),
                                                        "vllm": ("peer", peer)})
    model = decode_step.ModelShape("tiny", hidden=64, q=64, kv=32, intermediate=128, layers=3)
    records, failures = [], []
    decode_step.bench_step(model, decode_step.Step(T=6, adapters=3, rank=4), "cpu", records, failures, print,
                           parts=parts)
    return records, failures


def test_the_decode_step_times_the_peer_after_a_whole_eager_step(monkeypatch):
    """The decode step's vllm route: checked against the oracle like the routes, its whole step run once eagerly
    before the capture (vLLM fills its pointer tables on first use), its metadata made outside the step and timed
    on its own (meta_us); --parts leaves the peer out."""
    fake = VllmSemantics()
    seen = []
    decode_step = _replay_eagerly(monkeypatch, on_capture=lambda calls: seen.append((len(calls), fake.shrinks)))
    records, failures = _tiny_step(decode_step, monkeypatch, fake)
    assert not failures
    assert [r["backend"] for r in records] == ["base", "sgmv-cpu", "vllm"]
    assert all(r["err"] < 2e-2 for r in records)
    assert records[-1]["meta_us"] > 0 and all("meta_us" not in r for r in records[:-1])
    # the base's capture, the sgmv route's (build_segments and 12 modules), the peer's: 12 modules, after the whole
    # step and the first layer again ran eagerly
    assert seen[-1] == (12, 12 + 4)
    records, failures = _tiny_step(decode_step, monkeypatch, fake, parts=True)
    assert not failures and not any("vllm" in r["backend"] for r in records if r["op"] == "decode_step_part")


def test_a_wrong_or_failing_peer_is_logged_not_a_failure(monkeypatch):
    """A peer is measured, not trusted: wrong against the oracle or raising, it is left out of the records and the
    run's failures (which would withhold the op and routes tables)."""
    class Wrong(VllmSemantics):
        def lora_expand(self, buffer, *rest, **kw):
            super().lora_expand(buffer * 2, *rest, **kw)

    class Raising(VllmSemantics):
        def lora_shrink(self, *args):
            raise RuntimeError("no kernel")

    decode_step = _replay_eagerly(monkeypatch)
    for peer in (Wrong(), Raising()):
        records, failures = _tiny_step(decode_step, monkeypatch, peer)
        assert not failures and [r["backend"] for r in records] == ["base", "sgmv-cpu"]
    # the op bench: a record saying why, no failure
    monkeypatch.setattr(peers, "vllm_ops", lambda: (Wrong(), ""))
    records, failures = [], []
    pb = _problem(torch.float32, "cpu")
    ops._measure("sgmv", {"T": 12}, {"vllm": ops.vllm}, [pb], lambda b: b.p.y,
                 lambda b: reference.sgmv(*b.p.args()), torch.float32, pb.min_bytes(), None, "cpu", None, records,
                 failures, print)
    assert not failures and records[0]["backend"] == "vllm" and records[0]["unavailable"].startswith("wrong")


def test_the_peer_is_a_route_on_cuda_only_and_off_by_its_variable(monkeypatch):
    """routes() offers the vllm peer where CUDA is (Triton's interpreter would take hours over a model's step), and
    LORA_OPS_VLLM_PEER=off leaves it out."""
    from lora_ops.bench import decode_step

    fake = VllmSemantics()
    monkeypatch.setattr(peers, "vllm_ops", lambda: (fake, ""))
    for cuda in (False, True):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
        assert ("vllm" in decode_step.routes()) == cuda
    monkeypatch.undo()
    monkeypatch.setenv("LORA_OPS_VLLM_PEER", "off")
    peers.vllm_ops.cache_clear()
    try:
        assert peers.vllm_ops() == (None, "the vLLM peer is off (LORA_OPS_VLLM_PEER=off)")
    finally:
        peers.vllm_ops.cache_clear()


def test_release_empties_vllms_pointer_caches(monkeypatch):
    """vLLM keeps every weight list it saw (its caches, keyed by data_ptr); release() empties them."""
    utils = types.SimpleNamespace(_LORA_A_PTR_DICT={1: "a"}, _LORA_B_PTR_DICT={2: "b"})
    monkeypatch.setitem(sys.modules, "vllm.lora.ops.triton_ops.utils", utils)
    peers.release()
    assert utils._LORA_A_PTR_DICT == {} and utils._LORA_B_PTR_DICT == {}


SHAPES = {"three_slices": {}, "one_slice": dict(slices=1, N=40),
          "qkv_like": dict(T=40, N=64, offsets=[0, 32, 48, 64])}


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_vllm_peer_matches_the_oracle(device, dtype, shape):
    """vLLM's own kernels through the peer, where it is built: equal slices, one slice (vLLM's single-pointer
    path), unequal slices (its per-slice strides and sizes)."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if device == "cpu" and torch.cuda.is_available():
        pytest.skip("the peer's kernels run on the GPU where there is one")
    if device == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes bf16 tl.dot wrongly (vLLM's shrink gave values of ~1e10)")
    if peers.vllm_ops()[0] is None:
        pytest.skip(peers.vllm_ops()[1])
    try:
        assert _check(_problem(dtype, device, **SHAPES[shape]), dtype) == ""
    finally:
        peers.release()


def test_the_readme_section_shows_the_peer():
    """The report's sgmv table has the vllm column and names it where it is fastest, its claims say so, and the
    decode table has its route."""
    sgmv = lambda backend, us, pct=None: dict(op="sgmv", backend=backend, mode="graph", T=32, adapters=32, rank=16,
                                            pool_rank=16, K=4096, N=4096, slices=1, us=us, pct_roofline=pct)
    step = lambda backend, us, pct: dict(op="decode_step", model="llama3-8b", T=32, adapters=32, rank=16,
                                         backend=backend, us=us, base_us=100.0, overhead_pct=pct, floor_pct=19.0,
                                         fold_floor_pct=27.0, err=1e-3)
    records = [sgmv("cuda", 9.0, 30.0), sgmv("triton", 11.0, 25.0), sgmv("vllm", 8.0),
               step("base", 100.0, 0.0), step("fold-cuda", 120.0, 20.0), dict(step("vllm", 150.0, 50.0), meta_us=40.0)]
    text = report.readme_section(dict(gpu="test GPU", date="d", git_sha="abcdef0", torch="2.x", copy_tbps=4.2,
                                      records=records))
    assert "| cuda | triton | vllm | fastest |" in text and "| 9.0 (30%) | 11.0 (25%) | 8.0 | vllm |" in text
    assert "slower than a baseline or peer on: T=32, 32 adapters, rank 16 (vllm)" in text
    assert "| fold-cuda | vllm |" in text and "| **+20%** | +50% |" in text
