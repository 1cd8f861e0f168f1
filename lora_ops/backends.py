"""Which backend serves which op on which device, as data (xformers style), and the Triton registration.

Dispatch (docs/design.md §3): CPU -> csrc/cpu; CUDA -> csrc/cuda when compiled in (which hands the regimes that
its GPU's op table, lora_ops/op_tables/, gives to Triton over to it), else Triton; LORA_OPS_BACKEND=triton forces
Triton on CUDA; PrivateUse1 (torch_npu's "npu") -> csrc/ascend when built with CANN. Every refusal carries a
reason, printed by `python -m lora_ops.info`.
"""
from __future__ import annotations

import functools
import json
import os
import warnings
from typing import Dict, Optional

import torch

OPS = ("sgmv", "lora_expand", "grouped_gemm", "build_segments")
# Ops whose Triton kernel is also registered as lora_ops::_triton_<op>, so that a route (routes.py) or the C++ CUDA
# kernels (by their op table, op_table.py) can choose it explicitly.
TRITON_BY_NAME = ("sgmv", "lora_expand", "grouped_gemm")

# Filled by register_triton_where_needed(): which ops have a C++ CUDA kernel (read before Triton registers any),
# op -> "cuda" | "triton" | None, and why a backend is absent.
cuda_compiled: Dict[str, bool] = {}
cuda_served_by: Dict[str, Optional[str]] = {}
unavailable: Dict[str, str] = {}
# The error of a Triton backend that is installed but failed to import or register (None when it loaded, or when
# triton is simply not installed). Importing lora_ops survives it (CPU and CUDA kernels still work); the tests
# re-raise it, so that a broken backend fails the suite instead of vanishing from it.
triton_error: Optional[BaseException] = None
_lib = None


def build_info() -> dict:
    path = os.path.join(os.path.dirname(__file__), "_build_info.json")
    try:
        with open(path) as f:
            return json.load(f)
    except OSError:
        return {"backends": {}}


def sm90_kernels_run() -> bool:
    """The sm_90a kernels (the CUTLASS GEMMs of fold_linear and lora_linear, the wgmma prefill sgmv) are built and
    the current CUDA device runs them (compute capability 9.0)."""
    cuda = build_info().get("backends", {}).get("cuda", {})
    return bool(cuda.get("grouped_gemm_sm90", {}).get("built")) and torch.cuda.get_device_capability() == (9, 0)


def _has_kernel(op: str, key: str) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"lora_ops::{op}", key)


def npu_served_by(op: str) -> Optional[str]:
    """"ascend" when csrc/ascend's kernel serves the op on NPUs (PrivateUse1, torch_npu's "npu"), else None."""
    return "ascend" if _has_kernel(op, "PrivateUse1") else None


def forced_backend() -> str:
    return os.environ.get("LORA_OPS_BACKEND", "").strip().lower()


def register_triton_where_needed() -> None:
    """Serve the CUDA key with Triton for every op without a C++ CUDA kernel (or all, when forced), then hand the
    op table to the C++ CUDA kernels (op_table.install_default)."""
    for name, entry in build_info().get("backends", {}).items():
        if not entry.get("built"):
            unavailable[name] = entry.get("reason", "not built")
    cuda_compiled.update({op: _has_kernel(op, "CUDA") for op in OPS})
    force = forced_backend() == "triton"
    try:
        _register_triton(force)
    except ModuleNotFoundError as exc:
        if exc.name != "triton":
            _triton_failed(exc)
        else:  # not installed: a supported setup (CPU-only serving); ops without a C++ CUDA kernel stay unserved
            unavailable["triton"] = "not installed (pip install triton)"
            _unserve_triton()
    except Exception as exc:  # installed but broken: keep lora_ops importable, but say so loudly
        _triton_failed(exc)
    from . import op_table
    op_table.install_default()


def _register_triton(force: bool) -> None:
    global _lib
    from . import triton as triton_backend
    kernels = {op: getattr(triton_backend, op) for op in OPS}  # all found before any is registered
    _lib = torch.library.Library("lora_ops", "IMPL")
    for op in OPS:
        if cuda_compiled[op] and not force:
            cuda_served_by[op] = "cuda"
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel" when forced
            _lib.impl(op, kernels[op], "CUDA")
        cuda_served_by[op] = "triton"
    for op in TRITON_BY_NAME:  # reachable by name whatever serves the CUDA key
        _lib.impl(f"_triton_{op}", noting_the_op_table(op, kernels[op]), "CUDA")


def noting_the_op_table(op: str, kernel):
    """Triton's kernel of `op` as lora_ops::_triton_<op>, whose errors carry a note (Python 3.11+) on how a call of
    the public op gets there: the C++ CUDA kernels redispatch the op table's Triton regimes to it, so without the
    note an error would come from Triton with no word of the table. The try costs nothing until something raises;
    the wrapper adds one Python call (~0.1 µs) to a routed eager call, which is in Python already (Triton's
    launcher), and nothing to graph replay. (A catch in C++ could not annotate it: the error arrives there as a
    Python exception, and _C has no Python symbols.)"""
    note = (f"lora_ops: raised in lora_ops::_triton_{op} (Triton's kernel). A CUDA call of lora_ops.{op} is routed "
            "there when the op table (lora_ops/op_tables/) gives its regime to Triton; LORA_OPS_OP_TABLE=off "
            "keeps every call on the C++ kernels.")

    @functools.wraps(kernel)
    def twin(*args, **kwargs):
        try:
            return kernel(*args, **kwargs)
        except Exception as exc:
            if hasattr(exc, "add_note"):
                exc.add_note(note)
            raise
    return twin


def _triton_failed(exc: BaseException) -> None:
    global triton_error
    triton_error = exc
    unavailable["triton"] = f"installed but failed to load: {type(exc).__name__}: {exc}"
    _unserve_triton()
    warnings.warn(f"lora_ops: the Triton backend is {unavailable['triton']}", RuntimeWarning)


def _unserve_triton() -> None:
    for op in OPS:
        cuda_served_by[op] = "cuda" if cuda_compiled[op] else None
