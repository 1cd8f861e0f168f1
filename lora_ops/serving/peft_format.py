"""PEFT LoRA adapters on disk (adapter_config.json + adapter_model.safetensors): reading, config validation,
PEFT's module-selection and rank/alpha pattern rules, and staging the tensors in an AdapterPool's layout.
Nothing here changes a pool: the pool writes what `stage` returns only once everything has been validated."""
from __future__ import annotations

import collections
import dataclasses
import json
import math
import os
import re
from typing import Callable, Dict, Mapping, Optional, Tuple

import torch

# Fused base modules (Phi-3 style) and the per-module LoRA names whose adapters map onto their column slices.
FUSED_SLICES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
PEFT_DEFAULT_ALPHA = 8  # peft.LoraConfig's lora_alpha, which its loader takes when a config leaves it out


class AdapterError(Exception):
    """Base class of every adapter-loading error; a failed load leaves the pool unchanged."""


class AdapterFormatError(AdapterError):
    """Missing or malformed adapter_config.json / adapter_model.safetensors, or a file that contradicts its config."""


class UnsupportedAdapterError(AdapterError):
    """A PEFT feature that changes what the adapter computes and that the pool does not implement."""


class AdapterShapeError(AdapterError):
    """Target modules the model lacks, shapes that do not match the base layer, rank above the pool's max."""


class PoolFullError(AdapterError):
    """Every slot holds a pinned adapter."""


# Every LoraConfig field of peft 0.22 and what a load does with it (docs/design.md §8 shows this table):
#   honoured     the pool computes what PEFT computes; tests/test_serving_peft.py checks it against PEFT's forward
#   ignored      does not change what a loaded adapter computes at inference
#   unsupported  raises UnsupportedAdapterError when set (the note is the reason given)
# A field that is not in the table (a newer PEFT) raises when it is set, until someone adds it here.
LORA_CONFIG_FIELDS: Dict[str, Tuple[str, str]] = {
    "peft_type": ("honoured", "must be LORA"),
    "r": ("honoured", "the rank, unless rank_pattern gives the module another"),
    "lora_alpha": ("honoured", "scale = alpha / r, unless alpha_pattern gives the module another alpha"),
    "use_rslora": ("honoured", "scale = alpha / sqrt(r), with the module's own r"),
    "rank_pattern": ("honoured", "PEFT's rule: the first key k with re.match(rf'(.*\\.)?({k})$', module path)"),
    "alpha_pattern": ("honoured", "the same rule as rank_pattern"),
    "target_modules": ("honoured", "PEFT's selection rule; every tensor in the file must be on a selected "
                                   "module of this pool (a list entry that matches nothing is ignored, as PEFT "
                                   "ignores it)"),
    "exclude_modules": ("honoured", "part of PEFT's selection rule"),
    "layers_to_transform": ("honoured", "part of PEFT's selection rule"),
    "layers_pattern": ("honoured", "part of PEFT's selection rule"),
    "velora_config": ("honoured", "VeLoRA changes the backward only; its saved buffer is skipped"),
    "monteclora_config": ("honoured", "MonteCLoRA samples only in training; its saved sampler is skipped"),
    "init_lora_weights": ("ignored", "init only; but pissa*, corda*, astra, olora, lora_ga and loftq raise: their "
                                     "init rewrites the base weights"),
    "lora_dropout": ("ignored", "identity at inference"),
    "loftq_config": ("ignored", "init-time settings (the init itself is checked under init_lora_weights)"),
    "eva_config": ("ignored", "init-time settings; EVA's ranks are saved in rank_pattern"),
    "corda_config": ("ignored", "init-time settings (the init itself is checked under init_lora_weights)"),
    "astra_config": ("ignored", "init-time settings (the init itself is checked under init_lora_weights)"),
    "lora_ga_config": ("ignored", "init-time settings"),
    "megatron_config": ("ignored", "applies to Megatron parallel layers, which the pool does not wrap"),
    "megatron_core": ("ignored", "applies to Megatron parallel layers, which the pool does not wrap"),
    "ensure_weight_tying": ("ignored", "applies to tied embedding/lm_head targets, which raise anyway"),
    "qalora_group_size": ("ignored", "read only with use_qalora, which raises"),
    "runtime_config": ("ignored", "runtime options, not saved"),
    "task_type": ("ignored", "metadata"),
    "auto_mapping": ("ignored", "metadata"),
    "base_model_name_or_path": ("ignored", "metadata"),
    "revision": ("ignored", "metadata"),
    "peft_version": ("ignored", "metadata"),
    "inference_mode": ("ignored", "metadata"),
    "use_dora": ("unsupported", "DoRA adds a magnitude vector and a weight-norm division"),
    "bias": ("honoured", "'all'/'lora_only': PEFT saves the trained biases in the file, where they raise (they "
                         "would replace the base model's); a model without biases saves none: plain LoRA"),
    "lora_bias": ("unsupported", "lora_B has a bias vector"),
    "fan_in_fan_out": ("unsupported", "Conv1D (GPT-2 style) layers"),
    "modules_to_save": ("unsupported", "whole modules replaced by trained copies"),
    "trainable_token_indices": ("unsupported", "trained rows of the embedding matrix"),
    "target_parameters": ("unsupported", "LoRA on nn.Parameter (e.g. MoE experts), not on nn.Linear modules"),
    "alora_invocation_tokens": ("unsupported", "activated LoRA applies only from the invocation tokens on"),
    "use_qalora": ("unsupported", "QALoRA pools the input in groups before lora_A"),
    "layer_replication": ("unsupported", "PEFT rebuilds the model's layer stack"),
    "use_bdlora": ("unsupported", "block-diagonal LoRA factors"),
    "arrow_config": ("unsupported", "Arrow routes each token among several LoRA experts"),
    "kasa_config": ("unsupported", "KaSA puts singular values between A and B and truncates the base weight"),
}
_UNSET = (None, False, "", [], {})
# Inits that rewrite the base weights (a residual W - B0 A0, or a quantised W): PEFT redoes it when it loads a
# pissa, corda, olora or loftq adapter, and cannot for lora_ga (its B0 A0 come from gradients); astra (peft 0.22)
# needs the activations' eigenvectors that preprocess_astra computes from data.
_BASE_REWRITING_INITS = ("pissa", "corda", "astra", "olora", "lora_ga", "loftq")
# Extra tensors that inference-equivalent variants save next to lora_A/lora_B, by the config field that adds them.
_SKIPPED_TENSORS = {"velora_config": ".lora_velora_embed", "monteclora_config": ".lora_monteclora_sampler."}


def read_config(path: str) -> dict:
    """adapter_config.json, checked field by field against LORA_CONFIG_FIELDS."""
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
    for field, value in config.items():
        treatment, note = LORA_CONFIG_FIELDS.get(field, ("unknown", ""))
        is_set = value not in _UNSET
        if treatment == "unsupported" and is_set:
            raise UnsupportedAdapterError(f"{file}: {field}={value!r} is not supported ({note})")
        if treatment == "unknown" and is_set:
            raise UnsupportedAdapterError(f"{file}: unknown LoraConfig field {field}={value!r}: lora_ops knows the "
                                          "fields of peft 0.22 and cannot tell whether this one changes the output")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise UnsupportedAdapterError(
            f"{file}: init_lora_weights={init!r}: this init rewrites the base weights (PEFT redoes it when it loads "
            "a pissa, corda, olora or loftq adapter), and lora_ops serves adapters on an "
            "unchanged base. Convert it first with PEFT's save_pretrained(..., "
            "path_initial_model_for_weight_conversion=...)")
    if config.get("target_modules") is None:
        raise AdapterFormatError(f"{file}: no target_modules")
    return config


KeyRenaming = Callable[[str, dict, Dict[str, torch.Tensor]], Dict[str, torch.Tensor]]


def transformers_key_renaming(model) -> Optional[KeyRenaming]:
    """Where transformers 5 moved a model type's modules (its checkpoint conversion mapping: e.g. Gemma-3's or
    LLaVA's language_model.model.* is model.language_model.* now), PEFT renames the tensors of an adapter saved
    under the old paths when it loads one; this returns that renaming, PEFT's own function, as (adapter
    directory, its config as read_config returns it, tensors) -> tensors (paths already new stay as they are).
    None where the model is not a transformers model of such a type, or transformers lacks the mapping (the old
    paths then fail as modules the pool does not wrap). PEFT is imported at the first renaming, not here."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type is None:
        return None
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return None
    if get_checkpoint_conversion_mapping(model_type) is None:
        return None

    def rename(path: str, config: dict, weights: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        try:
            from peft import LoraConfig
            from peft.utils.transformers_weight_conversion import convert_peft_adapter_state_dict_for_transformers
        except ImportError as exc:
            raise AdapterFormatError(f"{path}: renaming the adapter for transformers' {model_type} module paths "
                                     f"needs PEFT's function for it ({exc})") from exc
        fields = {f.name for f in dataclasses.fields(LoraConfig)}
        peft_config = LoraConfig(**{k: v for k, v in config.items() if k in fields})
        try:
            return convert_peft_adapter_state_dict_for_transformers(model, peft_config, weights)
        except Exception as exc:  # e.g. an MoE merge PEFT cannot make of these tensors
            raise AdapterFormatError(f"{path}: PEFT's renaming of the adapter's tensors for transformers' "
                                     f"{model_type} module paths failed ({type(exc).__name__}: {exc})") from exc
    return rename


def read_weights(path: str) -> Dict[str, torch.Tensor]:
    """adapter_model.safetensors, else adapter_model.bin (PEFT's pickled format, read with weights_only: tensors
    and plain containers, no code), as PEFT's loader takes them."""
    file = os.path.join(path, "adapter_model.safetensors")
    if not os.path.isfile(file):
        pickled = os.path.join(path, "adapter_model.bin")
        if os.path.isfile(pickled):
            return _read_pickled(pickled)
        raise AdapterFormatError(f"{path}: adapter_model.safetensors not found (nor adapter_model.bin)")
    try:
        from safetensors.torch import load_file
    except ImportError as exc:
        raise ImportError("reading PEFT adapters needs safetensors: pip install 'lora_ops[hf]'") from exc
    try:
        return load_file(file)
    except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
        raise AdapterFormatError(f"{file}: unreadable safetensors file ({exc})") from exc


def _read_pickled(file: str) -> Dict[str, torch.Tensor]:
    try:
        weights = torch.load(file, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle, zip and weights_only refusals alike
        raise AdapterFormatError(f"{file}: unreadable adapter_model.bin ({exc})") from exc
    if not isinstance(weights, dict) or not all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                for k, v in weights.items()):
        raise AdapterFormatError(f"{file}: not a state dict of tensors")
    return weights


def pattern_value(patterns: Mapping[str, object], module_path: str, default):
    """rank_pattern / alpha_pattern lookup with PEFT's rule (peft.utils.other.get_pattern_key): the first key, in
    the file's order, that matches the module path as a regex after an optional `prefix.`. The key is wrapped in a
    group, so an alternation (`q_proj|v_proj`) stays inside it."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module_path):
            return value
    return default


def selects(config: dict, module_path: str) -> bool:
    """Whether the config puts LoRA on `module_path` (a path in the model PEFT wrapped, e.g.
    `model.layers.0.self_attn.q_proj`), by PEFT's rule (peft.tuners.tuners_utils.check_target_module_exists)."""
    exclude = config.get("exclude_modules")
    if exclude:
        if isinstance(exclude, str):
            if re.fullmatch(exclude, module_path):
                return False
        elif module_path in exclude or any(module_path.endswith(f".{e}") for e in exclude):
            return False
    targets = config["target_modules"]
    if isinstance(targets, str):  # a regex, or PEFT's all-linear shorthand (the output layer is never pooled)
        return targets.lower() == "all-linear" or re.fullmatch(targets, module_path) is not None
    if module_path in targets:  # an exact path: PEFT skips the layer filter for it
        return True
    if not any(module_path.endswith(f".{t}") for t in targets):
        return False
    layers = config.get("layers_to_transform")
    if layers is None or layers == []:
        return True
    patterns = config.get("layers_pattern")
    match = None
    if not patterns:  # the first numbered path component, e.g. layers.<i>
        match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", module_path)
    else:
        for p in [patterns] if isinstance(patterns, str) else patterns:
            match = re.match(rf"(?:^|.*?\.){p}\.(?P<idx>\d+)\.", module_path)
            if match:
                break
    if match is None:
        return False
    index = int(match.group("idx"))
    return index == layers if isinstance(layers, int) else index in layers


@dataclasses.dataclass
class StagedModule:
    """One pool module's share of an adapter, in the pool's slot layout."""
    lora_a: torch.Tensor  # [S*R, K]: slice s's A in rows s*R .. s*R+rank_s, zeros elsewhere
    lora_b: torch.Tensor  # [N, rank]: each slice's B in its rows, pre-multiplied by its scale / `scale`
    rank: int  # the largest slice rank
    scale: float


@dataclasses.dataclass
class _Slice:
    a: torch.Tensor  # [rank, K]
    b: torch.Tensor  # [slice width, rank]
    rank: int
    scale: float
    source: str  # the PEFT module path it came from


def stage(config: dict, weights: Dict[str, torch.Tensor], modules: Mapping, max_rank: int,
          path: str) -> Dict[str, StagedModule]:
    """Map an adapter's tensors onto pool modules (`modules`: name -> ModuleSlots); raises on anything the pool
    cannot serve exactly as PEFT would compute it."""
    pairs = _pairs(config, weights, path)
    r, alpha = int(config["r"]), float(config.get("lora_alpha", PEFT_DEFAULT_ALPHA))
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    slices: Dict[str, Dict[int, _Slice]] = collections.defaultdict(dict)
    for module_path, ab in pairs.items():
        if not selects(config, module_path):
            raise AdapterFormatError(
                f"{path}: the file has LoRA weights for {module_path}, which the config does not select "
                f"(target_modules={config['target_modules']!r}, exclude_modules={config.get('exclude_modules')!r}, "
                f"layers_to_transform={config.get('layers_to_transform')!r}); PEFT would not apply them")
        if set(ab) != {"A", "B"}:
            raise AdapterFormatError(f"{path}: module {module_path} has lora_{'A' if 'A' in ab else 'B'} only")
        mod, slice_idx = _resolve(modules, module_path, path)
        rank = int(pattern_value(rank_pattern, module_path, r))
        alpha_m = float(pattern_value(alpha_pattern, module_path, alpha))
        a, b = ab["A"], ab["B"]
        # slice_idx None: the adapter targets the (fused) module itself, one A for all its slices
        lo, hi = (0, mod.out_features) if slice_idx is None else \
            (mod.slice_offsets[slice_idx], mod.slice_offsets[slice_idx + 1])
        if rank < 1 or a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterShapeError(f"{path}: {module_path} has lora_A {list(a.shape)} and lora_B "
                                    f"{list(b.shape)}, expected rank {rank} from the config")
        if a.shape[1] != mod.in_features or b.shape[0] != hi - lo:
            raise AdapterShapeError(f"{path}: {module_path} maps {a.shape[1]} -> {b.shape[0]} features but "
                                    f"the base layer's {'slice' if len(mod.slice_names) > 1 else 'layer'} is "
                                    f"{mod.in_features} -> {hi - lo}")
        if rank > max_rank:
            raise AdapterShapeError(f"{path}: {module_path} has rank {rank} > the pool's max_rank {max_rank}")
        scale = alpha_m / (math.sqrt(rank) if config.get("use_rslora") else rank)
        for s in range(len(mod.slice_names)) if slice_idx is None else [slice_idx]:
            if s in slices[mod.name]:
                raise AdapterFormatError(f"{path}: {module_path} and {slices[mod.name][s].source} both give slice "
                                         f"{mod.slice_names[s]} of {mod.name}")
            s_lo, s_hi = mod.slice_offsets[s] - lo, mod.slice_offsets[s + 1] - lo
            slices[mod.name][s] = _Slice(a, b[s_lo:s_hi], rank, scale, module_path)
    return {name: _assemble(modules[name], per_slice, max_rank, path) for name, per_slice in slices.items()}


def _assemble(mod, per_slice: Dict[int, _Slice], max_rank: int, path: str) -> StagedModule:
    rank = max(s.rank for s in per_slice.values())
    # The slot's scale is the largest of its slices' (each other slice's ratio to it, <= 1, goes into its B: no
    # overflow in a 16-bit B); 0 where every slice's is (lora_alpha 0: PEFT adds nothing).
    scale = max((s.scale for s in per_slice.values()), key=abs)
    A = torch.zeros(len(mod.slice_names) * max_rank, mod.in_features, dtype=mod.lora_a.dtype)
    B = torch.zeros(mod.out_features, rank, dtype=mod.lora_b.dtype)
    for s, sl in per_slice.items():
        lo, hi = mod.slice_offsets[s], mod.slice_offsets[s + 1]
        A[s * max_rank: s * max_rank + sl.rank] = sl.a.to(A.dtype)
        # one scale per slot and module: a slice with another scale carries the ratio in its B
        B[lo:hi, :sl.rank] = (sl.b.float() * (sl.scale / scale if scale else 0.0)).to(B.dtype)
    # The kext route's GEMM multiplies every row's zeros by the B of every slot in a 64-column block it reads (and
    # its composition by every slot's): an inf or NaN of one adapter would reach other adapters' rows.
    if not (torch.isfinite(A).all() and torch.isfinite(B).all()):
        raise AdapterFormatError(f"{path}: {mod.name}: lora_A or lora_B holds inf or NaN in the pool's dtype "
                                 f"{A.dtype} (after the scale), which would reach other adapters' rows")
    return StagedModule(A, B, rank, scale)


def _pairs(config: dict, weights: Dict[str, torch.Tensor], path: str) -> Dict[str, Dict[str, torch.Tensor]]:
    """{PEFT module path: {"A": lora_A, "B": lora_B}} from the file's tensor names."""
    skipped = [part for field, part in _SKIPPED_TENSORS.items() if config.get(field)]
    pairs: Dict[str, Dict[str, torch.Tensor]] = collections.defaultdict(dict)
    for key, t in weights.items():
        if any(part in key for part in skipped):
            continue
        m = re.match(r"^(?:base_model\.model\.)?(.*)\.lora_([AB])(?:\.[^.]+)?\.weight$", key)
        if not m:
            if "lora_magnitude_vector" in key:
                raise UnsupportedAdapterError(f"{path}: DoRA weights ({key}) are not supported")
            if key.endswith(".bias"):
                raise UnsupportedAdapterError(f"{path}: {key!r} is a trained bias (bias={config.get('bias')!r}), "
                                              "which would replace the base model's: not supported")
            raise UnsupportedAdapterError(f"{path}: tensor {key!r} is not a LoRA A/B weight "
                                          "(modules_to_save, bias or embedding LoRA are not supported)")
        pairs[m.group(1)][m.group(2)] = t
    return pairs


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
