"""Probe (issue 12, T = 65-128): the fold route's GEMMs on a CUTLASS kernel split along K as batches
(benchmarks/fold_splitk_probe.cu: fp32 partials, then a reduce summing them in order) against cuBLAS (torch.mm),
in one process, CUDA-graph replay, each call on its own copy of W (rotated past L2, as a model's layers are).

    python3 benchmarks/fold_splitk_probe.py [--so build/probes/fold_splitk_probe.so] [--tokens 80,96,128]

The shapes are a llama3-8b layer's fold GEMMs with a 32-slot rank-16 pool (lora_ops/bench/decode_step.py:
[W; A of every slot], rows N + 32·S·16). Per shape and T: cuBLAS's µs, then each configuration's GEMM alone, with
its reduce (a kernel of its own here), the reduce's share, the partials' bytes, and the error of its y against the
fp32 product; each configuration timed in the same rounds as cuBLAS (time_interleaved), a configuration whose y
is wrong not timed. What it decides (csrc/cuda/NOTES.md, session 42): the planned design sums the partials in the
expand, so judge the GEMM alone plus the partials' extra bytes (2·S·T·N·4 at ~4 TB/s, mostly from L2), against
cuBLAS: within ~5% on qkv, o and down at T = 128 and the split-K fold GEMM (with the GDC trigger) is worth building;
slower by more than the ~1.5 µs a module that the early launch would hide and it is not. Equal splits only (K/64
divisible by S): o and down have 36·S tiles of 128 rows (72·S of 64), so some S leave ~1.09 waves on 132 SMs; a
"no" there may be that, not split-K.
"""
import argparse
import ctypes
import importlib.util
import os

import torch

# the bench's timing module by its path: importing lora_ops would need the extension built, which this probe does not
_spec = importlib.util.spec_from_file_location(
    "lora_ops_timing", os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "lora_ops", "bench", "timing.py"))
_timing = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_timing)
cuda_runner, time_interleaved = _timing.cuda_runner, _timing.time_interleaved

CONFIGS = {0: "64x128 pingpong c1", 1: "64x128 pingpong c2", 2: "128x128 coop c1", 3: "128x128 coop c2"}
# llama3-8b with a 32-slot rank-16 pool: (module, N rows of [W; A], K)
SHAPES = [("qkv", 6144 + 32 * 3 * 16, 4096), ("o", 4096 + 32 * 16, 4096), ("gate_up", 28672 + 32 * 2 * 16, 4096),
          ("down", 4096 + 32 * 16, 14336)]
L2_BYTES = 60 << 20


def fold_gemm_cases(tokens):
    """(name, n, k, t, x, ws, ys, want) per shape of SHAPES and token count: ws copies of a bf16 W [n, k] (enough to
    rotate past twice the L2, as a model's layers do), x [t, k], an output per copy, and x's fp32 product with ws[0]."""
    for name, n, k in SHAPES:
        copies = max(2, -(-2 * L2_BYTES // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda").div_(k ** 0.5).to(torch.bfloat16) for _ in range(copies)]
        for t in tokens:
            x = torch.randn(t, k, device="cuda").to(torch.bfloat16)
            ys = [torch.empty(t, n, device="cuda", dtype=torch.bfloat16) for _ in ws]
            yield name, n, k, t, x, ws, ys, x.float() @ ws[0].float().t()


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--so", default="build/probes/fold_splitk_probe.so")
    ap.add_argument("--tokens", default="80,96,128")
    ap.add_argument("--configs", default=",".join(map(str, CONFIGS)),
                    help="the CUTLASS configurations to time (ids of CONFIGS; empty: cuBLAS against cuBLASLt only)")
    args = ap.parse_args()
    configs = {c: CONFIGS[c] for c in (int(v) for v in args.configs.split(",") if v)}
    lib = ctypes.CDLL(args.so)
    lib.fold_splitk_probe.restype = ctypes.c_int
    lib.fold_splitk_probe.argtypes = [ctypes.c_int] + [ctypes.c_void_p] * 4 + [ctypes.c_int] * 4 + [ctypes.c_void_p]
    stream = lambda: ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, n, k, t, x, ws, ys, want in fold_gemm_cases([int(v) for v in args.tokens.split(",")]):
        mm = [lambda w=w, y=y: torch.mm(x, w.t(), out=y) for w, y in zip(ws, ys)]
        cublas = cuda_runner(mm, graph=True)
        # the same GEMM on ATen's cuBLASLt (the library is chosen per call, so at capture; fold_linear's own
        # cuBLASLt call: lt_workspace_probe.py)
        was = torch.backends.cuda.preferred_blas_library()
        torch.backends.cuda.preferred_blas_library("cublaslt")
        try:
            lt = cuda_runner(mm, graph=True)
        finally:
            torch.backends.cuda.preferred_blas_library(was)
        ms = time_interleaved({"cublas": cublas[0], "cublaslt": lt[0]}, min_ms=30.0)
        print(f"{name:8} N={n:6} K={k:6} T={t:4}: cuBLAS {ms['cublas'] * 1e3 / cublas[1]:6.2f} us, cuBLASLt "
              f"{ms['cublaslt'] * 1e3 / lt[1]:6.2f} ({ms['cublaslt'] / ms['cublas']:.2f}x)")
        for config, label in configs.items():
            for splits in (1, 2, 4, 7, 8):
                if k % (64 * splits):
                    continue
                partials = torch.empty(splits, t, n, device="cuda")

                def call(w, y):
                    status = lib.fold_splitk_probe(config, w.data_ptr(), x.data_ptr(), partials.data_ptr(),
                                                   None if y is None else y.data_ptr(), n, t, k, splits, stream())
                    if status:  # also while a graph is captured: a launch left out would time as a win
                        raise RuntimeError(f"fold_splitk_probe status {status}")
                partials.fill_(float("nan"))
                ys[0].fill_(float("nan"))
                try:
                    call(ws[0], ys[0])
                except RuntimeError as exc:
                    print(f"    {label:20} S={splits}: {exc}")
                    continue
                torch.cuda.synchronize()
                err = ((ys[0].float() - want).norm() / want.norm()).item()
                if not err < 1e-2:
                    print(f"    {label:20} S={splits}: WRONG, error {err:.1e} against the fp32 product")
                    continue
                try:
                    runners = {"cublas": cublas,
                               "gemm": cuda_runner([lambda w=w: call(w, None) for w in ws], graph=True),
                               "both": cuda_runner([lambda w=w, y=y: call(w, y) for w, y in zip(ws, ys)],
                                                   graph=True)}
                except RuntimeError as exc:  # a launch refused while the graph was captured
                    print(f"    {label:20} S={splits}: {exc}")
                    continue
                ms = time_interleaved({key: run for key, (run, _) in runners.items()}, min_ms=30.0)
                us = {key: ms[key] * 1e3 / runners[key][1] for key in runners}
                print(f"    {label:20} S={splits}: gemm {us['gemm']:7.2f} us ({us['gemm'] / us['cublas']:5.2f}x "
                      f"cuBLAS {us['cublas']:6.2f}), + reduce {us['both']:7.2f} (reduce "
                      f"{us['both'] - us['gemm']:5.2f}), partials {2 * splits * t * n * 4 / 1e6:5.1f} MB, "
                      f"err {err:.1e}")

if __name__ == "__main__":
    main()
