"""Times a Triton kernel over a grid of configs at the op bench's GPU shapes (H200, bf16, graph replay) and prints
the best per shape next to what the shape-class table picks. Used to fill the config tables; results go in
lora_ops/triton/NOTES.md.

    python benchmarks/triton_sweep.py --op sgmv            # sgmv_config (32-slot pool)
    python benchmarks/triton_sweep.py --op grouped_gemm    # grouped_gemm_config (the grouped_gemm cases, bf16)

grouped_gemm configs are checked against the float64 oracle before they are timed; a wrong one is reported."""
import argparse
import itertools

import torch

from lora_ops import reference, testing
from lora_ops.bench import ops as bench
from lora_ops.bench.timing import time_cuda
from lora_ops.triton import grouped_gemm_config, launch_grouped_gemm, launch_sgmv, sgmv_config

SGMV_SHAPES = [bench.Case(1, 1, 16), bench.Case(16, 4, 16), bench.Case(64, 16, 16), bench.Case(256, 32, 16),
               bench.Case(256, 32, 64), bench.Case(4096, 4, 16), bench.Case(16384, 8, 16)]


def _report(title: str, us_default: float, default: dict, results) -> None:
    results.sort(key=lambda r: r[0])
    print(f"{title}: table {us_default:.2f} us {default}", flush=True)
    for us, cfg in results[:3]:
        print(f"    {us:8.2f} us  {cfg}", flush=True)


def sweep_sgmv():
    for case in SGMV_SHAPES:
        sets = [bench.Problem(case, torch.bfloat16, "cuda", seed=s) for s in range(4 if case.T <= 256 else 1)]
        p0 = sets[0].p
        default = sgmv_config(p0.token_indices.shape[0], p0.seg_lora.shape[0], case.N, case.R, False)
        results = []
        for bm, bk, bn, ns, w in itertools.product([16, 32, 64], [64, 128, 256], [64, 128], [1, 2, 4, 8, 16], [4, 8]):
            if (case.T <= 256 and bm == 64) or (case.T > 256 and bm == 16) or bk * bm > 16384:
                continue
            cfg = dict(BLOCK_M=bm, BLOCK_K=bk, BLOCK_N=bn, N_SPLITS=ns, num_warps=w)
            calls = [lambda pb=pb, y=pb.p.y.clone(): launch_sgmv(*pb.p.args(y), config=cfg) for pb in sets]
            try:
                us = time_cuda(calls, graph=True, min_ms=5.0)
            except Exception:  # e.g. out of shared memory
                continue
            results.append((us, cfg))
        calls = [lambda pb=pb, y=pb.p.y.clone(): launch_sgmv(*pb.p.args(y), config=default) for pb in sets]
        _report(f"T={case.T} adapters={case.adapters} rank={case.rank}", time_cuda(calls, graph=True, min_ms=5.0),
                default, results)


def gg_candidates(case) -> list:
    """Configs that fit the shared memory (stages of an x tile and a w tile, 2 bytes each, within ~200 KB) and keep
    the accumulator within 128 float32 registers per thread."""
    if case.N <= 16:  # the LoRA shrink: one column block, long K
        grid = itertools.product([64, 128, 256], [16], [64, 128, 256], [4, 8], [3, 4])
    elif case.K <= 16:  # the LoRA expand: one K block (x fp32, split hi + lo)
        grid = itertools.product([64, 128], [64, 128, 256], [16], [4, 8], [2, 3])
    else:
        grid = itertools.product([64, 128], [128, 256], [64, 128], [4, 8], [3, 4])
    out = []
    for bm, bn, bk, w, st in grid:
        if st * (bm * bk + bk * bn) * 2 <= 200 * 1024 and bm * bn <= 128 * 32 * w:
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st))
    return out


def sweep_grouped_gemm():
    for case in [c for c in bench.GPU_GG_CASES if c.dtype == "bfloat16"]:
        pb = bench.GroupedGemmProblem(case, "cuda", seed=1)
        p = pb.p
        before = p.y.clone()
        ref = reference.grouped_gemm(*p.args(before.clone()))
        checked = lambda: (p.seg_indptr, p.seg_weight, p.token_indices, p.n_sizes, p.k_sizes)
        run = lambda y, cfg: launch_grouped_gemm(y, p.x, p.w, *checked(), p.alpha, p.accumulate, config=cfg)
        smem = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
        default = grouped_gemm_config(case.T, case.N, case.K, p.x.element_size(), p.w.element_size(), smem)
        results = []
        for cfg in gg_candidates(case):
            y = before.clone()
            try:
                run(y, cfg)
                torch.cuda.synchronize()
            except Exception as exc:  # e.g. out of shared memory
                print(f"    skipped {cfg}: {type(exc).__name__}", flush=True)
                continue
            bad = testing.check_against_reference(y, before, ref, p.w.dtype)
            if bad:
                print(f"    WRONG {cfg}: {bad}", flush=True)
                continue
            results.append((time_cuda([lambda y=y, cfg=cfg: run(y, cfg)], graph=True, min_ms=5.0), cfg))
        us_default = time_cuda([lambda y=before.clone(): run(y, default)], graph=True, min_ms=5.0)
        tf = lambda us: f"{pb.flops() / (us * 1e-6) / 1e12:.0f} TFLOP/s"
        _report(f"grouped_gemm {case.shape} ({tf(us_default)} with the table)", us_default, default,
                [(us, dict(cfg, tflops=tf(us))) for us, cfg in results])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--op", choices=["sgmv", "grouped_gemm"], default="sgmv")
    args = ap.parse_args()
    sweep_sgmv() if args.op == "sgmv" else sweep_grouped_gemm()


if __name__ == "__main__":
    main()
