"""Where a prefill sgmv CTA's time goes, phase by phase (csrc/cuda/NOTES.md, sessions 26, 60-61): per-CTA
%globaltimer stamps at the phase boundaries of both tensor-core kernels (start, tile found, shrink drained, h summed
over the cluster and converted, end), printed by thread 0 of every working CTA. The stamps are a patch, not part of
the extension (printf and the stamps cost registers: the wgmma instances spill 12-48 bytes with it):

    git switch -c trace && git apply benchmarks/sgmv_phase_trace.patch && git commit -qam "probe"
    PREBUILT_XZ=1 PREBUILT_OUT=$PWD/build/device-trace bash scripts/device_prebuild.sh   # or build on the GPU box
    python benchmarks/sgmv_phase_trace.py          # on the GPU, with that build as lora_ops/_C.so

Each case runs in a process of its own (the kernel variables are read at each launch; a fresh process keeps each
case's printf lines apart): 3 warm-up calls, an L2 flush, one measured call. The device's printf reaches stdout
through libc's buffer, possibly after the process's own lines, so the measured call's lines are the last quarter.
Prints the kernel's span, when the CTAs start (one wave or several), each phase's median and p90 over the CTAs, and
the boundary split into the wait for a cluster's last member and the sum after it, and the sum by its links: its
cluster barrier, the member's share of partials landed, every sum landed, the conversion. On mma.sync's kernel the
stamps place the early expand's first loads in the barrier's link, and h's conversion and (at rank tile 128) the
warps' swap of rank halves in the conversion's.
Spans are of the probe build: compare them with the bench's times of the same case.
"""
import os
import statistics
import subprocess
import sys

import torch

import lora_ops
from lora_ops import op_table, testing

FORCE_WGMMA_64 = {"LORA_OPS_CUDA_SGMV_KERNEL": "wgmma", "LORA_OPS_CUDA_SGMV_WGMMA_ROWS": "64"}
CASES = [  # name, positions, adapters, rank, slices, kernel variables (K = 4096, N = 4096 a slice, bf16)
    ("r128 T=4096 (wgmma, 128-position tiles)", 4096, 8, 128, 1, {}),
    ("r128 T=4096 wgmma, 64-position tiles", 4096, 8, 128, 1, FORCE_WGMMA_64),
    ("r128 T=4096 mma.sync", 4096, 8, 128, 1, {"LORA_OPS_CUDA_SGMV_KERNEL": "mma"}),
    ("r64 T=16384 (wgmma)", 16384, 8, 64, 1, {}),
    ("r16 T=4096 (mma.sync)", 4096, 4, 16, 1, {}),
    ("r16 T=16384 (mma.sync)", 16384, 8, 16, 1, {}),
    ("r16 T=1024, 3 slices 4096/1024/1024 (mma.sync)", 1024, 8, 16, 3, {}),
]
KERNELS = {"0": "mma.sync", "1": "wgmma, 64 positions", "2": "wgmma, 128 positions"}
PHASES = {"find": (0, 1), "shrink": (1, 2), "sum+convert": (2, 3), "expand": (3, 4), "whole CTA": (0, 4)}


def make_problem(positions, adapters, rank, slices, seed):
    """A case's inputs on the GPU: K = 4096, N = 4096 a slice (3 slices: 4096 / 1024 / 1024), a 32-slot pool, bf16."""
    gen = torch.Generator().manual_seed(seed)
    offsets = [0, 4096, 5120, 6144] if slices == 3 else None
    return testing.make_sgmv(testing.random_token_slots(positions, list(range(adapters)), gen), num_slots=32,
                             K=4096, N=offsets[-1] if offsets else 4096, max_rank=rank, dtype=torch.bfloat16,
                             device="cuda", gen=gen, slice_offsets=offsets)


def run_case(index):
    """One case's 3 warm-up calls and its measured call, in this process (the stamps go to stdout)."""
    _, positions, adapters, rank, slices, variables = CASES[index]
    os.environ.update(variables)
    problem = make_problem(positions, adapters, rank, slices, 61)
    flush = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
    with op_table.disabled():  # the C++ kernels
        for _ in range(3):
            lora_ops.ops.sgmv(*problem.args(problem.y.clone()))
        y = problem.y.clone()
        flush.zero_()
        torch.cuda.synchronize()
        lora_ops.ops.sgmv(*problem.args(y))
        torch.cuda.synchronize()


def quantile(values, q):
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(name, lines):
    rows = [line.split() for line in lines]
    if not rows:
        print(f"{name}: no TRACE lines (is this the probe build?)")
        return
    # TRACE kernel rank_tile sm block tile member group t0 ... t7 (t5-t7: the cluster sum's links; 0 without one)
    stamps = [[int(v) for v in row[8:16]] for row in rows]
    start = min(t[0] for t in stamps)
    us = lambda ns: ns / 1e3
    starts = [us(t[0] - start) for t in stamps]
    ends = [us(t[4] - start) for t in stamps]
    print(f"{name}: {KERNELS[rows[0][1]]}, rank tile {rows[0][2]}, {len(rows)} working CTAs on "
          f"{len({row[3] for row in rows})} SMs, span {max(ends):.1f} us")
    print("   CTA starts p10/p50/p90/max " + "/".join(f"{quantile(starts, q):.1f}" for q in (.1, .5, .9, 1)) +
          " us; ends p10/p50/p90 " + "/".join(f"{quantile(ends, q):.1f}" for q in (.1, .5, .9)) + " us")
    print("   " + "  ".join(
        f"{phase} {statistics.median(spans):.2f} (p90 {quantile(spans, .9):.2f})"
        for phase, (a, b) in PHASES.items() for spans in [[us(t[b] - t[a]) for t in stamps]]))
    # The boundary split by cluster (members share tile and group): each member's wait for the cluster's last
    # drained shrink (the members' skew), and the sum itself, from that last arrival to the member's h, by its links.
    clusters = {}
    for row, t in zip(rows, stamps):
        clusters.setdefault((row[5], row[7]), []).append(t)
    wait, after, links = [], [], {"barrier": [], "partials landed": [], "sums landed": [], "convert": []}
    for members in clusters.values():
        last = max(t[2] for t in members)
        wait += [us(last - t[2]) for t in members]
        after += [us(t[3] - last) for t in members]
        for t in members:
            if t[5]:
                for link, span in zip(links, (t[5] - last, t[6] - t[5], t[7] - t[6], t[3] - t[7])):
                    links[link].append(us(span))
    if any(len(members) > 1 for members in clusters.values()):
        print(f"   boundary: wait for the last member {statistics.median(wait):.2f} (p90 {quantile(wait, .9):.2f}), "
              f"then the sum {statistics.median(after):.2f} (p90 {quantile(after, .9):.2f}): " + ", ".join(
                  f"{link} {statistics.median(spans):.2f}" for link, spans in links.items() if spans))


if __name__ == "__main__":
    if len(sys.argv) > 1:
        run_case(int(sys.argv[1]))
        sys.exit()
    for index, case in enumerate(CASES):
        out = subprocess.run([sys.executable, __file__, str(index)], capture_output=True, text=True)
        if out.returncode:
            print(f"{case[0]}: FAILED\n{out.stderr[-2000:]}")
            continue
        lines = [line for line in out.stdout.splitlines() if line.startswith("TRACE")]
        report(case[0], lines[len(lines) * 3 // 4:])  # the 4 calls print as many lines each, in launch order
