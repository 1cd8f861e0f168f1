"""lora_linear (the kext route: a whole multi-LoRA linear layer from each row's own slot, h rounded to x's dtype):
the ATen composition on CPU against the float64 oracle, its errors, fake kernel, opcheck and torch.compile; on
CUDA the sm_90a kernels (csrc/cuda/lora_linear_sm90.cu: a shrink, then the K-extended GEMM launched
programmatically) where they serve, named through the profiler, against the oracle and the composition, bitwise
deterministic, under CUDA-graph replay, memory-safe for any slot values, and the composition wherever they do not
serve."""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import lora_ops
from lora_ops import backends, reference

from conftest import aten_op_names, case_generator, cuda_kernel_names, misaligned

# Relative error bounds against the float64 oracle (max |err| / max |ref|): float32 sums; half types add h's
# rounding to x's dtype and the output's.
TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 4e-3}


def _inputs(T, K, N, L, R, offsets, dtype, device, key, slots=None, layout="pool", leading=()):
    """x [*leading, T', K] with T rows in all, weight, lora_a, lora_b (layout "pool": a view of [N, L·R], each
    row's slots side by side, as the adapter pool keeps it; "contiguous": [L, N, R]), token_slot (given, or
    random over the slots, the first two -1 and L: no slot), scales, bias."""
    gen = case_generator(f"lora_linear-{key}")
    S = len(offsets) - 1
    x = torch.randn(T, K, generator=gen)
    w = torch.randn(N, K, generator=gen) / K ** 0.5
    a = torch.randn(L, S * R, K, generator=gen) / K ** 0.5
    b_cols = torch.randn(N, L * R, generator=gen) / R ** 0.5
    if slots is None:
        slots = torch.randint(-1, L + 1, (T,), generator=gen, dtype=torch.int32)
        slots[:2] = torch.tensor([-1, L])[:T]
    scales = torch.rand(L, generator=gen) + 0.5
    bias = torch.randn(N, generator=gen)
    x, w, a, b_cols, bias = (t.to(dtype).to(device) for t in (x, w, a, b_cols, bias))
    lora_b = b_cols.view(N, L, R).permute(1, 0, 2)
    if layout == "contiguous":
        lora_b = lora_b.contiguous()
    if leading:
        x = x.view(*leading, T // leading[0], K)
    return x, w, a, lora_b, torch.as_tensor(slots, dtype=torch.int32).to(device), scales.to(device), bias


def _rel_err(y, ref) -> float:
    return ((y.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def _assert_oracle(y, args, offsets, bias=None):
    x, w, a, b, slots, scales = args[:6]
    ref = reference.lora_linear(x, w, a, b, slots, scales, offsets, bias)
    assert y.dtype == x.dtype and y.shape == ref.shape
    assert _rel_err(y, ref) < TOLERANCE[x.dtype]


SLICES = {"one": lambda N: [0, N], "qkv": lambda N: [0, N // 2, 3 * N // 4, N], "empty_slice": lambda N: [0, 0, N]}


@pytest.mark.parametrize("slices", list(SLICES))
@pytest.mark.parametrize("layout", ["pool", "contiguous"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_cpu_matches_the_oracle(slices, layout, dtype):
    offsets = SLICES[slices](48)
    args = _inputs(10, 40, 48, 4, 8, offsets, dtype, "cpu", f"cpu-{slices}-{layout}", layout=layout, leading=(2,))
    x, w, a, b, slots, scales, bias = args
    for with_bias in (None, bias):
        _assert_oracle(lora_ops.lora_linear(x, w, a, b, slots, scales, offsets, with_bias), args, offsets, with_bias)
    assert slots.eq(-1).any() and slots.eq(4).any()  # rows without a slot, on both sides of [0, L)


def test_cpu_rows_without_a_slot_get_the_base_product_exactly():
    offsets = [0, 32]
    x, w, a, b, _, scales, bias = _inputs(6, 24, 32, 3, 4, offsets, torch.float32, "cpu", "noslot")
    slots = torch.tensor([-1, 3, -2 ** 31, 2 ** 31 - 1, -7, 100], dtype=torch.int32)
    assert torch.equal(lora_ops.lora_linear(x, w, a, b, slots, scales, offsets, bias), F.linear(x, w, bias))
    # int64 slots beyond int32 are no slot either, not wrapped into [0, L)
    wide = torch.tensor([2 ** 32, 2 ** 32 + 1, -2 ** 40, 2 ** 62, 5, 3], dtype=torch.int64)
    assert torch.equal(lora_ops.lora_linear(x, w, a, b, wide, scales, offsets), F.linear(x, w))


def test_cpu_default_scales_are_ones_and_h_is_rounded_to_x_dtype():
    """Without lora_scales every slot's scale is 1; h is rounded to x's dtype before its product with B (the
    kernels' precision): equal to the oracle applied to the rounded h."""
    offsets = [0, 16]
    x, w, a, b, slots, _, _ = _inputs(5, 32, 16, 2, 4, offsets, torch.bfloat16, "cpu", "ones",
                                      slots=[0, 1, 1, 0, -1])
    y = lora_ops.lora_linear(x, w, a, b, slots)
    ones = torch.ones(2)
    _assert_oracle(y, (x, w, a, b, slots, ones), offsets)
    base = F.linear(x, w).float()
    h = torch.stack([(x[t].float() @ a[s].float().T).to(torch.bfloat16) if s >= 0 else torch.zeros(4)
                     for t, s in enumerate(slots.tolist())])
    delta = torch.stack([h[t].float() @ b[s].float().T if s >= 0 else torch.zeros(16)
                         for t, s in enumerate(slots.tolist())])
    assert torch.equal(y, (base + delta).to(torch.bfloat16))


@pytest.mark.parametrize("case", ["no_rows", "no_k"])
def test_cpu_empty_inputs(case):
    T, K = (0, 16) if case == "no_rows" else (3, 0)
    x, w, a, b, slots, scales, bias = _inputs(T, K, 8, 2, 4, [0, 8], torch.float32, "cpu", case)
    y = lora_ops.lora_linear(x, w, a, b, slots, scales, None, bias)
    assert torch.equal(y, F.linear(x, w, bias)) and y.shape == (T, 8)
    assert torch.equal(reference.lora_linear(x, w, a, b, slots, scales, None, bias), y.double())  # the oracle too


ERRORS = {
    "x_0d": (ValueError, "x must be \\[..., K\\]"),
    "int_x": (TypeError, "x must be float16, bfloat16 or float32"),
    "weight_dtype": (TypeError, "weight must have x's dtype"),
    "weight_k": (ValueError, "weight must be \\[N, K\\] with K = x.size\\(-1\\) = 16"),
    "lora_a_2d": (ValueError, "lora_a must be 3-D"),
    "lora_b_slots": (ValueError, "lora_b must have L = lora_a.size\\(0\\) = 2 slots"),
    "lora_b_rank": (ValueError, "lora_b must be \\[L, N, R\\] with R = lora_a.size\\(1\\) / S = 2"),
    "slot_length": (ValueError, "token_slot must have 3 entries \\(one per row of x\\), got 2"),
    "slot_float": (TypeError, "token_slot must be int32 or int64"),
    "scales_dtype": (TypeError, "lora_scales must be float32"),
    "scales_length": (ValueError, "lora_scales must be 1-D with L = 2 entries"),
    "bias_length": (ValueError, "bias must be 1-D with N = 8 entries"),
    "slices": (ValueError, "slice_offsets must start at 0 and end at N = 8"),
    "slot_device": (ValueError, "token_slot is on meta but x is on cpu"),
    "strided_weight": (ValueError, "weight must have unit stride in its last dimension"),
    "lora_a_dtype": (TypeError, "lora_a must have x's dtype"),
    "lora_b_dtype": (TypeError, "lora_b must have x's dtype"),
    "strided_x": (ValueError, "x must have unit stride in its last dimension"),
    "bias_dtype": (TypeError, "bias must have x's dtype"),
    "bias_device": (ValueError, "bias is on meta but x is on cpu"),
    "scales_2d": (ValueError, "lora_scales must be 1-D with L = 2 entries, got shape \\[2, 1\\]"),
    "scales_device": (ValueError, "lora_scales is on meta but x is on cpu"),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_errors_name_the_argument(case):
    x, w, a, b, slots = torch.randn(3, 16), torch.randn(8, 16), torch.randn(2, 4, 16), torch.randn(2, 8, 4), \
        torch.zeros(3, dtype=torch.int32)
    scales, bias, offsets = torch.ones(2), torch.zeros(8), None
    if case == "x_0d":
        x = torch.tensor(1.0)
    elif case == "int_x":
        x = x.int()
    elif case == "weight_dtype":
        w = w.double()
    elif case == "weight_k":
        w = torch.randn(8, 15)
    elif case == "lora_a_2d":
        a = a[0]
    elif case == "lora_b_slots":
        b = torch.randn(3, 8, 4)
    elif case == "lora_b_rank":
        offsets = [0, 4, 8]
    elif case == "slot_length":
        slots = slots[:2]
    elif case == "slot_float":
        slots = slots.float()
    elif case == "scales_dtype":
        scales = scales.double()
    elif case == "scales_length":
        scales = torch.ones(3)
    elif case == "bias_length":
        bias = torch.zeros(9)
    elif case == "slices":
        offsets = [0, 4, 9]
    elif case == "slot_device":
        slots = slots.to("meta")
    elif case == "strided_weight":
        w = torch.randn(16, 8).t()
    elif case == "lora_a_dtype":
        a = a.double()
    elif case == "lora_b_dtype":
        b = b.half()
    elif case == "strided_x":
        x = torch.randn(16, 3).t()
    elif case == "bias_dtype":
        bias = bias.double()
    elif case == "bias_device":
        bias = bias.to("meta")
    elif case == "scales_2d":
        scales = scales[:, None]
    elif case == "scales_device":
        scales = scales.to("meta")
    error, match = ERRORS[case]
    with pytest.raises(error, match=match):
        lora_ops.lora_linear(x, w, a, b, slots, scales, offsets, bias)


def test_debug_mode_raises_on_a_slot_past_the_pool():
    """LORA_OPS_DEBUG=1 (read once per process: a subprocess) raises on a slot >= L; a negative one means no LoRA."""
    script = """
import torch, lora_ops
x, w, a, b, scales = torch.randn(3, 16), torch.randn(8, 16), torch.randn(2, 4, 16), torch.randn(2, 8, 4), torch.ones(2)
lora_ops.lora_linear(x, w, a, b, torch.tensor([-1, 0, 1], dtype=torch.int32), scales)
try:
    lora_ops.lora_linear(x, w, a, b, torch.tensor([-1, 0, 2], dtype=torch.int32), scales)
except ValueError as e:
    print(e)
"""
    out = subprocess.run([sys.executable, "-c", script], env={**os.environ, "LORA_OPS_DEBUG": "1"},
                         capture_output=True, text=True, timeout=120)
    assert "token_slot[2] = 2 is not below the number of slots 2" in out.stdout, out.stdout + out.stderr


def test_refuses_inputs_that_want_a_gradient():
    x, w, a, b, slots, scales, _ = _inputs(3, 16, 8, 2, 4, [0, 8], torch.float32, "cpu", "grad")
    with pytest.raises(RuntimeError, match="lora_linear: x requires grad, and the op has no backward"):
        lora_ops.lora_linear(x.requires_grad_(), w, a, b, slots, scales)
    with torch.no_grad():
        assert lora_ops.lora_linear(x, w, a, b, slots, scales).grad_fn is None


def test_fake_kernel_gives_the_shape_and_runs_the_checks():
    x, w, a, b, slots, scales, bias = (t.to("meta") for t in _inputs(
        6, 16, 8, 2, 4, [0, 8], torch.bfloat16, "cpu", "meta", leading=(2,)))
    y = lora_ops.lora_linear(x, w, a, b, slots, scales, None, bias)
    assert y.shape == (2, 3, 8) and y.dtype == torch.bfloat16 and y.device.type == "meta"
    with pytest.raises(ValueError, match="token_slot must have 6 entries"):
        lora_ops.lora_linear(x, w, a, b, slots[:5], scales)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck_lora_linear(device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for offsets in ([0, 256, 320, 384], [0, 384]):
        x, w, a, b, slots, scales, bias = _inputs(16, 1536, 384, 4, 16, offsets, dtype, device, "opcheck")
        torch.library.opcheck(torch.ops.lora_ops.lora_linear.default, (x, w, a, b, slots, scales, offsets, bias))
    torch.library.opcheck(torch.ops.lora_ops.lora_linear.default, (x, w, a, b, slots))  # one slice, no options


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_compiles_without_graph_breaks_or_recompiles_across_batch_mixes(device):
    torch._dynamo.reset()
    offsets = [0, 256, 384]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, w, a, b, _, scales, _ = _inputs(16, 1536, 384, 4, 16, offsets, dtype, device, "compile")
    from torch._dynamo.testing import CompileCounter
    counter = CompileCounter()
    f = torch.compile(lambda x, slots: lora_ops.lora_linear(x, w, a, b, slots, scales, offsets) * 2,
                      backend=counter, fullgraph=True)
    gen = case_generator("lora_linear-compile-mixes")
    for _ in range(3):  # a new mix of slots per step, same T
        slots = torch.randint(-1, 4, (16,), generator=gen, dtype=torch.int32).to(device)
        assert torch.equal(f(x, slots), lora_ops.lora_linear(x, w, a, b, slots, scales, offsets) * 2)
    assert counter.frame_count == 1


# ---- CUDA ----

def _ran_kext(keys) -> bool:
    """The shrink and the K-extended GEMM (mangled names: ...kext_shrink_kernel..., ...KextMainloop...)."""
    return any("kext_shrink_kernel" in k for k in keys) and any("KextMainloop" in k for k in keys)


def _assert_kext_ran(keys) -> None:
    """The kext kernels ran where the sm_90a kernels are built, and only there. Under compute-sanitizer the profiler
    sees no kernel at all (its CUPTI is the sanitizer's; cuda_kernel_names allows that only there): nothing to check."""
    if keys:
        assert _ran_kext(keys) == backends.sm90_kernels_run(), keys


def _kext_schedule(keys) -> str:
    """The K-extended GEMM's schedule as its name says: "Cooperative" (the 128-row tile) or "Pingpong"."""
    gemms = [k for k in keys if "KextMainloop" in k]
    assert len(gemms) == 1, f"not one K-extended GEMM among the kernels that ran: {keys}"
    gemm = gemms[0]
    return "Cooperative" if "Cooperative" in gemm else "Pingpong" if "Pingpong" in gemm else gemm


def _assert_schedule(keys, expected: str) -> None:
    """The K-extended GEMM ran with this schedule, where the sm_90a kernels are built. Under compute-sanitizer the
    profiler sees no kernel at all (its CUPTI is the sanitizer's; cuda_kernel_names allows that only there): nothing
    to check there."""
    if backends.sm90_kernels_run() and keys:
        assert _kext_schedule(keys) == expected, keys


def _prefer_tile(monkeypatch, tile: str) -> None:
    """LORA_OPS_CUDA_KEXT_TILE (the 65-128-token tile) as given; "auto": unset."""
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    if tile == "auto":
        monkeypatch.delenv("LORA_OPS_CUDA_KEXT_TILE", raising=False)
    else:
        monkeypatch.setenv("LORA_OPS_CUDA_KEXT_TILE", tile)


# K = 1536: at least 64 x the GEMM's pipeline stages (22 at 16 tokens); L·R = 64 and slice bounds in 64s.
CUDA_SHAPE = dict(K=1536, N=384, L=4, R=16)
CUDA_SLICES = {"one": [0, 384], "qkv": [0, 256, 320, 384], "qkv128": [0, 128, 256, 384]}  # qkv128: the 128-row tile's


@pytest.mark.gpu
# 16 | 17 | 33 | 65: the four token tiles; 128: the 128-token tile full (64 x 128: a narrow layer), its slot
# mask's 4 words
@pytest.mark.parametrize("T", [1, 16, 17, 32, 33, 64, 65, 128])
@pytest.mark.parametrize("slices", list(CUDA_SLICES))
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_kernels_match_the_oracle(T, slices, dtype, monkeypatch):
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    offsets = CUDA_SLICES[slices]
    args = _inputs(T, offsets=offsets, dtype=dtype, device="cuda", key=f"cuda-{T}-{slices}", **CUDA_SHAPE)
    x, w, a, b, slots, scales, bias = args
    for with_bias in (None, bias):
        y, ran = cuda_kernel_names(lambda: lora_ops.lora_linear(x, w, a, b, slots, scales, offsets, with_bias))
        _assert_oracle(y, args, offsets, with_bias)
        _assert_kext_ran(ran)


# The shrink's shapes beyond the other tests' (lora_linear_shrink.cu): every row on one slot, ranks 8, 24 and 64, K
# of exactly one batch of a warp's loads (1024: 32 lanes x 4 chunks of 8), and of several batches (8192; 14336,
# down_proj's, the last batch partial). (T, K, L, R, slots, the K split's parts on an H200): slots "random" over the
# pool and no slot, or given; the parts its rule (_shrink_parts) gives with N = 384 (6 GEMM CTAs) on 132 SMs: 2 at
# K 8192, 4 at 14336, 8 at T=1 and K 8192, and 2 at T=1, rank 24 (1 x 3 x 24 x 2 = 144 warps: idle ones in the
# last CTA).
SHRINK_CASES = {
    "128_rows_of_one_slot": (128, 1536, 4, 16, [1] * 128, 1),
    "33_rows_of_one_slot_k_1024": (100, 1024, 4, 16, [2] * 33 + [0, 3, -1] * 22 + [1], 1),
    "rank_8": (64, 1536, 8, 8, "random", 1),
    "rank_24": (48, 1536, 8, 24, "random", 1),
    "rank_64": (64, 2048, 4, 64, "random", 1),
    "k_8192": (32, 8192, 4, 16, "random", 2),
    "k_14336": (16, 14336, 4, 16, "random", 4),
    "t1_k_8192": (1, 8192, 4, 16, [3], 8),
    "t1_rank_24_k_2048": (1, 2048, 8, 24, [5], 2),
}


def _shrink_parts(T, K, N, S, R, sms) -> int:
    """The K split's rule (shrink_parts in lora_linear_shrink.cu): the most parts, a power of two up to 8 of at
    least 1024 columns each, whose CTAs of 32 warps fit the SMs the GEMM's min(N / 64, SMs) CTAs leave free, at up
    to 64 tokens; else 1."""
    if T > 64:
        return 1
    ctas, free, parts = -(-T * S * R // 32), sms - min(N // 64, sms), 1
    while parts < 8 and 2 * parts * ctas <= free and K // (2 * parts) >= 1024:
        parts *= 2
    return parts


def _shrink_split(ran) -> bool:
    """Whether the kext_shrink_kernel<T, kSplit> that ran is the K split's, from its name (demangled: "<T, true>";
    mangled: "Lb1E")."""
    names = [k for k in ran if "kext_shrink_kernel" in k]
    assert len(names) == 1, ran
    return ", true>" in names[0] or "Lb1E" in names[0]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(SHRINK_CASES))
def test_cuda_shrink_shapes_match_the_oracle(case, monkeypatch):
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    T, K, L, R, slots, h200_parts = SHRINK_CASES[case]
    offsets = CUDA_SLICES["qkv"]
    args = _inputs(T, K=K, N=384, L=L, R=R, offsets=offsets, dtype=torch.bfloat16, device="cuda",
                   key=f"shrink-{case}", slots=None if slots == "random" else slots)
    y, ran = cuda_kernel_names(lambda: lora_ops.lora_linear(*args[:6], offsets))
    _assert_oracle(y, args, offsets)
    _assert_kext_ran(ran)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    parts = _shrink_parts(T, K, 384, len(offsets) - 1, R, sms)
    assert sms != 132 or parts == h200_parts  # the rule as the table above states it
    if backends.sm90_kernels_run() and ran:
        assert _shrink_split(ran) == (parts > 1), ran
    assert torch.equal(y, lora_ops.lora_linear(*args[:6], offsets))  # the parts summed in a fixed order


@pytest.mark.gpu
@pytest.mark.parametrize("T", [65, 100, 128])  # the 128-row tile's token tile with 63, 28 and no empty rows
@pytest.mark.parametrize("slices", ["one", "qkv128"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cuda_128_row_tile_matches_the_oracle(T, slices, dtype, monkeypatch):
    """65-128 tokens on the cooperative 128 x 128 tile (preferred here: its automatic choice wants a 128-row W tile
    per SM, test_cuda_65_to_128_token_tile_choice)."""
    _prefer_tile(monkeypatch, "128x128")
    offsets = CUDA_SLICES[slices]
    args = _inputs(T, offsets=offsets, dtype=dtype, device="cuda", key=f"wide-{T}-{slices}", **CUDA_SHAPE)
    y, ran = cuda_kernel_names(lambda: lora_ops.lora_linear(*args[:6], offsets))
    _assert_oracle(y, args, offsets)
    _assert_schedule(ran, "Cooperative")


@pytest.mark.gpu
@pytest.mark.parametrize("case, expected", [
    ("auto_narrow_layer", "Pingpong"), ("auto_wide_layer", "Cooperative"),
    ("auto_wide_layer_slice_not_in_128s", "Pingpong"), ("preferred_64x128", "Pingpong"),
    ("preferred_128x128_slice_not_in_128s", "Pingpong")])
def test_cuda_65_to_128_token_tile_choice(case, expected, monkeypatch):
    """The 128-row tile where the layer has a 128-row W tile per SM or more and slice bounds on 128 rows (a W tile
    in one slice), or where preferred and those bounds allow; else the 64-row one. The product is the oracle's
    either way (a W tile across a slice bound would add the wrong slice's delta)."""
    _prefer_tile(monkeypatch, {"preferred_64x128": "64x128"}.get(case, "128x128" if "preferred" in case else "auto"))
    wide = 128 * torch.cuda.get_device_properties(0).multi_processor_count
    shape = dict(CUDA_SHAPE, N=384 if case in ("auto_narrow_layer", "preferred_128x128_slice_not_in_128s") else wide)
    N = shape["N"]
    offsets = [0, N] if case in ("auto_narrow_layer", "auto_wide_layer", "preferred_64x128") else [0, 64, N]
    args = _inputs(96, offsets=offsets, dtype=torch.bfloat16, device="cuda", key=case, **shape)
    y, ran = cuda_kernel_names(lambda: lora_ops.lora_linear(*args[:6], offsets))
    _assert_oracle(y, args, offsets)
    _assert_schedule(ran, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("used", [[], [2], [0, 3], [0, 1, 2, 3]], ids=["none", "one", "two", "all"])
def test_cuda_slots_no_row_uses_are_skipped_not_wrong(used):
    """The GEMM skips the B blocks of slots no row uses (from token_slot itself): any mix gives the oracle's
    product, and equals the composition to within one rounding."""
    T, offsets = 24, CUDA_SLICES["qkv"]
    slots = [used[t % len(used)] if used else -1 for t in range(T)]
    args = _inputs(T, offsets=offsets, dtype=torch.bfloat16, device="cuda", key=f"used-{used}", slots=slots,
                   **CUDA_SHAPE)
    y = lora_ops.lora_linear(*args[:6], offsets)
    _assert_oracle(y, args, offsets)
    composed = lora_ops.ops.lora_linear(*(t.cpu() for t in args[:6]), offsets)
    assert _rel_err(y, composed.double().cuda()) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
# the 64 tile's rows 32-63, the 128-token tiles' 64-127
@pytest.mark.parametrize("T, tile", [(33, "auto"), (64, "auto"), (65, "auto"), (128, "auto"), (65, "128x128"),
                                     (128, "128x128")])
def test_cuda_a_slot_only_the_last_row_uses_is_read(T, tile, monkeypatch):
    """The GEMM's slot mask covers every row of its tile: a slot only the batch's last row uses still has its B
    blocks read (a mask of the first rows only would skip them, and that row's delta would be lost)."""
    _prefer_tile(monkeypatch, tile)
    offsets = CUDA_SLICES["qkv" if tile == "auto" else "qkv128"]
    args = _inputs(T, offsets=offsets, dtype=torch.bfloat16, device="cuda", key=f"last-row-{T}",
                   slots=[-1] * (T - 1) + [3], **CUDA_SHAPE)
    y, ran = cuda_kernel_names(lambda: lora_ops.lora_linear(*args[:6], offsets))
    _assert_oracle(y, args, offsets)
    if tile != "auto":
        _assert_schedule(ran, "Cooperative")


@pytest.mark.gpu
# the 64 and the two 128-token tiles, full
@pytest.mark.parametrize("T, slices, tile", [(64, "one", "auto"), (128, "qkv", "auto"), (128, "qkv128", "128x128")])
def test_cuda_any_slot_values_are_memory_safe_and_mean_no_lora(T, slices, tile, monkeypatch):
    _prefer_tile(monkeypatch, tile)
    offsets = CUDA_SLICES[slices]
    x, w, a, b, _, scales, _ = _inputs(T, offsets=offsets, dtype=torch.bfloat16, device="cuda", key="wild",
                                       **CUDA_SHAPE)
    wild = torch.tensor([-2 ** 63, 2 ** 63 - 1, 2 ** 31, -2 ** 31 - 1, 4, 64, -1, 1000] * (T // 8),
                        dtype=torch.int64)
    y, ran = cuda_kernel_names(lambda: lora_ops.lora_linear(x, w, a, b, wild.cuda(), scales, offsets))
    if tile != "auto":
        _assert_schedule(ran, "Cooperative")
    _assert_oracle(y, (x, w, a, b, wild, scales), offsets)
    assert _rel_err(y, F.linear(x, w).double()) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("T, tile", [(32, "auto"), (128, "auto"), (128, "128x128")])  # the 32 and 128-token tiles
def test_cuda_kernels_are_bitwise_deterministic_and_replay_in_a_graph(T, tile, monkeypatch):
    _prefer_tile(monkeypatch, tile)
    offsets = CUDA_SLICES["qkv" if tile == "auto" else "qkv128"]
    args = _inputs(T, offsets=offsets, dtype=torch.bfloat16, device="cuda", key="graph", **CUDA_SHAPE)
    x, w, a, b, slots, scales, _ = args
    first, ran = cuda_kernel_names(lambda: lora_ops.lora_linear(x, w, a, b, slots, scales, offsets))
    if tile != "auto":
        _assert_schedule(ran, "Cooperative")
    assert all(torch.equal(first, lora_ops.lora_linear(x, w, a, b, slots, scales, offsets)) for _ in range(5))
    static_slots = slots.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lora_ops.lora_linear(x, w, a, b, static_slots, scales, offsets)
    gen = case_generator("lora_linear-graph-mix")
    for _ in range(3):  # each replay reads the slots written before it
        static_slots.copy_(torch.randint(-1, 4, (T,), generator=gen, dtype=torch.int32))
        graph.replay()
        assert torch.equal(out, lora_ops.lora_linear(x, w, a, b, static_slots, scales, offsets))
        _assert_oracle(out, (x, w, a, b, static_slots, scales), offsets)


@pytest.mark.gpu
# issue 12's pools, 64 slots; more W tiles than an H100's or H200's 132 SMs (192, in bf16 and fp16); rank 24 (a
# 64-column h block crosses slots mid-rank)
@pytest.mark.parametrize("T, L, R, offsets, dtype", [
    (32, 32, 16, [0, 256, 320, 384], torch.bfloat16), (64, 16, 64, [0, 256, 320, 384], torch.bfloat16),
    (16, 64, 16, [0, 256, 320, 384], torch.bfloat16), (32, 32, 16, [0, 8192, 10240, 12288], torch.bfloat16),
    (32, 32, 16, [0, 8192, 10240, 12288], torch.float16), (48, 8, 24, [0, 256, 320, 384], torch.float16)],
    ids=["32x16", "16x64", "64x16", "192_w_tiles", "192_w_tiles_fp16", "rank_24"])
def test_cuda_kernels_over_serving_pools(T, L, R, offsets, dtype, monkeypatch):
    """The kext kernels at a decode step's pools (qkv of 3 slices), with consecutive calls of other slot mixes (1, 2
    and every adapter in the batch: most slots' B blocks skipped, then none; h's memory reused by the caching
    allocator)."""
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    args = _inputs(T, K=1536, N=offsets[-1], L=L, R=R, offsets=offsets, dtype=dtype, device="cuda",
                   key=f"pool-{T}-{L}-{R}-{offsets[-1]}")
    x, w, a, b, _, scales, _ = args
    gen = case_generator(f"lora_linear-pool-mixes-{T}-{L}-{R}")
    for used in (1, 2, L):  # adapters in the batch
        slots = torch.randperm(L, generator=gen)[:used][torch.randint(0, used, (T,), generator=gen)]
        slots = slots.to(torch.int32).cuda()
        y, ran = cuda_kernel_names(lambda: lora_ops.lora_linear(x, w, a, b, slots, scales, offsets))
        _assert_oracle(y, (x, w, a, b, slots, scales), offsets)
        _assert_kext_ran(ran)


@pytest.mark.gpu
@pytest.mark.parametrize("off,T", [("x", 96), ("x", 129), ("bias", 129)])  # 96: the kernels' tokens, x off 16
def test_cuda_composition_with_an_operand_off_16(off, T, monkeypatch, full_precision_reduction):
    """x 2 bytes off 16, or 129 tokens, leaves the kernels for the ATen composition (its bias in addmm's epilogue),
    with x or the bias 2 bytes off 16. Rows without a slot (the base product plus the bias) against float64, each
    output within its rounding, at the shape where torch's default reduced-precision reduction put 5.9% of them past
    the tolerance (the fixture says why)."""
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    x, w, a, b, _, scales, bias = _inputs(T, 1024, 2568, 2, 16, [0, 2568], torch.bfloat16, "cuda", f"off16-{off}")
    w = w * 1024 ** 0.5  # fold_linear's test's scale: outputs of tens, where the sums were off
    slots = torch.full((T,), -1, dtype=torch.int32, device="cuda")
    if off == "bias":
        bias = misaligned(bias)
    else:
        x = misaligned(x)
    y, names = aten_op_names(lambda: lora_ops.lora_linear(x, w, a, b, slots, scales, [0, 2568], bias))
    assert "aten::addmm" in names, names
    ref = x.double() @ w.double().t() + bias.double()
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["129_tokens", "contiguous_lora_b", "k_not_in_64s", "float32", "slice_not_in_64s",
                                  "strided_x", "few_k_blocks", "forced_cublas"])
def test_cuda_composition_where_the_kernels_do_not_serve(case, monkeypatch):
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    shape = dict(CUDA_SHAPE)
    T, offsets, dtype, layout = 16, CUDA_SLICES["qkv"], torch.bfloat16, "pool"
    if case == "129_tokens":
        T = 129
    elif case == "contiguous_lora_b":
        layout = "contiguous"
    elif case == "k_not_in_64s":
        shape["K"] = 1544
    elif case == "float32":
        dtype = torch.float32
    elif case == "slice_not_in_64s":
        offsets = [0, 200, 384]
    elif case == "few_k_blocks":
        shape["K"] = 256  # 4 blocks of x, fewer than the pipeline's stages
    elif case == "forced_cublas":
        monkeypatch.setenv("LORA_OPS_CUDA_LINEAR_KERNEL", "cublas")
    args = _inputs(T, offsets=offsets, dtype=dtype, device="cuda", key=case, layout=layout, **shape)
    x = args[0]
    if case == "strided_x":  # rows 2K apart
        x = torch.cat([x, x], dim=1)[:, :x.shape[1]]
    y, ran = cuda_kernel_names(lambda: lora_ops.lora_linear(x, *args[1:6], offsets))
    _assert_oracle(y, (x,) + args[1:6], offsets)
    assert not _ran_kext(ran), ran
