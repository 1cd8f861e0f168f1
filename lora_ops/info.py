"""`python -m lora_ops.info`: version, torch, which backend serves which op on which device, and why any
backend is absent."""
import os
import platform

import torch

import lora_ops
from lora_ops import backends, op_table, routes
from lora_ops.bench.report import short_sha


def report() -> str:
    info = backends.build_info()
    lines = [f"lora_ops {lora_ops.__version__}  ({lora_ops.LIBRARY_PATH})",
             f"torch {torch.__version__} (CUDA {torch.version.cuda}), python {platform.python_version()}",
             f"built against torch {info.get('torch', '?')}"]
    cuda_build = info.get("backends", {}).get("cuda", {})
    if cuda_build.get("built"):
        lines.append(f"CUDA kernels: compiled for TORCH_CUDA_ARCH_LIST={cuda_build.get('arch_list')}")
    lines.append("")
    lines.append(f"{'device':<8} {'op':<16} backend")
    for op in backends.OPS:
        lines.append(f"{'cpu':<8} {op:<16} cpu (csrc/cpu)")
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA device visible"
    for op in backends.OPS:
        served = backends.cuda_served_by.get(op)
        where = {"cuda": "cuda (csrc/cuda)", "triton": "triton (lora_ops/triton)"}.get(served, "none")
        lines.append(f"{'cuda':<8} {op:<16} {where}")
    sm90 = cuda_build.get("grouped_gemm_sm90", {})
    cutlass = "built" if sm90.get("built") else f"not built: {sm90.get('reason') or cuda_build.get('reason')}"
    lines.append(f"{'any':<8} {'fold_linear':<16} at::linear; on CUDA 9.0 up to 64 tokens the CUTLASS GEMM that lets "
                 f"the expand start early and skips unused slots: {cutlass}")
    lines.append(f"{'any':<8} {'lora_linear':<16} ATen ops; on CUDA 9.0 up to 128 tokens a shrink and the CUTLASS "
                 f"K-extended GEMM [x | h]·[W | B]ᵀ launched early: {cutlass}")
    lines.append(f"CUDA device: {gpu}")
    lines += _op_table_lines()
    path = routes.default_path()
    table = routes.load(path)
    lines.append(f"serving routes on CUDA ({_packaged(path)}; measured on {table['gpu']}, {table['date']}, commit "
                 f"{short_sha(table['git_sha'])}; a pool takes the table of the shape nearest its modules):")
    lines += [f"  {line}" for line in routes.describe(table)]
    if info.get("backends", {}).get("ascend", {}).get("built"):
        for op in backends.OPS:
            served = "ascend (csrc/ascend)" if backends.npu_served_by(op) else "none: no AscendC kernel for it yet"
            lines.append(f"{'npu':<8} {op:<16} {served}")
        lines.append("Ascend kernels: fp16/bf16/fp32; tested on a CPU model of the AscendC API, not yet on Ascend "
                     "hardware")
    if backends.forced_backend():
        lines.append(f"LORA_OPS_BACKEND={backends.forced_backend()}")
    if backends.unavailable:
        lines.append("")
        lines.append("absent backends:")
        for name, why in sorted(backends.unavailable.items()):
            lines.append(f"  {name}: {why}")
    return "\n".join(lines)


def _packaged(path: str) -> str:
    """A file of the package as the README names it (lora_ops/...)."""
    return os.path.relpath(path, os.path.dirname(os.path.dirname(os.path.abspath(lora_ops.__file__))))


def _op_table_lines() -> list:
    """Which regimes the C++ CUDA kernels hand to Triton (lora_ops/op_table.py), or why none."""
    setting = os.environ.get("LORA_OPS_OP_TABLE", "").strip()
    if not op_table.cuda_kernels_take_tables():
        return ["op table: unused (no C++ CUDA kernels)"]
    table = op_table.installed
    if table is None:
        why = ("LORA_OPS_OP_TABLE=off" if setting.lower() == "off"
               else f"triton {backends.unavailable.get('triton', 'absent')}")
        return [f"op table: none ({why}): the C++ CUDA kernels serve every regime"]
    where = setting or _packaged(op_table.path_for(table["gpu"]))  # a packaged table is named by its GPU
    lines = [f"op table ({where}; measured on {table['gpu']}, {table['date']}, "
             f"commit {short_sha(table['git_sha'])}; fp16/bf16 weights; a forced LORA_OPS_CUDA_*_KERNEL bypasses it):"]
    lines += [f"  {op:<14} {op_table.describe(table, op)}" for op in op_table.OPS]
    return lines


if __name__ == "__main__":
    print(report())
