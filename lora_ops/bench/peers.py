"""Peers timed in the bench's own harness, where they import (docs/design.md §6): vLLM's Triton LoRA ops, run as
vLLM runs them (PunicaWrapperGPU.add_lora_linear: an fp32 buffer [slices, T, R], lora_shrink, which zeroes it,
then lora_expand adding into y), from the copy `scripts/make_vllm_peer.sh` builds out of vLLM's wheel. Its folder:
LORA_OPS_VLLM_PEER, default build/peers/vllm of the checkout (the device tool carries it to the GPU machine); "off"
leaves it out. A peer is measured, never trusted: a peer that raises or is wrong against the oracle is logged and
recorded as unavailable, and does not fail the bench (lora_ops' own implementations do).

vLLM keeps its own adapter layout, which the peer builds from a pool's once, outside what is timed: per slice a
contiguous A [L, R, K] and B [L, n, R], the rows past an adapter's rank zero (vLLM pads a smaller rank so) and B
times the adapter's scale (vLLM's kernels take one float for every adapter: it folds each adapter's scale into B
when it loads it). Its per-step metadata (LoRAKernelMeta.prepare_tensors) syncs the host, so it is made before a
graph is captured, as vLLM makes it before replaying one; lora_ops' routes build their segments inside the step, so
the decode step also records that metadata's own time per step (meta_us, VllmBatch.prepare_us).

vLLM caches each weight list's pointers by data_ptr for good (its weights live as long as the server): a bench that
makes new layouts calls release() once they are gone, which empties those caches."""
from __future__ import annotations

import functools
import os
import sys
import time
from typing import List, Optional, Sequence, Tuple

import torch

DEFAULT_VLLM_PEER = os.path.join(os.path.dirname(__file__), "..", "..", "build", "peers", "vllm")
PEERS = ("vllm",)  # the peers' names in the bench's records


@functools.lru_cache(maxsize=None)
def vllm_ops() -> Tuple[Optional[object], str]:
    """(vllm.lora.ops.triton_ops from the peer's folder, "") or (None, why it is not available)."""
    setting = os.environ.get("LORA_OPS_VLLM_PEER", DEFAULT_VLLM_PEER)
    if setting == "off":
        return None, "the vLLM peer is off (LORA_OPS_VLLM_PEER=off)"
    path = os.path.abspath(setting)
    if not os.path.isdir(os.path.join(path, "vllm")):
        return None, f"no vLLM peer at {path} (bash scripts/make_vllm_peer.sh)"
    if path not in sys.path:
        sys.path.insert(0, path)
    try:
        import vllm.lora.ops.triton_ops as ops
    except Exception as exc:  # a peer that does not import is reported, not fatal
        return None, f"the vLLM peer at {path} does not import: {type(exc).__name__}: {exc}"
    return ops, ""


def release() -> None:
    """Empties vLLM's caches of weight pointers, which hold the layouts they saw (and would match a later layout
    at a reused address); a no-op where the peer was never imported."""
    utils = sys.modules.get("vllm.lora.ops.triton_ops.utils")
    if utils is not None:
        utils._LORA_A_PTR_DICT.clear()
        utils._LORA_B_PTR_DICT.clear()


class VllmLayout:
    """One module's adapter pool in vLLM's layout (see the module's docstring). lora_a [L, S·R, K] and lora_b
    [L, N, R] as lora_ops takes them; ranks [L] or None (every slot the pool's R); scales [L] or None; `scale` the
    op's own factor; offsets: the slices' first columns and N."""

    def __init__(self, lora_a: torch.Tensor, lora_b: torch.Tensor, ranks: Optional[torch.Tensor],
                 scales: Optional[torch.Tensor], scale: float, offsets: Sequence[int]):
        L, N, R = lora_b.shape
        rank = torch.full((L,), R, device=lora_b.device) if ranks is None else ranks.clamp(0, R)
        keep = (torch.arange(R, device=lora_b.device)[None, :] < rank[:, None].to(lora_b.device))  # [L, R]
        coef = scale * (torch.ones(L, device=lora_b.device) if scales is None else scales.float())
        self.a: List[torch.Tensor] = []
        self.b: List[torch.Tensor] = []
        for s, (lo, hi) in enumerate(zip(offsets[:-1], offsets[1:])):
            a = lora_a[:, s * R:(s + 1) * R, :]
            self.a.append((a * keep[:, :, None].to(a.dtype)).contiguous())
            b = lora_b[:, lo:hi, :].float() * keep[:, None, :] * coef[:, None, None]
            self.b.append(b.to(lora_b.dtype).contiguous())
        self.R = R


class VllmBatch:
    """vLLM's metadata of one step's token slots (-1: no adapter) for a pool of num_slots."""

    def __init__(self, ops, token_slot: torch.Tensor, num_slots: int):
        self.T = token_slot.shape[0]
        meta = ops.LoRAKernelMeta.make(num_slots, self.T, token_slot.device)
        meta.prepare_tensors(token_slot.to(torch.int32))
        self.meta = meta  # meta_args' tensors are views of it
        self.args = meta.meta_args(self.T, False)  # vLLM's default: no specialisation to the adapters present

    def prepare_us(self, token_slot: torch.Tensor, reps: int = 20) -> float:
        """µs of one step's LoRAKernelMeta.prepare_tensors on the host clock (its small kernels and its syncs), as
        vLLM runs it before each step; the metadata is left as it was (the same slots)."""
        slots = token_slot.to(torch.int32)
        sync = torch.cuda.synchronize if slots.is_cuda else (lambda: None)
        self.meta.prepare_tensors(slots)
        sync()
        start = time.perf_counter()
        for _ in range(reps):
            self.meta.prepare_tensors(slots)
        sync()
        return (time.perf_counter() - start) / reps * 1e6


def add_lora_linear(ops, y: torch.Tensor, x: torch.Tensor, layout: VllmLayout, batch: VllmBatch) -> None:
    """y += each row's delta, as vLLM's PunicaWrapperGPU.add_lora_linear computes it."""
    buffer = torch.empty(len(layout.a), batch.T, layout.R, dtype=torch.float32, device=x.device)
    ops.lora_shrink(x, layout.a, buffer, *batch.args, 1.0)
    ops.lora_expand(buffer, layout.b, y, *batch.args, offset_start=0, add_inputs=True)
