"""The multi-LoRA linear layer (base output + the pool's per-row LoRA delta) and model patching."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import ops

if TYPE_CHECKING:  # the pool imports this module
    from .pool import AdapterPool, ModuleSlots


class MultiLoRALinear(nn.Module):
    """A base nn.Linear plus the pool's per-row LoRA delta: y = base(x) + one sgmv over the step's segments.

    With no batch active (pool.current is None) it is exactly the base layer."""

    def __init__(self, base: nn.Linear, slots: "ModuleSlots", pool: "AdapterPool"):
        super().__init__()
        self.base = base
        self._slots = slots
        self._pool = pool

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
        y = self.base(x)
        batch = self._pool.current
        if batch is None:
            return y
        x2d, y2d = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
        # Sizes known on the host, so no sync: a routing for another batch would silently mix rows up.
        if x2d.shape[0] != batch.token_indices.shape[0]:
            raise ValueError(f"{self._slots.name}: the LoRA batch routes {batch.token_indices.shape[0]} tokens but "
                             f"this layer's input {list(x.shape)} has {x2d.shape[0]}; set the batch with "
                             "tokens_per_row=L for a [B, L] input or lengths=[...] summing to its token count")
        self._add_sgmv(y2d, x2d, batch)
        return y

    def _add_sgmv(self, y: torch.Tensor, x: torch.Tensor, batch) -> None:
        """y += the LoRA delta of every token's slot: shrink and expand in one sgmv over the step's segments."""
        m = self._slots
        ops.sgmv(y, x, m.lora_a, m.lora_b, batch.seg_indptr, batch.seg_lora, batch.token_indices, m.ranks,
                 m.scales, m.offsets_arg)


def patch_model(model: nn.Module, pool: "AdapterPool") -> nn.Module:
    """Wrap every pool target module of `model` in a MultiLoRALinear, in place; returns the model."""
    for name, slots in pool.modules.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, leaf)
        if not isinstance(module, MultiLoRALinear):
            setattr(parent, leaf, MultiLoRALinear(module, slots, pool))
    return model
