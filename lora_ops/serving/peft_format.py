"""PEFT LoRA adapters on disk (adapter_config.json + adapter_model.safetensors): reading, config validation,
rank/alpha patterns, and staging the tensors in an AdapterPool's layout. Nothing here touches a pool."""
from __future__ import annotations

import collections
import json
import math
import os
import re
from typing import Dict, Mapping, Optional, Tuple

import torch

# Fused base modules (Phi-3 style) and the per-module LoRA names whose adapters map onto their column slices.
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


def read_config(path: str) -> dict:
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


def read_weights(path: str) -> Dict[str, torch.Tensor]:
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


def _pattern(patterns: dict, module_path: str, default):
    """PEFT rank_pattern / alpha_pattern lookup: the first key that matches the end of the module path."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?{key}$", module_path):
            return value
    return default


def stage(config: dict, weights: Dict[str, torch.Tensor], modules: Mapping, max_rank: int, path: str):
    """Map PEFT tensors onto pool modules; returns {module: (A [S*R, K], B [N, rank], rank, scale)}."""
    r, alpha = int(config["r"]), float(config.get("lora_alpha", config["r"]))
    rslora = bool(config.get("use_rslora", False))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    targets = config.get("target_modules")
    if isinstance(targets, (list, tuple)):
        known = {n.rsplit(".", 1)[-1] for n in modules}
        known |= {s for m in modules.values() for s in m.slice_names}
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
        mod, slice_idx = _resolve(modules, module_path, path)
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
        if rank_m > max_rank:
            raise AdapterShapeError(f"{path}: {module_path} has rank {rank_m} > the pool's max_rank {max_rank}")
        scale = alpha_m / (math.sqrt(rank_m) if rslora else rank_m)
        per_slice = staged.setdefault(mod.name, [mod, {}])[1]
        for s in (range(len(mod.slice_names)) if slice_idx is None else [slice_idx]):
            s_lo, s_hi = mod.slice_offsets[s] - lo, mod.slice_offsets[s + 1] - lo
            per_slice[s] = (a, b if slice_idx is not None else b[s_lo:s_hi], rank_m, scale)
    out = {}
    for name, (mod, slices) in staged.items():
        S, R = len(mod.slice_names), max_rank
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


def _resolve(modules: Mapping, module_path: str, path: str) -> Tuple[object, Optional[int]]:
    """The pool module a PEFT module maps to, and its slice (None: the whole module)."""
    if module_path in modules:
        return modules[module_path], None
    parent, _, leaf = module_path.rpartition(".")
    for fused, slice_names in FUSED_SLICES.items():
        fused_path = f"{parent}.{fused}" if parent else fused
        if leaf in slice_names and fused_path in modules:
            return modules[fused_path], slice_names.index(leaf)
    raise AdapterShapeError(f"{path}: target module {module_path} is not a LoRA target of this model/pool "
                            f"(pool modules end with {sorted({n.rsplit('.', 1)[-1] for n in modules})})")
