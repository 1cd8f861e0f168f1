"""What the kext route costs per module over cuBLAS's base GEMM, by the pool's slot count (csrc/cuda/NOTES.md,
session 55): lora_linear's shrink + K-extended GEMM on Llama-3-8B's four decode modules (qkv, o, gate_up, down),
bf16, graph replay over rotating weight sets (past the L2), against F.linear on the same weights. The GEMM's K
extension has L·R/64 blocks whatever the batch uses, and at decode each block costs its tile a pipeline turn: the
rows say what a pool's unused slots cost, for a batch with no LoRA row ("none"), one adapter ("one") or a slot per
row ("all").

    python benchmarks/kext_pool_probe.py [--tokens 32] [--rank 16] [--slots 4,32,64] [--mixes none,one]

Each row checks the op against lora_ops.reference (float64) first. Not yet run in this form: its rows first ran
from a scratch copy in session 55 (H100, T=32, rank 16, no LoRA row).
- Main's kernels with 32 slots (`benchmarks/results/2026-12-06-h100-30d0855-fused-module-probe.log`): qkv +2.7 us,
  o +3.0, gate_up +5.5, down +0.5.
- By pool size, 4 / 32 / 64 slots, on an experiment build whose consumers also read the slot mask (~1 us a module
  more; `-85189db-empty-blocks-ab.log`): qkv +2.1 / +3.6 / +5.3, o +2.5 / +4.1 / +5.9, gate_up +3.0 / +6.5 / +9.4,
  down +1.4 / +2.4 / +4.1.
"""
import argparse

import torch
import torch.nn.functional as F

import lora_ops
from lora_ops import reference
from lora_ops.bench.timing import time_cuda

MODULES = {  # name: (N, K, slice offsets)
    "qkv": (6144, 4096, [0, 4096, 5120, 6144]),
    "o": (4096, 4096, [0, 4096]),
    "gate_up": (28672, 4096, [0, 14336, 28672]),
    "down": (4096, 14336, [0, 4096]),
}
SETS = 4  # weight sets the timed calls cycle through: more bytes than the L2 holds for every module


def slots_for(mix: str, tokens: int, num_slots: int) -> torch.Tensor:
    rows = {"none": torch.full((tokens,), -1), "one": torch.zeros(tokens, dtype=torch.long),
            "all": torch.arange(tokens) % num_slots}[mix]
    return rows.to(torch.int32).cuda()


def probe(tokens: int, rank: int, num_slots: int, mix: str) -> None:
    gen = torch.Generator().manual_seed(0)
    for name, (n, k, offsets) in MODULES.items():
        slices = len(offsets) - 1

        def randn(*shape, scale):
            return (torch.randn(*shape, generator=gen) * scale).to(torch.bfloat16).cuda()

        x = randn(tokens, k, scale=1.0)
        sets = [(randn(n, k, scale=k ** -0.5), randn(num_slots, slices * rank, k, scale=k ** -0.5),
                 randn(n, num_slots * rank, scale=rank ** -0.5).view(n, num_slots, rank).permute(1, 0, 2))
                for _ in range(SETS)]  # lora_b as the pool keeps it: each row's slots side by side
        slots, scales = slots_for(mix, tokens, num_slots), torch.ones(num_slots, device="cuda")
        w, a, b = sets[0]
        y = lora_ops.lora_linear(x, w, a, b, slots, scales, offsets).double()
        ref = reference.lora_linear(x, w, a, b, slots, scales, offsets)
        err = ((y - ref).abs().max() / ref.abs().max()).item()
        assert err < 1.6e-2, f"{name}: relative error {err:.1e} against the float64 oracle"
        base = time_cuda([lambda w=w: F.linear(x, w) for w, _, _ in sets], graph=True)
        kext = time_cuda([lambda w=w, a=a, b=b: lora_ops.lora_linear(x, w, a, b, slots, scales, offsets)
                          for w, a, b in sets], graph=True)
        print(f"T={tokens} L={num_slots:2} R={rank} {mix:4} {name:8} base {base:6.1f} us  kext {kext:6.1f} us "
              f"(+{kext - base:5.1f}, err {err:.1e})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--slots", default="4,32,64", help="pool sizes, comma-separated")
    parser.add_argument("--mixes", default="none,one", help="of none, one, all")
    args = parser.parse_args()
    print(torch.cuda.get_device_name())
    for mix in args.mixes.split(","):
        for num_slots in map(int, args.slots.split(",")):
            probe(args.tokens, args.rank, num_slots, mix)


if __name__ == "__main__":
    main()
