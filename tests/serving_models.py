"""Tiny HF models and PEFT adapters for the serving tests, built from configs (no download).

`fused_twin` is the Phi-3 layout (qkv_proj, gate_up_proj) of a Llama with the same weights concatenated: it
computes what the Llama computes, so adapters saved on the Llama's per-module q/k/v/gate/up can be checked on the
fused model against PEFT's forward on the Llama."""
import copy

import peft
import torch
import transformers

from lora_ops.serving import AdapterPool, patch_model

VOCAB = 256
_SHAPE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False)


def llama(seed=0, **shape):
    """A Llama of _SHAPE, with any of its fields replaced by `shape`'s."""
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_SHAPE, **shape})).eval()


def fused_twin(model):
    """The Phi-3 model whose qkv_proj / gate_up_proj are the Llama's q|k|v and gate|up weights stacked."""
    shape = {k: getattr(model.config, k) for k in _SHAPE}
    fused = transformers.Phi3ForCausalLM(transformers.Phi3Config(pad_token_id=0, **shape)).eval()
    state = model.state_dict()
    out = {}
    for key, w in state.items():
        if ".self_attn.q_proj." in key:
            out[key.replace("q_proj", "qkv_proj")] = torch.cat(
                [w, state[key.replace("q_proj", "k_proj")], state[key.replace("q_proj", "v_proj")]])
        elif ".mlp.gate_proj." in key:
            out[key.replace("gate_proj", "gate_up_proj")] = torch.cat([w, state[key.replace("gate_proj", "up_proj")]])
        elif not any(f".{m}." in key for m in ("k_proj", "v_proj", "up_proj")):
            out[key] = w
    fused.load_state_dict(out, strict=True)
    ids = torch.randint(0, VOCAB, (2, 5))
    with torch.no_grad():  # the premise of every test that uses it
        torch.testing.assert_close(fused(ids).logits, model(ids).logits, rtol=0, atol=1e-6)
    return fused


def save_adapter(base, directory, **lora_kwargs):
    """A PEFT LoRA adapter with random (nonzero) A and B, saved in PEFT's format; returns its directory."""
    lora_kwargs.setdefault("init_lora_weights", False)
    model = peft.get_peft_model(copy.deepcopy(base), peft.LoraConfig(**lora_kwargs))
    model.save_pretrained(str(directory))
    return str(directory)


def peft_model(base, adapters):
    """PEFT's own model with every adapter of {name: directory} loaded (the reference)."""
    names = list(adapters)
    model = peft.PeftModel.from_pretrained(copy.deepcopy(base), adapters[names[0]], adapter_name=names[0])
    for name in names[1:]:
        model.load_adapter(adapters[name], adapter_name=name)
    return model.eval()


@torch.no_grad()
def peft_logits(model, ids, rows, **kwargs):
    return model(ids, adapter_names=[r or "__base__" for r in rows], **kwargs).logits


def pool_model(base, adapters, num_slots=4, max_rank=16, device="cpu"):
    """A copy of `base`, patched, with a pool holding every adapter of {name: directory}."""
    model = copy.deepcopy(base).to(device)
    pool = AdapterPool(model, num_slots=num_slots, max_rank=max_rank)
    patch_model(model, pool)
    for name, directory in adapters.items():
        pool.load(name, directory)
    return model, pool


@torch.no_grad()
def pool_logits(model, pool, ids, rows, **kwargs):
    with pool.batch(rows, tokens_per_row=ids.shape[1]):
        return model(ids, **kwargs).logits


def rel_err(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()
