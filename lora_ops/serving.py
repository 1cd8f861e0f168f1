"""Multi-LoRA serving on a HuggingFace model: an adapter pool that loads PEFT LoRA adapters unchanged, a
multi-LoRA linear layer (base output + one sgmv), model patching, and a per-step batch context.

    pool = AdapterPool(model, num_slots=8, max_rank=64)   # preallocated stacked weights per target module
    patch_model(model, pool)                              # wraps the target nn.Linear modules in place
    pool.load("sql", "/adapters/sql")                     # adapter_config.json + adapter_model.safetensors
    with pool.batch(["sql", None, "chat"], tokens_per_row=input_ids.shape[1]):
        logits = model(input_ids).logits                  # each row runs with its own adapter (None: base)

Only torch is needed for the pool arithmetic; reading adapters uses safetensors (the [hf] extra).
"""
from __future__ import annotations

import collections
import contextlib
import json
import math
import os
import re
from typing import Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch import nn

from . import ops

# Per-module LoRA names of common decoder models, and fused base modules whose slices they map onto.
LINEAR_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                  "gate_up_proj")
FUSED_SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class AdapterError(Exception):
    """Base class of every adapter-loading error; a failed load leaves the pool unchanged."""


class AdapterFormatError(AdapterError):
    """Missing or malformed adapter_config.json / adapter_model.safetensors."""


class UnsupportedAdapterError(AdapterError):
    """A PEFT feature the pool does not implement (DoRA, non-LoRA types, LoRA bias, modules_to_save...)."""


class AdapterShapeError(AdapterError):
    """Target modules the model lacks, shapes that do not match the base layer, rank above the pool's max."""


class PoolFullError(AdapterError):
    """Every slot holds a pinned adapter."""


class _ModuleSlots:
    """Stacked LoRA weights of one target module in the op layout: lora_a [L, S*R, K], lora_b [L, N, R]."""

    def __init__(self, name: str, base: nn.Linear, slice_names: Tuple[str, ...], slice_offsets: List[int],
                 num_slots: int, max_rank: int):
        self.name, self.slice_names, self.slice_offsets = name, slice_names, slice_offsets
        self.in_features, self.out_features = base.in_features, base.out_features
        kw = dict(dtype=base.weight.dtype, device=base.weight.device)
        S = len(slice_names)
        self.lora_a = torch.zeros(num_slots, S * max_rank, base.in_features, **kw)
        self.lora_b = torch.zeros(num_slots, base.out_features, max_rank, **kw)
        self.ranks = torch.zeros(num_slots, dtype=torch.int32, device=base.weight.device)
        self.scales = torch.ones(num_slots, dtype=torch.float32, device=base.weight.device)
        self.offsets_arg = slice_offsets if S > 1 else None


class LoRABatch:
    """One step's routing, shared by every layer: each token's slot and the segments built from it once.

    A pool keeps ONE of these and swaps its tensors every step: torch.compile guards on the identity of the
    objects a graph reads, so a new object per step would recompile the model."""

    def __init__(self):
        self.active = False
        self.token_slots = self.token_indices = self.seg_indptr = self.seg_lora = None

    def set(self, token_slots: torch.Tensor, num_slots: int) -> None:
        self.token_slots = token_slots
        self.token_indices, self.seg_indptr, self.seg_lora = ops.build_segments(token_slots, num_slots)
        # Their sizes depend on the pool only: static, so that torch.compile's duck sizing never ties them to a
        # batch dimension that happens to be equal (which recompiles when the batch changes).
        torch._dynamo.mark_static(self.seg_indptr)
        torch._dynamo.mark_static(self.seg_lora)
        self.active = True


class AdapterPool:
    """A fixed number of adapter slots for a model's LoRA target modules, on the model's device and dtype.

    Slots are reused least-recently-used; `pin`/`unpin` (or `pinned(...)`) keep an adapter of an in-flight
    batch from being evicted."""

    def __init__(self, model: nn.Module, num_slots: int = 8, max_rank: int = 64,
                 target_modules: Optional[Iterable[str]] = None):
        if num_slots < 1 or max_rank < 1:
            raise ValueError(f"num_slots and max_rank must be >= 1, got {num_slots} and {max_rank}")
        self.num_slots, self.max_rank = num_slots, max_rank
        targets = set(target_modules or LINEAR_TARGETS)
        self.modules: Dict[str, _ModuleSlots] = {}
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in targets and isinstance(module, (nn.Linear, MultiLoRALinear)):
                base = module.base if isinstance(module, MultiLoRALinear) else module
                slice_names, offsets = self._slices(model, leaf, base)
                self.modules[name] = _ModuleSlots(name, base, slice_names, offsets, num_slots, max_rank)
        if not self.modules:
            raise AdapterShapeError(f"the model has no nn.Linear named any of {sorted(targets)}")
        self._slot_of: "collections.OrderedDict[str, int]" = collections.OrderedDict()  # LRU order, oldest first
        self._pins: Dict[str, int] = {}
        self._batch = LoRABatch()

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
        if leaf == "qkv_proj" and cfg is not None:
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
        slot = self._slot_of.pop(name)
        for m in self.modules.values():
            m.ranks[slot] = 0

    def _free_slot(self) -> Tuple[int, Optional[str]]:
        used = set(self._slot_of.values())
        for s in range(self.num_slots):
            if s not in used:
                return s, None
        for name, s in self._slot_of.items():  # oldest first
            if not self._pins.get(name):
                return s, name
        raise PoolFullError(f"all {self.num_slots} slots hold pinned adapters ({sorted(self._pins)})")

    # ---- loading ----
    def load(self, name: str, path: str) -> int:
        """Load a PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) into a slot.

        Everything is read and validated before the pool changes, so a failed load leaves it as it was.
        Returns the slot."""
        if name in self._slot_of:
            raise ValueError(f"adapter {name!r} is already loaded; unload it first")
        config = _read_config(path)
        weights = _read_weights(path)
        staged = self._stage(config, weights, path)
        slot, evict = self._free_slot()
        if evict is not None:
            del self._slot_of[evict]
        for mod in self.modules.values():
            entry = staged.get(mod.name)
            if entry is None:  # not a target of this adapter: rank 0 skips it
                mod.ranks[slot] = 0
                continue
            a, b, rank, scale = entry
            mod.lora_a[slot].copy_(a)  # A is staged at full [S*R, K], zeros included
            mod.lora_b[slot].zero_()
            mod.lora_b[slot, :, :rank].copy_(b)
            mod.ranks[slot] = rank
            mod.scales[slot] = scale
        self._slot_of[name] = slot
        return slot

    def _stage(self, config: dict, weights: Dict[str, torch.Tensor], path: str):
        """Map PEFT tensors onto pool modules; returns {module: (A [S*R, K], B [N, rank], rank, scale)}."""
        r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
        rslora = bool(config.get("use_rslora", False))
        rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
        targets = config.get("target_modules")
        if isinstance(targets, (list, tuple)):
            known = {n.rsplit(".", 1)[-1] for n in self.modules}
            known |= {s for m in self.modules.values() for s in m.slice_names}
            missing = sorted(set(targets) - known)
            if missing:
                raise AdapterShapeError(f"{path}: target_modules {missing} are not LoRA targets of this model/pool "
                                        f"(it has {sorted(known)})")
        pairs: Dict[str, Dict[str, torch.Tensor]] = collections.defaultdict(dict)
        for key, t in weights.items():
            m = re.match(r"^(?:base_model\.model\.)?(.*)\.lora_([AB])(?:\.[^.]+)?\.weight$", key)
            if not m:
                if "lora_magnitude_vector" in key:
                    raise UnsupportedAdapterError(f"{path}: DoRA weights ({key}) are not supported")
                raise UnsupportedAdapterError(f"{path}: tensor {key!r} is not a LoRA A/B weight "
                                              "(modules_to_save, bias or embedding LoRA are not supported)")
            pairs[m.group(1)][m.group(2)] = t
        staged: Dict[str, list] = {}
        for module_path, ab in pairs.items():
            if set(ab) != {"A", "B"}:
                raise AdapterFormatError(f"{path}: module {module_path} has lora_{'A' if 'A' in ab else 'B'} only")
            mod, slice_idx = self._resolve(module_path, path)
            rank_m = int(_pattern(rank_pattern, module_path, r))
            alpha_m = float(_pattern(alpha_pattern, module_path, alpha))
            a, b = ab["A"], ab["B"]
            # slice_idx None: the adapter targets the (fused) module itself, one A for all its slices
            lo, hi = (0, mod.out_features) if slice_idx is None else \
                (mod.slice_offsets[slice_idx], mod.slice_offsets[slice_idx + 1])
            if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank_m or b.shape[1] != rank_m:
                raise AdapterShapeError(f"{path}: {module_path} has lora_A {list(a.shape)} and lora_B "
                                        f"{list(b.shape)}, expected rank {rank_m} from the config")
            if a.shape[1] != mod.in_features or b.shape[0] != hi - lo:
                raise AdapterShapeError(f"{path}: {module_path} maps {a.shape[1]} -> {b.shape[0]} features but "
                                        f"the base layer's {'slice' if len(mod.slice_names) > 1 else 'layer'} is "
                                        f"{mod.in_features} -> {hi - lo}")
            if rank_m > self.max_rank:
                raise AdapterShapeError(f"{path}: {module_path} has rank {rank_m} > the pool's max_rank "
                                        f"{self.max_rank}")
            scale = alpha_m / (math.sqrt(rank_m) if rslora else rank_m)
            per_slice = staged.setdefault(mod.name, [mod, {}])[1]
            for s in (range(len(mod.slice_names)) if slice_idx is None else [slice_idx]):
                s_lo, s_hi = mod.slice_offsets[s] - lo, mod.slice_offsets[s + 1] - lo
                per_slice[s] = (a, b if slice_idx is not None else b[s_lo:s_hi], rank_m, scale)
        out = {}
        for name, (mod, slices) in staged.items():
            S, R = len(mod.slice_names), self.max_rank
            rank = max(v[2] for v in slices.values())
            scale = next(iter(slices.values()))[3]
            A = torch.zeros(S * R, mod.in_features, dtype=mod.lora_a.dtype)
            B = torch.zeros(mod.out_features, rank, dtype=mod.lora_b.dtype)
            for s, (a, b, rank_s, scale_s) in slices.items():
                lo, hi = mod.slice_offsets[s], mod.slice_offsets[s + 1]
                A[s * R: s * R + rank_s] = a.to(A.dtype)
                # one scale per slot and module: a slice with another alpha carries the ratio in its B
                B[lo:hi, :rank_s] = (b.float() * (scale_s / scale)).to(B.dtype)
            out[name] = (A, B, rank, scale)
        return out

    def _resolve(self, module_path: str, path: str) -> Tuple[_ModuleSlots, Optional[int]]:
        """The pool module a PEFT module maps to, and its slice (None: the whole module)."""
        if module_path in self.modules:
            return self.modules[module_path], None
        parent, _, leaf = module_path.rpartition(".")
        for fused, slice_names in FUSED_SLICES.items():
            fused_path = f"{parent}.{fused}" if parent else fused
            if leaf in slice_names and fused_path in self.modules:
                return self.modules[fused_path], slice_names.index(leaf)
        raise AdapterShapeError(f"{path}: target module {module_path} is not a LoRA target of this model/pool "
                                f"(pool modules end with {sorted({n.rsplit('.', 1)[-1] for n in self.modules})})")

    # ---- per-step batch ----
    def set_batch(self, adapters: Sequence[Optional[str]], tokens_per_row: int = 1) -> LoRABatch:
        """Route row i (and its tokens_per_row tokens) to adapters[i] (None: base model) for the next forwards."""
        slots = torch.tensor([self.slot(a) for a in adapters], dtype=torch.int32)
        device = next(iter(self.modules.values())).ranks.device
        self._batch.set(slots.repeat_interleave(tokens_per_row).to(device, non_blocking=True), self.num_slots)
        return self._batch

    def clear_batch(self) -> None:
        self._batch.active = False

    @contextlib.contextmanager
    def batch(self, adapters: Sequence[Optional[str]], tokens_per_row: int = 1):
        names = [a for a in adapters if a is not None]
        with self.pinned(*names):
            self.set_batch(adapters, tokens_per_row)
            try:
                yield self.current
            finally:
                self.clear_batch()


def _pattern(patterns: dict, module_path: str, default):
    """PEFT rank_pattern / alpha_pattern lookup: the first key that matches the end of the module path."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module_path):
            return value
    return default


def _read_config(path: str) -> dict:
    file = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(file):
        raise AdapterFormatError(f"{path}: adapter_config.json not found")
    try:
        with open(file) as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise AdapterFormatError(f"{file}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict) or "r" not in config:
        raise AdapterFormatError(f"{file}: no LoRA rank 'r'")
    peft_type = str(config.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise UnsupportedAdapterError(f"{file}: peft_type {peft_type} is not supported (LORA only)")
    if config.get("use_dora"):
        raise UnsupportedAdapterError(f"{file}: DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise UnsupportedAdapterError(f"{file}: LoRA bias={config['bias']!r} is not supported")
    if config.get("fan_in_fan_out"):
        raise UnsupportedAdapterError(f"{file}: fan_in_fan_out (Conv1D layers) is not supported")
    if config.get("modules_to_save"):
        raise UnsupportedAdapterError(f"{file}: modules_to_save {config['modules_to_save']} is not supported")
    return config


def _read_weights(path: str) -> Dict[str, torch.Tensor]:
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        raise AdapterFormatError(f"{path}: adapter_model.safetensors not found")
    try:
        from safetensors.torch import load_file
    except ImportError as exc:
        raise ImportError("reading PEFT adapters needs safetensors: pip install 'lora_ops[hf]'") from exc
    try:
        return load_file(file)
    except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
        raise AdapterFormatError(f"{file}: unreadable safetensors file ({exc})") from exc


class MultiLoRALinear(nn.Module):
    """A base nn.Linear plus the pool's per-row LoRA delta: y = base(x) + one sgmv over the step's segments.

    With no batch active (pool.current is None) it is exactly the base layer."""

    def __init__(self, base: nn.Linear, slots: _ModuleSlots, pool: AdapterPool):
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
        m = self._slots
        ops.sgmv(y.view(-1, y.shape[-1]), x.reshape(-1, x.shape[-1]), m.lora_a, m.lora_b, batch.seg_indptr,
                 batch.seg_lora, batch.token_indices, m.ranks, m.scales, m.offsets_arg)
        return y


def patch_model(model: nn.Module, pool: AdapterPool) -> nn.Module:
    """Wrap every pool target module of `model` in a MultiLoRALinear, in place; returns the model."""
    for name, slots in pool.modules.items():
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        module = getattr(parent, leaf)
        if not isinstance(module, MultiLoRALinear):
            setattr(parent, leaf, MultiLoRALinear(module, slots, pool))
    return model


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
