"""Which backend serves which op on which device, as data (xformers style), and the Triton registration.

Dispatch (docs/design.md §3): CPU -> csrc/cpu; CUDA -> csrc/cuda when compiled in, else Triton; LORA_OPS_BACKEND=triton
forces Triton on CUDA; PrivateUse1 (torch_npu's "npu") -> csrc/ascend when built with CANN. Every refusal carries a
reason, printed by `python -m lora_ops.info`.
"""
from __future__ import annotations

import json
import os
import warnings
from typing import Dict, Optional

import torch

OPS = ("sgmv", "lora_expand", "grouped_gemm", "build_segments")
# Ops whose Triton kernel is also registered as lora_ops::_triton_<op>, so a route can choose it explicitly.
TRITON_BY_NAME = ("sgmv", "lora_expand")

# Filled by register_triton_where_needed(): which ops have a C++ CUDA kernel (read before Triton registers any),
# op -> "cuda" | "triton" | None, and why a backend is absent.
cuda_compiled: Dict[str, bool] = {}
cuda_served_by: Dict[str, Optional[str]] = {}
unavailable: Dict[str, str] = {}
_lib = None


def build_info() -> dict:
    path = os.path.join(os.path.dirname(__file__), "_build_info.json")
    try:
        with open(path) as f:
            return json.load(f)
    except OSError:
        return {"backends": {}}


def _has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"lora_ops::{op}", key)


def npu_served_by(op: str) -> Optional[str]:
    """"ascend" when csrc/ascend's kernel serves the op on NPUs (PrivateUse1, torch_npu's "npu"), else None."""
    return "ascend" if _has_kernel(op, "PrivateUse1") else None


def forced_backend() -> str:
    return os.environ.get("LORA_OPS_BACKEND", "").strip().lower()


def register_triton_where_needed() -> None:
    """Serve the CUDA key with Triton for every op without a C++ CUDA kernel (or all, when forced)."""
    global _lib
    for name, entry in build_info().get("backends", {}).items():
        if not entry.get("built"):
            unavailable[name] = entry.get("reason", "not built")
    cuda_compiled.update({op: _has_kernel(op, "CUDA") for op in OPS})
    force = forced_backend() == "triton"
    try:
        from . import triton as triton_backend
    except Exception as exc:  # triton missing or broken: CUDA ops without a C++ kernel stay unserved
        unavailable["triton"] = f"import failed: {exc}"
        for op in OPS:
            cuda_served_by[op] = "cuda" if cuda_compiled[op] else None
        return
    _lib = torch.library.Library("lora_ops", "IMPL")
    for op in OPS:
        if cuda_compiled[op] and not force:
            cuda_served_by[op] = "cuda"
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel" when forced
            _lib.impl(op, getattr(triton_backend, op), "CUDA")
        cuda_served_by[op] = "triton"
    for op in TRITON_BY_NAME:  # reachable by name whatever serves the CUDA key (lora_ops/routes.py picks them)
        _lib.impl(f"_triton_{op}", getattr(triton_backend, op), "CUDA")
