"""Probe (issue 12): fold_linear's own cuBLASLt call (csrc/cuda/fold_linear_lt.cpp: the same mapping, alignment
preferences, float32 split-K reduction and first heuristic algorithm) replayed through ctypes at several workspace
limits, against cuBLAS (torch.mm), on the fold route's GEMMs of a llama3-8b layer; CUDA-graph replay, each call on
its own copy of W (rotated past L2; benchmarks/fold_splitk_probe.py's cases). No build: the extension is not
imported (torch's loaded libcublasLt answers the name).

    python3 benchmarks/lt_workspace_probe.py [--tokens 80,128] [--limits-mib 1,32]

Per shape, T and limit: the chosen algorithm's id, split-K parts and reduction scheme (cublasLtReductionScheme_t),
its workspace, µs, the ratio to cuBLAS and the product's error against the fp32 one. Session 44: ATen's cuBLASLt
picked a down GEMM 0.83-0.87x cuBLAS's time with a 1-4 MiB limit and cuBLAS's own with 32 MiB; this call did the
same (H100: down 0.83-0.88x at 64-128 tokens, 1 MiB, session 45; with the reduction mask 0.83-0.86x, session 46).
"""
import argparse
import ctypes
import functools
import importlib.util
import os

import torch

# the split-K probe's shapes, inputs and timing, by its path (neither builds nor imports lora_ops)
_spec = importlib.util.spec_from_file_location(
    "fold_splitk_probe", os.path.join(os.path.dirname(os.path.abspath(__file__)), "fold_splitk_probe.py"))
_splitk = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_splitk)
cuda_runner, time_interleaved, fold_gemm_cases = _splitk.cuda_runner, _splitk.time_interleaved, _splitk.fold_gemm_cases

# cublasLt.h / cublas_api.h / library_types.h
COMPUTE_32F, R_32F, R_16BF = 68, 0, 14
DESC_TRANSA, DESC_TRANSB, OP_N, OP_T = 3, 4, 0, 1
PREF_MAX_WORKSPACE, PREF_REDUCTION_MASK, PREF_ALIGN = 1, 3, (5, 6, 7, 8)  # A, B, C, D
REDUCTION_COMPUTE_TYPE = 2  # with none: a split K is summed in float32 (fold_linear_lt's mask)
ALGO_CONFIG_ID, ALGO_CONFIG_SPLITK_NUM, ALGO_CONFIG_REDUCTION_SCHEME = 0, 2, 3


class HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspace_size", ctypes.c_size_t), ("state", ctypes.c_int),
                ("waves", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


class Lt:
    def __init__(self):
        self.lib = ctypes.CDLL(f"libcublasLt.so.{torch.version.cuda.split('.')[0]}")
        self.handle = ctypes.c_void_p()
        self.ok(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "create")

    @staticmethod
    def ok(status, what):
        if status != 0:
            raise RuntimeError(f"cuBLASLt {what}: status {status}")

    def attr(self, fn, obj, key, value, ctype):
        v = ctype(value)
        self.ok(getattr(self.lib, fn)(obj, key, ctypes.byref(v), ctypes.c_size_t(ctypes.sizeof(v))), fn)

    def plan(self, t, n, k, limit):
        """fold_linear_lt's descriptors and first heuristic algorithm for y [t, n] = x [t, k] . w [n, k]^T."""
        op = ctypes.c_void_p()
        self.ok(self.lib.cublasLtMatmulDescCreate(ctypes.byref(op), COMPUTE_32F, R_32F), "desc")
        self.attr("cublasLtMatmulDescSetAttribute", op, DESC_TRANSA, OP_T, ctypes.c_int)
        self.attr("cublasLtMatmulDescSetAttribute", op, DESC_TRANSB, OP_N, ctypes.c_int)
        layouts = []
        for rows, cols, ld in ((k, n, k), (k, t, k), (n, t, n)):  # w, x, y
            lay = ctypes.c_void_p()
            self.ok(self.lib.cublasLtMatrixLayoutCreate(ctypes.byref(lay), R_16BF, ctypes.c_uint64(rows),
                                                        ctypes.c_uint64(cols), ctypes.c_int64(ld)), "layout")
            layouts.append(lay)
        pref = ctypes.c_void_p()
        self.ok(self.lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "preference")
        self.attr("cublasLtMatmulPreferenceSetAttribute", pref, PREF_MAX_WORKSPACE, limit, ctypes.c_uint64)
        self.attr("cublasLtMatmulPreferenceSetAttribute", pref, PREF_REDUCTION_MASK, REDUCTION_COMPUTE_TYPE,
                  ctypes.c_uint32)
        for key in PREF_ALIGN:  # fresh allocations: 256-byte aligned
            self.attr("cublasLtMatmulPreferenceSetAttribute", pref, key, 256, ctypes.c_uint32)
        result, found = HeuristicResult(), ctypes.c_int()
        w, x, y = layouts
        self.ok(self.lib.cublasLtMatmulAlgoGetHeuristic(self.handle, op, w, x, y, y, pref, 1, ctypes.byref(result),
                                                        ctypes.byref(found)), "heuristic")
        if found.value < 1:
            raise RuntimeError("no algorithm")
        config = []  # the algorithm's id, split-K parts and reduction scheme
        for attribute in (ALGO_CONFIG_ID, ALGO_CONFIG_SPLITK_NUM, ALGO_CONFIG_REDUCTION_SCHEME):
            value, written = ctypes.c_uint32(), ctypes.c_size_t()
            self.ok(self.lib.cublasLtMatmulAlgoConfigGetAttribute(ctypes.byref(result.algo), attribute,
                                                                  ctypes.byref(value), ctypes.c_size_t(4),
                                                                  ctypes.byref(written)), "algorithm config")
            config.append(value.value)
        return op, layouts, result, config

    def matmul(self, plan, w, x, y, workspace):
        op, (wl, xl, yl), result, _ = plan
        one, zero = ctypes.c_float(1.0), ctypes.c_float(0.0)
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        ptr = lambda tensor: ctypes.c_void_p(tensor.data_ptr())
        self.ok(self.lib.cublasLtMatmul(self.handle, op, ctypes.byref(one), ptr(w), wl, ptr(x), xl, ctypes.byref(zero),
                                        ptr(y), yl, ptr(y), yl, ctypes.byref(result.algo), ptr(workspace),
                                        ctypes.c_size_t(result.workspace_size), stream), "matmul")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", default="80,128")
    ap.add_argument("--limits-mib", default="1,32")
    args = ap.parse_args()
    lt = Lt()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    for name, n, k, t, x, ws, ys, want in fold_gemm_cases([int(v) for v in args.tokens.split(",")]):
        runs = {"cublas": cuda_runner([lambda w=w, y=y: torch.mm(x, w.t(), out=y) for w, y in zip(ws, ys)],
                                      graph=True)}
        chosen = {}
        for mib in (int(v) for v in args.limits_mib.split(",")):
            plan = lt.plan(t, n, k, mib << 20)
            workspace = torch.empty(max(plan[2].workspace_size, 1), dtype=torch.uint8, device="cuda")
            lt.matmul(plan, ws[0], x, ys[0], workspace)
            torch.cuda.synchronize()
            err = ((ys[0].float() - want).abs().max() / want.abs().max()).item()
            chosen[mib] = (plan, err)
            runs[mib] = cuda_runner([functools.partial(lt.matmul, plan, w, x, y, workspace) for w, y in zip(ws, ys)],
                                    graph=True)
        ms = time_interleaved({key: run for key, (run, _) in runs.items()}, min_ms=30.0)
        us = {key: ms[key] * 1e3 / runs[key][1] for key in runs}
        print(f"{name:<8} N={n:6d} K={k:6d} T={t:4d}: cuBLAS {us['cublas']:7.2f} us" + "".join(
            f" | {mib} MiB: algo {chosen[mib][0][3][0]:3d} split {chosen[mib][0][3][1]} "
            f"reduction {chosen[mib][0][3][2]} "
            f"ws {chosen[mib][0][2].workspace_size >> 10:5d} KiB "
            f"{us[mib]:7.2f} us ({us[mib] / us['cublas']:.2f}x) err {chosen[mib][1]:.1e}" for mib in chosen))


if __name__ == "__main__":
    main()
