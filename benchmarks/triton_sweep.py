"""Times the Triton sgmv over a grid of configs at the target shapes (H200, bf16, 32-slot pool, graph replay)
and prints the best per shape next to what lora_ops.triton.sgmv_config picks. Used to fill the config table;
results go in lora_ops/triton/NOTES.md."""
import itertools

import torch

from lora_ops.bench import ops as bench
from lora_ops.bench.timing import time_cuda
from lora_ops.triton import launch_sgmv, sgmv_config

SHAPES = [bench.Case(1, 1, 16), bench.Case(16, 4, 16), bench.Case(64, 16, 16), bench.Case(256, 32, 16),
          bench.Case(256, 32, 64), bench.Case(4096, 4, 16), bench.Case(16384, 8, 16)]


def main():
    for case in SHAPES:
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
            except Exception as exc:  # e.g. out of shared memory
                continue
            results.append((us, cfg))
        results.sort(key=lambda r: r[0])
        calls = [lambda pb=pb, y=pb.p.y.clone(): launch_sgmv(*pb.p.args(y), config=default) for pb in sets]
        us_default = time_cuda(calls, graph=True, min_ms=5.0)
        print(f"T={case.T} adapters={case.adapters} rank={case.rank}: table {us_default:.2f} us {default}")
        for us, cfg in results[:3]:
            print(f"    {us:8.2f} us  {cfg}")


if __name__ == "__main__":
    main()
