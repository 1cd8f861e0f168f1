"""python -m tests.fuzz: see tests/fuzz/README.md."""
import argparse
import sys
import time

from .run import fuzz


def main() -> int:
    p = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    p.add_argument("--seed", type=int, default=None, help="run seed (default: from the clock, printed)")
    p.add_argument("--seconds", type=float, default=None)
    p.add_argument("--minutes", type=float, default=None)
    p.add_argument("--cases", type=str, default=None, help="comma-separated case seeds to replay instead")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--backends", type=str, default=None,
                   help="comma-separated: cpu, triton, cuda, and cuda kernels forced as in "
                        "child.FORCED_CUDA_KERNELS (default: all here)")
    p.add_argument("--large", action="store_true", help="GPU-sized shapes too (K, N up to 4096, thousands of rows)")
    p.add_argument("--debug", action="store_true", help="LORA_OPS_DEBUG=1: bad metadata must raise instead")
    p.add_argument("--timeout", type=float, default=120.0, help="seconds one call may take before it is a HANG")
    p.add_argument("--batch", type=int, default=500, help="cases per child process")
    a = p.parse_args()
    seed = a.seed if a.seed is not None else time.time_ns() % 2 ** 40
    cases = [int(c) for c in a.cases.split(",")] if a.cases else None
    seconds = a.seconds if a.seconds is not None else (a.minutes * 60 if a.minutes is not None else
                                                       (None if cases else 60.0))
    print(f"fuzz: run seed {seed} (replay with --seed {seed})", flush=True)
    report = fuzz(seed, seconds=seconds, cases=cases, device=a.device,
                  backends=a.backends.split(",") if a.backends else None, large=a.large, debug=a.debug,
                  timeout=a.timeout, batch=a.batch, log=lambda m: print(m, flush=True))
    print(report.text(), flush=True)
    return 0 if report.ok else 1


sys.exit(main())
