"""Multi-LoRA serving on a HuggingFace model: an adapter pool that loads PEFT LoRA adapters unchanged, a
multi-LoRA linear layer (base output + one sgmv), model patching, and a per-step batch context.

    pool = AdapterPool(model, num_slots=8, max_rank=64)   # preallocated stacked weights per target module
    patch_model(model, pool)                              # wraps the target nn.Linear modules in place
    pool.load("sql", "/adapters/sql")                     # adapter_config.json + adapter_model.safetensors
    with torch.no_grad(), pool.batch(["sql", None, "chat"], tokens_per_row=input_ids.shape[1]):
        logits = model(input_ids).logits                  # each row runs with its own adapter (None: base)

Inference only: with grad mode on, a patched layer refuses an input or base weight that requires grad. The
step's routing lives in fixed device buffers, so a CUDA graph captured over the model replays each new step's
routing (LoRABatch).

Modules: pool (slots, LRU, pins, the step's routing), peft_format (reading and validating PEFT adapters),
layer (MultiLoRALinear, patch_model), generation (greedy_generate). Only torch is needed for the pool
arithmetic; reading adapters uses safetensors (the [hf] extra).
"""
from .generation import greedy_generate
from .layer import MultiLoRALinear, patch_model
from .peft_format import (FUSED_SLICES, AdapterError, AdapterFormatError, AdapterShapeError, PoolFullError,
                          UnsupportedAdapterError)
from .pool import LINEAR_TARGETS, AdapterPool, LoRABatch, ModuleSlots

__all__ = ["AdapterPool", "LoRABatch", "ModuleSlots", "MultiLoRALinear", "patch_model", "greedy_generate",
           "AdapterError", "AdapterFormatError", "UnsupportedAdapterError", "AdapterShapeError", "PoolFullError",
           "LINEAR_TARGETS", "FUSED_SLICES"]
