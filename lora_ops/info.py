"""`python -m lora_ops.info`: version, torch, which backend serves which op on which device, and why any
backend is absent."""
import platform

import torch

import lora_ops
from lora_ops import backends


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
    lines.append(f"CUDA device: {gpu}")
    if info.get("backends", {}).get("ascend", {}).get("built"):
        for op in backends.OPS:
            served = "ascend (csrc/ascend)" if backends.npu_served_by(op) else "none: no AscendC kernel for it yet"
            lines.append(f"{'npu':<8} {op:<16} {served}")
        lines.append("Ascend kernels: fp16/bf16 (grouped_gemm also fp32); tested on a CPU model of the AscendC API, "
                     "not yet on Ascend hardware")
    if backends.forced_backend():
        lines.append(f"LORA_OPS_BACKEND={backends.forced_backend()}")
    if backends.unavailable:
        lines.append("")
        lines.append("absent backends:")
        for name, why in sorted(backends.unavailable.items()):
            lines.append(f"  {name}: {why}")
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
