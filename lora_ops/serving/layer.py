"""The multi-LoRA linear layer (base output + the pool's per-row LoRA delta) and model patching."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import ops, routes

if TYPE_CHECKING:  # the pool imports this module
    from .pool import AdapterPool, ModuleSlots


class MultiLoRALinear(nn.Module):
    """A base nn.Linear plus the pool's per-row LoRA delta, by one of three routes (lora_ops/routes.py picks the
    route and backend per regime of tokens, from the decode-step bench's measurements):

    - "sgmv": y = base(x), then one sgmv over the step's segments (shrink and expand of the adapters present);
    - "fold": one GEMM against the module's [W; A of every slot] gives y and every used slot's h (fold_linear,
      which skips the A of the slots no row uses where it can), then lora_expand adds each row's own window of h
      times its B (its rows form: the rows' slots, no segments). h is rounded to the
      activation dtype there (the sgmv route keeps it in float32); y is returned as a view of the wider GEMM
      output;
    - "kext": one lora_linear: a shrink writes each row's h, then one GEMM [x | h]·[W | B of every slot]ᵀ (on the
      modules its CUDA kernels serve, the pool keeps a copy of B as extra columns of W's rows, b_cols) that starts
      while the shrink runs; h is rounded to the activation dtype, as on the fold route.

    With no batch active (pool.current is None) it is exactly the base layer."""

    def __init__(self, base: nn.Linear, slots: "ModuleSlots", pool: "AdapterPool"):
        super().__init__()
        self.base = base
        self._slots = slots
        self._pool = pool
        routes.preload()

    @property
    def in_features(self):
        return self.base.in_features

    @property
    def out_features(self):
        return self.base.out_features

    @property
    def weight(self):
        return self.base.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch = self._pool.current
        if batch is None:
            return self.base(x)
        if torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in self.base.parameters())):
            # the fold route's GEMM reads w_cat, not base.weight: without this its gradient would silently vanish
            raise RuntimeError(f"{self._slots.name}: the LoRA layers are for inference (the ops have no backward); "
                               "run the model under torch.no_grad() or torch.inference_mode()")
        # another Parameter (identity: what torch.compile's guards check too); the same one given other data is
        # refused once a step, by AdapterPool.set_batch
        if self.base.weight is not self._slots.base_params[0] or self.base.bias is not self._slots.base_params[1]:
            raise self._slots.replaced_error()
        if torch.is_autocast_enabled(x.device.type):
            raise RuntimeError(f"{self._slots.name}: the LoRA layers do not run under autocast; create the pool on "
                               "the model in its compute dtype (model.to(dtype) before AdapterPool)")
        x2d = x.reshape(-1, x.shape[-1])
        tokens = x2d.shape[0]
        # Sizes known on the host, so no sync: a routing for another batch would silently mix rows up.
        if tokens != batch.token_indices.shape[0]:
            raise ValueError(f"{self._slots.name}: the LoRA batch routes {batch.token_indices.shape[0]} tokens but "
                             f"this layer's input {list(x.shape)} has {tokens}; set the batch with "
                             "tokens_per_row=L for a [B, L] input or lengths=[...] summing to its token count (a "
                             "layer outside the text model, e.g. a vision tower's, is left alone by building the "
                             "pool with target_modules selecting the text model's modules only)")
        m = self._slots
        route, backend = routes.pick(tokens, x.device.type, m.lora_b.shape[2], m.kext_serves,
                                     self._pool.route_table.index())
        if route == "kext":  # no ranks: A and B are zero past each slot's rank
            return ops.lora_linear(x, self.base.weight, m.lora_a, m.kext_lora_b, batch.token_slots, m.scales,
                                   m.offsets_arg, self.base.bias)
        per_slot = (m.ranks_arg, m.scales, m.offsets_arg)
        if route == "fold":
            slot_rows = len(m.slice_names) * m.lora_b.shape[2]
            # with the step's segments: on sm_90 at decode sizes the GEMM skips the A of the slots no row uses
            out = ops.fold_linear(x, m.w_cat, m.bias_cat, batch.seg_indptr, slot_rows)
            N, out2d = m.out_features, out.view(tokens, out.shape[-1])
            h = out2d[:, N:].view(tokens, m.lora_b.shape[0], slot_rows)
            rows = routes.fold_expand_rows(backend, batch.sorted_slots,
                                           (batch.seg_indptr, batch.seg_lora, batch.token_indices))
            routes.op("lora_expand", backend)(out2d[:, :N], h, m.lora_b, *rows, *per_slot)
            return out[..., :N]
        y = self.base(x)
        routes.op("sgmv", backend)(y.view(tokens, y.shape[-1]), x2d, m.lora_a, m.lora_b, batch.seg_indptr,
                                   batch.seg_lora, batch.token_indices, *per_slot)
        return y


def patch_model(model: nn.Module, pool: "AdapterPool") -> nn.Module:
    """Wrap every pool target module of `model` in a MultiLoRALinear, in place (modules wrapped for an earlier
    pool move to this one); returns the model."""
    for name, slots in pool.modules.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, leaf)
        if isinstance(module, MultiLoRALinear):  # patched for another pool: this one's slots hold its weight now
            module._slots, module._pool = slots, pool
        else:
            setattr(parent, leaf, MultiLoRALinear(module, slots, pool))
    return model
