"""Run one bench case's lora_ops.sgmv a few times, for a profiler or a tracing build:
`ncu --clock-control none -k regex:sgmv python benchmarks/profile_case.py T adapters rank [pool_rank]`.
Inputs as in `python -m lora_ops.bench`; the L2 is flushed before each call, as the bench's rotation does."""
import sys

import torch

import lora_ops
from lora_ops.bench import Case, Problem


def main(argv):
    T, adapters, rank = (int(v) for v in argv[:3])
    case = Case(T, adapters, rank, pool_rank=int(argv[3]) if len(argv) > 3 else None)
    pb = Problem(case, torch.bfloat16, "cuda", seed=1)
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for i in range(3):
        flush.zero_()
        for meta in (pb.p.seg_indptr, pb.p.seg_lora, pb.p.token_indices, pb.p.lora_ranks, pb.p.lora_scales):
            meta.clone()  # the step's segment metadata is L2-hot in a real model too (read by every layer)
        torch.cuda.synchronize()
        print(f"call {i}", flush=True)
        lora_ops.sgmv(*pb.p.args())
        torch.cuda.synchronize()


if __name__ == "__main__":
    main(sys.argv[1:])
