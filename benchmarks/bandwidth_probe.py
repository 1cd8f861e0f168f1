"""What one launch of a plain streaming kernel reaches against the size it streams (csrc/cuda/NOTES.md, sgmv prefill,
sessions 27-28): the prefill sgmv at T=4096, K=N=4096 reads x (32 MB) in its shrink phase at ~68% of the copy
bandwidth, and so did the same access pattern without any math, at every row width. Either any one-phase read of
32 MB pays that much fill and drain (then only overlapping the shrink of some tiles with the expand of others
helps), or the pattern does (then bulk copies or deeper pipelines may). This times torch's own streaming kernels
over 4-512 MB, one launch per call, under CUDA-graph replay with enough rotating buffers that nothing is served
from the L2:
- copy (read + write), read (a float32 sum of bf16 rows), write (fill), read-modify-write (in-place add);
- a gather of 8 KB rows (index_select through a permutation, the shrink's x rows through token_indices).

    python benchmarks/bandwidth_probe.py [--sizes 4,8,16,32,64,128,512]
"""
import argparse
import math

import torch

from lora_ops.bench.timing import copy_bandwidth_tbps, time_cuda

ROW = 4096  # bf16 elements per row: K = 4096, 8 KB
FOOTPRINT = 256 << 20  # bytes the rotating buffers of one case span at least: > 4x the H200's 60 MB L2


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="4,8,16,32,64,128,512", help="MB streamed per call (read side)")
    args = ap.parse_args()
    dev = "cuda"
    copy_tbps = copy_bandwidth_tbps(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_tbps:.2f} TB/s (1 GiB, read + written), "
          f"{torch.cuda.get_device_properties(dev).multi_processor_count} SMs")
    print(f"{'MB':>5} {'case':<36} {'us':>9} {'TB/s':>6} {'% of copy':>9}")
    for mb in (int(s) for s in args.sizes.split(",")):
        rows = (mb << 20) // (ROW * 2)
        sets = max(2, math.ceil(FOOTPRINT / (2 * rows * ROW * 2)))
        src = [torch.randn(rows, ROW, device=dev).to(torch.bfloat16) for _ in range(sets)]
        dst = [torch.empty_like(s) for s in src]
        sums = [torch.empty(ROW, device=dev) for _ in range(sets)]
        perm = torch.randperm(rows, device=dev)
        nbytes = rows * ROW * 2

        def report(name, calls, moved):
            us = time_cuda(calls, graph=True)
            tbps = moved / (us * 1e-6) / 1e12
            print(f"{mb:>5} {name:<36} {us:9.2f} {tbps:6.2f} {100 * tbps / copy_tbps:8.1f}%")

        report("copy", [lambda d=d, s=s: d.copy_(s) for d, s in zip(dst, src)], 2 * nbytes)
        report("read (sum over rows, fp32)", [lambda o=o, s=s: torch.sum(s, dim=0, dtype=torch.float32, out=o)
                                              for o, s in zip(sums, src)], nbytes)
        report("write (fill)", [lambda d=d: d.fill_(1.0) for d in dst], nbytes)
        report("read-modify-write (add_ in place)", [lambda d=d: d.add_(1.0) for d in dst], 2 * nbytes)
        report("gather 8 KB rows (index_select)", [lambda d=d, s=s: torch.index_select(s, 0, perm, out=d)
                                                   for d, s in zip(dst, src)], 2 * nbytes)
        del src, dst, sums
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
