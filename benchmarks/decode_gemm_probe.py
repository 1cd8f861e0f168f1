"""Can a decode GEMM of our own read the base weights as fast as cuBLAS, and what does it buy the fold route?
(csrc/cuda/NOTES.md, issue 12, sessions 15-16)

decode_gemm_cutlass.cu (CUTLASS 3.x's sm_90 kernels, built beforehand with the command in its header, loaded through
ctypes: no lora_ops build needed) against `x @ w.T` (cuBLAS) on Llama-3-8B's four linear layers at T = 1, 32, 128:
every configuration at 1, 2 and 4 K splits, CUDA-graph replay, weights rotated past the L2, the error against a
float32 product checked.

    python benchmarks/decode_gemm_probe.py --cutlass build/decode_gemm_cutlass.so

With --step (needs lora_ops built) it times whole Llama-3-8B decode steps as `python -m lora_ops.bench --decode-step`
does (one CUDA graph per step, every layer), the base and the fold route (GEMM over [W; A of every slot], then the
lora_expand op's rows kernel), with cuBLAS or with each library's fastest configuration per module as the GEMM: the
second library is the same source built with -DCUTLASS_ENABLE_GDC_FOR_SM90, whose kernels let the lora_expand kernel
(launched programmatically dependent) start before the GEMM's epilogue ends.

    python benchmarks/decode_gemm_probe.py --step build/decode_gemm_cutlass.so build/decode_gemm_cutlass_gdc.so

The mma.sync probe of session 15 and the LoRA-in-epilogue variants of session 16 were removed after they were
measured (their logs are in benchmarks/results; the code is at e9389df).
"""
import argparse
import ctypes
import importlib.util
import itertools
import os

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def _load_timing():
    """lora_ops/bench/timing.py by its path (it needs only torch): `import lora_ops` would need the extension
    built, and the --cutlass probe runs without it."""
    spec = importlib.util.spec_from_file_location("lora_ops_bench_timing",
                                                  os.path.join(HERE, "..", "lora_ops", "bench", "timing.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_timing = _load_timing()
copy_bandwidth_tbps, time_cuda = _timing.copy_bandwidth_tbps, _timing.time_cuda

MODULES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
L2_BYTES = 60 << 20


def cutlass_library(lib_path):
    lib = ctypes.CDLL(lib_path)
    lib.dgc_config_name.restype = ctypes.c_char_p
    lib.dgc_workspace.restype = ctypes.c_size_t
    ptr, i32 = ctypes.c_void_p, ctypes.c_int
    lib.dgc_run.argtypes = [i32, ptr, ptr, ptr, i32, i32, i32, i32, ptr, ctypes.c_size_t, ptr]
    return lib


def timed_configs(lib, xs, ws, ref=None):
    """(µs, label, run(x, w, y), max error or None) of every configuration and K split the library has, for
    y = x . w^T over the rotating sets (xs, ws); the error against `ref` (xs[0] . ws[0]^T) where given."""
    t, (m, k) = xs[0].shape[0], ws[0].shape
    y = torch.empty(t, m, dtype=torch.bfloat16, device=xs[0].device)
    out = []
    for config, splits in itertools.product(range(lib.dgc_configs()), (1, 2, 4)):
        need = lib.dgc_workspace(config, t, m, k, splits)
        workspace = torch.empty(max(need, 1), dtype=torch.uint8, device=y.device)

        def run(x, w, y, config=config, splits=splits, workspace=workspace):
            rc = lib.dgc_run(config, x.data_ptr(), w.data_ptr(), y.data_ptr(), t, m, k, splits, workspace.data_ptr(),
                             workspace.numel(), torch.cuda.current_stream().cuda_stream)
            if rc:
                raise RuntimeError(f"dgc_run: {rc}")
        try:
            run(xs[0], ws[0], y)  # a K split the configuration's scheduler does not have raises here
        except RuntimeError:
            continue
        err = None if ref is None else (y.float() - ref).abs().max().item()
        us = time_cuda([lambda x=x, w=w: run(x, w, y) for x, w in zip(xs, ws)], graph=True)
        out.append((us, f"{lib.dgc_config_name(config).decode()}, splits {splits}", run, err))
    return out


def fastest(lib, t, m, k, dev):
    """The fastest configuration's (label, run) for y [t, m] = x [t, k] . w [m, k]^T."""
    sets = max(2, -(-3 * L2_BYTES // (m * k * 2)))
    ws = [torch.randn(m, k, device=dev).to(torch.bfloat16) for _ in range(sets)]
    xs = [torch.randn(t, k, device=dev).to(torch.bfloat16)]
    return min(timed_configs(lib, xs, ws), key=lambda c: c[0])[1:3]


def time_modules(lib, dev):
    """Every configuration against cuBLAS per module and T."""
    gen = torch.Generator(dev).manual_seed(0)
    copy_tbps = copy_bandwidth_tbps(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_tbps:.2f} TB/s")
    for (name, (n, k)), t in itertools.product(MODULES.items(), (1, 32, 128)):
        w_bytes = n * k * 2
        sets = max(2, -(-3 * L2_BYTES // w_bytes))
        ws = [(torch.randn(n, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16) for _ in range(sets)]
        xs = [torch.randn(t, k, generator=gen, device=dev).to(torch.bfloat16) for _ in range(sets)]
        moved = w_bytes + t * k * 2 + t * n * 2

        def line(label, us, err=None):
            tbps = moved / (us * 1e-6) / 1e12
            tail = "" if err is None else f"  max err {err:.1e}"
            print(f"  {label:<66} {us:8.2f} us  {100 * tbps / copy_tbps:5.1f}% of the copy{tail}")

        print(f"{name} T={t} N={n} K={k}")
        cublas = time_cuda([lambda x=x, w=w: torch.mm(x, w.T) for x, w in zip(xs, ws)], graph=True)
        line("cuBLAS", cublas)
        results = timed_configs(lib, xs, ws, xs[0].float() @ ws[0].float().T)
        for us, label, _, err in results:
            line(label, us, err)
        print(f"  best / cuBLAS: {min(r[0] for r in results) / cublas:.3f}")


def time_steps(libs, dev):
    """The decode step's base and fold route with cuBLAS and with each library's CUTLASS GEMM (see --step)."""
    from lora_ops.bench import decode_step as ds
    from lora_ops.bench.timing import capture, time_loop

    expand = torch.ops.lora_ops.lora_expand.default
    model = ds.MODELS["llama3-8b"]
    for step in ds.STEPS:
        s = ds.Setup(model, step, dev)
        ref = s.reference(0)
        print(f"{model.name} T={step.T} adapters={step.adapters} rank={step.rank}")
        gemms = {"cuBLAS": lambda x, w, y: torch.mm(x, w.t(), out=y)}
        for name, lib in libs.items():
            chosen = {(rows, m.K): fastest(lib, step.T, rows, m.K, dev)
                      for m in s.layers[0] for rows in (m.N, m.w_cat.shape[0])}
            print(f"  {name}: " + "; ".join(f"{n} {chosen[m.N, m.K][0]} / fold {chosen[m.w_cat.shape[0], m.K][0]}"
                                            for n, m in zip(s.names, s.layers[0])))
            gemms[name] = lambda x, w, y, chosen=chosen: chosen[tuple(w.shape)][1](x, w, y)
        base_us = None
        for name, gemm in gemms.items():
            def fold_one(m, n, gemm=gemm):
                out = s.out[n]
                gemm(s.x[n], m.w_cat, out)
                expand(out[:, :m.N], out[:, m.N:].view(step.T, ds.POOL_SLOTS, m.S * m.R), m.lora_b,
                       *s.expand_rows(expand), s.ranks, s.scales, m.slice_offsets, 1.0)
            base = [lambda m=m, n=n, g=gemm: g(s.x[n], m.w, s.y[n]) for layer in s.layers
                    for n, m in zip(s.names, layer)]
            fold = [s.build_segments] + [lambda m=m, n=n: fold_one(m, n) for layer in s.layers
                                         for n, m in zip(s.names, layer)]
            for f in fold[:1 + len(s.names)]:
                f()
            err = max(ds._rel(s.out[n][:, :m.N], ref[n][1]) for n, m in zip(s.names, s.layers[0]))
            for label, calls in (("base", base), ("fold", fold)):
                us = 1e3 * time_loop(capture(calls).replay, min_ms=100)
                base_us = base_us or us
                tail = f"  err {err:.1e}" if label == "fold" else ""
                print(f"  {name:<10} {label:<5} {us:9.1f} us  {100 * (us - base_us) / base_us:+6.1f}% of cuBLAS's "
                      f"base{tail}")
        del s
        torch.cuda.empty_cache()


def main():
    ap = argparse.ArgumentParser()
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--cutlass", metavar="LIB", help="time decode_gemm_cutlass.cu's configurations from this library")
    what.add_argument("--step", nargs="+", metavar="LIB",
                      help="time decode steps with each library's GEMM (the first without, the second with GDC)")
    args = ap.parse_args()
    if args.step:
        names = ("CUTLASS", "CUTLASS+GDC")
        time_steps({name: cutlass_library(path) for name, path in zip(names, args.step)}, "cuda")
    else:
        time_modules(cutlass_library(args.cutlass), "cuda")


if __name__ == "__main__":
    main()
