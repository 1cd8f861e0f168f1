"""The adapter pool: preallocated stacked LoRA weights per target module, slots reused least-recently-used,
pins for in-flight batches, and the per-step routing (LoRABatch) that every patched layer reads."""
from __future__ import annotations

import collections
import contextlib
import operator
import re
import warnings
from typing import Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

import torch
from torch import nn

from .. import ops, routes
from .layer import MultiLoRALinear
from .peft_format import (FUSED_SLICES, AdapterShapeError, PoolFullError, read_config, read_weights, stage,
                          transformers_key_renaming)

# Per-module LoRA names of common decoder models (and the fused modules of Phi-3 style models).
LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                  "gate_up_proj")


class ModuleSlots:
    """Stacked LoRA weights of one target module in the op layout: lora_a [L, S*R, K], lora_b [L, N, R].

    The base weight and every slot's A share one tensor, w_cat = [W; A of slot 0; ...; A of slot L-1]
    ([N + L*S*R, K]): the base layer's weight (and bias, with zeros after it in bias_cat) become views of its first
    N rows and lora_a a view of the rest. The fold route's one GEMM against w_cat gives y and every used slot's h
    at once, and W and A are stored once.

    B is stored twice where lora_linear's CUDA kernels serve the module (kext_serves: sm_90, its dtypes and
    sizes): lora_b [L, N, R] (contiguous: the sgmv and fold routes) and b_cols [N, L*R] (slot l's R columns at l*R,
    as extra columns of W's rows: the kext route's GEMM reads [W | B] row by row; kext_lora_b is its view
    [L, N, R], strides (R, L*R, 1)). One layout for both cost the fold route 3-8 points of a llama3-8b decode step
    (the strided B in its expand; H200, csrc/cuda/NOTES.md session 31), the copy costs B's bytes once more
    (llama3-8b, 32 slots of rank 16: 1.4 GB). Elsewhere there is no copy (b_cols None, kext_lora_b is lora_b: the
    composition lora_linear runs there reads any layout). Create the pool after moving the model to its device and
    dtype."""

    def __init__(self, name: str, base: nn.Linear, slice_names: Tuple[str, ...], slice_offsets: List[int],
                 num_slots: int, max_rank: int):
        self.name, self.slice_names, self.slice_offsets = name, slice_names, slice_offsets
        self.in_features, self.out_features = base.in_features, base.out_features
        kw = dict(dtype=base.weight.dtype, device=base.weight.device)
        N, S = base.out_features, len(slice_names)
        self.w_cat = torch.zeros(N + num_slots * S * max_rank, base.in_features, **kw)
        self.bias_cat = None if base.bias is None else torch.zeros(self.w_cat.shape[0], **kw)
        with torch.no_grad():
            self.w_cat[:N].copy_(base.weight)
            base.weight = nn.Parameter(self.w_cat[:N], requires_grad=base.weight.requires_grad)
            if base.bias is not None:
                self.bias_cat[:N].copy_(base.bias)
                base.bias = nn.Parameter(self.bias_cat[:N], requires_grad=base.bias.requires_grad)
        # The parameters that are views of w_cat and bias_cat: one replaced later (load_state_dict(assign=True),
        # an assignment; the layer checks) or given other data (param.data = ...; set_batch checks) leaves the fold
        # route reading the old values, so the model refuses to run then.
        self.base_params = (base.weight, base.bias)
        self.lora_a = self.w_cat[N:].view(num_slots, S * max_rank, base.in_features)
        self.lora_b = torch.zeros(num_slots, N, max_rank, **kw)
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=base.weight.device)
        self.scales = torch.ones(num_slots, dtype=torch.float32, device=base.weight.device)
        self.offsets_arg = slice_offsets if S > 1 else None
        # kext_serves: whether lora_linear's CUDA kernels serve this module (device, dtype, sizes, B's layout): the
        # kext route is taken only where they do (elsewhere lora_linear is its composition of torch ops, no route),
        # and only there is B copied. They run on CUDA only: asked there, with the copy they would read.
        self.b_cols, self.kext_lora_b, self.kext_serves = None, self.lora_b, False
        if self.lora_b.is_cuda:
            b_cols = torch.zeros(N, num_slots * max_rank, **kw)
            b_view = b_cols.view(N, num_slots, max_rank).permute(1, 0, 2)
            if torch.ops.lora_ops._lora_linear_kernels_serve(base.weight, self.lora_a, b_view, self.offsets_arg):
                self.b_cols, self.kext_lora_b, self.kext_serves = b_cols, b_view, True
        self.ranks_arg: Optional[torch.Tensor] = None  # what the ops get: see AdapterPool.load
        # Sizes fixed by the pool: static, so that torch.compile never ties them to a step's token count that
        # happens to be equal (e.g. T = max_rank), which would recompile at the next T.
        for t in (self.w_cat, self.bias_cat, self.lora_a, self.lora_b, self.b_cols, self.kext_lora_b, self.ranks,
                  self.scales):
            if t is not None:
                torch._dynamo.mark_static(t)

    def replaced_error(self) -> RuntimeError:
        return RuntimeError(
            f"{self.name}: the base layer's weight or bias was replaced after the pool was built (e.g. "
            "load_state_dict(..., assign=True), or param.data = ...), and the fold route would read the old values; "
            "load weights in place (load_state_dict without assign) or build the pool after loading them")

    def base_data_moved(self) -> bool:
        """Whether the base weight or bias the pool made was given other data since (param.data = ...)."""
        weight, bias = self.base_params
        return weight.data_ptr() != self.w_cat.data_ptr() or (
            bias is not None and bias.data_ptr() != self.bias_cat.data_ptr())

    def clear(self, slot: int) -> None:
        """Rank 0, and zeros in A and B: with or without ranks the ops add nothing for the slot."""
        self.ranks[slot] = 0
        self.scales[slot] = 1.0
        self.lora_a[slot].zero_()
        self.set_b(slot, None)

    def set_b(self, slot: int, lora_b: Optional[torch.Tensor]) -> None:
        """Slot `slot`'s B ([N, rank], rank <= R; None: zeros), in both of its layouts where there are two, zeros past
        its rank."""
        self.lora_b[slot].zero_()
        if lora_b is not None:
            self.lora_b[slot, :, :lora_b.shape[1]].copy_(lora_b)
        if self.b_cols is not None:
            self.kext_lora_b[slot].copy_(self.lora_b[slot])


def _target_rule(target_modules, model: nn.Module) -> Callable[[str], bool]:
    """Which module names the pool wraps, by PEFT's rule for a LoraConfig's target_modules: a string is a regular
    expression the whole name must match (e.g. r".*language_model.*\\.(q_proj|v_proj)", to leave a multimodal
    model's vision tower alone), or "all-linear" (any case): every linear layer but the output layer
    (model.get_output_embeddings()); a list names modules by their name or a dotted suffix of it ("q_proj",
    "self_attn.q_proj"); None: LINEAR_TARGETS by their last name."""
    if target_modules is None:
        return lambda name: name.rsplit(".", 1)[-1] in LINEAR_TARGETS
    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
        output = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        excluded = {name for name, module in model.named_modules() if output is not None and module is output}
        return lambda name: name not in excluded
    if isinstance(target_modules, str):
        try:
            pattern = re.compile(target_modules)
        except re.error as exc:
            raise ValueError(f"target_modules {target_modules!r} is not a regular expression ({exc})") from exc
        return lambda name: pattern.fullmatch(name) is not None
    targets = list(target_modules)
    if not targets or not all(isinstance(t, str) for t in targets):
        raise ValueError(f"target_modules must be module names (or a regular expression), got {targets!r}; "
                         f"None takes the defaults {sorted(LINEAR_TARGETS)}")
    return lambda name: any(name == t or name.endswith("." + t) for t in targets)


def _is_count(n) -> bool:
    """An integer (Python's, numpy's, a 0-d integer tensor's), not a float or bool that int() would truncate."""
    if isinstance(n, bool):
        return False
    try:
        operator.index(n)
    except TypeError:
        return False
    return True


class LoRABatch:
    """One step's routing, shared by every layer: each token's slot and the segments built from it once.

    Every step's routing is written into the same device buffers, and token_slots / token_indices / sorted_slots
    (each position's slot in build_segments' order: the fold route's rows form) are views of their first T entries:
    a CUDA graph captured over the patched model (by hand, as vLLM-style servers do, or by torch.compile's
    reduce-overhead mode) reads its routing at fixed addresses, so replaying it after the next set_batch (with the
    same T) runs that step's routing. Only a step with more tokens than the buffers hold moves them (AdapterPool's
    max_batch_tokens; a warning says so: graphs captured before then read freed memory).
    A pool keeps ONE of these: torch.compile guards on the identity of the objects a graph reads, so a new object
    per step would recompile the model."""

    def __init__(self, device, num_slots: int, max_tokens: int):
        self.active = False
        self.num_slots = num_slots
        self._allocate(max_tokens, device)
        self.seg_indptr = torch.zeros(num_slots + 1, dtype=torch.int32, device=device)
        self.seg_lora = torch.arange(num_slots, dtype=torch.int32, device=device)  # build_segments' are arange
        # Their sizes depend on the pool only: static, so that torch.compile's duck sizing never ties them to a
        # batch dimension that happens to be equal (which recompiles when the batch changes).
        torch._dynamo.mark_static(self.seg_indptr)
        torch._dynamo.mark_static(self.seg_lora)
        self.token_slots = self.token_indices = self.sorted_slots = None

    def _allocate(self, max_tokens: int, device) -> None:
        # One entry more than any step uses: torch.compile would tie a step's T to the buffer's length when they
        # are equal (the views' base is an input too), and recompile at the next T.
        self._slot_buffer = torch.empty(max_tokens + 1, dtype=torch.int32, device=device)
        self._index_buffer = torch.empty_like(self._slot_buffer)
        self._sorted_slot_buffer = torch.empty_like(self._slot_buffer)
        for buffer in (self._slot_buffer, self._index_buffer, self._sorted_slot_buffer):
            torch._dynamo.mark_static(buffer)

    def set(self, token_slots: torch.Tensor) -> None:
        """token_slots: [T] int32 on the host (copied to the device here, without a sync)."""
        T = token_slots.shape[0]
        if T >= self._slot_buffer.shape[0]:
            warnings.warn(f"a step of {T} tokens is larger than the routing buffers "
                          f"({self._slot_buffer.shape[0] - 1} tokens, AdapterPool's max_batch_tokens): they move, "
                          "and CUDA graphs captured before now read freed memory (wrong output); capture again",
                          stacklevel=3)
            self._allocate(2 * T, self._slot_buffer.device)
        self.token_slots = self._slot_buffer[:T]
        self.token_slots.copy_(token_slots, non_blocking=True)
        token_indices, seg_indptr, _ = ops.build_segments(self.token_slots, self.num_slots)
        self.token_indices = self._index_buffer[:T]
        self.token_indices.copy_(token_indices)
        self.seg_indptr.copy_(seg_indptr)
        self.sorted_slots = self._sorted_slot_buffer[:T]
        routes.sorted_slots(self.token_slots, self.token_indices, out=self.sorted_slots)
        self.active = True


class AdapterPool:
    """A fixed number of adapter slots for a model's LoRA target modules, on the model's device and dtype.

    Slots are reused least-recently-used; `pin`/`unpin` (or `pinned(...)`) keep an adapter of an in-flight
    batch from being evicted. The step's routing lives in device buffers of `max_batch_tokens` tokens (LoRABatch):
    CUDA graphs captured over the patched model stay valid across steps of up to that many tokens."""

    def __init__(self, model: nn.Module, num_slots: int = 8, max_rank: int = 64,
                 target_modules: Union[None, str, Iterable[str]] = None, max_batch_tokens: int = 16384):
        if num_slots < 1 or max_rank < 1 or max_batch_tokens < 1:
            raise ValueError(f"num_slots, max_rank and max_batch_tokens must be >= 1, got {num_slots}, {max_rank} "
                             f"and {max_batch_tokens}")
        self.num_slots, self.max_rank = num_slots, max_rank
        targeted = _target_rule(target_modules, model)
        # an earlier pool's layers are taken over whole: their base nn.Linear is not a target of its own
        wrapped = {name for name, module in model.named_modules() if isinstance(module, MultiLoRALinear)}
        self.modules: Dict[str, ModuleSlots] = {}
        for name, module in model.named_modules():
            parent, _, leaf = name.rpartition(".")
            if parent in wrapped:
                continue
            if targeted(name) and isinstance(module, (nn.Linear, MultiLoRALinear)):
                base = module.base if isinstance(module, MultiLoRALinear) else module
                slice_names, offsets = self._slices(model, leaf, base)
                self.modules[name] = ModuleSlots(name, base, slice_names, offsets, num_slots, max_rank)
        if not self.modules:
            raise AdapterShapeError(f"the model has no nn.Linear that target_modules selects "
                                    f"({target_modules if target_modules is not None else sorted(LINEAR_TARGETS)!r})")
        # The routes table measured on the model shape nearest this one's modules (lora_ops/routes.py)
        self.route_table = routes.NearestTable([(m.in_features, m.out_features) for m in self.modules.values()])
        self._slot_of: "collections.OrderedDict[str, int]" = collections.OrderedDict()  # LRU order, oldest first
        self._pins: Dict[str, int] = {}
        # The active routing's token slots (host int32), None without one, and those of the routings that enclosing
        # batch() blocks will set again on exit: no load reuses any of their slots (their rows would silently run
        # the new adapter; an unloaded adapter's rows add nothing).
        self._routing: Optional[torch.Tensor] = None
        self._outer_routings: List[Optional[torch.Tensor]] = []
        # While every adapter loaded so far has the pool's rank on every module, the ops get no ranks
        # (lora_ranks=None: the kernels skip a dependent load per row, the slot's rank). The first adapter that
        # does not ends it for good: one switch, so torch.compile recompiles at most once for it. A graph
        # captured before the switch stays right: A and B are zero past each slot's rank and in a cleared slot.
        self._one_rank = True
        self._batch = LoRABatch(next(iter(self.modules.values())).ranks.device, num_slots, max_batch_tokens)
        self._rename_keys = transformers_key_renaming(model)

    @property
    def current(self) -> Optional[LoRABatch]:
        """The active step's routing, or None (every layer then runs as its base layer)."""
        return self._batch if self._batch.active else None

    @staticmethod
    def _slices(model, leaf, base) -> Tuple[Tuple[str, ...], List[int]]:
        """Slice names and column offsets of a fused module (Phi-3 style qkv_proj / gate_up_proj)."""
        if leaf not in FUSED_SLICES:
            return (leaf,), [0, base.out_features]
        cfg = getattr(model, "config", None)
        if leaf == "qkv_proj" and cfg is None:
            raise AdapterShapeError("qkv_proj: its q, k and v widths come from model.config (num_attention_heads, "
                                    "num_key_value_heads, head_dim), and the model has no config")
        if leaf == "qkv_proj":
            head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
            q = cfg.num_attention_heads * head_dim
            kv = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads) * head_dim
            widths = [q, kv, kv]
        else:
            widths = [base.out_features // 2] * 2
        if sum(widths) != base.out_features:
            raise AdapterShapeError(f"cannot split {leaf} of {base.out_features} outputs into slices {widths}")
        return FUSED_SLICES[leaf], [0] + list(torch.tensor(widths).cumsum(0).tolist())

    # ---- slots ----
    @property
    def loaded(self) -> List[str]:
        return list(self._slot_of)

    def slot(self, name: Optional[str]) -> int:
        """The slot of a loaded adapter (-1 for None: base model only)."""
        if name is None:
            return -1
        if name not in self._slot_of:
            raise KeyError(f"adapter {name!r} is not loaded (loaded: {self.loaded})")
        self._slot_of.move_to_end(name)
        return self._slot_of[name]

    def pin(self, name: str) -> None:
        self.slot(name)
        self._pins[name] = self._pins.get(name, 0) + 1

    def unpin(self, name: str) -> None:
        if self._pins.get(name, 0) == 0:
            raise ValueError(f"adapter {name!r} is not pinned")
        self._pins[name] -= 1
        if self._pins[name] == 0:
            del self._pins[name]

    @contextlib.contextmanager
    def pinned(self, *names: str):
        done = []
        try:
            for n in names:
                self.pin(n)
                done.append(n)
            yield
        finally:
            for n in done:
                self.unpin(n)

    def unload(self, name: str) -> None:
        if self._pins.get(name):
            raise ValueError(f"adapter {name!r} is pinned; unpin it before unloading")
        if name not in self._slot_of:
            raise KeyError(f"adapter {name!r} is not loaded (loaded: {self.loaded})")
        slot = self._slot_of.pop(name)
        for m in self.modules.values():
            m.clear(slot)  # a routing set before the unload (or a graph replaying it) may still name the slot

    def _free_slot(self) -> Tuple[int, Optional[str]]:
        routed = {int(s) for r in (self._routing, *self._outer_routings) if r is not None for s in r.unique()}
        used = set(self._slot_of.values())
        for s in range(self.num_slots):
            if s not in used and s not in routed:
                return s, None
        for name, s in self._slot_of.items():  # oldest first
            if not self._pins.get(name) and s not in routed:
                return s, name
        raise PoolFullError(f"all {self.num_slots} slots hold pinned adapters ({sorted(self._pins)}) or are routed "
                            f"(slots {sorted(routed - {-1})} of the active routing or an enclosing batch's); "
                            "clear_batch() or route other adapters first")

    # ---- loading ----
    def load(self, name: str, path: str) -> int:
        """Load a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) into a slot.

        Everything is read and validated before the pool changes, so a failed load leaves it as it was.
        Returns the slot."""
        if name in self._slot_of:
            raise ValueError(f"adapter {name!r} is already loaded; unload it first")
        config = read_config(path)
        weights = read_weights(path)
        if self._rename_keys is not None:  # an adapter saved under transformers 4's module paths, as PEFT loads it
            weights = self._rename_keys(path, config, weights)
        staged = stage(config, weights, self.modules, self.max_rank, path)
        slot, evict = self._free_slot()
        if evict is not None:
            del self._slot_of[evict]
        for mod in self.modules.values():
            entry = staged.get(mod.name)
            if entry is None:  # not a target of this adapter: rank 0 skips it (and zeros, for a pool of one rank)
                mod.clear(slot)
                continue
            mod.lora_a[slot].copy_(entry.lora_a)  # A is staged at full [S*R, K], zeros included
            mod.set_b(slot, entry.lora_b)
            mod.ranks[slot] = entry.rank
            mod.scales[slot] = entry.scale
        self._slot_of[name] = slot
        if self._one_rank and any(staged.get(m) is None or staged[m].rank < self.max_rank for m in self.modules):
            self._one_rank = False
            for mod in self.modules.values():
                mod.ranks_arg = mod.ranks
        return slot

    # ---- per-step batch ----
    def set_batch(self, adapters: Sequence[Optional[str]], tokens_per_row: Optional[int] = None,
                  lengths: Optional[Sequence[int]] = None) -> LoRABatch:
        """Route the next forwards' tokens: row i runs adapters[i] (None: the base model only).

        Every patched layer sees its input flattened to [T, K] tokens, rows one after another. Row i covers
        `lengths[i]` consecutive tokens (a packed ragged batch, T = sum(lengths)), or `tokens_per_row` of them
        (a [B, L] batch, T = B*L; the default is 1, a decode step). A padded [B, L] batch of ragged prompts (HF's
        forward with an attention_mask) has L tokens in every row, padding included: pass tokens_per_row=L. The
        padding positions then run their row's adapter, and the attention mask discards them as it discards any
        padding. A layer whose input does not have T tokens raises ValueError."""
        if tokens_per_row is not None and lengths is not None:
            raise ValueError("pass tokens_per_row or lengths, not both")
        if tokens_per_row is not None and not (_is_count(tokens_per_row) and tokens_per_row >= 0):
            raise ValueError(f"tokens_per_row must be an integer >= 0, got {tokens_per_row!r}")
        if lengths is None:
            lengths = [1 if tokens_per_row is None else tokens_per_row] * len(adapters)
        lengths = list(lengths)
        if len(lengths) != len(adapters) or not all(_is_count(n) and n >= 0 for n in lengths):
            raise ValueError(f"lengths must be {len(adapters)} integers >= 0 (one per row of adapters), "
                             f"got {lengths}")
        lengths = [int(n) for n in lengths]
        adapters = list(adapters)
        # once a step, in eager code (a compiled model's guards see a Parameter's identity, not its data): ~0.15 us
        # a module
        moved = next((m for m in self.modules.values() if m.base_data_moved()), None)
        if moved is not None:
            raise moved.replaced_error()
        slots = torch.tensor([self.slot(a) for a in adapters], dtype=torch.int32)
        self._route(slots.repeat_interleave(torch.tensor(lengths, dtype=torch.int64)))
        return self._batch

    def _route(self, token_slots: Optional[torch.Tensor]) -> None:
        """Make token_slots (host int32) the active routing, or end it (None)."""
        if token_slots is None:
            self._batch.active = False
        else:
            self._batch.set(token_slots)
        self._routing = token_slots

    def clear_batch(self) -> None:
        self._route(None)

    @contextlib.contextmanager
    def batch(self, adapters: Sequence[Optional[str]], tokens_per_row: Optional[int] = None,
              lengths: Optional[Sequence[int]] = None):
        """set_batch for the duration of a `with` block, with the batch's adapters pinned. On exit the routing
        active before it (a set_batch, an enclosing batch) is set again, else the batch is cleared: a nested
        batch or greedy_generate leaves the outer block's routing as it found it."""
        names = [a for a in adapters if a is not None]
        self._outer_routings.append(self._routing)  # its slots stay out of loads' reach until it is set again
        try:
            with self.pinned(*names):
                self.set_batch(adapters, tokens_per_row, lengths)
                yield self.current
        finally:
            # by slot, as it was routed (an adapter of it unloaded inside the block adds nothing, as it would have)
            self._route(self._outer_routings.pop())
