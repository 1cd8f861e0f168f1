"""Can a decode GEMM of our own read the base weights as fast as cuBLAS? (csrc/cuda/NOTES.md, issue 12, session 15)

The +5% target at T=32 with one adapter needs the LoRA inside the base GEMM's launch, and that needs a GEMM of our
own at cuBLAS's speed first. This builds decode_gemm_probe.cu (torch's JIT extension loader) and times it against
`x @ w.T` (cuBLAS) on Llama-3-8B's four linear layers at T = 32 and 128: CUDA-graph replay, weights rotated past
the L2, every (warps, mma tiles per warp, cluster splits, tokens per tile) candidate; the error against a float32
product is checked.

    python benchmarks/decode_gemm_probe.py
    python benchmarks/decode_gemm_probe.py --cutlass build/decode_gemm_cutlass.so

With --cutlass it times CUTLASS 3.x's sm_90 kernels instead (decode_gemm_cutlass.cu, built beforehand with the
command in its header and loaded through ctypes), at T = 1, 32, 128, each configuration at 1, 2 and 4 K splits;
then the same GEMM with the LoRA term h . B_slot^T added in its epilogue: with h given; with h computed by the same
kernel over [A of every slot; W] (the fold in one launch); and as a grouped GEMM whose groups are the present slots'
A and then W (only the present adapters' bytes), each checked against the float32 product and timed beside the
plain GEMM.

    python benchmarks/decode_gemm_probe.py --step build/decode_gemm_cutlass.so build/decode_gemm_cutlass_gdc.so

With --step (needs lora_ops built) it times whole Llama-3-8B decode steps as `python -m lora_ops.bench --decode-step`
does (one CUDA graph per step, every layer), the base and the fold route (GEMM over [W; A of every slot], then the
lora_expand op's rows kernel), with cuBLAS or with each library's fastest plain CUTLASS configuration per module as
the GEMM: the second library is the same source built with -DCUTLASS_ENABLE_GDC_FOR_SM90, whose kernels let the
lora_expand kernel (launched programmatically dependent) start before the GEMM's epilogue ends.
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


def cutlass_library(lib_path):
    lib = ctypes.CDLL(lib_path)
    lib.dgc_config_name.restype = ctypes.c_char_p
    lib.dgc_workspace.restype = ctypes.c_size_t
    ptr, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_int64
    common = [i32, ptr, ptr, ptr, i32, i32, i32, i32, ptr, ctypes.c_size_t, ptr]
    lib.dgc_run.argtypes = common
    lib.dgc_run_lora.argtypes = common + [ptr, ptr, ptr, i64, i64, i64, i32, i32]
    lib.dgc_run_fold.argtypes = [i32, ptr, ptr, ptr, i32, i32, i32, ptr, ctypes.c_size_t, ptr,
                                 ptr, ptr, ptr, i64, i64, i32, i32, ctypes.c_float, i32, ptr]
    lib.dgc_grouped_name.restype = ctypes.c_char_p
    lib.dgc_grouped_setup.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, i32, i32, i32, i32, i32, ptr, ptr,
                                      ctypes.c_size_t, ptr]
    lib.dgc_grouped_run.argtypes = [i32, ptr, i32, i32, i32, i32, ptr, ctypes.c_size_t, ptr, ptr, ptr, ptr, i64,
                                    i64, i32, ctypes.c_float, i32, ptr, ptr]
    return lib


def grouped_fold_configs(lib, t, n, k, xs, a_sets, ws, ys, slot, rank, slots):
    """(label, run(x, w, y, extra), arrays) of the grouped fold: groups of the present slots' A, then W; extra =
    (token_slot, h scratch, B, scale, counters, the set's device arrays). Each configuration twice: with the slots
    present known on the host (the arrays' shapes written at setup), and with the device prep kernel before each
    GEMM deciding them from the token slots (the op's way; once per step there, here once per module: the worst
    case)."""
    present = (ctypes.c_int * slots)(*[int(s in set(slot.tolist())) for s in range(slots)])
    d_scratch = torch.empty(slots, t, rank, device="cuda", dtype=torch.bfloat16)
    out = []
    for config in range(2):
        need = ctypes.c_size_t(0)
        lib.dgc_grouped_setup(config, 0, 0, 0, 0, 0, t, n, k, rank, slots, present, 0, 0, ctypes.byref(need))
        arrays = []
        for x, a, w, y in zip(xs, a_sets, ws, ys):
            buf = torch.empty(need.value, dtype=torch.uint8, device="cuda")
            rc = lib.dgc_grouped_setup(config, x.data_ptr(), a.data_ptr(), w.data_ptr(), y.data_ptr(),
                                       d_scratch.data_ptr(), t, n, k, rank, slots, present, buf.data_ptr(),
                                       buf.numel(), None)
            if rc:
                raise RuntimeError(f"dgc_grouped_setup: {rc}")
            arrays.append(buf)
        out.append((config, arrays))
    count = sum(present)

    def configs():
        for (config, arrays), (how, present_count) in itertools.product(out, (("host-known slots", count),
                                                                               ("device prep", -1))):
            ws_need = ctypes.c_size_t(0)
            lib.dgc_grouped_run(config, arrays[0].data_ptr(), slots, t, n, k, 0, 0, None, 0, 0, 0, 0, 0, rank, 1.0,
                                present_count, 0, ctypes.byref(ws_need))
            workspace = torch.empty(max(ws_need.value, 1), dtype=torch.uint8, device="cuda")

            def run(x, w, y, extra, config=config, workspace=workspace, present_count=present_count,
                    d_scratch=d_scratch):
                # d_scratch: kept alive with run (the h groups' D, which the kernel writes)
                token_slot, h, b, scale, counters, buf = extra
                rc = lib.dgc_grouped_run(config, buf.data_ptr(), slots, t, n, k, workspace.data_ptr(),
                                         workspace.numel(), torch.cuda.current_stream().cuda_stream,
                                         token_slot.data_ptr(), h.data_ptr(), b.data_ptr(), b.stride(0), b.stride(1),
                                         rank, scale, present_count, counters.data_ptr(), None)
                if rc:
                    raise RuntimeError(f"dgc_grouped_run: {rc}")
            yield f"{lib.dgc_grouped_name(config).decode()}, {how}", run, arrays
    return configs()


def cutlass_configs(lib, t, m, k, mode="plain"):
    """(label, run(x, w, y, extra)) per configuration and K split. mode "plain": y = x . w^T; "lora": the LoRA
    epilogue with h given, extra = (token_slot int32 [T], h float32 [T, R], B bf16 [slots, N, R]); "fold": w = [A of
    every slot; W], y = [T, S*R + N], extra = (token_slot, h scratch float32 [T, S*R], B, scale, counters int32 [2])."""
    first_lora = lib.dgc_lora_configs_from()
    for config in range(first_lora) if mode == "plain" else range(first_lora, first_lora + 3):
        for splits in (1, 2, 4) if mode != "fold" else (1,):
            if "pingpong" in lib.dgc_config_name(config).decode() and splits > 1:
                continue  # the ping-pong kernel has no split-K scheduler
            need = lib.dgc_workspace(config, t, m, k, splits)
            ws = torch.empty(max(need, 1), dtype=torch.uint8, device="cuda")

            def run(x, w, y, extra=None, config=config, splits=splits, ws=ws):
                stream = torch.cuda.current_stream().cuda_stream
                if mode == "fold":
                    slot, h, b, scale, counters = extra
                    rc = lib.dgc_run_fold(config, x.data_ptr(), w.data_ptr(), y.data_ptr(), t, m, k, ws.data_ptr(),
                                          ws.numel(), stream, slot.data_ptr(), h.data_ptr(), b.data_ptr(),
                                          b.stride(0), b.stride(1), b.shape[2], b.shape[0], scale, h.shape[1],
                                          counters.data_ptr())
                else:
                    head = (config, x.data_ptr(), w.data_ptr(), y.data_ptr(), t, m, k, splits, ws.data_ptr(),
                            ws.numel(), stream)
                    if mode == "plain":
                        rc = lib.dgc_run(*head)
                    else:
                        slot, h, b = extra
                        rc = lib.dgc_run_lora(*head, slot.data_ptr(), h.data_ptr(), b.data_ptr(), h.stride(0),
                                              b.stride(0), b.stride(1), h.shape[1], b.shape[0])
                if rc:
                    raise RuntimeError(f"dgc_run ({mode}): {rc}")
            yield f"{lib.dgc_config_name(config).decode()}{', fold' if mode == 'fold' else ''}, splits {splits}", run


def time_cutlass(lib, t, n, k, xs, ws, ref, line, dev, gen):
    """The plain configurations; then, on 32-slot pools of rank 16 (B and A rotated with W) with min(T, 32) adapters
    and with 1, the LoRA epilogue with h given and the fold (h computed by the same kernel), each beside the shape's
    best plain time and the bytes LoRA must read. Returns the best plain time."""

    def measure(label, run, weights, outs, extras, expect, counters=None):
        if counters is not None:
            counters.zero_()  # a failed configuration before this one may have left them set
        try:
            run(xs[0], weights[0], outs[0], extras[0])
            torch.cuda.synchronize()
            err = (outs[0][:, -n:].float() - expect).abs().max().item()
            us = time_cuda([lambda x=x, w=w, y=y, e=e: run(x, w, y, e)
                            for x, w, y, e in zip(xs, weights, outs, extras)], graph=True)
            # after the replays too: the fold's counters must have been reset by every launch (stale counters let
            # the W tiles skip their wait, which may still read the right h by luck: check them as well)
            err = max(err, (outs[0][:, -n:].float() - expect).abs().max().item())
            if counters is not None and counters.tolist() != [0, 0]:
                raise RuntimeError(f"counters not reset after the replays: {counters.tolist()}")
        except RuntimeError as exc:
            print(f"  {label:<66} {exc}")
            return None
        line(label, us, err)
        return us

    ys = [torch.empty(t, n, device=dev, dtype=torch.bfloat16) for _ in xs]
    plain = [measure(label, run, ws, ys, [None] * len(xs), ref) for label, run in cutlass_configs(lib, t, n, k)]
    plain = min(us for us in plain if us is not None)
    rank, slots, scale = 16, 32, 0.5
    a_sets = [(torch.randn(slots * rank, k, generator=gen, device=dev) / k ** 0.5).to(torch.bfloat16) for _ in xs]
    folded = [torch.cat([a, w]) for a, w in zip(a_sets, ws)]
    y_ext = [torch.empty(t, slots * rank + n, device=dev, dtype=torch.bfloat16) for _ in xs]
    h_scratch = torch.empty(t, slots * rank, device=dev)
    counters = torch.zeros(2, dtype=torch.int32, device=dev)
    for adapters in sorted({min(t, 32), 1}):
        slot = torch.randperm(slots, generator=gen, device=dev)[:adapters][
            torch.randint(0, adapters, (t,), generator=gen, device=dev)].to(torch.int32)
        bs = [(torch.randn(slots, n, rank, generator=gen, device=dev) / rank ** 0.5).to(torch.bfloat16) for _ in xs]
        present = len(set(slot.tolist()))
        w_bytes = n * k * 2
        every_a = 100 * slots * rank * k * 2 / w_bytes
        print(f"  + LoRA, {adapters} adapter(s) of rank {rank} in a {slots}-slot pool: present B "
              f"{100 * present * n * rank * 2 / w_bytes:.1f}% of W's bytes, present A "
              f"{100 * present * rank * k * 2 / w_bytes:.1f}%, every slot's A {every_a:.1f}%; "
              f"best plain {plain:.2f} us")
        h = torch.randn(t, rank, generator=gen, device=dev) * 0.05
        expect = ref + torch.einsum("tr,tnr->tn", h, bs[0][slot.long()].float())
        given = [measure(label, run, ws, ys, [(slot, h, b) for b in bs], expect)
                 for label, run in cutlass_configs(lib, t, n, k, "lora")]
        h_true = (xs[0].float() @ a_sets[0].float().T).view(t, slots, rank)[torch.arange(t, device=dev), slot.long()]
        expect = ref + scale * torch.einsum("tr,tnr->tn", h_true, bs[0][slot.long()].float())
        fold = [measure(label, run, folded, y_ext, [(slot, h_scratch, b, scale, counters) for b in bs], expect,
                        counters) for label, run in cutlass_configs(lib, t, slots * rank + n, k, "fold")]
        try:
            grouped = [measure(label, run, ws, ys, [(slot, h_scratch, b, scale, counters, buf)
                                                    for b, buf in zip(bs, arrays)], expect, counters)
                       for label, run, arrays in grouped_fold_configs(lib, t, n, k, xs, a_sets, ws, ys, slot, rank,
                                                                      slots)]
        except RuntimeError as exc:
            print(f"  grouped fold: {exc}")
            grouped = []
        for what, times in (("h given", given), ("fold", fold), ("grouped fold", grouped)):
            times = [us for us in times if us is not None]
            if times:
                print(f"  best with LoRA ({what}) / best plain: {min(times) / plain:.3f}")
    return plain


def fastest_plain(lib, t, m, k, dev):
    """The fastest plain configuration's run for y [t, m] = x [t, k] . w [m, k]^T (graph replay, weights rotated
    past the L2), and its label."""
    sets = max(2, -(-3 * L2_BYTES // (m * k * 2)))
    ws = [torch.randn(m, k, device=dev).to(torch.bfloat16) for _ in range(sets)]
    x = torch.randn(t, k, device=dev).to(torch.bfloat16)
    y = torch.empty(t, m, dtype=torch.bfloat16, device=dev)
    timed = []
    for label, run in cutlass_configs(lib, t, m, k):
        try:
            run(x, ws[0], y)
        except RuntimeError:  # a K split the library's scheduler does not have (the GDC build)
            continue
        timed.append((time_cuda([lambda w=w, run=run: run(x, w, y) for w in ws], graph=True), label, run))
    return min(timed, key=lambda c: c[0])[1:]


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
        runs = {"cuBLAS": (lambda x, w, y: torch.mm(x, w.t(), out=y),) * 2}
        for name, lib in libs.items():
            chosen = []
            for n, m in zip(s.names, s.layers[0]):
                chosen.append([fastest_plain(lib, step.T, rows, m.K, dev) for rows in (m.N, m.w_cat.shape[0])])
            print(f"  {name}: " + "; ".join(f"{n} {b[0]} / fold {f[0]}" for n, (b, f) in zip(s.names, chosen)))
            by_shape = {(w.shape[0], m.K): c[i][1] for m, c in zip(s.layers[0], chosen)
                        for i, w in enumerate((m.w, m.w_cat))}
            gemm = lambda x, w, y, by_shape=by_shape: by_shape[tuple(w.shape)](x, w, y)
            runs[name] = (gemm, gemm)
        base_us = None
        for name, (base_gemm, fold_gemm) in runs.items():
            def fold_one(m, n, gemm=fold_gemm):
                out = s.out[n]
                gemm(s.x[n], m.w_cat, out)
                expand(out[:, :m.N], out[:, m.N:].view(step.T, ds.POOL_SLOTS, m.S * m.R), m.lora_b,
                       *s.expand_rows(expand), s.ranks, s.scales, m.slice_offsets, 1.0)
            base = [lambda m=m, n=n, g=base_gemm: g(s.x[n], m.w, s.y[n]) for layer in s.layers
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
    ap.add_argument("--cutlass", default=None, help="time decode_gemm_cutlass.cu's configurations from this library")
    ap.add_argument("--step", nargs="+", default=None, metavar="LIB",
                    help="time decode steps with each library's GEMM (the first without, the second with GDC)")
    args = ap.parse_args()
    if args.step:
        names = ("CUTLASS", "CUTLASS+GDC")
        return time_steps({name: cutlass_library(path) for name, path in zip(names, args.step)}, "cuda")
    cutlass = cutlass_library(args.cutlass) if args.cutlass else None
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
            print(f"  {label:<66} {us:8.2f} us  {100 * tbps / copy_tbps:5.1f}% of the copy{tail}")

        print(f"{name} T={t} N={n} K={k}")
        cublas = time_cuda([lambda x=x, w=w: torch.mm(x, w.T) for x, w in zip(xs, ws)], graph=True)
        line("cuBLAS", cublas)
        if cutlass:
            plain = time_cutlass(cutlass, t, n, k, xs, ws, ref, line, dev, gen)
            print(f"  best plain / cuBLAS: {plain / cublas:.3f}")
            continue
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
