"""Serving layer: PEFT parity, pool slots (LRU, pin), every load error (pool unchanged), fused slices, compile,
and the step's routing (row lengths, its size check, cleared when generation fails).

transformers, peft and safetensors are imported, not skipped when absent: a broken install must fail the suite."""
import copy
import json

import peft
import pytest
import torch
import torch._dynamo.testing
import transformers

import lora_ops
from lora_ops import backends
from lora_ops.serving import (AdapterFormatError, AdapterPool, AdapterShapeError, PoolFullError,
                              UnsupportedAdapterError, greedy_generate, patch_model)
from serving_models import rel_err

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
SPECS = {
    "a": dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]),
    "b": dict(r=16, lora_alpha=16, use_rslora=True,
              target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "c": dict(r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"], rank_pattern={"down_proj": 2},
              alpha_pattern={"down_proj": 3}),
}


def _llama(**config):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, **config)
    return transformers.LlamaForCausalLM(cfg).eval()


def _model_and_adapters(tmp_path_factory, **config):
    """A tiny Llama (LlamaConfig fields: config) and the SPECS adapters saved for it: (model, their directory)."""
    base = _llama(**config)
    root = tmp_path_factory.mktemp("adapters")
    for name, kw in SPECS.items():
        peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(init_lora_weights=False, **kw)).save_pretrained(
            str(root / name))
    return base, root


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return _model_and_adapters(tmp_path_factory)


def _peft_model(base, root, names):
    model = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(root / names[0]), adapter_name=names[0])
    for n in names[1:]:
        model.load_adapter(str(root / n), adapter_name=n)
    return model.eval()


def _pool_model(base, root, names, num_slots=4, max_rank=16, device="cpu", dtype=None, **pool_kw):
    model = copy.deepcopy(base).to(device, dtype)
    pool = AdapterPool(model, num_slots=num_slots, max_rank=max_rank, **pool_kw)
    patch_model(model, pool)
    for n in names:
        pool.load(n, str(root / n))
    return model, pool


def _slot_tensors(m):
    return m.lora_a, m.lora_b, m.kext_lora_b, m.ranks, m.scales


def _pool_state(pool):
    return {k: [t.clone() for t in _slot_tensors(m)] for k, m in pool.modules.items()}, dict(pool._slot_of)


def _assert_same_state(pool, state):
    tensors, slots = state
    assert dict(pool._slot_of) == slots
    for k, m in pool.modules.items():
        for got, want in zip(_slot_tensors(m), tensors[k]):
            assert torch.equal(got, want), k


@pytest.mark.parametrize("device", DEVICES)
def test_peft_parity_mixed_batch(adapters, device):
    base, root = adapters
    names = ["a", "b", "c"]
    ref_model = _peft_model(base, root, names).to(device)
    model, pool = _pool_model(base, root, names, device=device)
    rows = ["a", None, "b", "c", "b", None]
    ids = torch.randint(0, 256, (len(rows), 7), device=device)
    tokens, logits = greedy_generate(model, pool, ids, rows, max_new_tokens=4)
    with torch.no_grad():
        ref = ref_model(tokens[:, :-1], adapter_names=[r or "__base__" for r in rows]).logits
        base_logits = copy.deepcopy(base).to(device)(tokens[:, :-1]).logits  # never move the shared fixture
    assert ((logits - ref).norm() / ref.norm()).item() < 1e-5
    # base-only rows equal the unpatched model; adapter rows really differ from it
    torch.testing.assert_close(logits[[1, 5]], base_logits[[1, 5]], rtol=1e-5, atol=1e-5)
    assert (logits[0] - base_logits[0]).abs().max() > 1e-3


def test_unpatched_behaviour_without_batch(adapters):
    base, root = adapters
    model, pool = _pool_model(base, root, ["a"])
    ids = torch.randint(0, 256, (2, 5))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits)


def test_lru_eviction_pin_unpin_unload(adapters):
    base, root = adapters
    model, pool = _pool_model(base, root, ["a", "b"], num_slots=2)
    pool.slot("a")  # a is now most recently used: b is evicted next
    slot_b = pool.slot("b")
    pool.slot("a")
    assert pool.load("c", str(root / "c")) == slot_b and pool.loaded == ["a", "c"]
    with pool.pinned("a", "c"):
        state = _pool_state(pool)
        with pytest.raises(PoolFullError, match="all 2 slots hold pinned adapters"):
            pool.load("b", str(root / "b"))
        _assert_same_state(pool, state)
    pool.pin("c")
    pool.load("b", str(root / "b"))  # a (unpinned) is evicted, pinned c stays
    assert sorted(pool.loaded) == ["b", "c"]
    with pytest.raises(ValueError, match="is pinned"):
        pool.unload("c")
    pool.unpin("c")
    pool.unload("c")
    assert pool.loaded == ["b"]
    for m in pool.modules.values():  # (B's copy for the kext kernels, on sm_90: test_kext_route_runs_its_kernels...)
        assert m.lora_b[slot_b].any() != m.lora_b[1 - slot_b].any()
    with pytest.raises(KeyError, match="'c' is not loaded"):
        pool.slot("c")
    with pytest.raises(ValueError, match="is not pinned"):
        pool.unpin("b")


def _tampered(root, tmp_path, name, config_change=None, weights_change=None, drop=None):
    """A copy of adapter `name` with its config or weights altered."""
    from safetensors.torch import load_file, save_file
    out = tmp_path / f"{name}_bad"
    out.mkdir()
    config = json.loads((root / name / "adapter_config.json").read_text())
    weights = load_file(str(root / name / "adapter_model.safetensors"))
    if config_change:
        config.update(config_change)
    if weights_change:
        weights = weights_change(weights)
    if drop != "config":
        (out / "adapter_config.json").write_text(json.dumps(config))
    if drop != "weights":
        save_file(weights, str(out / "adapter_model.safetensors"))
    if drop == "corrupt":  # the file cut short
        data = (out / "adapter_model.safetensors").read_bytes()
        (out / "adapter_model.safetensors").write_bytes(data[:len(data) // 2])
    return out


def _first_key(weights, part):
    return next(k for k in sorted(weights) if part in k)


BAD = {
    "missing_config": (dict(drop="config"), AdapterFormatError, "adapter_config.json not found"),
    "missing_weights": (dict(drop="weights"), AdapterFormatError, "adapter_model.safetensors not found"),
    "dora": (dict(config_change={"use_dora": True}), UnsupportedAdapterError, "DoRA"),
    "not_lora": (dict(config_change={"peft_type": "IA3"}), UnsupportedAdapterError, "peft_type IA3"),
    "bias": (dict(config_change={"bias": "all"}, weights_change=lambda w: {
        **w, "base_model.model.model.layers.0.self_attn.q_proj.bias": torch.zeros(64)}),
        UnsupportedAdapterError, r"q_proj\.bias' is a trained bias \(bias='all'\)"),
    "module_not_pooled": (dict(config_change={"target_modules": SPECS["b"]["target_modules"] + ["c_attn"]},
                               weights_change=lambda w: {
        **w, **{k.replace("q_proj", "c_attn"): v.clone() for k, v in w.items() if ".0.self_attn.q_proj" in k}}),
        AdapterShapeError, "model.layers.0.self_attn.c_attn is not a LoRA target"),
    "shape": (dict(weights_change=lambda w: {k: (v[:, :-1].contiguous() if "lora_A" in k else v) for k, v in w.items()}),
              AdapterShapeError, "features but the base layer"),
    "rank_not_the_configs": (dict(config_change={"r": 8}), AdapterShapeError, "expected rank 8 from the config"),
    "no_target_modules": (dict(config_change={"target_modules": None}), AdapterFormatError, "no target_modules"),
    "unreadable_safetensors": (dict(weights_change=lambda w: w, drop="corrupt"), AdapterFormatError,
                               "unreadable safetensors file"),
    "rank_over_max": (dict(config_change={"r": 32}, weights_change=lambda w: {
        k: (torch.randn(32, v.shape[1]) if "lora_A" in k else torch.randn(v.shape[0], 32)) for k, v in w.items()}),
        AdapterShapeError, "rank 32 > the pool's max_rank 16"),
    "half_pair": (dict(weights_change=lambda w: {k: v for k, v in w.items() if k != _first_key(w, "lora_B")}),
                  AdapterFormatError, "has lora_A only"),
    "extra_tensor": (dict(weights_change=lambda w: {**w, "base_model.model.lm_head.weight": torch.zeros(2, 2)}),
                     UnsupportedAdapterError, "not a LoRA A/B weight"),
    "non_finite_a": (dict(weights_change=lambda w: {k: (v.index_fill(1, torch.tensor([0]), float("nan"))
                                                        if k == _first_key(w, "lora_A") else v) for k, v in w.items()}),
                     AdapterFormatError, "holds inf or NaN"),
    "non_finite": (dict(weights_change=lambda w: {k: (v.index_fill(0, torch.tensor([0]), float("inf"))
                                                      if k == _first_key(w, "lora_B") else v) for k, v in w.items()}),
                   AdapterFormatError, "holds inf or NaN"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_failed_load_leaves_pool_unchanged(adapters, tmp_path, case):
    base, root = adapters
    model, pool = _pool_model(base, root, ["a", "c"], num_slots=2)
    kwargs, exc, msg = BAD[case]
    bad = _tampered(root, tmp_path, "b", **kwargs)
    state = _pool_state(pool)
    with pytest.raises(exc, match=msg):
        pool.load("b", str(bad))
    _assert_same_state(pool, state)


def test_pickled_adapter_loads_as_its_safetensors_twin(adapters, tmp_path):
    """adapter_model.bin (PEFT's save_pretrained(safe_serialization=False)) loads as the safetensors file does;
    an unreadable one is an AdapterFormatError."""
    from safetensors.torch import load_file
    base, root = adapters
    pickled = tmp_path / "a_bin"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((root / "a" / "adapter_config.json").read_text())
    torch.save(load_file(str(root / "a" / "adapter_model.safetensors")), str(pickled / "adapter_model.bin"))
    model, pool = _pool_model(base, root, ["a"])
    pool.load("a_bin", str(pickled))
    for m in pool.modules.values():
        assert all(torch.equal(t[pool.slot("a")], t[pool.slot("a_bin")]) for t in _slot_tensors(m))
    (pickled / "adapter_model.bin").write_bytes(b"not a pickle")
    with pytest.raises(AdapterFormatError, match="unreadable adapter_model.bin"):
        pool.load("broken", str(pickled))


def test_malformed_json(adapters, tmp_path):
    base, root = adapters
    model, pool = _pool_model(base, root, [])
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterFormatError, match="not valid JSON"):
        pool.load("x", str(tmp_path))


def test_fused_qkv_and_gate_up_slices_match_peft(tmp_path):
    """Phi-3 style fused qkv_proj / gate_up_proj: the pool maps them onto sgmv slices (GQA widths)."""
    torch.manual_seed(1)
    cfg = transformers.Phi3Config(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                  pad_token_id=0)
    base = transformers.Phi3ForCausalLM(cfg).eval()
    peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(
        r=8, lora_alpha=8, target_modules=["qkv_proj", "gate_up_proj", "o_proj"], init_lora_weights=False)
    ).save_pretrained(str(tmp_path / "f"))
    ref = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(tmp_path / "f"), adapter_name="f").eval()
    model = copy.deepcopy(base)
    pool = AdapterPool(model, num_slots=2, max_rank=8)
    patch_model(model, pool)
    pool.load("f", str(tmp_path / "f"))
    qkv = next(m for n, m in pool.modules.items() if n.endswith("qkv_proj"))
    assert qkv.slice_offsets == [0, 64, 96, 128]
    ids = torch.randint(0, 256, (3, 6))
    rows = ["f", None, "f"]
    with torch.no_grad(), pool.batch(rows, tokens_per_row=6):
        got = model(ids).logits
    with torch.no_grad():
        want = ref(ids, adapter_names=[r or "__base__" for r in rows]).logits
    assert ((got - want).norm() / want.norm()).item() < 1e-5


STEPS = ((["a", None, "b"], 5), (["c", "c", "a", None, "b"], 3), (["b", "a"], 8))


def _compile_run(adapters, device, mode=None, steps=STEPS, **pool_kw):
    base, root = adapters
    model, pool = _pool_model(base, root, ["a", "b", "c"], device=device, **pool_kw)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager" if mode is None else "inductor")
    fwd = lambda ids: model(ids, use_cache=False).logits
    compiled = torch.compile(fwd, backend=counter, fullgraph=True, dynamic=True) if mode is None else \
        torch.compile(fwd, fullgraph=True, dynamic=True, mode=mode)
    compiles_after_first = None
    for rows, length in steps:
        ids = torch.randint(0, 256, (len(rows), length), device=device)
        with torch.no_grad(), pool.batch(rows, tokens_per_row=length):
            for _ in range(2 if mode else 1):
                got = compiled(ids)
            want = model(ids, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        if compiles_after_first is None:
            compiles_after_first = counter.frame_count
    # a new batch size / adapter mix must not compile again (the first may restart its analysis once)
    return compiles_after_first, counter.frame_count


def test_compile_patched_model_no_graph_break_no_recompile(adapters):
    first, total = _compile_run(adapters, "cpu")
    assert first >= 1 and total == first
    # a first step whose T equals the pool's max rank and the routing buffers' size ties no size to T
    first, total = _compile_run(adapters, "cpu", steps=STEPS[::-1], max_batch_tokens=16)
    assert first >= 1 and total == first


@pytest.mark.gpu
def test_compile_patched_model_cuda_reduce_overhead(adapters):
    first, total = _compile_run(adapters, "cuda")
    assert first >= 1 and total == first
    _compile_run(adapters, "cuda", mode="reduce-overhead")


def test_greedy_generate_clears_the_batch_when_it_raises(adapters):
    base, root = adapters
    model, pool = _pool_model(base, root, ["a", "b"])
    ids = torch.randint(0, 256, (2, 5))
    ids[1, 2] = 256 + 7  # outside the vocabulary: the embedding raises
    with pytest.raises(IndexError):
        greedy_generate(model, pool, ids, ["a", "b"], max_new_tokens=3)
    assert pool.current is None and pool._pins == {}
    ids = torch.randint(0, 256, (1, 3))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, base(ids).logits, rtol=0, atol=0)


def test_routing_that_does_not_match_the_input_raises(adapters):
    base, root = adapters
    model, pool = _pool_model(base, root, ["a", "b"])
    ids = torch.randint(0, 256, (3, 4))
    with torch.no_grad():
        with pool.batch(["a", None, "b"]):  # the default: one token per row, a decode step
            with pytest.raises(ValueError, match=r"q_proj: the LoRA batch routes 3 tokens but this layer's input "
                                                 r"\[3, 4, 64\] has 12; set the batch with tokens_per_row=L"):
                model(ids)
        with pool.batch(["a", None, "b"], lengths=[4, 4, 3]):
            with pytest.raises(ValueError, match="routes 11 tokens"):
                model(ids)


def test_routing_is_written_into_the_same_buffers_every_step(adapters):
    """A CUDA graph captured over the patched model holds the routing's addresses: each step must write its
    routing there (what a tensor taken at one step sees is the next step's routing, same T), and a smaller step
    uses the same buffers' first entries."""
    base, root = adapters
    model, pool = _pool_model(base, root, ["a", "b", "c"])
    first = pool.set_batch(["a", "b", None, "c"], tokens_per_row=2)
    held = {n: getattr(first, n) for n in ("token_slots", "token_indices", "sorted_slots", "seg_indptr", "seg_lora")}
    ptrs = {n: t.data_ptr() for n, t in held.items()}
    mixes = (["c", None, "a", "a"], [None, "b"])
    for rows in mixes:
        step = pool.set_batch(rows, tokens_per_row=2)
        want = lora_ops.build_segments(torch.tensor([pool.slot(r) for r in rows for _ in range(2)],
                                                    dtype=torch.int32), pool.num_slots)
        for name, want_t in zip(("token_indices", "seg_indptr", "seg_lora"), want):
            assert getattr(step, name).data_ptr() == ptrs[name], name
            assert torch.equal(getattr(step, name), want_t), name
        assert step.token_slots.data_ptr() == ptrs["token_slots"]
        # the fold route's rows form: each position's slot in build_segments' order
        assert step.sorted_slots.data_ptr() == ptrs["sorted_slots"]
        assert torch.equal(step.sorted_slots, step.token_slots[want[0].long()])
        if len(rows) * 2 == held["token_slots"].shape[0]:  # what the first step's graph would now read
            assert torch.equal(held["token_slots"], step.token_slots)
            assert torch.equal(held["token_indices"], want[0]) and torch.equal(held["seg_indptr"], want[1])
            assert torch.equal(held["sorted_slots"], step.sorted_slots)
    pool.clear_batch()


def test_a_step_beyond_the_routing_buffers_warns_and_still_routes(adapters):
    base, root = adapters
    model = copy.deepcopy(base)
    pool = AdapterPool(model, num_slots=4, max_rank=16, max_batch_tokens=4)
    patch_model(model, pool)
    pool.load("a", str(root / "a"))
    ref_model = _peft_model(base, root, ["a"])
    rows = ["a", None, "a"]
    ids = torch.randint(0, 256, (len(rows), 3))
    with pytest.warns(UserWarning, match="larger than the routing buffers"), torch.no_grad(), \
            pool.batch(rows, tokens_per_row=3):
        got = model(ids).logits
    with torch.no_grad():
        want = ref_model(ids, adapter_names=[r or "__base__" for r in rows]).logits
    assert rel_err(got, want) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("route", ["fold-cuda", "sgmv-cuda", "kext-cuda", "fold-triton", "sgmv-triton"])
def test_a_captured_graph_replays_the_next_steps_routing(adapters, route, dtype, monkeypatch):
    """A vLLM-style server captures the forward once per batch size and replays it every step after set_batch:
    the replay must run the new step's adapters (here a decoder layer's MLP and q_proj, against them run eagerly).
    In bf16 fold-cuda reaches the tensor-core expand kernels (12 tokens over 4 slots: the runs kernel, which reads
    build_segments' order from the routing buffers); in fp32 the positions kernel."""
    monkeypatch.setenv("LORA_OPS_ROUTE", route)
    base, root = adapters
    model, pool = _pool_model(base, root, ["a", "b", "c"], device="cuda", dtype=dtype)
    layer = model.model.layers[0]
    run = lambda x: (layer.mlp(x), layer.self_attn.q_proj(x))
    x = torch.randn(12, 64, device="cuda", dtype=dtype)
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        pool.set_batch(["a", "b", None, "c"], tokens_per_row=3)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            run(x)  # warm-up outside the capture
        torch.cuda.current_stream().wait_stream(stream)
        with torch.cuda.graph(graph):
            captured = run(x)
        if route == "fold-cuda" and dtype == torch.bfloat16 and backends.cuda_served_by.get("lora_expand") == "cuda":
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                run(x)
                torch.cuda.synchronize()
            assert any("expand_runs_kernel" in e.key for e in prof.key_averages()), "the runs kernel did not run"
        # bf16: the eager GEMMs may round differently from the captured ones; the step's routings differ by far more
        tol, previous = (1e-5 if dtype == torch.float32 else 1e-2), None
        for rows in (["c", "c", "a", None], [None, "b", "b", "a"]):
            pool.set_batch(rows, tokens_per_row=3)
            graph.replay()
            wanted = run(x)
            for got, want in zip(captured, wanted):
                assert rel_err(got, want) < tol, rows
            if previous is not None:
                assert all(rel_err(want, before) > 10 * tol for want, before in zip(wanted, previous)), rows
            previous = wanted
    pool.clear_batch()


@pytest.mark.parametrize("device", DEVICES)
def test_a_pool_of_one_rank_passes_no_ranks(adapters, device):
    """While every adapter loaded has the pool's rank on every module (b: 16 everywhere), the ops get
    lora_ranks=None; the first one that does not (a: 8, on q and v only) ends that for good. An op call without
    ranks stays right after it (a graph captured before): A and B are zero past each slot's rank and where the
    adapter in a slot (c, after b) does not target the module; and an unloaded slot that a routing still names
    adds nothing."""
    base, root = adapters
    model, pool = _pool_model(base, root, ["b"], num_slots=2, max_rank=16, device=device)
    assert all(m.ranks_arg is None for m in pool.modules.values())
    ids = torch.randint(0, 256, (3, 5), device=device)

    def check(names, rows):
        ref_model = _peft_model(base, root, names).to(device)
        tokens, logits = greedy_generate(model, pool, ids, rows, max_new_tokens=2)
        with torch.no_grad():
            want = ref_model(tokens[:, :-1], adapter_names=[r or "__base__" for r in rows]).logits
        assert rel_err(logits, want) < 1e-5, rows

    check(["b"], ["b", None, "b"])
    with torch.no_grad():
        pool.set_batch(["b", None, "b"], tokens_per_row=ids.shape[1])
        pool.unload("b")
        got = model(ids).logits
        want = copy.deepcopy(base).to(device)(ids).logits
    pool.clear_batch()
    assert rel_err(got, want) < 1e-5
    pool.load("b", str(root / "b"))
    pool.load("a", str(root / "a"))
    assert all(m.ranks_arg is m.ranks for m in pool.modules.values())
    pool.load("c", str(root / "c"))  # evicts b, the oldest: c targets o and down only
    for m in pool.modules.values():
        m.ranks_arg = None  # as a graph captured while the pool held b alone calls the ops
    check(["a", "c"], ["a", "c", None])
    for m in pool.modules.values():
        m.ranks_arg = m.ranks
    pool.unload("a")
    pool.unload("c")
    pool.load("b", str(root / "b"))
    assert all(m.ranks_arg is m.ranks for m in pool.modules.values())


def test_compile_recompiles_once_when_the_pool_stops_being_of_one_rank(adapters, tmp_path):
    """The switch from no ranks to ranks happens once in a pool's life, for every module at once: the loads and
    unloads after it do not recompile. (Decided per module, d, rank 16 on q_proj only, then a, rank 8 on q and v,
    left the modules in two new mixes of with and without ranks: a recompile for each.)"""
    base, root = adapters
    peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(r=16, lora_alpha=16, target_modules=["q_proj"],
                                                             init_lora_weights=False)).save_pretrained(
        str(tmp_path / "d"))
    model, pool = _pool_model(base, root, ["b"], num_slots=2, max_rank=16)
    torch._dynamo.reset()
    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(lambda ids: model(ids, use_cache=False).logits, backend=counter, fullgraph=True,
                             dynamic=True)
    ids = torch.randint(0, 256, (2, 5))

    def step(rows):
        with torch.no_grad(), pool.batch(rows, tokens_per_row=5):
            got = compiled(ids)
            want = model(ids, use_cache=False).logits
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    step(["b", None])
    before_switch = counter.frame_count
    pool.load("d", str(tmp_path / "d"))
    step(["d", "b"])
    assert counter.frame_count == before_switch + 1
    for name, path in (("a", root / "a"), ("c", root / "c"), ("d", tmp_path / "d")):
        pool.unload(next(n for n in pool.loaded if n != "b"))
        pool.load(name, str(path))
        step([name, "b"])
    assert counter.frame_count == before_switch + 1
    torch._dynamo.reset()


def test_a_second_pool_takes_over_a_patched_model(adapters):
    base, root = adapters
    model, first = _pool_model(base, root, ["a"])
    second = AdapterPool(model, num_slots=2, max_rank=16)
    patch_model(model, second)
    second.load("b", str(root / "b"))
    ref_model = _peft_model(base, root, ["b"])
    rows = ["b", None]
    ids = torch.randint(0, 256, (2, 5))
    with torch.no_grad(), second.batch(rows, tokens_per_row=5):
        got = model(ids).logits
    with torch.no_grad():
        want = ref_model(ids, adapter_names=[r or "__base__" for r in rows]).logits
    assert rel_err(got, want) < 1e-5
    with torch.no_grad(), first.batch(["a", "a"], tokens_per_row=5):  # the first pool no longer drives the layers
        torch.testing.assert_close(model(ids).logits, base(ids).logits)


def _fold_linear_call(pool, lin, adapters, x):
    """(the arguments of the one fold_linear call lin's forward makes under pool.batch(adapters), the batch)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    calls = []

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            calls.append((func, args))
            return func(*args, **(kwargs or {}))

    with torch.no_grad(), pool.batch(adapters) as batch, Record():
        lin(x)
    (args,) = [a for func, a in calls if func is torch.ops.lora_ops.fold_linear.default]
    return args, batch


@pytest.mark.parametrize("route", ["fold-cuda", "fold-triton"])
def test_fold_route_hands_fold_linear_the_steps_segments(adapters, route, monkeypatch):
    """The layer's fold route passes fold_linear the step's seg_indptr and the rows of one slot's window, so that
    on sm_90 the GEMM skips the unused slots' A (on CPU every row is computed: F.linear's product)."""
    monkeypatch.setenv("LORA_OPS_ROUTE", route)
    base, root = adapters
    model, pool = _pool_model(base, root, ["a", "b"])
    lin = model.get_submodule("model.layers.0.self_attn.q_proj")
    args, batch = _fold_linear_call(pool, lin, ["b", None, "a"], torch.randn(3, 64))
    assert args[1].data_ptr() == lin._slots.w_cat.data_ptr()
    assert args[3] is not None and args[3].data_ptr() == batch.seg_indptr.data_ptr()
    assert args[4] == lin._slots.lora_b.shape[2]  # one slice: S * R rows per slot


def test_fold_route_slot_windows_of_a_fused_module(adapters, monkeypatch):
    """On a fused module (Phi-3's qkv_proj) fold_linear's slot window is S·R rows of [W; A], all of its slices'."""
    from serving_models import fused_twin
    monkeypatch.setenv("LORA_OPS_ROUTE", "fold-cuda")
    base, _ = adapters
    model = fused_twin(base)
    pool = AdapterPool(model, num_slots=2, max_rank=8)
    patch_model(model, pool)
    lin = model.get_submodule("model.layers.0.self_attn.qkv_proj")
    args, _ = _fold_linear_call(pool, lin, [None, None], torch.randn(2, 64))
    assert len(lin._slots.slice_names) == 3 and args[4] == 3 * 8


def test_kext_route_hands_lora_linear_the_pools_weights_and_the_steps_slots(adapters, monkeypatch):
    """The layer's kext route passes lora_linear the pool's tensors themselves, nothing copied per step: the base
    weight (w_cat's first rows), B (here, off lora_linear's CUDA kernels, lora_b itself: no copy; where they serve the
    module, test_kext_route_runs_its_kernels_in_a_model), the slots' scales, and the step's token slots."""
    monkeypatch.setenv("LORA_OPS_ROUTE", "kext-cuda")
    base, root = adapters
    model, pool = _pool_model(base, root, ["a", "b"])
    lin = model.get_submodule("model.layers.0.self_attn.q_proj")
    m, calls, lora_linear = lin._slots, [], lora_ops.ops.lora_linear
    monkeypatch.setattr(lora_ops.ops, "lora_linear", lambda *args: calls.append(args) or lora_linear(*args))
    with torch.no_grad(), pool.batch(["b", None, "a"]) as batch:
        lin(torch.randn(3, 64))
    ((x, weight, lora_a, lora_b, token_slot, scales, offsets, bias),) = calls
    assert weight.data_ptr() == m.w_cat.data_ptr() and weight.shape == (m.out_features, m.in_features)
    assert lora_a is m.lora_a and lora_b is m.kext_lora_b and scales is m.scales and offsets is m.offsets_arg
    assert lora_b is m.lora_b and m.b_cols is None  # B is copied only for lora_linear's CUDA kernels
    assert token_slot.data_ptr() == batch.token_slots.data_ptr() and bias is lin.base.bias


@pytest.mark.parametrize("route", ["sgmv-cuda", "fold-cuda", "kext-cuda"])
def test_layer_edges_no_tokens_backward_autocast(adapters, route, monkeypatch):
    """No tokens give an empty output on every route; a forward with grad mode on and a forward under autocast raise
    (the ops have no backward, and take no mixed dtypes) instead of a silently wrong or missing gradient or an
    error about the layer's internal tensors."""
    monkeypatch.setenv("LORA_OPS_ROUTE", route)
    base, root = adapters
    model, pool = _pool_model(base, root, ["a", "b"])
    lin = model.get_submodule("model.layers.0.self_attn.q_proj")
    with torch.no_grad(), pool.batch([]):
        assert lin(torch.randn(0, 64)).shape == (0, 64)
    x = torch.randn(2, 64)
    with pool.batch(["a", "b"]):
        for inp in (x, x.clone().requires_grad_()):  # the base weight requires grad (fold's GEMM does not read it)
            with pytest.raises(RuntimeError, match="q_proj: the LoRA layers are for inference"):
                lin(inp)
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(RuntimeError,
                                                                                         match="autocast"):
            lin(x)


def test_pool_arguments_named_in_errors(adapters):
    base, root = adapters
    with pytest.raises(AdapterShapeError, match="no nn.Linear that target_modules selects \\('q_proj'\\)"):
        AdapterPool(copy.deepcopy(base), target_modules="q_proj")  # a regular expression for the whole name
    with pytest.raises(ValueError, match=r"target_modules must be module names \(or a regular expression\), got \[\]"):
        AdapterPool(copy.deepcopy(base), target_modules=[])
    with pytest.raises(ValueError, match="is not a regular expression"):
        AdapterPool(copy.deepcopy(base), target_modules="q_proj(")
    fused = torch.nn.Module()
    fused.qkv_proj = torch.nn.Linear(8, 16)
    with pytest.raises(AdapterShapeError, match="qkv_proj: .* model.config"):
        AdapterPool(fused)
    model, pool = _pool_model(base, root, ["a"])
    with pytest.raises(KeyError, match="'x' is not loaded"):
        pool.unload("x")


def test_target_modules_by_peft_rule(adapters):
    """target_modules as PEFT reads a LoraConfig's: a list of names or dotted suffixes, a regular expression
    matching whole names (a multimodal model's text layers without its vision tower's same-named ones), or
    "all-linear": every linear layer but the output layer."""
    base, root = adapters
    everything = AdapterPool(copy.deepcopy(base)).modules
    suffix = AdapterPool(copy.deepcopy(base), target_modules=["self_attn.q_proj", "down_proj"]).modules
    assert sorted(suffix) == sorted(n for n in everything if n.endswith(("q_proj", "down_proj")))
    all_linear = AdapterPool(copy.deepcopy(base), target_modules="All-Linear").modules  # PEFT's shorthand
    assert sorted(all_linear) == sorted(n for n, m in base.named_modules()
                                        if isinstance(m, torch.nn.Linear) and n != "lm_head")
    assert sorted(all_linear) == sorted(everything)  # the defaults are the Llama's linear layers but lm_head
    first_layer = AdapterPool(copy.deepcopy(base), target_modules=r"model\.layers\.0\..*_proj").modules
    assert sorted(first_layer) == sorted(n for n in everything if n.startswith("model.layers.0."))
    model, pool = _pool_model(base, root, [], target_modules=r".*\.0\.self_attn\.(q|v)_proj")
    assert sorted(pool.modules) == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.v_proj"]
    again = AdapterPool(model, target_modules=r".*q_proj.*").modules  # a patched layer's base is not one of its own
    assert sorted(again) == [f"model.layers.{i}.self_attn.q_proj" for i in range(2)]
    with pytest.raises(AdapterShapeError, match="model.layers.1.self_attn.q_proj is not a LoRA target"):
        pool.load("a", str(root / "a"))  # its layer-1 weights have no module here: refused, not dropped


def test_replaced_base_weights_are_refused_and_in_place_ones_served(adapters, monkeypatch):
    """The fold route reads the pool's [W; A] buffer, of which the base weight is a view: weights loaded in place
    are what every route computes with; a replaced parameter (load_state_dict(assign=True)) would be stale on the
    fold route, so the layer refuses to run."""
    base, root = adapters
    model, pool = _pool_model(base, root, ["a"])
    ids = torch.randint(0, 256, (1, 5))
    new_weights = {k: v + 0.01 for k, v in model.state_dict().items() if k.endswith("self_attn.q_proj.base.weight")}
    assert len(new_weights) == 2
    model.load_state_dict(new_weights, strict=False)  # in place: the fold route sees them
    reference = copy.deepcopy(base)
    reference.load_state_dict({k.replace(".base.", "."): v for k, v in new_weights.items()}, strict=False)
    with torch.no_grad():
        for route in ("fold-cuda", "sgmv-cuda"):  # off CUDA, "cuda" is the public op
            monkeypatch.setenv("LORA_OPS_ROUTE", route)
            with pool.batch([None], tokens_per_row=5):
                torch.testing.assert_close(model(ids).logits, reference(ids).logits, rtol=1e-5, atol=1e-5)
        model.load_state_dict(new_weights, strict=False, assign=True)
        with pool.batch(["a"], tokens_per_row=5), pytest.raises(RuntimeError, match="weight or bias was replaced"):
            model(ids)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("how", ["assign", "data"])
@pytest.mark.parametrize("param", ["weight", "bias"])
def test_a_replaced_bias_or_new_data_is_refused(param, how, compiled, tmp_path_factory):
    """The guard covers the bias too (a view of bias_cat), and a Parameter kept but given other data (param.data =
    ...), which the fold route would not see either: refused by the layer (another Parameter) or by set_batch
    (other data, which a compiled model's guards do not see), before any output."""
    base, root = _model_and_adapters(tmp_path_factory, attention_bias=True)
    model, pool = _pool_model(base, root, ["a"])
    run = torch.compile(model, backend="eager") if compiled else model
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad(), pool.batch(["a"], tokens_per_row=5):
        run(ids)  # compiled (and guarded) before the change
    lin = model.get_submodule("model.layers.0.self_attn.q_proj").base
    new = getattr(lin, param).detach() + 0.5
    if how == "assign":
        model.load_state_dict({f"model.layers.0.self_attn.q_proj.base.{param}": new}, strict=False, assign=True)
    else:
        getattr(lin, param).data = new
    with torch.no_grad(), pytest.raises(RuntimeError, match="was replaced"):
        with pool.batch(["a"], tokens_per_row=5):
            run(ids)


def test_set_batch_rejects_bad_lengths(adapters):
    base, root = adapters
    model, pool = _pool_model(base, root, ["a"])
    with pytest.raises(ValueError, match="not both"):
        pool.set_batch(["a"], tokens_per_row=2, lengths=[2])
    with pytest.raises(ValueError, match=r"lengths must be 2 integers >= 0 \(one per row of adapters\), got \[2\]"):
        pool.set_batch(["a", None], lengths=[2])
    with pytest.raises(ValueError, match="lengths must be 2 integers"):
        pool.set_batch(["a", None], lengths=[2, -1])
    with pytest.raises(ValueError, match=r"lengths must be 2 integers >= 0 .*got \[2.9, 1.2\]"):
        pool.set_batch(["a", None], lengths=[2.9, 1.2])  # not truncated to [2, 1]
    with pytest.raises(ValueError, match="tokens_per_row must be an integer >= 0, got -2"):
        pool.set_batch(["a", None], tokens_per_row=-2)
    assert pool.current is None
    pool.set_batch(["a", None], lengths=[torch.tensor(2), 1])  # integers of any kind


def test_nested_batches_leave_the_outer_routing_as_they_found_it(adapters):
    """An inner pool.batch or greedy_generate sets the enclosing block's routing again on exit (it cleared it: the
    rest of the block ran the base model, silently)."""
    base, root = adapters
    model, pool = _pool_model(base, root, ["a", "b"])
    ids = torch.randint(0, 256, (2, 5))
    with torch.no_grad(), pool.batch(["a", "b"], tokens_per_row=5):
        before = model(ids).logits
        with pool.batch(["b", None], tokens_per_row=5):
            inner = model(ids).logits
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
        greedy_generate(model, pool, ids, ["b", None], max_new_tokens=2)
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)
    assert pool.current is None and pool._pins == {}
    assert (inner[0] - before[0]).abs().max() > 1e-3  # the inner block really routed otherwise


def test_loading_a_loaded_name_is_refused(adapters):
    base, root = adapters
    model, pool = _pool_model(base, root, ["a", "c"])
    state = _pool_state(pool)
    with pytest.raises(ValueError, match="adapter 'a' is already loaded; unload it first"):
        pool.load("a", str(root / "b"))
    _assert_same_state(pool, state)


def test_load_does_not_evict_an_adapter_of_the_active_routing(adapters):
    """set_batch pins nothing, but its adapters are not evicted while it is active: their rows would silently run
    the adapter loaded into their slot. Cleared, the routing holds nothing."""
    base, root = adapters
    model, pool = _pool_model(base, root, ["a"], num_slots=1)
    pool.set_batch(["a", "a"])
    state = _pool_state(pool)
    with pytest.raises(PoolFullError, match=r"or are routed \(slots \[0\] of the active routing"):
        pool.load("b", str(root / "b"))
    _assert_same_state(pool, state)
    pool.unload("a")  # its rows now add nothing; its slot stays out of a load's reach while they are routed
    with pytest.raises(PoolFullError, match="or are routed"):
        pool.load("b", str(root / "b"))
    pool.clear_batch()
    pool.load("b", str(root / "b"))
    assert pool.loaded == ["b"]
    # an enclosing routing (a bare set_batch) keeps its slots through a nested batch, and comes back after it
    model, pool = _pool_model(base, root, ["a", "b"], num_slots=2)
    pool.set_batch(["a"], tokens_per_row=5)
    outer = pool.current.token_slots.clone()
    with pool.batch(["b"], tokens_per_row=5), pytest.raises(PoolFullError, match=r"slots \[0, 1\]"):
        pool.load("c", str(root / "c"))
    assert torch.equal(pool.current.token_slots, outer)


def _one_adapter_against_peft(base, path):
    """A pool holding the adapter at `path` (named by its directory), and the relative error of its logits
    against PEFT's on one 5-token row."""
    ids = torch.randint(0, 256, (1, 5))
    with torch.no_grad():
        ref = peft.PeftModel.from_pretrained(copy.deepcopy(base), str(path)).eval()(ids).logits
        model, pool = _pool_model(base, path.parent, [path.name])
        with pool.batch([path.name], tokens_per_row=5):
            got = model(ids).logits
    return pool, ((got - ref).norm() / ref.norm()).item()


def test_config_without_lora_alpha_takes_peft_default(adapters, tmp_path):
    """PEFT's LoraConfig default lora_alpha is 8 (not r): a config without the field scales by 8 / r (8 / sqrt(r)
    with rslora), as PEFT's loader does."""
    base, root = adapters
    bad = _tampered(root, tmp_path, "b", config_change={"lora_alpha": None})  # r 16, rslora: 8 / 4, not 16 / 4
    config = json.loads((bad / "adapter_config.json").read_text())
    del config["lora_alpha"]
    (bad / "adapter_config.json").write_text(json.dumps(config))
    pool, err = _one_adapter_against_peft(base, bad)
    assert err < 1e-5
    assert pool.modules["model.layers.0.self_attn.q_proj"].scales[pool.slot(bad.name)].item() == 8 / 4


def test_zero_alpha_adds_nothing(adapters, tmp_path):
    """lora_alpha 0 (or an alpha_pattern entry of 0): PEFT adds nothing there; the pool stores scale 0 instead of
    dividing by it."""
    base, root = adapters
    zero = _tampered(root, tmp_path, "b", config_change={"alpha_pattern": {"q_proj": 0}})
    pool, err = _one_adapter_against_peft(base, zero)
    assert err < 1e-5
    assert pool.modules["model.layers.0.self_attn.q_proj"].scales[pool.slot(zero.name)].item() == 0


def test_packed_ragged_rows_match_peft_layers(adapters):
    """lengths=[...]: rows of different lengths packed one after another, as serving engines lay out prefill."""
    base, root = adapters
    names = ["a", "b", "c"]
    ref = _peft_model(base, root, names)
    model, pool = _pool_model(base, root, names)
    rows, lengths = ["b", None, "a", "c", "b"], [3, 5, 1, 0, 4]
    per_token = [r or "__base__" for r, n in zip(rows, lengths) for _ in range(n)]
    for path in ("model.layers.0.self_attn.q_proj", "model.layers.1.mlp.down_proj"):
        ours, theirs = model.get_submodule(path), ref.base_model.model.get_submodule(path)
        x = torch.randn(sum(lengths), ours.in_features)
        with torch.no_grad(), pool.batch(rows, lengths=lengths):
            got = ours(x)
        with torch.no_grad():
            want = theirs(x, adapter_names=per_token)
        assert rel_err(got, want) < 1e-5, path


def test_left_padded_ragged_prompts_match_peft_and_each_row_alone(adapters):
    base, root = adapters
    names = ["a", "b", "c"]
    model, pool = _pool_model(base, root, names)
    rows, lengths, new = ["a", None, "c", "b"], [3, 7, 5, 1], 4
    L = max(lengths)
    prompts = [torch.randint(1, 256, (n,)) for n in lengths]
    ids = torch.zeros(len(rows), L, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):
        ids[i, L - len(p):], mask[i, L - len(p):] = p, 1
    tokens, logits = greedy_generate(model, pool, ids, rows, new, attention_mask=mask)
    full_mask = torch.cat([mask, torch.ones(len(rows), new - 1, dtype=mask.dtype)], 1)
    with torch.no_grad():
        want = _peft_model(base, root, names)(tokens[:, :-1], attention_mask=full_mask,
                                             position_ids=(full_mask.cumsum(-1) - 1).clamp(min=0),
                                             adapter_names=[r or "__base__" for r in rows]).logits
    real = full_mask.bool()
    assert rel_err(logits[real], want[real]) < 1e-5
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        alone, _ = greedy_generate(model, pool, prompt[None], [row], new)
        assert torch.equal(tokens[i, L - len(prompt):], alone[0]), i
