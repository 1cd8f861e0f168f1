"""Multi-LoRA serving, complete: a tiny Llama built from a config (no download), three PEFT LoRA adapters saved
in PEFT's format, loaded into lora_ops' adapter pool, one mixed batch checked against PEFT, then generation.

    python examples/serving.py        # needs the [hf] extra: transformers, peft, safetensors
"""
import copy
import tempfile
import warnings

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from lora_ops.serving import AdapterPool, greedy_generate, patch_model

warnings.filterwarnings("ignore", category=FutureWarning)  # peft 0.21 calls APIs that transformers 5 deprecates
torch.manual_seed(0)
model = LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2)).eval()

# Three adapters as PEFT saves them (adapter_config.json + adapter_model.safetensors). init_lora_weights=False
# gives them random weights, as if trained: a fresh PEFT adapter is a no-op.
adapter_dir = tempfile.mkdtemp()
configs = {
    "sql": LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    "chat": LoraConfig(r=16, lora_alpha=16, use_rslora=True, target_modules="all-linear", init_lora_weights=False),
    "code": LoraConfig(r=4, lora_alpha=8, target_modules=["o_proj", "down_proj"], rank_pattern={"down_proj": 2},
                       init_lora_weights=False),
}
for name, config in configs.items():
    get_peft_model(copy.deepcopy(model), config).save_pretrained(f"{adapter_dir}/{name}")

# PEFT's own multi-adapter model, to check against.
reference = PeftModel.from_pretrained(copy.deepcopy(model), f"{adapter_dir}/sql", adapter_name="sql").eval()
for name in ["chat", "code"]:
    reference.load_adapter(f"{adapter_dir}/{name}", adapter_name=name)

# lora_ops: a pool of adapter slots on the model's device and dtype, the model's linear layers patched in place,
# and the adapter directories loaded as they are.
pool = AdapterPool(model, num_slots=4, max_rank=16)
patch_model(model, pool)
for name in configs:
    pool.load(name, f"{adapter_dir}/{name}")

# One batch, each row on its own adapter (None: the base model). A [B, L] input has L tokens per row.
adapters = ["sql", None, "chat", "code"]
ids = torch.randint(0, 512, (len(adapters), 6))
with torch.no_grad():
    with pool.batch(adapters, tokens_per_row=ids.shape[1]):
        logits = model(ids).logits
    want = reference(ids, adapter_names=[a or "__base__" for a in adapters]).logits
error = ((logits - want).norm() / want.norm()).item()
print(f"mixed batch {adapters}: logits vs PEFT, relative error {error:.1e}")

# Greedy generation: the prompt's forward, then one token per row and step, each row on its adapter.
tokens, _ = greedy_generate(model, pool, ids, adapters, max_new_tokens=8)
for adapter, row in zip(adapters, tokens):
    print(f"{adapter or 'base':>5}: prompt {row[:6].tolist()} -> {row[6:].tolist()}")
