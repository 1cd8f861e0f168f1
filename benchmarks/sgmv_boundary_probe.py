"""What the prefill sgmv's shrink/expand boundary costs the kernel, not the CTA (csrc/cuda/NOTES.md, session 62).

The phase trace (sgmv_phase_trace.py) puts the cluster's h sum at 15-18% of a CTA's time at rank 128, but a CTA's
chain did not predict the kernel's time in session 62: ~1-3 us cut from every CTA's start moved nothing. So before the
producer-warp kernel (which would hide the boundary) is built, this times the kernel with the boundary removed
outright: `benchmarks/sgmv_boundary_probe.patch` makes every cluster member expand with its own K-partial of h (no
cluster sum; the results are wrong on purpose):

    git switch -c boundary && git apply benchmarks/sgmv_boundary_probe.patch && git commit -qam "probe"
    PREBUILT_XZ=1 PREBUILT_OUT=$PWD/build/device-boundary bash scripts/device_prebuild.sh
    python benchmarks/sgmv_boundary_probe.py      # on the GPU, once with main's lora_ops/_C.so, once with the probe's

For each of the trace's cases it prints graph-replay µs per call (4 input sets, rotated past L2, as the op bench) and,
up to 4096 positions, the error against lora_ops.reference relative to the delta's largest magnitude: ~1e-3 on main's
build, ~1 on the probe's (which build ran). If the kernel drops by about the boundary's share, a kernel that hides the boundary
has that room; if not, the boundary is hidden already, as the lookup's trips were.
"""
import hashlib
import os
import sys

import torch

import lora_ops
from lora_ops import op_table, reference
from lora_ops.bench import timing
from lora_ops.bench.ops import environment

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sgmv_phase_trace import CASES, make_problem  # noqa: E402  (the trace's cases, to read beside it)

INPUT_SETS = 4
MAX_CHECKED_POSITIONS = 4096  # the float64 oracle runs on the host: beyond this, seconds a case (the smaller cases
# already tell which build ran: the whole run is one library)


def relative_error(p):
    """Largest |kernel - oracle| over the largest |oracle delta|, one call from y."""
    y = p.y.clone()
    lora_ops.ops.sgmv(*p.args(y))
    want = reference.sgmv(*[a.cpu() if torch.is_tensor(a) else a for a in p.args()])
    delta = (want - p.y.double().cpu()).abs().max().item()
    return (y.double().cpu() - want).abs().max().item() / max(delta, 1e-30)


def main():
    with open(lora_ops.LIBRARY_PATH, "rb") as f:
        digest = hashlib.sha1(f.read()).hexdigest()[:12]
    print(f"{torch.cuda.get_device_name()}; {lora_ops.LIBRARY_PATH} (sha1 {digest})")
    for name, positions, adapters, rank, slices, variables in CASES:
        with environment(variables), op_table.disabled():  # the case's kernel, and the C++ kernels
            sets = [make_problem(positions, adapters, rank, slices, 62 + i) for i in range(INPUT_SETS)]
            error = relative_error(sets[0]) if positions <= MAX_CHECKED_POSITIONS else None
            us = timing.time_cuda([lambda p=p: lora_ops.ops.sgmv(*p.args()) for p in sets], graph=True)
        print(f"{name:<50} {us:8.2f} us   " + (f"error {error:.1e}" if error is not None else "(not checked)"))
        del sets
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
