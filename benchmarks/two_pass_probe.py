"""Probe (issue 13, prefill sgmv): the fused sgmv against two passes of grouped_gemm, a shrink into a float32 h and
an expand of h into y, at the issue's prefill shapes, in one process, CUDA-graph replay, inputs rotated past L2.

    python3 benchmarks/two_pass_probe.py

Why: the fused kernels keep h on chip, yet at rank 128 both reach 32% of the memory roofline (87 us at T=4096
against a floor of ~28), while grouped_gemm's LoRA-shaped paths stream at 74% (expand, CUDA) and 92% (shrink,
Triton) at rank 16. Two passes add h's round trip (T x S*R floats, written and read: 4 MB at T=4096 r128, from L2)
and one launch, and lose nothing else: x is read once by the shrink, y once by the expand. Predicted: r128 T=4096
~35-45 us (the shrink ~10 at x's bytes, the expand ~22 at y's), r16 T=16384 ~the fused kernels' (35 + 87 at
a24a444: no gain), T=4096 r16 ~32 (against 40). If a two-pass composition beats the fused kernels by > 10% at a
shape, the op table gets it as a choice there (sgmv's CUDA entry composing the two kernels); otherwise the fused
kernels stay and the expand's efficiency is the lever (piece_probe.cu).

Each row prints µs per call for: the fused CUDA kernel (the op table off), the fused Triton kernel, CUDA's
grouped_gemm shrink with lora_expand (the composition of public ops that takes sgmv's per-slot scales, ranks and
slices as they are), two passes on CUDA's grouped_gemm (op table off), on Triton's, and Triton's shrink with CUDA's
expand; and the error of each y's delta against the fused CUDA kernel's (h float32 in all: the same sums up to
order).
"""
import torch

import lora_ops
from lora_ops import op_table
from lora_ops.bench.timing import cuda_runner, time_interleaved

L2_BYTES = 60 << 20
# (T, adapters, rank, K, N, slices): issue 13's table, then rank 64 at T=4096, then issue 12's two largest sgmv op
# cases (T=256, 32 adapters, ranks 16 and 64: the decode regime's split shrink and the expand's 64-row tiles)
SHAPES = [(4096, 4, 16, 4096, 4096, 1), (16384, 8, 16, 4096, 4096, 1), (16384, 8, 64, 4096, 4096, 1),
          (1024, 8, 16, 4096, 6144, 3), (4096, 8, 128, 4096, 4096, 1), (4096, 8, 64, 4096, 4096, 1),
          (256, 32, 16, 4096, 4096, 1), (256, 32, 64, 4096, 4096, 1)]
SLOTS = 32


def main():
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    ops, triton = torch.ops.lora_ops, torch.ops.lora_ops
    for T, adapters, R, K, N, S in SHAPES:
        dt = torch.bfloat16
        offsets = [0, N] if S == 1 else [0, 4096, 5120, 6144]
        lora_a = (torch.randn(SLOTS, S * R, K, device="cuda", generator=gen) / K ** 0.5).to(dt)
        lora_b = (torch.randn(SLOTS, N, R, device="cuda", generator=gen) / R ** 0.5).to(dt)
        slots = torch.randperm(SLOTS, device="cuda", generator=gen)[:adapters]
        token_lora = slots[torch.randint(0, adapters, (T,), device="cuda", generator=gen)].to(torch.int32)
        seg = lora_ops.build_segments(token_lora, SLOTS)
        sets = max(2, -(-2 * L2_BYTES // (T * (K + N) * 2)))
        xs = [torch.randn(T, K, device="cuda", generator=gen).to(dt) for _ in range(sets)]
        ys = [torch.randn(T, N, device="cuda", generator=gen).to(dt) for _ in range(sets)]
        h = torch.empty(T, S * R, device="cuda")
        # the expand's weights per slice: B's rows of slice s, as grouped_gemm's [L, n_s, R] (a view of lora_b)
        b_slices = [lora_b[:, offsets[s]:offsets[s + 1]] for s in range(S)]
        idx = (seg.seg_indptr, seg.seg_lora, seg.token_indices)

        def fused(sgmv):
            return lambda x, y: sgmv(y, x, lora_a, lora_b, *idx, None, None, offsets if S > 1 else None, 0.5)

        def two_pass(shrink, expand):
            def call(x, y):
                shrink(h, x, lora_a, *idx, None, None, 1.0, False)
                for s in range(S):
                    expand(y[:, offsets[s]:offsets[s + 1]], h[:, s * R:(s + 1) * R], b_slices[s], *idx, None, None,
                           0.5, True)
            return call

        # h broadcast over the slots ([T, L, S*R], slot stride 0): lora_expand reads each row's own slot window
        h_slots = h.unsqueeze(1).expand(T, SLOTS, S * R)

        def shrink_then_lora_expand(shrink, expand):
            def call(x, y):
                shrink(h, x, lora_a, *idx, None, None, 1.0, False)
                expand(y, h_slots, lora_b, *idx, None, None, offsets if S > 1 else None, 0.5)
            return call

        impls = {"fused-cuda": fused(ops.sgmv.default), "fused-triton": fused(triton._triton_sgmv.default),
                 "gg+expand-cuda": shrink_then_lora_expand(ops.grouped_gemm.default, ops.lora_expand.default),
                 "2pass-cuda": two_pass(ops.grouped_gemm.default, ops.grouped_gemm.default),
                 "2pass-triton": two_pass(triton._triton_grouped_gemm.default, triton._triton_grouped_gemm.default),
                 "2pass-tri+cuda": two_pass(triton._triton_grouped_gemm.default, ops.grouped_gemm.default)}
        print(f"T={T} adapters={adapters} r{R} K={K} N={N} slices={S} ({sets} input sets)")
        with op_table.disabled():  # the C++ kernels for the public ops, at capture too
            want = ys[0].clone()
            impls["fused-cuda"](xs[0], want)
            errors = {}
            for name, call in impls.items():
                got = ys[0].clone()
                call(xs[0], got)
                errors[name] = ((got.float() - want.float()).norm() / (want.float() - ys[0].float()).norm()).item()
            runners = {name: cuda_runner([lambda x=x, y=y, c=call: c(x, y) for x, y in zip(xs, ys)], graph=True)
                       for name, call in impls.items()}
            ms = time_interleaved({name: run for name, (run, _) in runners.items()}, min_ms=40.0)
        for name in impls:
            print(f"    {name:15} {ms[name] * 1e3 / runners[name][1]:8.1f} us   delta error vs fused-cuda "
                  f"{errors[name]:.1e}")


if __name__ == "__main__":
    main()
