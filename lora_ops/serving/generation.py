"""Greedy decoding of a batch whose rows use different adapters, through a patched HF model."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from .pool import AdapterPool


@torch.no_grad()
def greedy_generate(model: nn.Module, pool: AdapterPool, input_ids: torch.Tensor,
                    adapters: Sequence[Optional[str]], max_new_tokens: int, progress=None):
    """Greedy decoding of a batch whose rows use different adapters (HF KV cache). Returns (tokens [B, L+n],
    per-step logits [B, L+n-1, V]: the prompt's logits, then each decode step's)."""
    B, L = input_ids.shape
    with pool.pinned(*[a for a in adapters if a is not None]):
        pool.set_batch(adapters, tokens_per_row=L)
        out = model(input_ids, use_cache=True)
        logits = [out.logits]
        past, tokens = out.past_key_values, input_ids
        for step in range(max_new_tokens):
            nxt = logits[-1][:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], 1)
            if step == max_new_tokens - 1:
                break  # the last token needs no forward
            pool.set_batch(adapters, tokens_per_row=1)
            out = model(nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
            logits.append(out.logits)
            if progress is not None:
                progress.update(1)
        pool.clear_batch()
    return tokens, torch.cat(logits, 1)
