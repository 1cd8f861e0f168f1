"""Command line of the benchmarks; exits non-zero when an implementation of lora_ops is wrong or crashes."""
from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import subprocess
import sys
from typing import List

import torch

from lora_ops import backends, op_table, routes

from . import decode_step, names, ops, peers, report
from .timing import copy_bandwidth_tbps, launch_floor_us


def git_sha(cwd: str = os.path.dirname(os.path.abspath(__file__))) -> str:
    """The commit the records come from: LORA_OPS_GIT_SHA (the GPU machine's copy of the tree has no .git: the
    caller names the commit it copied), else HEAD, with "-dirty" when tracked files differ from it (such records
    came from no commit)."""
    if os.environ.get("LORA_OPS_GIT_SHA"):
        return os.environ["LORA_OPS_GIT_SHA"]
    try:
        git = lambda *args: subprocess.check_output(["git", *args], text=True, stderr=subprocess.DEVNULL, cwd=cwd)
        sha = git("rev-parse", "HEAD").strip()
        return sha + ("-dirty" if git("status", "--porcelain", "--untracked-files=no").strip() else "")
    except Exception:
        return "unknown"


OP_KINDS = ("sgmv", "lora_expand", "grouped_gemm", "build_segments")


def run_op_bench(kinds, quick, min_tokens, only, dtype, device, l2, copy_tbps, records, failures, log,
                 sgmv_cases=None) -> None:
    """The op bench's cases of each kind (sgmv: `sgmv_cases` where given) of at least `min_tokens` tokens (--quick:
    the first few of them), timed on every implementation in `only` (default: all but names.ON_REQUEST)."""
    pick = lambda impls: {k: v for k, v in impls.items() if (k in only if only else k not in names.ON_REQUEST)}
    cpu = device == "cpu"
    long_enough = lambda cases: [case for case in cases if case.T >= min_tokens]
    if "sgmv" in kinds:
        impls = pick(ops.implementations(device))
        cases = long_enough(sgmv_cases or (ops.CPU_CASES if cpu else ops.GPU_CASES))
        for case in cases[:3] if quick else cases:
            log(f"sgmv T={case.T} adapters={case.adapters} rank={case.rank} (pool rank {case.R}) K={case.K} "
                f"N={case.N} slices={case.slices}")
            ops.bench_case(case, impls, dtype, device, l2, copy_tbps, records, failures, log)
    if "lora_expand" in kinds:
        impls = pick(ops.expand_implementations(device))
        cases = long_enough(ops.CPU_EXPAND_CASES if cpu else ops.GPU_EXPAND_CASES)
        for case in cases[:1] if quick else cases:
            log(f"lora_expand T={case.T} adapters={case.adapters} rank={case.rank} (pool rank {case.R}) "
                f"N={case.N} slices={case.slices}")
            ops.bench_expand_case(case, impls, dtype, device, l2, copy_tbps, records, failures, log)
    if "grouped_gemm" in kinds:
        impls = pick(ops.gg_implementations(device))
        cases = long_enough(ops.CPU_GG_CASES if cpu else ops.GPU_GG_CASES)
        for case in cases[:1] + cases[-2:] if quick else cases:
            log(f"grouped_gemm {case.shape}: {case.groups} groups, T={case.T} K={case.K} N={case.N} w {case.dtype}"
                f" x {case.x_dtype or case.dtype} y {case.y_dtype or case.dtype}"
                f"{' accumulate' if case.accumulate else ''}")
            ops.bench_gg_case(case, impls, device, l2, copy_tbps, records, failures, log)
    if "build_segments" in kinds:
        ops.bench_build_segments(device, records, failures, log)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lora_ops.bench", description=ops.__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    ap.add_argument("--ops", action="store_true", help="the op bench (the default when --decode-step is not given)")
    ap.add_argument("--op-kinds", default=",".join(OP_KINDS),
                    help=f"with the op bench: which ops, comma-separated (default: {','.join(OP_KINDS)})")
    ap.add_argument("--op-table", default=None, metavar="PATH",
                    help="with the op bench: write the CUDA kernels' op table from this run's graph records "
                         "(lora_ops/op_tables/<gpu>.json; needs --out, whose .json the table names as its source, "
                         "a CUDA device, bf16 or fp16, every op and implementation, not --quick; a run with "
                         "failures writes none)")
    ap.add_argument("--decode-step", action="store_true", help="the decode-step bench (CUDA only; see decode_step.py)")
    ap.add_argument("--models", default="llama3-8b",
                    help=f"decode-step model shapes, comma-separated or 'all' ({', '.join(decode_step.MODELS)})")
    ap.add_argument("--routes", default=None, metavar="PATH",
                    help="with --decode-step: time every route per regime on each --models shape and write the "
                         "routes table of each (the serving layer's: lora_ops/route_tables/<gpu>.json, of all three shapes)")
    ap.add_argument("--between-modules", action="store_true",
                    help="with --decode-step: a kernel writes each module's input just before it, as a model's norms "
                         "and activations do (see decode_step.py)")
    ap.add_argument("--parts", action="store_true",
                    help="with --decode-step: also time each route's parts alone (GEMMs, expand, sgmv), and each "
                         "module's layers alone through the base GEMM and each fold and kext route")
    ap.add_argument("--steps", default=None, metavar="T/ADAPTERS/RANK[/drawn],...",
                    help="with --decode-step: these steps instead of the default six (issue 12's four, then two of "
                         "them drawn; e.g. 16/16/64,64/16/64/drawn: /drawn spreads the rows over the adapters "
                         "unevenly, as a serving batch does)")
    ap.add_argument("--quick", action="store_true", help="only the first few op cases / the first decode step")
    ap.add_argument("--min-tokens", type=int, default=0, metavar="T",
                    help="with the op bench: only the sgmv, lora_expand and grouped_gemm cases of at least T tokens "
                         "(e.g. 1024: the prefill cases, for an A/B of the prefill kernels)")
    ap.add_argument("--sgmv-cases", default=None, metavar="T/ADAPTERS/RANK[/SLICES],...",
                    help="with the op bench: these sgmv cases instead of the default ones (K = N = 4096; 3 slices: "
                         "the fused QKV, N = 6144), e.g. with --impls cuda,cuda-mma,cuda-wgmma-rows64,"
                         "cuda-wgmma-rows128 the rows that the prefill kernel choice's bounds come from")
    ap.add_argument("--impls", default=None,
                    help="comma-separated implementations or routes to time (default: all but the sgmv op's "
                         f"{', '.join(names.ON_REQUEST)})")
    ap.add_argument("--out", default=None, help="write <out>.json and <out>.csv (and <out>.png with matplotlib)")
    args = ap.parse_args(argv)
    kinds = args.op_kinds.split(",")
    if set(kinds) - set(OP_KINDS):
        ap.error(f"--op-kinds: unknown {sorted(set(kinds) - set(OP_KINDS))}; expected some of {OP_KINDS}")
    if args.op_table and not args.out:
        ap.error("--op-table needs --out: the table names the results file it was built from")
    if args.steps and not args.decode_step:
        ap.error("--steps needs --decode-step")
    try:
        sgmv_cases = ops.parse_sgmv_cases(args.sgmv_cases) if args.sgmv_cases else None
    except ValueError as e:
        ap.error(f"--sgmv-cases: {e}")
    if sgmv_cases and ("sgmv" not in kinds or not (args.ops or not args.decode_step)):
        ap.error("--sgmv-cases needs the op bench (--ops, or no --decode-step) with the sgmv op in --op-kinds")
    if args.between_modules and not args.decode_step:
        ap.error("--between-modules needs --decode-step")
    swept = set(decode_step.MODELS) if args.models == "all" else set(args.models.split(","))
    serving_file = args.routes and os.path.dirname(os.path.abspath(args.routes)) == os.path.abspath(routes.TABLES_DIR)
    if serving_file and swept != set(decode_step.MODELS):
        ap.error(f"--routes {args.routes}: the serving layer's file holds every shape's table: give --models all "
                 "(or write elsewhere and build it with python -m lora_ops.bench.report --routes)")
    if serving_file and args.device.startswith("cuda") and torch.cuda.is_available():
        own = f"{op_table.gpu_word(torch.cuda.get_device_name(torch.device(args.device)))}.json"
        if os.path.basename(args.routes) != own:  # another GPU's table would be overwritten with this one's times
            ap.error(f"--routes {args.routes}: the serving layer's tables are named by the GPU they were measured on; "
                     f"this GPU's is {os.path.join(os.path.dirname(args.routes), own)}")
    try:
        steps = decode_step.parse_steps(args.steps) if args.steps else None
    except ValueError as e:
        ap.error(f"--steps: {e}")
    if args.op_table and args.decode_step and not args.ops:
        ap.error("--op-table needs the op bench (--ops)")
    dtype = getattr(torch, args.dtype)
    device = args.device
    only = args.impls.split(",") if args.impls else None
    run_ops = args.ops or not args.decode_step
    settings = dict(device=device, quick=args.quick, min_tokens=args.min_tokens, impls=only, op_kinds=kinds,
                    dtype=args.dtype, sgmv_cases=args.sgmv_cases)
    if args.op_table and op_table.run_problems(settings):
        ap.error("--op-table: no table from this run: " + "; ".join(op_table.run_problems(settings)))
    log = lambda s: print(s, flush=True)
    records: List[dict] = []
    failures: List[str] = []
    if backends.triton_error is not None:  # installed but broken: its kernels cannot be timed
        failures.append(f"triton {backends.unavailable['triton']}")
    copy_tbps = None
    if device == "cpu":
        gpu, l2 = "cpu", 0
        if args.decode_step:
            ap.error("--decode-step needs a CUDA device")
    else:
        props = torch.cuda.get_device_properties(device)
        gpu, l2 = props.name, getattr(props, "L2_cache_size", 50 << 20)
        copy_tbps = copy_bandwidth_tbps(device)
        log(f"{gpu}: copy bandwidth {copy_tbps:.2f} TB/s, L2 {l2 >> 20} MiB")
        floor_us = launch_floor_us(device)
        records.append(dict(op="launch_floor", backend="torch", mode="graph", us=round(floor_us, 3)))
        log(f"graph replay of a one-element add (per-kernel floor): {floor_us:.2f} us")
        vllm_ops, why = peers.vllm_ops()
        log("peer vllm: vLLM's Triton LoRA ops" if vllm_ops is not None else f"peer vllm: none ({why})")
    # The op bench times each backend alone: the C++ kernels without the op table that hands some regimes to Triton
    # (the table is made from these records). The decode step and the routes sweep time the routes as the serving
    # layer runs them, whose backend "cuda" is the public op, with the installed table (lora_ops/routes.py).
    if run_ops:
        if device != "cpu":
            for table_on in (True, False):
                with contextlib.nullcontext() if table_on else op_table.disabled():
                    host_us = ops.host_overhead_us(device)
                records.append(dict(op="sgmv", backend=backends.cuda_served_by.get("sgmv"), mode="host",
                                    dtype="bfloat16", T=1, adapters=1, rank=8, K=64, N=64, slices=1,
                                    us=round(host_us, 3), pct_roofline=None, op_table=table_on))
                log(f"eager host overhead of lora_ops.sgmv, op table {'on' if table_on else 'off'}: "
                    f"{host_us:.2f} us/call")
        with op_table.disabled():
            run_op_bench(kinds, args.quick, args.min_tokens, only, dtype, device, l2, copy_tbps, records, failures,
                         log, sgmv_cases)
    if args.decode_step:
        models = list(decode_step.MODELS) if args.models == "all" else args.models.split(",")
        steps = steps or (decode_step.STEPS[:1] if args.quick else decode_step.STEPS)
        decode_step.run(models, device, records, failures, log, only, steps, args.parts, args.between_modules,
                        copy_tbps)
    meta = {"gpu": gpu, "git_sha": git_sha(), "date": datetime.date.today().isoformat(), "torch": torch.__version__}
    if args.routes:
        if not args.decode_step:
            ap.error("--routes needs --decode-step")
        decode_step.write_routes(args.routes, device, records, failures, log, meta, models)
    # l2_bytes: what the op records' rotated_bytes are measured against
    result = dict(meta, copy_tbps=round(copy_tbps, 3) if copy_tbps else None, l2_bytes=l2 or None,
                  **({"op_bench": settings} if run_ops else {}), failures=failures, records=records)
    if args.out:
        report.write(result, args.out)
        log(f"wrote {args.out}.json / .csv")
    table_refused = False
    if args.op_table:
        try:
            table = op_table.write(args.op_table, result,
                                   report.table_meta(result, source=os.path.basename(args.out) + ".json"))
        except ValueError as exc:
            log(str(exc))
            table_refused = True
        else:
            log(f"wrote {args.op_table}:")
            for op in op_table.OPS:
                log(f"  {op:<14} {op_table.describe(table, op)}")
    for f in failures:
        log(f"FAILURE: {f}")
    return 1 if failures or table_refused else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
