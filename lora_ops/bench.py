"""`python -m lora_ops.bench`: time every available backend of sgmv / build_segments against baselines
(docs/design.md §6): a PyTorch per-adapter loop, gather+bmm, and torch._grouped_mm where present.

Every implementation is checked against the float64 oracle before it is timed. On CUDA each case is timed as
CUDA-graph replay and eagerly, rotating among enough input sets to exceed twice the L2 (each layer of a real
model has its own activations and weights, so they are not L2-resident; the segment metadata, built once per
step for all layers, is shared), and reported as µs, GB/s and % of the memory roofline:
minimum bytes (x read, the true-rank rows of the adapters present, y read and written) over the device-to-device
copy bandwidth measured in the same run.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
from typing import Callable, Dict, List, Optional

import torch

import lora_ops
from lora_ops import backends, reference, testing


@dataclasses.dataclass(frozen=True)
class Case:
    T: int
    adapters: int
    rank: int
    K: int = 4096
    N: int = 4096
    slices: int = 1
    pool_rank: Optional[int] = None  # pool's max rank R (default: rank)
    pool_slots: int = 32

    @property
    def R(self):
        return self.pool_rank or self.rank


# The target table (H200, bf16, K = N = 4096, 32-slot pool, one slice), then wider coverage.
GPU_CASES = [Case(1, 1, 16), Case(16, 4, 16), Case(64, 16, 16), Case(256, 32, 16), Case(256, 32, 64),
             Case(4096, 4, 16), Case(16384, 8, 16), Case(16384, 8, 64),
             Case(256, 32, 8, pool_rank=8), Case(256, 32, 8, pool_rank=64),          # true-rank cost
             Case(64, 16, 16, K=4096, N=6144, slices=3), Case(1024, 8, 16, K=4096, N=6144, slices=3),  # fused QKV
             Case(32, 8, 32, K=8192, N=8192), Case(32, 8, 16, K=16384, N=16384), Case(4096, 8, 128)]
CPU_CASES = [Case(1, 1, 16, K=1024, N=1024), Case(8, 4, 16, K=1024, N=1024), Case(32, 8, 16, K=1024, N=1024),
             Case(8, 4, 8, K=1024, N=1024, pool_rank=64)]
# Reported by the issue for vLLM 0.33 lora_shrink + lora_expand on this H200 (not measured here: vLLM is not
# installable on the benchmark machine). Keyed by (T, adapters, rank).
VLLM_033_REPORTED_US = {(1, 1, 16): 8.7, (16, 4, 16): 8.6, (64, 16, 16): 14.7, (256, 32, 16): 24.8,
                        (256, 32, 64): 35.5, (4096, 4, 16): 55.7, (16384, 8, 16): 205, (16384, 8, 64): 333}


class Problem:
    """One input set of a case on a device: pool, batch, segments, and the baselines' host-side metadata.

    Sets made with `like=` share its batch composition and segment tensors, as every layer of a model shares the
    step's one build_segments output, while their activations and adapter weights are their own."""

    def __init__(self, case: Case, dtype, device, seed, like: Optional["Problem"] = None):
        gen = torch.Generator().manual_seed(seed)
        slots = torch.randperm(case.pool_slots, generator=gen)[:case.adapters].tolist()
        token_lora = testing.random_token_slots(case.T, slots, gen)
        if like is not None:
            slots, token_lora = like.slots, like.token_lora.cpu()
        width = case.N // case.slices
        offsets = [s * width for s in range(case.slices)] + [case.N]
        ranks = [case.rank] * case.pool_slots
        self.p = testing.make_sgmv(token_lora, num_slots=case.pool_slots, K=case.K, N=case.N, max_rank=case.R,
                                   dtype=dtype, device=device, gen=gen, ranks=ranks, scales=True,
                                   slice_offsets=offsets if case.slices > 1 else None)
        self.slots = slots
        if like is not None:
            self.token_lora = like.token_lora
            self.p.token_indices, self.p.seg_indptr, self.p.seg_lora = \
                like.p.token_indices, like.p.seg_indptr, like.p.seg_lora
            self.p.lora_ranks, self.p.lora_scales = like.p.lora_ranks, like.p.lora_scales
        else:
            self.token_lora = token_lora.to(device)
            seg = lora_ops.build_segments(self.token_lora, case.pool_slots)
            self.p.token_indices, self.p.seg_indptr, self.p.seg_lora = seg
        self.offsets = offsets
        self.rows_by_slot = [(s, (token_lora == s).nonzero().flatten().to(device)) for s in slots]
        self.case = case

    def min_bytes(self) -> int:
        c, p = self.case, self.p
        e, ey = p.x.element_size(), p.y.element_size()
        weights = c.adapters * c.rank * (c.slices * c.K + c.N) * e
        return c.T * c.K * e + weights + 2 * c.T * c.N * ey


# ---- implementations: each is f(problem, y) -> None, adding the LoRA delta into y ----

def _ours(module):
    def run(pb: Problem, y):
        module.sgmv(*pb.p.args(y))
    return run


def torch_loop(pb: Problem, y):
    """PEFT's mixed batch: per adapter, gather its rows, two matmuls, scatter-add."""
    p = pb.p
    R = pb.case.R
    for slot, rows in pb.rows_by_slot:
        xs = p.x.index_select(0, rows)
        coef = p.lora_scales[slot] * p.scale
        for s in range(len(pb.offsets) - 1):
            lo, hi = pb.offsets[s], pb.offsets[s + 1]
            h = xs @ p.lora_a[slot, s * R: s * R + pb.case.rank].T
            y[:, lo:hi].index_add_(0, rows, ((h @ p.lora_b[slot, lo:hi, :pb.case.rank].T) * coef).to(y.dtype))


def gather_bmm(pb: Problem, y):
    """Per-token weight gather + bmm (the simple BGMV); every row is assumed to have an adapter."""
    p = pb.p
    R = pb.case.R
    slot = pb.token_lora.long()
    coef = (p.lora_scales[slot] * p.scale)[:, None, None]
    for s in range(len(pb.offsets) - 1):
        lo, hi = pb.offsets[s], pb.offsets[s + 1]
        a = p.lora_a[slot, s * R: s * R + pb.case.rank]            # [T, r, K]
        b = p.lora_b[slot, lo:hi, :pb.case.rank]                   # [T, n, r]
        h = torch.bmm(p.x[:, None, :], a.transpose(1, 2))          # [T, 1, r]
        y[:, lo:hi] += torch.bmm((h * coef).to(b.dtype), b.transpose(1, 2))[:, 0].to(y.dtype)


def grouped_mm(pb: Problem, y):
    """torch._grouped_mm shrink + expand over rows sorted by slot (bf16 intermediate), then scatter-add."""
    p = pb.p
    R = pb.case.R
    idx = p.token_indices.long()
    offs = p.seg_indptr[1:]
    xs = p.x.index_select(0, idx)
    coef = (p.lora_scales[pb.token_lora.long()] * p.scale)[idx, None]
    r = pb.case.rank  # the true rank: rows beyond it in a larger pool are not part of the adapter
    for s in range(len(pb.offsets) - 1):
        lo, hi = pb.offsets[s], pb.offsets[s + 1]
        h = torch._grouped_mm(xs, p.lora_a[:, s * R:s * R + r].transpose(1, 2), offs=offs)
        d = torch._grouped_mm(h, p.lora_b[:, lo:hi, :r].transpose(1, 2), offs=offs)
        y[:, lo:hi].index_add_(0, idx, (d * coef).to(y.dtype))


def implementations(device) -> Dict[str, Callable]:
    impls: Dict[str, Callable] = {}
    if device == "cpu":
        impls["cpu"] = _ours(lora_ops.ops)
    else:
        if backends.cuda_served_by.get("sgmv") == "cuda":
            impls["cuda"] = _ours(lora_ops.ops)
        if "triton" not in backends.unavailable:
            import lora_ops.triton as lt
            impls["triton"] = _ours(lt)
    impls["torch_loop"] = torch_loop
    impls["gather_bmm"] = gather_bmm
    if device != "cpu" and hasattr(torch, "_grouped_mm"):
        impls["grouped_mm"] = grouped_mm
    return impls


# ---- timing ----

def copy_bandwidth_tbps(device) -> float:
    """Device-to-device copy of 1 GiB, counting bytes read plus written."""
    src = torch.empty(1 << 29, dtype=torch.float16, device=device).normal_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()
    return 2 * src.numel() * 2 * 20 / (start.elapsed_time(end) * 1e-3) / 1e12


def _time_cuda(fn_sets: List[Callable[[], None]], graph: bool, min_ms: float = 30.0) -> float:
    """µs per call: mean over calls cycling through the input sets, as graph replay or eager launches."""
    calls = fn_sets * max(1, 20 // len(fn_sets))
    for f in calls[:len(fn_sets) * 2]:
        f()
    torch.cuda.synchronize()
    if graph:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        g = torch.cuda.CUDAGraph()
        with torch.cuda.stream(stream), torch.cuda.graph(g, stream=stream):
            for f in calls:
                f()
        torch.cuda.current_stream().wait_stream(stream)
        run = g.replay
    else:
        def run():
            for f in calls:
                f()
    run()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    reps = 1
    while True:
        start.record()
        for _ in range(reps):
            run()
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end)
        if ms >= min_ms or reps >= 1 << 14:
            return ms * 1e3 / (reps * len(calls))
        reps *= 2 if ms * 4 < min_ms else max(2, int(min_ms / max(ms, 1e-3)) + 1)


def _time_cpu(fn: Callable[[], None], min_s: float = 0.2) -> float:
    fn()
    reps, elapsed = 0, 0.0
    t0 = time.perf_counter()
    while elapsed < min_s:
        fn()
        reps += 1
        elapsed = time.perf_counter() - t0
    return elapsed / reps * 1e6


def launch_floor_us(device) -> float:
    """Graph replay of a one-element add: the per-kernel floor that every row below includes."""
    t = torch.zeros(1, device=device)
    return _time_cuda([lambda: t.add_(1)], graph=True)


def host_overhead_us(device, n=2000) -> float:
    """Enqueue cost of one eager lora_ops.sgmv call on a problem too small to keep the GPU busy."""
    pb = Problem(Case(1, 1, 8, K=64, N=64, pool_slots=4), torch.bfloat16, device, seed=0)
    args = pb.p.args()
    for _ in range(100):
        lora_ops.sgmv(*args)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        lora_ops.sgmv(*args)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / n * 1e6


def bench_case(case: Case, impls, dtype, device, l2_bytes, copy_tbps, records, log):
    pb0 = Problem(case, dtype, device, seed=1)
    set_bytes = pb0.min_bytes() + pb0.p.lora_a.numel() * pb0.p.lora_a.element_size() * 2
    n_sets = 1 if device == "cpu" else int(min(16, max(1, (2 * l2_bytes) // max(set_bytes, 1) + 1)))
    sets = [pb0] + [Problem(case, dtype, device, seed=2 + i, like=pb0) for i in range(n_sets - 1)]
    ref = reference.sgmv(*pb0.p.args())
    before = pb0.p.y.clone()
    row = {"T": case.T, "adapters": case.adapters, "rank": case.rank, "pool_rank": case.R, "K": case.K,
           "N": case.N, "slices": case.slices, "dtype": str(dtype).replace("torch.", "")}
    for name, fn in impls.items():
        y = before.clone()
        try:
            fn(pb0, y)
        except Exception as exc:  # a baseline that cannot run this shape (e.g. _grouped_mm alignment)
            log(f"  {name:<11} unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}")
            continue
        bad = testing.check_against_reference(y, before, ref, dtype)
        if bad:
            log(f"  {name:<11} WRONG vs float64 oracle: {bad}; not timed")
            continue
        ys = [pb.p.y.clone() for pb in sets]
        calls = [(lambda pb=pb, yy=yy: fn(pb, yy)) for pb, yy in zip(sets, ys)]
        modes = ["eager"] if device == "cpu" else ["graph", "eager"]
        for mode in modes:
            try:
                us = _time_cpu(calls[0]) if device == "cpu" else _time_cuda(calls, graph=(mode == "graph"))
            except Exception as exc:  # e.g. a baseline that syncs cannot be captured
                log(f"  {name:<11} {mode}: not timed ({type(exc).__name__})")
                continue
            gbps = pb0.min_bytes() / (us * 1e-6) / 1e9
            rec = dict(op="sgmv", backend=name, mode=mode, us=round(us, 3), gbps=round(gbps, 1),
                       pct_roofline=round(100 * gbps / (copy_tbps * 1e3), 1) if copy_tbps else None, **row)
            records.append(rec)
        got = [r for r in records if r["backend"] == name and r["T"] == case.T and r["K"] == case.K
               and r["rank"] == case.rank and r["pool_rank"] == case.R and r["slices"] == case.slices
               and r["adapters"] == case.adapters]
        log("  " + f"{name:<11}" + "  ".join(f"{r['mode']} {r['us']:9.2f} us ({r['pct_roofline']}% roofline)"
                                             if r['pct_roofline'] is not None else f"{r['mode']} {r['us']:9.2f} us"
                                             for r in got))


def bench_build_segments(device, records, log):
    for T in (1, 256, 4096, 16384):
        token_lora = torch.randint(-1, 32, (T,), dtype=torch.int32, device=device)
        fn = lambda: lora_ops.build_segments(token_lora, 32)
        for mode in (["eager"] if device == "cpu" else ["graph", "eager"]):
            us = _time_cpu(fn) if device == "cpu" else _time_cuda([fn], graph=(mode == "graph"))
            records.append(dict(op="build_segments", backend=backends.cuda_served_by.get("build_segments", "cpu")
                                if device != "cpu" else "cpu", mode=mode, dtype="int32", T=T, adapters=32, rank=0,
                                K=0, N=0, slices=0, us=round(us, 3), pct_roofline=None))
            log(f"  build_segments T={T:<6} {mode:<5} {us:8.2f} us")


def git_sha() -> str:
    if os.environ.get("LORA_OPS_GIT_SHA"):
        return os.environ["LORA_OPS_GIT_SHA"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True,
                                       cwd=os.path.dirname(os.path.abspath(__file__)), stderr=subprocess.DEVNULL).strip()
    except Exception:
        return "unknown"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--quick", action="store_true", help="only the first few cases")
    ap.add_argument("--impls", default=None, help="comma-separated implementations to time (default: all)")
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.csv (and <out>.png with matplotlib)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device = args.device
    log = lambda s: print(s, flush=True)
    records: List[dict] = []
    if device == "cpu":
        gpu, copy_tbps, l2 = "cpu", None, 0
        cases = CPU_CASES
    else:
        props = torch.cuda.get_device_properties(device)
        gpu, l2 = props.name, getattr(props, "L2_cache_size", 50 << 20)
        copy_tbps = copy_bandwidth_tbps(device)
        cases = GPU_CASES
        log(f"{gpu}: copy bandwidth {copy_tbps:.2f} TB/s, L2 {l2 >> 20} MiB")
        host_us = host_overhead_us(device)
        records.append(dict(op="sgmv", backend=backends.cuda_served_by.get("sgmv"), mode="host", dtype="bfloat16",
                            T=1, adapters=1, rank=8, K=64, N=64, slices=1, us=round(host_us, 3), pct_roofline=None))
        log(f"eager host overhead of lora_ops.sgmv: {host_us:.2f} us/call")
        floor_us = launch_floor_us(device)
        records.append(dict(op="launch_floor", backend="torch", mode="graph", dtype="float32", T=1, adapters=0,
                            rank=0, K=0, N=0, slices=0, us=round(floor_us, 3), pct_roofline=None))
        log(f"graph replay of a one-element add (per-kernel floor): {floor_us:.2f} us")
    if args.quick:
        cases = cases[:3]
    impls = implementations(device)
    if args.impls:
        impls = {k: v for k, v in impls.items() if k in args.impls.split(",")}
    for case in cases:
        vllm = VLLM_033_REPORTED_US.get((case.T, case.adapters, case.rank)) if case.K == case.N == 4096 and \
            case.slices == 1 and case.R == case.rank else None
        log(f"T={case.T} adapters={case.adapters} rank={case.rank} (pool rank {case.R}) K={case.K} N={case.N} "
            f"slices={case.slices}" + (f"   [vLLM 0.33 reported: {vllm} us]" if vllm else ""))
        bench_case(case, impls, dtype, device, l2, copy_tbps, records, log)
    bench_build_segments(device, records, log)
    result = {"gpu": gpu, "git_sha": git_sha(), "date": datetime.date.today().isoformat(), "torch": torch.__version__,
              "copy_tbps": round(copy_tbps, 3) if copy_tbps else None, "vllm_0.33_reported_us":
              {f"T={k[0]},adapters={k[1]},rank={k[2]}": v for k, v in VLLM_033_REPORTED_US.items()},
              "records": records}
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump(result, f, indent=1)
        keys = sorted({k for r in records for k in r})
        with open(args.out + ".csv", "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys)
            w.writeheader()
            w.writerows(records)
        _plot(records, args.out + ".png")
        log(f"wrote {args.out}.json / .csv")
    return result


def _plot(records, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    mode = "graph" if any(r["mode"] == "graph" for r in records) else "eager"  # CPU runs have eager only
    rows = [r for r in records if r["op"] == "sgmv" and r["mode"] == mode]
    labels = sorted({(r["T"], r["adapters"], r["rank"], r["pool_rank"], r["K"], r["N"], r["slices"]) for r in rows},
                    key=lambda k: (k[0], k[1]))
    names = sorted({r["backend"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 4.5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        us = {(r["T"], r["adapters"], r["rank"], r["pool_rank"], r["K"], r["N"], r["slices"]): r["us"]
              for r in rows if r["backend"] == name}
        ax.bar([j + i * width for j in range(len(labels))], [us.get(l, 0) for l in labels], width, label=name)
    ax.set_yscale("log")
    ax.set_ylabel("µs per call (log)")
    ax.set_xticks([j + 0.4 for j in range(len(labels))])
    ax.set_xticklabels([f"T{l[0]} a{l[1]} r{l[2]}/{l[3]}\n{l[4]}x{l[5]} s{l[6]}" for l in labels], fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1:])
