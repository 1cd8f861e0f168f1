"""Run one bench case's lora_ops.sgmv (or, with --expand, lora_expand on a random h; with --fold, the fold route's
GEMM; with --kext, the kext route's lora_linear) a few times, for a profiler or a tracing build:
`ncu --clock-control none -k regex:"shrink|expand|mma" python benchmarks/profile_case.py T adapters rank [pool_rank]
[--expand [--rows] | --fold [--skip] | --kext | --grouped-gemm] [--k K] [--n N] [--slices S]` (the module shape; default
K = N = 4096, one slice; --rows: lora_expand's rows form as the fold route passes it, each position's slot in build_segments' order;
--fold: fold_linear against [W; A of every slot], which on sm_90 up to 64 tokens is the CUTLASS kernel, ncu's
-k regex:device_kernel; --skip: with the case's seg_indptr, skipping the unused slots' A; --kext: lora_linear with
B as the adapter pool keeps it for that route, each row's slot as given, which on sm_90 up to 128 tokens is a shrink
and the K-extended GEMM, ncu's -k regex:"kext|device_kernel"; --grouped-gemm: grouped_gemm's LoRA expand as the op
bench's case runs it, T rows in `adapters` groups, k = rank, N, x float32, w and y bf16, accumulated, ncu's
-k regex:grouped_gemm).
Inputs as in `python -m lora_ops.bench`; the L2 is flushed before each call, as the bench's rotation does."""
import argparse

import torch

import lora_ops
from lora_ops import routes
from lora_ops.bench.decode_step import b_as_columns
from lora_ops.bench.ops import Case, GroupedGemmCase, GroupedGemmProblem, Problem


def main():
    parser = argparse.ArgumentParser(description=__doc__)
    for name in ("T", "adapters", "rank"):
        parser.add_argument(name, type=int)
    parser.add_argument("pool_rank", type=int, nargs="?")
    parser.add_argument("--expand", action="store_true")
    parser.add_argument("--rows", action="store_true")
    parser.add_argument("--fold", action="store_true")
    parser.add_argument("--skip", action="store_true")
    parser.add_argument("--kext", action="store_true")
    parser.add_argument("--grouped-gemm", action="store_true")
    parser.add_argument("--k", type=int, default=4096)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--slices", type=int, default=1)
    args = parser.parse_args()
    expand = args.expand
    case = Case(args.T, args.adapters, args.rank, K=args.k, N=args.n, slices=args.slices, pool_rank=args.pool_rank)
    T = case.T
    pb = Problem(case, torch.bfloat16, "cuda", seed=1)
    p = pb.p
    h = torch.randn(T, *p.lora_a.shape[:2], dtype=torch.bfloat16, device="cuda")
    sorted_slots = routes.sorted_slots(pb.token_lora, p.token_indices)  # the fold route's rows form
    slot_rows = p.lora_a.shape[1]
    w_cat = torch.cat([torch.randn(p.y.shape[1], case.K, dtype=torch.bfloat16, device="cuda"),
                       p.lora_a.reshape(-1, case.K)]) if args.fold else None
    w = torch.randn(p.y.shape[1], case.K, dtype=torch.bfloat16, device="cuda") if args.kext else None
    kext_b = b_as_columns(p.lora_b)[1] if args.kext else None  # the pool's kext_lora_b
    gg = GroupedGemmProblem(GroupedGemmCase(args.adapters, T // args.adapters, args.rank, args.n, "bfloat16",
                                            x_dtype="float32", accumulate=True, shape="LoRA expand"),
                            "cuda", seed=1) if args.grouped_gemm else None
    flush = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
    for i in range(3):
        flush.zero_()
        for meta in (p.seg_indptr, p.seg_lora, p.token_indices, p.lora_ranks, p.lora_scales, pb.token_lora):
            if meta is not None:  # lora_ranks: none where every adapter has the pool's rank (the bench's case)
                meta.clone()  # the step's segment metadata is L2-hot in a real model too (read by every layer)
        torch.cuda.synchronize()
        print(f"call {i}", flush=True)
        if gg is not None:
            lora_ops.grouped_gemm(*gg.args(gg.p.y))
        elif args.kext:
            lora_ops.lora_linear(p.x, w, p.lora_a, kext_b, pb.token_lora, p.lora_scales, p.slice_offsets)
        elif args.fold:
            lora_ops.fold_linear(p.x, w_cat, None, *((p.seg_indptr, slot_rows) if args.skip else ()))
        elif expand and args.rows:
            lora_ops.lora_expand(p.y, h, p.lora_b, None, sorted_slots, p.token_indices, p.lora_ranks,
                                 p.lora_scales, p.slice_offsets, p.scale)
        elif expand:
            lora_ops.lora_expand(p.y, h, p.lora_b, p.seg_indptr, p.seg_lora, p.token_indices, p.lora_ranks,
                                 p.lora_scales, p.slice_offsets, p.scale)
        else:
            lora_ops.sgmv(*p.args())
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()
