"""PEFT adapter formats: every LoraConfig field honoured (checked against PEFT's own forward) or refused, PEFT's
rank/alpha pattern rule, per-slice adapters on fused qkv/gate_up modules, and slots reused after eviction."""
import dataclasses
import json

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_ops.serving import AdapterFormatError, UnsupportedAdapterError
from lora_ops.serving.peft_format import LORA_CONFIG_FIELDS
from serving_models import (VOCAB, fused_twin, llama, peft_logits, peft_model, pool_logits, pool_model, rel_err,
                            save_adapter)

ALL7 = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ROWS = ["x", None, "x", "x"]


@pytest.fixture(scope="module")
def base():
    return llama()


def _assert_matches_peft(base, directory, rows=ROWS, max_rank=16):
    ids = torch.randint(0, VOCAB, (len(rows), 6))
    ref = peft_logits(peft_model(base, {"x": directory}), ids, rows)
    model, pool = pool_model(base, {"x": directory}, max_rank=max_rank)
    got = pool_logits(model, pool, ids, rows)
    assert rel_err(got, ref) < 1e-5
    with torch.no_grad():
        plain = base(ids).logits
    assert (got[0] - plain[0]).abs().max() > 1e-3, "the adapter must change the output for the test to mean anything"
    return pool


# rank_pattern / alpha_pattern keys as PEFT matches them: regex, suffix, layer-qualified, full path, first key wins.
PATTERNS = {
    "rank_alternation": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                             rank_pattern={"q_proj|v_proj": 4}),
    "alpha_alternation": dict(r=8, lora_alpha=16, target_modules=ALL7, alpha_pattern={"k_proj|o_proj": 5}),
    "layer_qualified": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                            rank_pattern={"layers.1.self_attn.q_proj": 2},
                            alpha_pattern={"layers.0.mlp.down_proj": 32}),
    "full_path": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj"],
                      rank_pattern={"model.layers.0.self_attn.v_proj": 12},
                      alpha_pattern={"model.layers.1.self_attn.k_proj": 1}),
    "first_key_wins": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                           rank_pattern={"layers.0.self_attn.q_proj": 2, "q_proj": 6},
                           alpha_pattern={"o_proj": 3, "layers.1.self_attn.o_proj": 30}),
    # PEFT anchors a key at a dotted boundary and at the end: "_proj" matches no module (a search would match all)
    "unanchored_key_matches_nothing": dict(r=4, lora_alpha=8, target_modules=["q_proj", "o_proj"],
                                           alpha_pattern={"_proj": 3}, rank_pattern={"proj": 2}),
    "rslora_with_rank_pattern": dict(r=4, lora_alpha=8, use_rslora=True,
                                     target_modules=["q_proj", "v_proj", "down_proj"],
                                     rank_pattern={"down_proj": 16, "v_proj": 2}),
}


@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys did not match")  # PEFT's, as it should
@pytest.mark.parametrize("case", list(PATTERNS))
def test_rank_and_alpha_patterns_match_peft(base, tmp_path, case):
    _assert_matches_peft(base, save_adapter(base, tmp_path / case, **PATTERNS[case]))


# Fields that select modules or only matter in training: the adapter computes exactly what PEFT computes.
HONOURED = {
    "layers_to_transform_int": dict(target_modules=["q_proj", "v_proj"], layers_to_transform=1),
    "layers_to_transform_with_pattern": dict(target_modules=["q_proj", "down_proj"], layers_to_transform=[0],
                                             layers_pattern="layers"),
    "exclude_modules_list": dict(target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                 exclude_modules=["layers.0.self_attn.k_proj"]),
    "exclude_modules_regex": dict(target_modules=ALL7, exclude_modules=r".*\.1\.mlp\..*"),
    "target_modules_regex": dict(target_modules=r".*\.(q_proj|down_proj)"),
    "all_linear": dict(target_modules="all-linear"),
    # PEFT raises only when no entry matches: the others are ignored
    "target_modules_entry_matching_nothing": dict(target_modules=["q_proj", "v_proj", "query_key_value"]),
    # a model without biases: PEFT saves none, and the adapter is plain LoRA (test_trained_biases_are_refused)
    "bias_all_without_biases": dict(target_modules=["q_proj", "down_proj"], bias="all"),
    "bias_lora_only_without_biases": dict(target_modules=["q_proj", "down_proj"], bias="lora_only"),
    "lora_dropout": dict(target_modules=["q_proj", "o_proj"], lora_dropout=0.5),
    "velora": dict(target_modules=["q_proj", "v_proj"], velora_config="VeloraConfig"),
    "monteclora": dict(target_modules=["q_proj"], monteclora_config="MontecloraConfig"),
}


@pytest.mark.parametrize("case", list(HONOURED))
def test_config_field_matches_peft(base, tmp_path, case):
    kwargs = dict(HONOURED[case])
    for field in ("velora_config", "monteclora_config"):  # default settings of the variant, where PEFT has it
        if field in kwargs:
            if not hasattr(peft.tuners.lora.config, kwargs[field]):
                pytest.skip(f"peft {peft.__version__} has no {kwargs[field]}")
            kwargs[field] = getattr(peft.tuners.lora.config, kwargs[field])()
    _assert_matches_peft(base, save_adapter(base, tmp_path / case, r=4, lora_alpha=8, **kwargs))


def _rewrite(directory, config_change=None, weights_change=None):
    """Edit a saved adapter in place."""
    config_file, weights_file = f"{directory}/adapter_config.json", f"{directory}/adapter_model.safetensors"
    if config_change:
        config = json.load(open(config_file))
        config.update(config_change)
        json.dump(config, open(config_file, "w"))
    if weights_change:
        save_file(weights_change(load_file(weights_file)), weights_file)


def _copy_module(weights, src, dst):
    """weights with `src`'s lora_A/lora_B copied under module `dst`."""
    extra = {k.replace(src, dst): v.clone() for k, v in weights.items() if src in k}
    assert extra, src
    return {**weights, **extra}


# A file whose tensors contradict the selection fields of its config: PEFT would not apply them, so the pool
# must not either (it refuses the file instead of serving something PEFT would not compute).
UNSELECTED = {
    "layers_to_transform": (dict(target_modules=["q_proj"], layers_to_transform=1),
                            ("layers.1.self_attn.q_proj", "layers.0.self_attn.q_proj")),
    "exclude_modules": (dict(target_modules=["q_proj", "k_proj"], exclude_modules=["layers.0.self_attn.k_proj"]),
                        ("layers.1.self_attn.k_proj", "layers.0.self_attn.k_proj")),
    "target_modules_regex": (dict(target_modules=r".*\.q_proj"),
                             ("layers.1.self_attn.q_proj", "layers.1.self_attn.v_proj")),
}


@pytest.mark.parametrize("case", list(UNSELECTED))
def test_tensors_the_config_does_not_select_are_refused(base, tmp_path, case):
    kwargs, (src, dst) = UNSELECTED[case]
    directory = save_adapter(base, tmp_path / case, r=4, **kwargs)
    _rewrite(directory, weights_change=lambda w: _copy_module(w, src, dst))
    model, pool = pool_model(base, {})
    with pytest.raises(AdapterFormatError, match=f"weights for model.{dst}, which the config does not select"):
        pool.load("x", directory)
    assert pool.loaded == []


UNSUPPORTED = {
    "use_dora": True,
    "lora_bias": True,
    "fan_in_fan_out": True,
    "modules_to_save": ["lm_head"],
    "trainable_token_indices": [1, 2],
    "target_parameters": ["mlp.experts.gate_up_proj"],
    "alora_invocation_tokens": [5, 6],
    "use_qalora": True,
    "layer_replication": [[0, 2], [1, 2]],
    "use_bdlora": {"target_modules_bd_a": ["q_proj"], "nblocks": 2},
    "arrow_config": {"top_k": 2},
    "kasa_config": {"beta": 0.1},
}
BASE_REWRITING_INITS = ["pissa", "pissa_niter_4", "corda", "astra", "olora", "lora_ga", "loftq"]


def _refused(base, directory, match):
    model, pool = pool_model(base, {})
    with pytest.raises(UnsupportedAdapterError, match=match):
        pool.load("x", directory)
    assert pool.loaded == []


@pytest.mark.parametrize("field", list(UNSUPPORTED))
def test_unsupported_config_field_raises(base, tmp_path, field):
    directory = save_adapter(base, tmp_path / field, r=4, target_modules=["q_proj"])
    _rewrite(directory, config_change={field: UNSUPPORTED[field]})
    _refused(base, directory, f"{field}=.* is not supported")


@pytest.mark.parametrize("init", BASE_REWRITING_INITS)
def test_base_rewriting_init_raises(base, tmp_path, init):
    directory = save_adapter(base, tmp_path / init, r=4, target_modules=["q_proj"])
    _rewrite(directory, config_change={"init_lora_weights": init})
    _refused(base, directory, "rewrites the base weights")


@pytest.mark.parametrize("bias", ["all", "lora_only"])
def test_trained_biases_are_refused(tmp_path, bias):
    """On a model with biases (a Llama with attention_bias) PEFT saves the trained biases beside lora_A/lora_B;
    they would replace the base model's, so the load names the first one and refuses the adapter."""
    biased = llama(attention_bias=True)
    directory = save_adapter(biased, tmp_path / bias, r=4, target_modules=["q_proj"], bias=bias)
    assert any(k.endswith(".bias") for k in load_file(f"{directory}/adapter_model.safetensors"))
    _refused(biased, directory, rf"\.bias' is a trained bias \(bias='{bias}'\)")


def test_unknown_config_field_raises_when_set(base, tmp_path):
    directory = save_adapter(base, tmp_path / "a", r=4, target_modules=["q_proj"])
    _rewrite(directory, config_change={"future_option": None})
    pool_model(base, {"x": directory})  # unset: nothing to honour
    _rewrite(directory, config_change={"future_option": 2})
    _refused(base, directory, "unknown LoraConfig field future_option=2")


# PEFT warns about what these adapters are; the test is that the pool refuses them.
@pytest.mark.filterwarnings("ignore:.*(lora_bias|LoRA tensor|aLoRA is currently)")
@pytest.mark.parametrize("kwargs", [dict(lora_bias=True), dict(alora_invocation_tokens=[5, 6]),
                                    dict(trainable_token_indices=[3, 4])], ids=lambda k: next(iter(k)))
def test_unsupported_adapters_saved_by_peft_raise(base, tmp_path, kwargs):
    field = next(iter(kwargs))
    _refused(base, save_adapter(base, tmp_path / field, r=4, target_modules=["q_proj"], **kwargs),
             f"{field}=.* is not supported")


def test_every_lora_config_field_is_classified():
    """A PEFT upgrade that adds a field fails here until the field is classified (and tested if it matters)."""
    fields = {f.name for f in dataclasses.fields(peft.LoraConfig)}
    assert fields - set(LORA_CONFIG_FIELDS) == set()
    unsupported = {f for f, (treatment, _) in LORA_CONFIG_FIELDS.items() if treatment == "unsupported"}
    assert unsupported == set(UNSUPPORTED)


# Per-slice adapters of a Llama on the fused (Phi-3 layout) twin: q/k/v and gate/up with their own ranks and alphas.
SLICED = {
    "s": dict(r=8, lora_alpha=16, target_modules=ALL7, rank_pattern={"k_proj": 4, "up_proj": 2},
              alpha_pattern={"v_proj": 40, "gate_proj": 4}),
    "t": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["k_proj", "v_proj", "up_proj"],
              rank_pattern={"v_proj": 16}),
    "u": dict(r=2, lora_alpha=3, target_modules=["v_proj", "down_proj"], alpha_pattern={"down_proj": 12}),
    # each fused module's first slice at alpha 0: the slot's scale is not the first slice's
    "z": dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"],
              alpha_pattern={"q_proj": 0, "gate_proj": 0}),
}


@pytest.fixture(scope="module")
def sliced(base, tmp_path_factory):
    root = tmp_path_factory.mktemp("sliced")
    return fused_twin(base), {name: save_adapter(base, root / name, **kw) for name, kw in SLICED.items()}


@pytest.mark.parametrize("route", ["sgmv-cuda", "fold-cuda", "kext-cuda"])
def test_per_slice_adapters_on_fused_modules_match_peft(base, sliced, route, monkeypatch):
    """On each route the CPU takes when forced (its own is sgmv): the fold route's slot windows are S·R rows of
    [W; A], the kext route's slices passed to lora_linear."""
    monkeypatch.setenv("LORA_OPS_ROUTE", route)
    fused, dirs = sliced
    rows = ["s", "t", None, "u", "s", "z"]
    ids = torch.randint(0, VOCAB, (len(rows), 6))
    ref = peft_logits(peft_model(base, dirs), ids, rows)
    model, pool = pool_model(fused, dirs)
    tol = 1e-5 if route.startswith("sgmv") else 2e-5  # fold, kext: h rounds to the activation dtype (fp32 here)
    assert rel_err(pool_logits(model, pool, ids, rows), ref) < tol


def test_a_fused_module_and_its_slice_both_given_are_refused(base, sliced, tmp_path):
    """An adapter with weights for both k_proj and the fused qkv_proj holding it gives slice k twice: refused,
    naming both modules, the pool unchanged."""
    import shutil
    fused, dirs = sliced
    directory = shutil.copytree(dirs["t"], tmp_path / "t_and_qkv")
    config = json.load(open(f"{directory}/adapter_config.json"))
    prefix = "base_model.model.model.layers.0.self_attn"
    _rewrite(directory, config_change={"target_modules": config["target_modules"] + ["qkv_proj"]},
             weights_change=lambda w: {**w, f"{prefix}.qkv_proj.lora_A.weight": torch.randn(4, 64),
                                       f"{prefix}.qkv_proj.lora_B.weight": torch.randn(64 + 2 * 32, 4)})
    model, pool = pool_model(fused, {})
    with pytest.raises(AdapterFormatError, match=r"self_attn.k_proj and .*self_attn.qkv_proj both give slice k_proj|"
                                                 r"self_attn.qkv_proj and .*self_attn.k_proj both give slice k_proj"):
        pool.load("x", directory)
    assert pool.loaded == []


def test_reused_slot_holds_no_stale_weights(base, sliced):
    """A slot that held an adapter on every module and slice, reused for one on two slices, computes only the
    new adapter; and so does a slot freed by unload."""
    fused, dirs = sliced
    model, pool = pool_model(fused, {"s": dirs["s"], "t": dirs["t"]}, num_slots=2)
    slot_s = pool.slot("s")
    pool.slot("t")  # s is now the least recently used
    assert pool.load("u", dirs["u"]) == slot_s and pool.loaded == ["t", "u"]
    rows = ["u", "t", None, "u"]
    ids = torch.randint(0, VOCAB, (len(rows), 6))
    ref = peft_logits(peft_model(base, {"t": dirs["t"], "u": dirs["u"]}), ids, rows)
    assert rel_err(pool_logits(model, pool, ids, rows), ref) < 1e-5
    slot_t = pool.slot("t")
    pool.unload("t")
    assert pool.load("s", dirs["s"]) == slot_t
    rows = ["s", "u", "s", None]
    ref = peft_logits(peft_model(base, {"s": dirs["s"], "u": dirs["u"]}), ids, rows)
    assert rel_err(pool_logits(model, pool, ids, rows), ref) < 1e-5


def test_an_adapter_saved_under_transformers_4_paths_loads_as_peft_loads_it(tmp_path):
    """Transformers 5 moved Gemma-3's text model (language_model.model.* is model.language_model.* now); an adapter
    saved under the old paths is renamed by PEFT's own function when the pool loads it, as PEFT does, and computes
    what the same adapter under the new paths computes in PEFT."""
    conversion = pytest.importorskip("transformers.conversion_mapping")
    pytest.importorskip("peft.utils.transformers_weight_conversion")
    import copy
    import shutil
    import transformers
    from lora_ops.serving import AdapterPool, patch_model
    if conversion.get_checkpoint_conversion_mapping("gemma3") is None:
        pytest.skip("this transformers has no conversion mapping for gemma3")
    torch.manual_seed(0)
    text = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=64, sliding_window=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    base = transformers.Gemma3ForConditionalGeneration(transformers.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=VOCAB - 1)).eval()
    new = save_adapter(base, tmp_path / "new", r=4, lora_alpha=8, target_modules=r".*language_model.*\.(q_proj|v_proj)")
    old = shutil.copytree(new, tmp_path / "old")
    _rewrite(old, weights_change=lambda w: {
        k.replace("base_model.model.model.language_model.", "base_model.model.language_model.model."): v
        for k, v in w.items()})
    assert all(".language_model.model.layers." in k for k in load_file(f"{old}/adapter_model.safetensors"))
    ids = torch.randint(0, VOCAB - 2, (2, 5))
    ref = peft_logits(peft_model(base, {"x": new}), ids, ["x", None])
    model = copy.deepcopy(base)
    pool = AdapterPool(model, num_slots=2, max_rank=8, target_modules=r".*language_model.*_proj")
    patch_model(model, pool)
    pool.load("old", old)
    assert rel_err(pool_logits(model, pool, ids, ["old", None]), ref) < 1e-5
    with torch.no_grad():
        assert (ref[0] - base(ids).logits[0]).abs().max() > 1e-3  # the adapter changes the output
