"""Greedy decoding of a batch whose rows use different adapters, through a patched HF model."""
from __future__ import annotations

import inspect
from typing import Optional, Sequence

import torch
from torch import nn

from .pool import AdapterPool


@torch.no_grad()
def greedy_generate(model: nn.Module, pool: AdapterPool, input_ids: torch.Tensor,
                    adapters: Sequence[Optional[str]], max_new_tokens: int,
                    attention_mask: Optional[torch.Tensor] = None, progress=None):
    """Greedy decoding with the HF KV cache, row i of `input_ids` [B, L] on adapters[i] (None: base model).

    Ragged prompts: left-pad them to L and pass their attention_mask (1 = token, 0 = padding); positions then
    count real tokens only, as in HF's generate. Returns (tokens [B, L+n], logits [B, L+n-1, V]: the prompt's,
    then each decode step's). The adapters stay pinned, and the routing active before the call (or none) is set
    again after it, even when a forward raises."""
    B, L = input_ids.shape
    cache_kw = _cache_keyword(model)
    extra = {}
    if attention_mask is not None:
        extra = dict(attention_mask=attention_mask, position_ids=(attention_mask.long().cumsum(-1) - 1).clamp(min=0))
    tokens = input_ids
    with pool.batch(adapters, tokens_per_row=L):  # pinned; on exit the routing before it, or none
        out = model(input_ids, use_cache=True, **extra)
        logits = [out.logits]
        pool.set_batch(adapters, tokens_per_row=1)  # every decode step: one token per row, the same routing
        for step in range(max_new_tokens):
            nxt = logits[-1][:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
            if step == max_new_tokens - 1:
                break  # the last token needs no forward
            if attention_mask is not None:
                extra["attention_mask"] = torch.cat([extra["attention_mask"], attention_mask.new_ones(B, 1)], 1)
                extra["position_ids"] = extra["position_ids"][:, -1:] + 1
            out = model(nxt, use_cache=True, **{cache_kw: _cache_of(out)}, **extra)
            logits.append(out.logits)
            if progress is not None:
                progress.update(1)
    return tokens, torch.cat(logits, 1)


def _cache_keyword(model: nn.Module) -> str:
    """The forward's KV-cache argument: `cache` from transformers 5.2x, `past_key_values` before."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _cache_of(out):
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values
