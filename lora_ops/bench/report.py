"""Results files of the benchmarks, and the README's benchmark section rendered from one of them, so that the
table and its claims cannot drift from the data:

    python -m lora_ops.bench.report benchmarks/results/2026-11-30-h200.json --readme README.md

rewrites the part of README.md between the `<!-- bench:begin -->` and `<!-- bench:end -->` markers; with
`--op-table lora_ops/op_tables/h200.json` it also writes the CUDA kernels' op table from the file's records
(lora_ops/op_table.py), unless the file has failures or comes from a partial run (op_table.results_problems);
with `--routes lora_ops/route_tables/<gpu>.json` the serving layer's routes table from a route sweep's records (the decode-step
bench's --routes writes the same table).
Several files of one commit and GPU (the op bench and the decode-step bench run as separate processes, so that
one's results survive the other's crash or timeout) are merged first; `--out PATH` writes the merged results."""
from __future__ import annotations

import argparse
import csv
import json
import os
import re
import sys
from typing import Dict, List

from . import names
from .peers import PEERS  # other projects' kernels in the same harness

BEGIN, END = "<!-- bench:begin -->", "<!-- bench:end -->"
OURS = tuple(name for name in names.OURS if not name.startswith("cpu"))  # the GPU tables' columns of ours
BASELINES = ("grouped_mm", "torch_loop", "gather_bmm", "gg_composed")  # gg_composed: sgmv as two grouped_gemm


def write(result: dict, out: str) -> None:
    """<out>.json, <out>.csv and, with matplotlib, <out>.png."""
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    records = result["records"]
    keys = sorted({k for r in records for k in r})
    with open(out + ".csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(records)
    _plot(records, out + ".png")


def _plot(records: List[dict], path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    rows = [r for r in records if r["op"] == "sgmv" and r["mode"] in ("graph", "eager") and r["us"] is not None]
    mode = "graph" if any(r["mode"] == "graph" for r in rows) else "eager"  # CPU runs have eager only
    rows = [r for r in rows if r["mode"] == mode]
    if not rows:
        return
    key = lambda r: (r["T"], r["adapters"], r["rank"], r["pool_rank"], r["K"], r["N"], r["slices"])
    labels = sorted({key(r) for r in rows})
    names = sorted({r["backend"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(8, len(labels) * 0.9), 4.5))
    width = 0.8 / max(len(names), 1)
    for i, name in enumerate(names):
        us = {key(r): r["us"] for r in rows if r["backend"] == name}
        ax.bar([j + i * width for j in range(len(labels))], [us.get(l, 0) for l in labels], width, label=name)
    ax.set_yscale("log")
    ax.set_ylabel(f"µs per call, {mode} (log)")
    ax.set_xticks([j + 0.4 for j in range(len(labels))])
    ax.set_xticklabels([f"T{l[0]} a{l[1]} r{l[2]}/{l[3]}\n{l[4]}x{l[5]} s{l[6]}" for l in labels], fontsize=7)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _has_copy_floor(rows: List[dict]) -> bool:
    """Whether any record has the copy floor (records from before the bench wrote it have none)."""
    return any(r.get("floor_copy_pct") is not None for r in rows)


def _decode_table(records: List[dict], between: bool = False) -> List[str]:
    """The decode steps timed with input writers (between) or without: a row never combines the two."""
    rows = [r for r in records if r["op"] == "decode_step" and bool(r.get("between_modules")) == between]
    if not rows:
        return []
    routes = [b for b in ("sgmv-cuda", "sgmv-triton", "fold-cuda", "fold-triton", "kext-cuda") + PEERS
              if any(r["backend"] == b for r in rows)]
    copy = _has_copy_floor(rows)
    out = ["| model | T | adapters | rank | base step | floor | " + ("copy floor | " if copy else "")
           + "fold floor | serving default | " + " | ".join(routes) + " |",
           "|---|---|---|---|---|---|---|---|" + "---|" * (len(routes) + copy)]
    steps: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:  # records from before the spread was recorded have even sizes
        steps.setdefault((r["model"], r["T"], r["adapters"], r["rank"], r.get("spread", "even")), {})[r["backend"]] = r
    for (model, T, adapters, rank, spread), by in steps.items():
        base = by.get("base")
        if base is None:
            continue
        best = min((by[b]["overhead_pct"] for b in routes if b in by), default=None)
        cells = []
        for b in routes:
            if b not in by:
                cells.append("—")
                continue
            v = f"+{by[b]['overhead_pct']:.0f}%"
            cells.append(f"**{v}**" if by[b]["overhead_pct"] == best else v)
        default = next((f"+{r['overhead_pct']:.0f}% ({b})" for b, r in by.items() if r.get("serving_default")), "—")
        floors = f"+{base['floor_pct']:.1f}% | "
        if copy:
            floors += "— | " if base.get("floor_copy_pct") is None else f"+{base['floor_copy_pct']:.1f}% | "
        drawn = " drawn" if spread == "drawn" else ""
        out.append(f"| {model} | {T} | {adapters}{drawn} | {rank} | {base['us'] / 1e3:.2f} ms | {floors}"
                   f"{_fold_floor(model, T, adapters, rank)} | {default} | " + " | ".join(cells) + " |")
    return out


def _fold_floor(model: str, T: int, adapters: int, rank: int) -> str:
    """The fold route's own floor (every pool slot's A, the present adapters' B), from the model's shapes: records
    from before the bench wrote it get it too."""
    from . import decode_step  # imports torch: only for a results file with decode steps
    if model not in decode_step.MODELS:
        return "—"
    return f"+{decode_step.floors_pct(decode_step.MODELS[model], decode_step.Step(T, adapters, rank))[1]:.1f}%"


def _op_table(records: List[dict]) -> List[str]:
    rows = [r for r in records if r["op"] == "sgmv" and r["mode"] == "graph" and r["us"] is not None]
    if not rows:
        return []
    key = lambda r: (r["T"], r["adapters"], r["rank"], r["pool_rank"], r["K"], r["N"], r["slices"])
    cases: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        cases.setdefault(key(r), {})[r["backend"]] = r
    names = [n for n in OURS + BASELINES + PEERS if any(n in by for by in cases.values())]
    out = ["| T | adapters | rank (pool) | K × N, slices | " + " | ".join(names) + " | fastest |",
           "|---|---|---|---|" + "---|" * (len(names) + 1)]
    for (T, a, r, R, K, N, S), by in cases.items():
        cells = []
        for n in names:
            if n not in by:
                cells.append("—")
            elif n in OURS and by[n].get("pct_roofline") is not None:
                cells.append(f"{by[n]['us']:.1f} ({by[n]['pct_roofline']:.0f}%)")
            else:
                cells.append(f"{by[n]['us']:.1f}")
        fastest = min(by, key=lambda n: by[n]["us"])
        out.append(f"| {T} | {a} | {r} ({R}) | {K} × {N}, {S} | " + " | ".join(cells) + f" | {fastest} |")
    return out


def _expand_table(records: List[dict]) -> List[str]:
    rows = [r for r in records if r["op"] == "lora_expand" and r["mode"] == "graph" and r["us"] is not None]
    if not rows:
        return []
    key = lambda r: (r["T"], r["adapters"], r["rank"], r["pool_rank"], r["N"], r["slices"])
    cases: Dict[tuple, Dict[str, dict]] = {}
    for r in rows:
        cases.setdefault(key(r), {})[r["backend"]] = r
    names = [n for n in OURS + BASELINES + PEERS if any(n in by for by in cases.values())]
    out = ["| T | adapters | rank (pool) | N, slices | " + " | ".join(names) + " | fastest |",
           "|---|---|---|---|" + "---|" * (len(names) + 1)]
    for (T, a, r, R, N, S), by in cases.items():
        cells = [_cell(by.get(n), n) for n in names]
        fastest = min(by, key=lambda n: by[n]["us"])
        out.append(f"| {T} | {a} | {r} ({R}) | {N}, {S} | " + " | ".join(cells) + f" | {fastest} |")
    return out


def _cell(r, name) -> str:
    """µs, with (TFLOP/s,) % of the memory roofline for our implementations; 'unavailable' for a baseline that
    could not run; '—' when not run."""
    if r is None:
        return "—"
    if r["us"] is None:
        return "unavailable"
    extra = [f"{r['tflops']:.0f} TF/s"] if r.get("tflops") is not None else []
    if name in OURS and r.get("pct_roofline") is not None:
        extra.append(f"{r['pct_roofline']:.0f}%")
    return f"{r['us']:.1f}" + (f" ({', '.join(extra)})" if extra else "")


def _grouped_gemm_rows(records: List[dict]) -> Dict[tuple, Dict[str, dict]]:
    key = lambda r: (r["shape"], r["groups"], r["T"], r["K"], r["N"], r["dtype"], r["x_dtype"], r["y_dtype"],
                     r["accumulate"])
    cases: Dict[tuple, Dict[str, dict]] = {}
    for r in records:
        if r["op"] == "grouped_gemm" and r["mode"] == "graph":
            cases.setdefault(key(r), {})[r["backend"]] = r
    return cases


def _grouped_gemm_table(records: List[dict]) -> List[str]:
    cases = _grouped_gemm_rows(records)
    if not cases:
        return []
    names = [n for n in OURS + BASELINES + PEERS if any(n in by for by in cases.values())]
    out = ["| case | G × M, K × N | w / x / y | memory floor | " + " | ".join(names) + " | fastest |",
           "|---|---|---|---|" + "---|" * (len(names) + 1)]
    for (shape, G, T, K, N, w, x, y, acc), by in cases.items():
        timed = {n: r for n, r in by.items() if r["us"] is not None}
        ref = next((r for r in timed.values() if r.get("pct_roofline")), None)
        floor = f"{ref['us'] * ref['pct_roofline'] / 100:.1f}" if ref else "—"
        fastest = min(timed, key=lambda n: timed[n]["us"]) if timed else "—"
        out.append(f"| {shape}{' (y +=)' if acc else ''} | {G} × {T // G}, {K} × {N} | {_short(w)} / {_short(x)} / "
                   f"{_short(y)} | {floor} | " + " | ".join(_cell(by.get(n), n) for n in names) + f" | {fastest} |")
    return out


def _short(dtype: str) -> str:
    return {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, dtype)


def _grouped_gemm_claims(records: List[dict]) -> List[str]:
    """Issue 13's targets: ≥ 0.9× torch._grouped_mm's TFLOP/s, fp16 as fast as bf16, LoRA shapes at ≥ 85% of the
    memory roofline; each said as measured."""
    out = []
    cases = _grouped_gemm_rows(records)
    best = lambda by: min((by[n] for n in OURS if n in by and by[n]["us"] is not None), key=lambda r: r["us"],
                          default=None)
    for (shape, G, T, K, N, w, x, y, acc), by in cases.items():
        ours, torch_mm = best(by), by.get("grouped_mm")
        if ours is None:
            continue
        if torch_mm is not None and torch_mm["us"] is not None:
            how = ("timed alone, on its own output" if torch_mm.get("timed_alone")
                   else "timed with the store of its output into y")
            out.append(f"- grouped_gemm {shape} ({_short(w)}): lora_ops ({ours['backend']}) reaches "
                       f"{ours['tflops'] / torch_mm['tflops']:.2f}× the TFLOP/s of torch._grouped_mm "
                       f"({ours['tflops']:.0f} against {torch_mm['tflops']:.0f}; torch._grouped_mm {how}).")
        elif w == "float16":
            # the same case in bf16: key (shape, groups, T, K, N, w, x, y, accumulate)
            twin = next((b for k, b in cases.items() if k[0] == shape and k[5] == "bfloat16" and best(b) is not None),
                        None)
            eager = next((r for r in records if r["op"] == "grouped_gemm" and r["backend"] == "grouped_mm"
                          and r["mode"] == "eager" and r.get("us") and r["shape"] == shape
                          and r["dtype"] == "float16"), None)
            torch_fp16 = ("torch._grouped_mm has no fp16 path" if eager is None else
                          f"torch._grouped_mm's fp16 path cannot be captured in a graph; eager it takes "
                          f"{eager['us']:.1f} µs, {eager['tflops']:.0f} TFLOP/s")
            if twin is not None:
                out.append(f"- grouped_gemm {shape} in fp16: {ours['tflops']:.0f} TFLOP/s, "
                           f"{ours['tflops'] / best(twin)['tflops']:.2f}× its bf16 speed ({torch_fp16}).")
        if min(K, N) <= 128 and ours.get("pct_roofline") is not None:
            out.append(f"- grouped_gemm {shape}: {ours['us']:.1f} µs, {ours['pct_roofline']:.0f}% of the memory "
                       f"roofline ({ours['backend']}).")
    return out


def _claims(records: List[dict]) -> List[str]:
    rows = [r for r in records if r["op"] == "sgmv" and r["mode"] == "graph" and r["us"] is not None]
    key = lambda r: (r["T"], r["adapters"], r["rank"], r["pool_rank"], r["K"], r["N"], r["slices"])
    cases: Dict[tuple, Dict[str, float]] = {}
    for r in rows:
        cases.setdefault(key(r), {})[r["backend"]] = r["us"]
    ours_best = [c for c, by in cases.items() if min(by, key=by.get) in OURS]
    lost = [(c, min(by, key=by.get)) for c, by in cases.items() if min(by, key=by.get) not in OURS]
    out = []
    if cases:
        out.append(f"- lora_ops (CUDA or Triton) is the fastest implementation on {len(ours_best)} of {len(cases)} "
                   "op cases" + ("." if not lost else ", and slower than a baseline or peer on: " + "; ".join(
                       f"T={c[0]}, {c[1]} adapters, rank {c[2]} ({w})" for c, w in lost) + "."))
    both = [by for by in cases.values() if "cuda" in by and "triton" in by]
    if both:
        cuda_wins = sum(by["cuda"] <= by["triton"] for by in both)
        out.append(f"- CUDA beats Triton on {cuda_wins} of {len(both)} op cases.")
    seg = [r for r in records if r["op"] == "build_segments" and r["mode"] == "graph"]
    if seg:
        out.append("- `build_segments` (graph replay): " + ", ".join(f"{r['us']:.1f} µs at T = {r['T']}" for r in seg)
                   + ".")
    return out


def merge(results: List[dict]) -> dict:
    """One result from runs of one commit on one GPU: their records and failures together, the launch floor and
    copy bandwidth of the first, the op bench's settings of the run that had one (at most one may)."""
    for key in ("gpu", "git_sha", "torch"):
        values = sorted({str(r[key]) for r in results})
        if len(values) > 1:
            raise ValueError(f"the results disagree on {key}: {values}; merge only runs of one commit on one GPU")
    benches = [r["op_bench"] for r in results if "op_bench" in r]
    if len(benches) > 1:
        raise ValueError("more than one of the results has an op bench; merge at most one")
    merged = {k: v for k, v in results[0].items() if k != "op_bench"}
    merged["failures"] = [f for r in results for f in r["failures"]]
    merged["records"] = list(results[0]["records"]) + [rec for r in results[1:] for rec in r["records"]
                                                        if rec["op"] != "launch_floor"]
    if benches:
        merged["op_bench"] = benches[0]
    return merged


def _decode_legend(copy: bool) -> str:
    copy_floor = ("; *copy floor*, those bytes at the run's copy bandwidth, over the base step: about the least that "
                  "kernels reading them after the base GEMM (sgmv, vllm) can add, where a route reading them in a "
                  "GEMM of its own (fold, kext) can beat both floors if the base GEMM runs below copy bandwidth"
                  if copy else "")
    return ("**Decode step** (every linear layer of the model in one CUDA graph, bf16, 32-slot pool, each row on a "
            "random adapter; LoRA overhead over the base step, best route in bold), beside its floors: *floor*, the "
            "adapters' bytes over the base weights' bytes, as if read at the base step's bandwidth" + copy_floor
            + "; *fold floor*, the fold route's own where its GEMM reads every pool slot's A (the present adapters' "
            "B; fold_linear's sm_90 kernel skips the unused slots' A):")


def short_sha(sha: str) -> str:
    """A commit's first 7 digits, keeping the "-dirty" of records from a changed tree (__main__.git_sha)."""
    return sha[:7] + ("-dirty" if sha.endswith("-dirty") else "")


def readme_section(result: dict) -> str:
    records = result["records"]
    floor = next((r["us"] for r in records if r["op"] == "launch_floor"), None)
    head = [f"{result['gpu']}, {result['date']}, commit `{short_sha(result['git_sha'])}`, torch {result['torch']}."
            + (f" Copy bandwidth measured in the same run: {result['copy_tbps']:.2f} TB/s." if result.get("copy_tbps")
               else "") + (f" A one-element add costs {floor:.2f} µs per graph node." if floor else "")]
    decode, between = _decode_table(records), _decode_table(records, between=True)
    if decode or between:
        head += ["", _decode_legend(_has_copy_floor([r for r in records if r["op"] == "decode_step"]))]
    if decode:
        head += [""] + decode
    if between:
        head += ["", "With --between-modules (a kernel writes each module's input just before the module, as a model's "
                 "norms, attention and activation do):", ""] + between
    op = _op_table(records)
    if op:
        head += ["", "**sgmv op** (bf16, graph replay, µs; in brackets % of the memory roofline):", ""] + op
    expand = _expand_table(records)
    if expand:
        head += ["", "**lora_expand op** (the fold route's expand alone, h bf16 [T, 32 slots, S·R]; bf16, graph "
                 "replay, µs; in brackets % of the memory roofline):", ""] + expand
    grouped = _grouped_gemm_table(records)
    if grouped:
        head += ["", "**grouped_gemm op** (graph replay, µs; in brackets TFLOP/s and % of the memory roofline; "
                 "the memory floor is the minimum bytes over the copy bandwidth):", ""] + grouped
    claims = _claims(records) + _grouped_gemm_claims(records)
    if claims:
        head += [""] + claims
    return "\n".join(head)


def update_readme(readme: str, result: dict) -> None:
    with open(readme) as f:
        text = f.read()
    if BEGIN not in text or END not in text:
        raise SystemExit(f"{readme}: no {BEGIN} ... {END} section to rewrite")
    section = f"{BEGIN}\n{readme_section(result)}\n{END}"
    text = re.sub(re.escape(BEGIN) + r".*?" + re.escape(END), lambda _: section, text, flags=re.S)
    with open(readme, "w") as f:
        f.write(text)


def table_meta(result: dict, source: str) -> dict:
    """What a table written from these results records about its measurement."""
    return {"gpu": result["gpu"], "git_sha": result["git_sha"], "date": result["date"], "torch": result["torch"],
            "source": source}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("results", nargs="+", help="results JSON written by python -m lora_ops.bench --out (several: "
                                               "merged, see merge)")
    ap.add_argument("--readme", default=None, help="rewrite this file's bench section (default: print it)")
    ap.add_argument("--op-table", default=None, metavar="PATH",
                    help="write the op table built from the file's records (lora_ops/op_tables/<gpu>.json, "
                         "<gpu> as op_table.gpu_word names the records' GPU) instead")
    ap.add_argument("--routes", default=None, metavar="PATH",
                    help="write the serving layer's routes table built from the file's route-sweep records "
                         "(lora_ops/route_tables/<gpu>.json; what --decode-step --routes writes) instead")
    ap.add_argument("--routes-models", default="llama3-8b,qwen2-7b,llama3-70b-tp8",
                    help="with --routes: the models whose sweeps the table is built from, the first the default "
                         "where a pool's modules are as near two (default: llama3-8b,qwen2-7b,llama3-70b-tp8)")
    ap.add_argument("--out", default=None, help="write the merged results to <out>.json/.csv/.png")
    args = ap.parse_args(argv)
    loaded = []
    for path in args.results:
        with open(path) as f:
            loaded.append(json.load(f))
    try:
        result = merge(loaded)
    except ValueError as exc:
        raise SystemExit(f"{', '.join(args.results)}: {exc}")
    source = os.path.basename(args.results[0])
    if args.out:
        write(result, args.out)
        source = os.path.basename(args.out) + ".json"
    if args.op_table:
        from lora_ops import op_table
        try:
            op_table.write(args.op_table, result, table_meta(result, source=source))
        except ValueError as exc:
            raise SystemExit(f"{', '.join(args.results)}: {exc}")
    elif args.routes:
        from lora_ops.bench import decode_step
        try:
            if result["failures"]:
                raise ValueError(f"a run with failures writes no routes table: {result['failures']}")
            table = decode_step.routes_table(result["records"], table_meta(result, source=source),
                                             args.routes_models.split(","))
        except ValueError as exc:
            raise SystemExit(f"{', '.join(args.results)}: {exc}")
        with open(args.routes, "w") as f:
            json.dump(table, f, indent=1)
    elif args.readme:
        update_readme(args.readme, result)
    elif not args.out:
        print(readme_section(result))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
