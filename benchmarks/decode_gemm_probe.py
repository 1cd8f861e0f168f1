"""Can a decode GEMM of our own read the base weights as fast as cuBLAS? (csrc/cuda/NOTES.md, issue 12, session 15)

The +5% target at T=32 with one adapter needs the LoRA inside the base GEMM's launch, and that needs a GEMM of our
own at cuBLAS's speed first. This builds decode_gemm_probe.cu (torch's JIT extension loader) and times it against
`x @ w.T` (cuBLAS) on Llama-3-8B's four linear layers at T = 32 and 128: CUDA-graph replay, weights rotated past
the L2, every (warps, mma tiles per warp, cluster splits, tokens per tile) candidate; the error against a float32 product is checked.

    python benchmarks/decode_gemm_probe.py
"""
import itertools
import os

import torch
from torch.utils.cpp_extension import load

from lora_ops.bench.timing import copy_bandwidth_tbps, time_cuda

MODULES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
L2_BYTES = 60 << 20


def build():
    here = os.path.dirname(os.path.abspath(__file__))
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    return load(name="decode_gemm_probe", sources=[os.path.join(here, "decode_gemm_probe.cu")],
                extra_cuda_cflags=["-O3", "-std=c++20", "-Xptxas=-v"], verbose=False)


def main():
    ext = build()
    dev = "cuda"
    gen = torch.Generator(dev).manual_seed(0)
    copy_tbps = copy_bandwidth_tbps(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_tbps:.2f} TB/s")
    for (name, (n, k)), t in itertools.product(MODULES.items(), (32, 128)):
        w_bytes = n * k * 2
        sets = max(2, -(-3 * L2_BYTES // w_bytes))
        ws = [(torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16) for _ in range(sets)]
        xs = [torch.randn(t, k, generator=gen, device=dev).to(torch.bfloat16) for _ in range(sets)]
        ref = xs[0].float() @ ws[0].float().T
        moved = w_bytes + t * k * 2 + t * n * 2

        def line(label, us, err=None):
            tbps = moved / (us * 1e-6) / 1e12
            tail = "" if err is None else f"  max err {err:.1e}"
            print(f"  {label:<28} {us:8.2f} us  {100 * tbps / copy_tbps:5.1f}% of the copy{tail}")

        print(f"{name} T={t} N={n} K={k}")
        cublas = time_cuda([lambda x=x, w=w: torch.mm(x, w.T) for x, w in zip(xs, ws)], graph=True)
        line("cuBLAS", cublas)
        results = []
        for warps, mt, splits, tt in itertools.product((4, 8), (1, 2), (1, 2, 4, 8), (32, 64, 128)):
            if tt > max(32, t) or (mt == 2 and tt == 128):
                continue
            err = (ext.decode_gemm(xs[0], ws[0], splits, warps, mt, tt).float() - ref).abs().max().item()
            us = time_cuda([lambda x=x, w=w: ext.decode_gemm(x, w, splits, warps, mt, tt) for x, w in zip(xs, ws)],
                           graph=True)
            results.append((us, f"warps {warps} m-tiles {mt} splits {splits} tile {tt}", err))
        for us, label, err in sorted(results)[:4]:
            line(label, us, err)
        print(f"  best / cuBLAS: {sorted(results)[0][0] / cublas:.3f}")


if __name__ == "__main__":
    main()
