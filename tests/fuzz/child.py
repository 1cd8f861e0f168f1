"""The fuzzer's child process: runs a batch of case seeds on every requested backend and reports each case on
stdout as one line `FUZZ {json}` (other output, e.g. compute-sanitizer's, passes through and is kept by the
parent for its crash reports). A `start` line precedes each call, so that the parent knows which seed and
backend were running when the process died or stopped answering.

Job (one JSON line on stdin): {"seeds": [...], "device": "cpu"|"cuda", "backends": [...], "large": bool,
"debug": bool, "deadline": unix time after which no new case starts}. LORA_OPS_DEBUG and TRITON_INTERPRET come
from the environment the parent sets.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch

import lora_ops
from lora_ops import backends as lora_backends

from . import cases

PREFIX = "FUZZ "
# The CUDA kernel choices a backend forces (csrc/cuda/registration.cpp): op -> (environment variable, value).
# "cuda" is the automatic choice for every op; a forced backend skips the ops it forces nothing for
# (build_segments has one CUDA kernel): the "cuda" call already runs that kernel on the same case. "cuda:split"
# forces grouped_gemm's split-K shrink where it serves. lora_expand's kernels ride along: the positions kernel with
# "cuda:mma", the segment-tile kernel with "cuda:split", the runs kernel (the rows form; elsewhere the automatic
# choice) with "cuda:skinny"; "cuda" runs the tensor-core kernels where they serve (the segments kernel on the
# segment form, the rows or runs kernel on the rows form). fold_linear: "cuda" takes the CUTLASS GEMM up to 32
# tokens where it serves, "cuda:mma" at any token count.
FORCED_CUDA_KERNELS = {
    "cuda:mma": {"sgmv": ("LORA_OPS_CUDA_SGMV_KERNEL", "mma"), "grouped_gemm": ("LORA_OPS_CUDA_GG_KERNEL", "mma"),
                 "lora_expand": ("LORA_OPS_CUDA_EXPAND_KERNEL", "positions"),
                 "fold_linear": ("LORA_OPS_CUDA_LINEAR_KERNEL", "cutlass")},
    "cuda:split": {"sgmv": ("LORA_OPS_CUDA_SGMV_KERNEL", "split"), "grouped_gemm": ("LORA_OPS_CUDA_GG_KERNEL", "split"),
                   "lora_expand": ("LORA_OPS_CUDA_EXPAND_KERNEL", "tiles")},
    "cuda:skinny": {"grouped_gemm": ("LORA_OPS_CUDA_GG_KERNEL", "skinny"),
                    "lora_expand": ("LORA_OPS_CUDA_EXPAND_KERNEL", "runs")},
}
_KERNEL_VARIABLES = {var for forced in FORCED_CUDA_KERNELS.values() for var, _ in forced.values()}


def available_backends(device: str):
    """Every backend this process can run for tensors on `device` ("cpu" or "cuda")."""
    names = ["cpu"]
    if device == "cuda" and torch.cuda.is_available():
        names.append("cuda")
        names += [name for name, forced in FORCED_CUDA_KERNELS.items()
                  if any(lora_backends.cuda_served_by.get(op) == "cuda" for op in forced)]
    # Triton runs on CUDA tensors where a GPU is visible, and under the interpreter only where none is (as
    # tests/conftest.py does): the H200 image's Triton 3.6 interpreter fails under its numpy 2.5 ("only
    # 0-dimensional arrays can be converted to Python scalars"), which says nothing about the kernels.
    if "triton" not in lora_backends.unavailable and (device == "cuda") == torch.cuda.is_available():
        names.append("triton")
    return names


def backend_device(name: str, device: str) -> str:
    return device if name == "triton" else name.split(":")[0]


def _call(name: str, case: cases.Case):
    if name == "triton":
        import lora_ops.triton as module
    else:
        module = lora_ops.ops
    for var in _KERNEL_VARIABLES:
        os.environ.pop(var, None)
    if name in FORCED_CUDA_KERNELS:
        variable, value = FORCED_CUDA_KERNELS[name][case.op]
        os.environ[variable] = value
    out = getattr(module, case.op)(**case.kwargs)
    if case.device == "cuda":
        torch.cuda.synchronize()  # an asynchronous kernel fault belongs to this call
    return out


def run_case(seed: int, device: str, backends, large: bool, debug: bool) -> dict:
    results = {}
    for name in backends:
        emit({"start": seed, "backend": name})
        dev = backend_device(name, device)
        case = cases.make_case(seed, dev, large)
        interpreted = name == "triton" and os.environ.get("TRITON_INTERPRET") == "1"
        if interpreted and not (case.fp32_only or case.error_names):
            results[name] = ["SKIP", "the Triton interpreter runs float32 only", case.op]
            continue
        if name == "triton" and case.op == "fold_linear":
            results[name] = ["SKIP", "fold_linear has no Triton kernel (F.linear)", case.op]
            continue
        if name in FORCED_CUDA_KERNELS and case.op not in FORCED_CUDA_KERNELS[name]:
            results[name] = ["SKIP", f"{name} forces no {case.op} kernel", case.op]
            continue
        outcome, detail = cases.judge(case, lambda: _call(name, case), debug)
        results[name] = [outcome, detail, case.op] + ([case.describe()] if outcome == "FAIL" else [])
    return results


def emit(record: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(record) + "\n")
    sys.stdout.flush()


def serve() -> None:
    job = json.loads(sys.stdin.readline())
    for seed in job["seeds"]:
        if time.time() > job["deadline"]:
            break
        results = run_case(seed, job["device"], job["backends"], job["large"], job["debug"])
        emit({"done": seed, "results": results})
        if any("CUDA error" in r[1] for r in results.values()):
            sys.exit(3)  # the CUDA context is unusable after a device fault: the parent starts a fresh child
    emit({"finished": True})
