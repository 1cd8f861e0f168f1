"""Where a decode step's time goes between kernels: the decode-step bench's step (lora_ops.bench.decode_step, a few
layers of one model shape) captured as one CUDA graph per route, replayed under the profiler, and each kernel's
start and end on the GPU printed for the middle layer's kernels, module after module (µs from the layer's first
kernel's start; `gap`: from the previous kernel's end to this one's start, negative where they overlap, as a
programmatic launch lets them).
`python benchmarks/timeline.py [--model llama3-8b] [--steps 32/1/16,...] [--routes base,kext-cuda,fold-cuda]
[--layers 4]` (at least 2: the middle layer's kernels follow another layer's)."""
import argparse
import dataclasses
import json
import os
import tempfile

import torch

from lora_ops.bench import decode_step as ds
from lora_ops.bench.timing import capture


def kernel_events(graph: torch.cuda.CUDAGraph, replays: int):
    """(name, start µs, end µs) of every kernel of the last of `replays` replays, in start order."""
    for _ in range(replays):
        graph.replay()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = json.load(f)
    kernels = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"]))
               for e in trace["traceEvents"] if e.get("cat") == "kernel"]
    return sorted(kernels, key=lambda k: k[1])


def short(name: str) -> str:
    for key, label in (("kext_shrink", "shrink"), ("KextMainloop", "kext-gemm"), ("expand", "expand"),
                       ("build_segments", "segments"), ("device_kernel", "cutlass"), ("gemm", "cublas"),
                       ("sm90_xmma", "cublas"), ("nvjet", "cublas")):
        if key in name:
            return label
    return name[:40]


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="llama3-8b", choices=list(ds.MODELS))
    parser.add_argument("--steps", default="32/1/16,32/32/16,128/32/16")
    parser.add_argument("--routes", default="base,kext-cuda,fold-cuda")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--between-modules", action="store_true")
    args = parser.parse_args()
    if args.layers < 2:
        parser.error("--layers: at least 2 (the middle layer's kernels follow another layer's)")
    model = dataclasses.replace(ds.MODELS[args.model], layers=args.layers)
    ops = ds.routes()
    for step in ds.parse_steps(args.steps):
        s = ds.Setup(model, step, "cuda", between=args.between_modules)
        for route in args.routes.split(","):
            if route == "base":
                calls = s.base_calls()
            else:
                kind, op = ops[route]
                calls = s.kext_calls(route, op) if kind == "kext" else s.fold_calls(route, op) if kind == "fold" \
                    else s.sgmv_calls(op)
            for f in calls:  # once eagerly: handles and workspaces before the capture
                f()
            events = kernel_events(capture(calls), replays=5)
            one_off = sum("build_segments" in name for name, _, _ in events)  # once per step, before the layers
            per_layer = (len(events) - one_off) // args.layers
            total = events[-1][2] - events[one_off][1]
            print(f"{model.name} {step.label()} {route}: {len(events)} kernels,"
                  f" {total:.1f} us for {args.layers} layers ({total / args.layers:.1f} per layer)")
            first = one_off + per_layer * (args.layers // 2)  # the middle layer's first kernel
            prev_end = events[first - 1][2]
            t0 = events[first][1]
            for name, start, end in events[first:first + per_layer]:
                print(f"  {short(name):<10} start {start - t0:7.1f}  end {end - t0:7.1f}  dur {end - start:6.1f}"
                      f"  gap {start - prev_end:6.1f}")
                prev_end = max(prev_end, end)


if __name__ == "__main__":
    main()
