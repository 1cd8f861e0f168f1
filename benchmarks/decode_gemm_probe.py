"""Can a decode GEMM of our own read the base weights as fast as cuBLAS? (csrc/cuda/NOTES.md, issue 12, session 15)

The +5% target at T=32 with one adapter needs the LoRA inside the base GEMM's launch, and that needs a GEMM of our
own at cuBLAS's speed first. This builds decode_gemm_probe.cu (torch's JIT extension loader) and times it against
`x @ w.T` (cuBLAS) on Llama-3-8B's four linear layers at T = 32 and 128: CUDA-graph replay, weights rotated past
the L2, every (warps, mma tiles per warp, cluster splits, tokens per tile) candidate; the error against a float32 product is checked.

    python benchmarks/decode_gemm_probe.py
    python benchmarks/decode_gemm_probe.py --cutlass build/decode_gemm_cutlass.so

With --cutlass it times CUTLASS 3.x's sm_90 kernels instead (decode_gemm_cutlass.cu, built beforehand with the
command in its header and loaded through ctypes), at T = 1, 32, 128, each configuration at 1, 2 and 4 K splits.
"""
import argparse
import ctypes
import importlib.util
import itertools
import os

import torch
from torch.utils.cpp_extension import load

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_timing():
    """lora_ops/bench/timing.py by its path (it needs only torch): `import lora_ops` would need the extension
    built, and the probe runs without it."""
    spec = importlib.util.spec_from_file_location("lora_ops_bench_timing",
                                                  os.path.join(HERE, "..", "lora_ops", "bench", "timing.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_timing = _load_timing()
copy_bandwidth_tbps, time_cuda = _timing.copy_bandwidth_tbps, _timing.time_cuda

MODULES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
L2_BYTES = 60 << 20


def build():
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "9.0a")
    return load(name="decode_gemm_probe", sources=[os.path.join(HERE, "decode_gemm_probe.cu")],
                extra_cuda_cflags=["-O3", "-std=c++20", "-Xptxas=-v"], verbose=False)


def cutlass_candidates(lib_path):
    """(label, run(x, w, y) or None where the configuration refuses the shape) per CUTLASS configuration."""
    lib = ctypes.CDLL(lib_path)
    lib.dgc_config_name.restype = ctypes.c_char_p
    lib.dgc_workspace.restype = ctypes.c_size_t
    lib.dgc_run.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                            ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t,
                            ctypes.c_void_p]

    def configs(t, n, k):
        for config, splits in itertools.product(range(5), (1, 2, 4)):
            if config == 2 and splits > 1:  # the ping-pong kernel has no stream-K / split-K scheduler
                continue
            need = lib.dgc_workspace(config, t, n, k, splits)
            ws = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda")

            def run(x, w, y, config=config, splits=splits, ws=ws):
                rc = lib.dgc_run(config, x.data_ptr(), w.data_ptr(), y.data_ptr(), t, n, k, splits, ws.data_ptr(),
                                 ws.numel(), torch.cuda.current_stream().cuda_stream)
                if rc:
                    raise RuntimeError(f"dgc_run: {rc}")
            yield f"{lib.dgc_config_name(config).decode()}, splits {splits}", run
    return configs


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cutlass", default=None, help="time decode_gemm_cutlass.cu's configurations from this library")
    args = ap.parse_args()
    cutlass = cutlass_candidates(args.cutlass) if args.cutlass else None
    ext = None if cutlass else build()
    dev = "cuda"
    gen = torch.Generator(dev).manual_seed(0)
    copy_tbps = copy_bandwidth_tbps(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_tbps:.2f} TB/s")
    for (name, (n, k)), t in itertools.product(MODULES.items(), (1, 32, 128) if cutlass else (32, 128)):
        w_bytes = n * k * 2
        sets = max(2, -(-3 * L2_BYTES // w_bytes))
        ws = [(torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16) for _ in range(sets)]
        xs = [torch.randn(t, k, generator=gen, device=dev).to(torch.bfloat16) for _ in range(sets)]
        ref = xs[0].float() @ ws[0].float().T
        moved = w_bytes + t * k * 2 + t * n * 2

        def line(label, us, err=None):
            tbps = moved / (us * 1e-6) / 1e12
            tail = "" if err is None else f"  max err {err:.1e}"
            print(f"  {label:<36} {us:8.2f} us  {100 * tbps / copy_tbps:5.1f}% of the copy{tail}")

        print(f"{name} T={t} N={n} K={k}")
        cublas = time_cuda([lambda x=x, w=w: torch.mm(x, w.T) for x, w in zip(xs, ws)], graph=True)
        line("cuBLAS", cublas)
        results = []
        if cutlass:
            ys = [torch.empty(t, n, device=dev, dtype=torch.bfloat16) for _ in range(sets)]
            for label, run in cutlass(t, n, k):
                try:
                    run(xs[0], ws[0], ys[0])
                    torch.cuda.synchronize()
                    err = (ys[0].float() - ref).abs().max().item()
                    us = time_cuda([lambda x=x, w=w, y=y: run(x, w, y) for x, w, y in zip(xs, ws, ys)], graph=True)
                except RuntimeError as exc:
                    print(f"  {label:<36} {exc}")
                    continue
                results.append((us, label, err))
        for warps, mt, splits, tt in () if cutlass else itertools.product((4, 8), (1, 2), (1, 2, 4, 8), (32, 64, 128)):
            if tt > max(32, t) or (mt == 2 and tt == 128):
                continue
            err = (ext.decode_gemm(xs[0], ws[0], splits, warps, mt, tt).float() - ref).abs().max().item()
            us = time_cuda([lambda x=x, w=w: ext.decode_gemm(x, w, splits, warps, mt, tt) for x, w in zip(xs, ws)],
                           graph=True)
            results.append((us, f"warps {warps} m-tiles {mt} splits {splits} tile {tt}", err))
        for us, label, err in sorted(results)[:None if cutlass else 4]:
            line(label, us, err)
        print(f"  best / cuBLAS: {sorted(results)[0][0] / cublas:.3f}")


if __name__ == "__main__":
    main()
