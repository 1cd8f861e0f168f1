"""What a read-modify-write of y reaches on this GPU, beside the LoRA expand that does one (csrc/cuda/NOTES.md,
grouped_gemm, session 13): the expand case (T = 16384 rows in 8 groups, k = 16, N = 4096, x fp32, y bf16 +=) runs at
~60% of the copy bandwidth in every implementation. This separates the candidates, in one process:
- a copy and torch's in-place add on y (is ~60% what any read-modify-write of y gets here?);
- the expand with y's rows 8 KB apart (a power of two) and with them padded by 128 bytes (do the tiles' row stride
  and the DRAM channels collide?).
CUDA-graph replay, two rotating input sets (each y is 134 MB, past the L2).

    python benchmarks/rmw_probe.py
"""
import torch

import lora_ops
from lora_ops.bench.timing import copy_bandwidth_tbps, time_cuda

T, N, K, GROUPS, PAD = 16384, 4096, 16, 8, 64


def main():
    dev = "cuda"
    gen = torch.Generator(dev).manual_seed(0)
    copy_tbps = copy_bandwidth_tbps(dev)
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {copy_tbps:.2f} TB/s (1 GiB, read + written)")
    y_bytes = T * N * 2

    def report(name, us, bytes_moved):
        tbps = bytes_moved / (us * 1e-6) / 1e12
        print(f"  {name:<44} {us:8.1f} us  {tbps:5.2f} TB/s  {100 * tbps / copy_tbps:5.1f}% of the copy")

    def fresh(cols):
        return torch.randn(T, cols, generator=gen, device=dev).to(torch.bfloat16)

    ys, srcs = [fresh(N) for _ in range(2)], [fresh(N) for _ in range(2)]
    report("copy y <- src", time_cuda([lambda d=d, s=s: d.copy_(s) for d, s in zip(ys, srcs)], graph=True),
           2 * y_bytes)
    report("y.add_(1) (in place)", time_cuda([lambda d=d: d.add_(1.0) for d in ys], graph=True), 2 * y_bytes)
    padded = [fresh(N + PAD)[:, :N] for _ in range(2)]
    report(f"y.add_(1), rows padded by {PAD} elements", time_cuda([lambda d=d: d.add_(1.0) for d in padded],
                                                                  graph=True), 2 * y_bytes)

    indptr = torch.arange(0, T + 1, T // GROUPS, dtype=torch.int32, device=dev)
    seg = torch.arange(GROUPS, dtype=torch.int32, device=dev)
    x = [torch.randn(T, K, generator=gen, device=dev) for _ in range(2)]
    w = [(torch.randn(GROUPS, N, K, generator=gen, device=dev) / K ** 0.5).to(torch.bfloat16) for _ in range(2)]
    expand_bytes = 2 * y_bytes + T * K * 4 + GROUPS * N * K * 2
    for name, targets in (("expand, y rows 8 KB apart", ys), (f"expand, y rows padded by {PAD} elements", padded)):
        calls = [lambda y=y, xi=xi, wi=wi: lora_ops.grouped_gemm(y, xi, wi, indptr, seg) for y, xi, wi in
                 zip(targets, x, w)]
        report(name, time_cuda(calls, graph=True), expand_bytes)
    # cuBLAS on the same expand (h bf16): one addmm per group with beta = 1, in place on y's rows
    rows = T // GROUPS
    hb = [xi.to(torch.bfloat16) for xi in x]
    calls = [lambda y=y, hi=hi, wi=wi: [y[g * rows:(g + 1) * rows].addmm_(hi[g * rows:(g + 1) * rows], wi[g].t())
                                        for g in range(GROUPS)] for y, hi, wi in zip(ys, hb, w)]
    report("cuBLAS addmm_ per group (h bf16)", time_cuda(calls, graph=True), expand_bytes - T * K * 2)


if __name__ == "__main__":
    main()
