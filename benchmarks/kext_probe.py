"""Issue 12's "expand as extra K blocks" design, timed in whole decode steps beside the fold route (a probe: see
benchmarks/kext_probe.cu, which this loads as a shared library built by the nvcc line at its top).

Routes, each one CUDA graph per step as `python -m lora_ops.bench --decode-step` times them (its Setup: same weights,
routing, rotation and oracle):
- base, fold-cuda: as in the bench;
- kext: per module the shrink, then the GEMM over [x | h] . [W | B]^T launched programmatically (it waits for the
  shrink only before its h blocks);
- kext-serial: the same two launches, the GEMM launched in stream order (what the overlap is worth);
- kext-narrow: kext with CTAs of 32 warps instead of 4 (the shrink on few SMs, the GEMM's x blocks on the others);
- kext-lib: the library's lora_linear (csrc/cuda/lora_linear_sm90.cu: kext-narrow-tokmask with W and B as two
  tensors, B the pool's b_cols), as the serving layer's kext route calls it;
- kext-tc, kext-tc-serial: kext with the shrink on tensor cores (a CUTLASS GEMM over every slot's A rows whose
  epilogue masks and scales h; one CTA per 64 of those rows, so it holds few SMs and lets the GEMM start on the
  others);
- kext-gemm: the GEMM alone on the h the last shrink left (what the shrink costs; its output is not checked);
- kext-gemm-tokmask, kext-narrow-tokmask: kext-gemm and kext-narrow with the GEMM's slot mask taken from the rows'
  slots (as a library op would, so that no seg_indptr can disagree with h) instead of seg_indptr;
- fold-gemm: fold_linear alone, as the fold route calls it (what the fold route's expand costs);
- shrink-only, shrink-narrow-only, ..., shrink-tc-only: each shrink alone, as a share of the base step.
Errors: the first layer's outputs after one eager run, and the last layer's after a replay, against the float64
oracle, as the bench checks its routes.

Usage (on the GPU, after lora_ops is built, e.g. by `scripts/gpu_run.sh build`):
  PYTHONPATH=. python3 benchmarks/kext_probe.py build/kext_probe.so [--steps 32/1/16,...] [--models llama3-8b]
      [--between-modules]
"""
from __future__ import annotations

import argparse
import ctypes
import sys
from typing import Dict

import torch

import lora_ops
from lora_ops.bench import decode_step as ds
from lora_ops.bench.timing import capture, time_interleaved

# the SIMT shrinks timed: route suffix -> warps per CTA (a warp per 4 rank rows sharing x's loads, "-r4" and
# "-narrow-r4", lost everywhere: NOTES.md, session 31)
SHRINKS: Dict[str, int] = {"": 4, "-narrow": 32}


class Kext:
    def __init__(self, path: str):
        lib = ctypes.CDLL(path)
        p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.kext_shrink.argtypes = [p, i64, p, p, p, p, i, i, i, i, i, i, p]
        lib.kext_gemm.argtypes = [p, i64, p, p, p, i, i, i, i, p, p, p, i, i, i, p]
        lib.kext_hgemm.argtypes = [p, i64, p, p, p, p, p, i, i, i, p]
        self.lib = lib

    def shrink(self, x, lora_a, slots, scales, h, K, S, R, L, warps):
        rc = self.lib.kext_shrink(x.data_ptr(), x.stride(0), lora_a.data_ptr(), slots.data_ptr(), scales.data_ptr(),
                                  h.data_ptr(), x.shape[0], K, S, R, L, warps,
                                  torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"kext_shrink returned {rc}")

    def hgemm(self, x, a_h, row_slot, row_scale, slots, h):
        rc = self.lib.kext_hgemm(x.data_ptr(), x.stride(0), a_h.data_ptr(), row_slot.data_ptr(), row_scale.data_ptr(),
                                 slots.data_ptr(), h.data_ptr(), x.shape[0], x.shape[1], a_h.shape[0],
                                 torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"kext_hgemm returned {rc}")

    def gemm(self, x, h, w_ext, y, slice_end, seg_indptr, K, S, R, L, pdl, token_slot=None):
        """token_slot: the GEMM's slot mask from the rows' slots instead of seg_indptr."""
        rc = self.lib.kext_gemm(x.data_ptr(), x.stride(0), h.data_ptr(), w_ext.data_ptr(), y.data_ptr(), x.shape[0],
                                y.shape[1], K, S, slice_end, seg_indptr.data_ptr(),
                                None if token_slot is None else token_slot.data_ptr(), R, L, int(pdl),
                                torch.cuda.current_stream().cuda_stream)
        if rc:
            raise RuntimeError(f"kext_gemm returned {rc}")


class TcShrink:
    """The tensor-core shrink's operands for one step: per module A_h (every slot's A rows in h's column order,
    slice-major) and per row its slot and that slot's scale."""

    def __init__(self, s: ds.Setup, scales):
        L = ds.POOL_SLOTS
        self.a_h = [[m.lora_a.view(L, m.S, m.R, m.K).permute(1, 0, 2, 3).reshape(m.S * L * m.R, m.K).contiguous()
                     for m in layer] for layer in s.layers]
        self.row_slot, self.row_scale = {}, {}
        for n, m in zip(s.names, s.layers[0]):
            slot = (torch.arange(m.S * L * m.R, device="cuda") % (L * m.R)) // m.R
            self.row_slot[n] = slot.float().contiguous()
            self.row_scale[n] = scales[slot].float().contiguous()


def kext_calls(s: ds.Setup, kext: Kext, w_ext, h, slots, scales, shrink, pdl: bool, gemm: bool = True,
               token_mask: bool = False):
    """shrink: the SIMT shrink's warps per CTA, a TcShrink (the tensor-core one), or None: no
    shrink, the GEMM alone on the h left by the last one; gemm=False: the shrinks alone; token_mask: the GEMM's slot
    mask from the rows' slots, not seg_indptr."""
    L = ds.POOL_SLOTS

    def one(i, m, e, n):
        s.write_input(n)
        if isinstance(shrink, TcShrink):
            kext.hgemm(s.x[n], shrink.a_h[i][s.names.index(n)], shrink.row_slot[n], shrink.row_scale[n], slots, h[n])
        elif shrink:
            kext.shrink(s.x[n], m.lora_a, slots, scales, h[n], m.K, m.S, m.R, L, shrink)
        if not gemm:
            return
        ends = (ctypes.c_int * 4)(*m.offsets[1:])
        kext.gemm(s.x[n], h[n], e, s.y[n], ctypes.cast(ends, ctypes.c_void_p), s.seg.seg_indptr, m.K, m.S, m.R, L,
                  pdl, slots if token_mask else None)
    return [s.build_segments] + [lambda i=i, m=m, e=e, n=n: one(i, m, e, n)
                                 for i, (layer, exts) in enumerate(zip(s.layers, w_ext))
                                 for n, m, e in zip(s.names, layer, exts)]


def run_step(model, step, kext: Kext, between: bool, log) -> None:
    s = ds.Setup(model, step, "cuda", between=between)
    L = ds.POOL_SLOTS
    # W_ext = [W | B of every slot], B's column s*R + r = lora_b[s, n, r]
    w_ext = [[torch.cat([m.w, m.b_cols], dim=1) for m in layer]
             for layer in s.layers]
    h = {n: torch.zeros(step.T, m.S * L * m.R, dtype=torch.bfloat16, device="cuda")
         for n, m in zip(s.names, s.layers[0])}
    slots = s.token_lora.to(torch.int32)
    scales = s.scales.float().contiguous()
    ref, ref_last = s.reference(0), s.reference(-1)
    floor, _ = ds.floors_pct(model, step)
    log(f"{model.name} T={step.T} adapters={step.adapters} rank={step.rank}: floor +{floor:.1f}%"
        + (", an input writer before each module" if between else ""))
    calls = {"base": s.base_calls(),
             "fold-cuda": s.fold_calls("fold-cuda", torch.ops.lora_ops.lora_expand.default),
             "kext-gemm": kext_calls(s, kext, w_ext, h, slots, scales, None, False),
             "kext-gemm-tokmask": kext_calls(s, kext, w_ext, h, slots, scales, None, False, token_mask=True)}
    for name, shrink in SHRINKS.items():
        calls[f"kext{name}"] = kext_calls(s, kext, w_ext, h, slots, scales, shrink, True)
        calls[f"shrink{name}-only"] = kext_calls(s, kext, w_ext, h, slots, scales, shrink, False, gemm=False)
    calls["kext-narrow-tokmask"] = kext_calls(s, kext, w_ext, h, slots, scales, SHRINKS["-narrow"], True,
                                              token_mask=True)
    calls["kext-serial"] = kext_calls(s, kext, w_ext, h, slots, scales, SHRINKS[""], False)
    tc = TcShrink(s, scales)
    calls["kext-tc"] = kext_calls(s, kext, w_ext, h, slots, scales, tc, True)
    calls["kext-tc-serial"] = kext_calls(s, kext, w_ext, h, slots, scales, tc, False)
    calls["shrink-tc-only"] = kext_calls(s, kext, w_ext, h, slots, scales, tc, False, gemm=False)
    calls["kext-lib"] = s.kext_calls("kext-lib", lora_ops.ops.lora_linear)
    s.build_segments()
    calls["fold-gemm"] = [s.build_segments] + s.fold_linear_calls()
    checked = [name for name in calls if name.startswith(("kext", "fold-cuda")) and not name.startswith("kext-gemm")]
    errs = {}
    for name in checked:
        for f in calls[name][:1 + len(s.names)]:
            f()
        torch.cuda.synchronize()
        errs[name] = max(ds._rel(s.outputs(name)[n], ref[n][1]) for n in s.names)
    graphs = {name: capture(c) for name, c in calls.items()}
    ms = time_interleaved({name: g.replay for name, g in graphs.items()}, min_ms=100)
    for name in checked:
        graphs[name].replay()
        torch.cuda.synchronize()
        errs[name] = max(errs[name], max(ds._rel(s.outputs(name)[n], ref_last[n][1]) for n in s.names))
    base = ms["base"]
    for name, t in ms.items():
        err = f"  err {errs[name]:.1e}" if name in errs else ""
        bad = "  WRONG" if name in errs and not errs[name] < 1e-2 else ""
        if name.endswith("-only"):  # no base GEMMs in these: their time as a share of the base step
            log(f"  {name:<18} {t * 1e3:9.1f} us  = {100 * t / base:5.1f}% of base")
        else:
            log(f"  {name:<18} {t * 1e3:9.1f} us  overhead {100 * (t - base) / base:+6.1f}%{err}{bad}")
    del graphs, calls, s, w_ext, tc
    torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("lib")
    ap.add_argument("--models", default="llama3-8b")
    ap.add_argument("--steps",
                    default="32/1/16,32/32/16,64/16/64,32/16/64,16/16/64,32/4/16,48/4/16,64/32/16,128/32/16")
    ap.add_argument("--between-modules", action="store_true")
    args = ap.parse_args(argv)
    kext = Kext(args.lib)
    log = lambda text: print(text, flush=True)
    failed = False
    for name in args.models.split(","):
        for step in ds.parse_steps(args.steps):
            try:
                run_step(ds.MODELS[name], step, kext, args.between_modules, log)
            except Exception as exc:  # a failing step is reported; the others still run
                failed = True
                log(f"{name} {step}: FAILED: {type(exc).__name__}: {exc}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
