"""Command line of the benchmarks; exits non-zero when an implementation of lora_ops is wrong or crashes."""
from __future__ import annotations

import argparse
import datetime
import os
import subprocess
import sys
from typing import List

import torch

from lora_ops import backends

from . import decode_step, ops, report
from .timing import copy_bandwidth_tbps, launch_floor_us


def git_sha() -> str:
    if os.environ.get("LORA_OPS_GIT_SHA"):
        return os.environ["LORA_OPS_GIT_SHA"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True, stderr=subprocess.DEVNULL,
                                       cwd=os.path.dirname(os.path.abspath(__file__))).strip()
    except Exception:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lora_ops.bench", description=ops.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--ops", action="store_true", help="the op bench (the default when --decode-step is not given)")
    ap.add_argument("--decode-step", action="store_true", help="the decode-step bench (CUDA only; see decode_step.py)")
    ap.add_argument("--models", default="llama3-8b",
                    help=f"decode-step model shapes, comma-separated or 'all' ({', '.join(decode_step.MODELS)})")
    ap.add_argument("--routes", default=None, metavar="PATH",
                    help="with --decode-step: time every route per regime and write the serving layer's table "
                         "(lora_ops/routes.json)")
    ap.add_argument("--parts", action="store_true",
                    help="with --decode-step: also time each route's parts alone (GEMMs, expand, sgmv)")
    ap.add_argument("--quick", action="store_true", help="only the first few op cases / the first decode step")
    ap.add_argument("--impls", default=None, help="comma-separated implementations or routes to time (default: all)")
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.csv (and <out>.png with matplotlib)")
    args = ap.parse_args(argv)
    dtype = getattr(torch, args.dtype)
    device = args.device
    only = args.impls.split(",") if args.impls else None
    log = lambda s: print(s, flush=True)
    records: List[dict] = []
    failures: List[str] = []
    copy_tbps = None
    if device == "cpu":
        gpu, l2, cases = "cpu", 0, ops.CPU_CASES
        if args.decode_step:
            ap.error("--decode-step needs a CUDA device")
    else:
        props = torch.cuda.get_device_properties(device)
        gpu, l2, cases = props.name, getattr(props, "L2_cache_size", 50 << 20), ops.GPU_CASES
        copy_tbps = copy_bandwidth_tbps(device)
        log(f"{gpu}: copy bandwidth {copy_tbps:.2f} TB/s, L2 {l2 >> 20} MiB")
        floor_us = launch_floor_us(device)
        records.append(dict(op="launch_floor", backend="torch", mode="graph", us=round(floor_us, 3)))
        log(f"graph replay of a one-element add (per-kernel floor): {floor_us:.2f} us")
    if args.ops or not args.decode_step:
        if device != "cpu":
            host_us = ops.host_overhead_us(device)
            records.append(dict(op="sgmv", backend=backends.cuda_served_by.get("sgmv"), mode="host",
                                dtype="bfloat16", T=1, adapters=1, rank=8, K=64, N=64, slices=1,
                                us=round(host_us, 3), pct_roofline=None))
            log(f"eager host overhead of lora_ops.sgmv: {host_us:.2f} us/call")
        impls = ops.implementations(device)
        if only:
            impls = {k: v for k, v in impls.items() if k in only}
        for case in cases[:3] if args.quick else cases:
            log(f"T={case.T} adapters={case.adapters} rank={case.rank} (pool rank {case.R}) K={case.K} N={case.N} "
                f"slices={case.slices}")
            ops.bench_case(case, impls, dtype, device, l2, copy_tbps, records, failures, log)
        ops.bench_build_segments(device, records, log)
    if args.decode_step:
        models = list(decode_step.MODELS) if args.models == "all" else args.models.split(",")
        steps = decode_step.STEPS[:1] if args.quick else decode_step.STEPS
        decode_step.run(models, device, records, failures, log, only, steps, args.parts)
    meta = {"gpu": gpu, "git_sha": git_sha(), "date": datetime.date.today().isoformat(), "torch": torch.__version__}
    if args.routes:
        if not args.decode_step:
            ap.error("--routes needs --decode-step")
        decode_step.write_routes(args.routes, device, records, failures, log, meta)
    result = dict(meta, copy_tbps=round(copy_tbps, 3) if copy_tbps else None, records=records)
    if args.out:
        report.write(result, args.out)
        log(f"wrote {args.out}.json / .csv")
    for f in failures:
        log(f"FAILURE: {f}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
