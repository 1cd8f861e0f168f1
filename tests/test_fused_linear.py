"""lora_ops/triton/fused_linear.py (linear layer + per-row LoRA delta in one kernel, after a split-K shrink)
against the float64 oracle x·Wᵀ + bias + reference.sgmv, on fresh random inputs with y poisoned (NaN): under the
interpreter on the CPU in fp32, on a GPU in every dtype at decode shapes. Each case also runs with small tiles and
forced K splits, so the shrink's and the linear kernel's fixed-order reductions are both exercised."""
import pytest
import torch

from lora_ops import reference, testing

from conftest import HAS_CUDA, case_generator, triton_backend

DEVICE = "cuda" if HAS_CUDA else "cpu"
# The interpreter mishandles bf16 (docs/design.md §5): fp32 only there.
DTYPES = [torch.float32, torch.float16, torch.bfloat16] if HAS_CUDA else [torch.float32]
# Small tiles with K split in 3: the shrink's and the linear kernel's last-arrival sums run at CPU test sizes.
SPLIT_CFGS = (dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, SPLIT_K=3, num_warps=4, num_stages=2),
              dict(BLOCK_M=16, BLOCK_K=16, SPLIT_K=3, num_warps=4, num_stages=2))


@pytest.fixture(scope="module")
def fl():
    triton_backend()  # skips without triton, fails when it is installed but broken
    from lora_ops.triton import fused_linear
    return fused_linear


def reference_linear_lora(x, w, bias, lora_a, lora_b, token_lora, lora_ranks, lora_scales, slice_offsets, scale):
    """float64 x·Wᵀ + bias + the sgmv delta with per-token routing (seg_indptr = arange(T+1), seg_lora = token_lora,
    docs/design.md §2)."""
    cpu = lambda t: None if t is None else t.cpu()
    x, w = x.cpu(), w.cpu()
    base = x.double() @ w.double().t()
    if bias is not None:
        base += bias.cpu().double()
    indptr = torch.arange(x.shape[0] + 1, dtype=torch.int32)
    return reference.sgmv(base, x, cpu(lora_a), cpu(lora_b), indptr, cpu(token_lora), None, cpu(lora_ranks),
                          cpu(lora_scales), slice_offsets, scale)


def _slots(gen, T, choices):
    return torch.tensor(choices, dtype=torch.int64)[torch.randint(len(choices), (T,), generator=gen)]


# name -> (T, K, slice widths, L, R, ranks or None, slot choices per row, extra)
CASES = {
    # qkv-like: 3 GQA slices, mixed ranks (one 0), rows without LoRA and bad slots (-5, L, huge)
    "qkv_mixed": (13, 70, (24, 8, 8), 5, 8, [8, 3, 0, 5, 1], [0, 1, 2, 3, 4, -1, -5, 5, 1 << 40], {}),
    "one_row": (1, 33, (20,), 3, 4, None, [2], {}),
    "partial_tiles": (19, 45, (70,), 4, 16, [16, 1, 7, 0], [0, 1, 2, 3, -1], {}),
    "rank_20_pool_of_7": (23, 40, (30, 34), 7, 20, [20, 13, 0, 1, 20, 5, 9], list(range(7)) + [7], {}),
    "gate_up_no_bias": (9, 64, (24, 24), 4, 8, None, [0, 3], dict(bias=False)),
    "all_rows_without_lora": (8, 24, (20,), 3, 8, None, [-1, 3, -7], {}),
    "no_scales": (10, 30, (18,), 3, 8, [8, 2, 4], [0, 1, 2], dict(scales=False, scale=0.37)),
    "y_col_slice_padded_inputs": (14, 40, (16, 9, 9), 4, 8, [8, 8, 3, 6], [0, 1, 2, 3, -1],
                                  dict(pad=3, y_col_pad=10)),
    "one_slot_of_many": (12, 32, (40,), 9, 16, None, [6, -(1 << 40) + 6, (1 << 40) + 6], {}),
}


def _problem(name, dtype, gen_key, y_dtype=None):
    """The case's arguments (y a NaN-poisoned output) on DEVICE."""
    T, K, widths, L, R, ranks, choices, extra = CASES[name]
    gen = case_generator(f"fused-linear-{gen_key}")
    offsets = [0]
    for width in widths:
        offsets.append(offsets[-1] + width)
    N = offsets[-1]
    token_lora = _slots(gen, T, choices)
    p = testing.make_sgmv(token_lora.clamp(-1, L - 1).to(torch.int32), num_slots=L, K=K, N=N, max_rank=R,
                          dtype=dtype, device=DEVICE, gen=gen, ranks=ranks, scales=extra.get("scales", True),
                          slice_offsets=offsets if len(widths) > 1 else None, y_dtype=y_dtype,
                          y_col_pad=extra.get("y_col_pad", 0), scale=extra.get("scale", 0.7),
                          pad=extra.get("pad", 0))
    w = testing.padded((torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype), extra.get("pad", 0), DEVICE)
    bias = torch.randn(N, generator=gen).to(dtype).to(DEVICE) if extra.get("bias", True) else None
    p.y.fill_(float("nan"))
    return dict(y=p.y, x=p.x, w=w, bias=bias, lora_a=p.lora_a, lora_b=p.lora_b, token_lora=token_lora.to(DEVICE),
                lora_ranks=p.lora_ranks, lora_scales=p.lora_scales, slice_offsets=offsets, scale=p.scale)


def _run_and_check(fl, args, **kw) -> str:
    y = args["y"]
    before, around = y.clone(), testing.storage_snapshot(y)
    ref = reference_linear_lora(**{k: v for k, v in args.items() if k != "y"})
    fl.linear_lora(**args, **kw)
    return testing.check_against_reference(y, before, ref, args["x"].dtype) or testing.check_outside_view(y, around)


@pytest.mark.parametrize("tiles", ["default", "split"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_linear_lora_parity(fl, name, dtype, tiles):
    cfg = dict(zip(("linear_cfg", "shrink_cfg"), SPLIT_CFGS)) if tiles == "split" else {}
    assert _run_and_check(fl, _problem(name, dtype, name), **cfg) == ""


def test_linear_lora_reads_nothing_past_the_rank_or_of_absent_slots(fl):
    """A and B past each slot's rank, and every byte of the slots no row uses, may hold anything (NaN here)."""
    args = _problem("qkv_mixed", torch.float32, "nan-outside")
    a, b, ranks = args["lora_a"], args["lora_b"], args["lora_ranks"].tolist()
    R = b.shape[2]
    used = set(args["token_lora"].tolist())
    for slot, rank in enumerate(ranks):
        if slot not in used:
            a[slot] = float("nan")
            b[slot] = float("nan")
        b[slot, :, rank:] = float("nan")
        for s in range(3):
            a[slot, s * R + rank:(s + 1) * R] = float("nan")
    for cfg in ({}, dict(zip(("linear_cfg", "shrink_cfg"), SPLIT_CFGS))):
        args["y"].fill_(float("nan"))
        assert _run_and_check(fl, args, **cfg) == ""


@pytest.mark.parametrize("tiles", ["default", "split"])
def test_shrink_writes_h_of_each_row_up_to_its_rank_only(fl, tiles):
    """h[t, s·R + r] = x[t]·A[slot_t, s·R + r]ᵀ for r < rank; past the rank and on rows without LoRA, h keeps its
    poison: the shrink neither reads nor writes there."""
    args = _problem("qkv_mixed", torch.float32, f"shrink-{tiles}")
    x, a, tok, ranks = args["x"], args["lora_a"], args["token_lora"], args["lora_ranks"]
    T, K = x.shape
    L, SR, _ = a.shape
    R = args["lora_b"].shape[2]
    cfg = SPLIT_CFGS[1] if tiles == "split" else fl.shrink_config(T, K, True)
    h = torch.full((T, SR), float("nan"), device=DEVICE)
    ws = torch.empty(fl.shrink_workspace_size(T, L, SR, cfg), device=DEVICE)
    fl.launch_shrink(h, x, a, tok, ranks, R, ws, cfg)
    expect = torch.full((T, SR), float("nan"), dtype=torch.float64)
    for t, slot in enumerate(tok.tolist()):
        if 0 <= slot < L:
            for s in range(SR // R):
                window = slice(s * R, s * R + int(ranks[slot]))
                expect[t, window] = x[t].cpu().double() @ a[slot, window].cpu().double().t()
    assert torch.equal(h.isnan().cpu(), expect.isnan())
    written = ~expect.isnan()
    assert testing.relative_error(h.cpu()[written], expect[written]) <= testing.TOLERANCE[torch.float32]


def test_linear_lora_rank0_slot_ignores_its_nan_scale(fl):
    args = _problem("qkv_mixed", torch.float32, "rank0")  # slot 2 has rank 0
    args["lora_scales"][2] = float("nan")
    assert _run_and_check(fl, args) == ""


def test_linear_lora_k0_is_the_bias_alone(fl):
    """K = 0: the empty reductions add exactly nothing, whatever the scales hold."""
    args = _problem("qkv_mixed", torch.float32, "k0")
    args["x"], args["w"], args["lora_a"] = args["x"][:, :0], args["w"][:, :0], args["lora_a"][:, :, :0]
    args["lora_scales"].fill_(float("inf"))
    fl.linear_lora(**args)
    assert torch.equal(args["y"], args["bias"].expand_as(args["y"]))


def test_linear_lora_deterministic_and_counters_reset(fl):
    """Three calls, bitwise equal: the parts' sums are in a fixed order and each call leaves the counters at 0."""
    args = _problem("partial_tiles", DTYPES[-1], "determinism")
    cfg = dict(zip(("linear_cfg", "shrink_cfg"), SPLIT_CFGS))
    outs = []
    for _ in range(3):
        args["y"].fill_(float("nan"))
        fl.linear_lora(**args, **cfg)
        outs.append(args["y"].clone())
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert all(int(c.count_nonzero()) == 0 for c in fl._counter_pool.values())


def test_plain_skinny_gemm_without_lora(fl):
    """linear(): the kernel without its LoRA part (the decode bench's GEMM-alone part), x·Wᵀ + bias."""
    for cfg in (None, SPLIT_CFGS[0]):
        args = _problem("partial_tiles", torch.float32, "plain")
        before = args["y"].clone()
        fl.linear(args["y"], args["x"], args["w"], args["bias"], config=cfg)
        ref = args["x"].double() @ args["w"].double().t() + args["bias"].double()
        assert testing.check_against_reference(args["y"], before, ref, torch.float32) == ""


@pytest.mark.parametrize("change,exc,msg", [
    (dict(x=torch.randn(4, 8, 1)), ValueError, r"x must be a 2-D tensor"),
    (dict(w=torch.randn(12, 7)), ValueError, r"w must be \[N, K\] with K = x.size\(1\) = 8"),
    (dict(y=torch.randn(4, 11)), ValueError, r"y must be \[T, N\] = \[4, 12\]"),
    (dict(lora_a=torch.randn(3, 4, 8)), ValueError, r"lora_a must be \[L, S\*R, K\] = \[3, 8, 8\]"),
    (dict(slice_offsets=[0, 5]), ValueError, r"slice_offsets must be .* from 0 to N = 12"),
    (dict(token_lora=torch.zeros(4)), TypeError, r"token_lora must be int32 or int64"),
    (dict(token_lora=torch.zeros(3, dtype=torch.int32)), ValueError, r"token_lora must have T = x.size\(0\) = 4"),
    (dict(w=torch.randn(12, 8, dtype=torch.float16)), TypeError, r"w must have x's dtype"),
    (dict(x=torch.randn(8, 4).t()), ValueError, r"x must have unit stride in its last dimension"),
    (dict(lora_scales=torch.ones(3, dtype=torch.float64)), ValueError, r"lora_scales must be float32 with 3"),
])
def test_linear_lora_argument_error(fl, change, exc, msg):
    args = dict(y=torch.randn(4, 12), x=torch.randn(4, 8), w=torch.randn(12, 8), bias=None,
                lora_a=torch.randn(3, 8, 8), lora_b=torch.randn(3, 12, 4), token_lora=torch.zeros(4, dtype=torch.int32),
                slice_offsets=[0, 6, 12])
    args.update(change)
    with pytest.raises(exc, match=r"lora_ops\.linear_lora: " + msg):
        fl.linear_lora(**args)


# ---- GPU: decode shapes of Llama-3-8B's modules (32-slot pool, rank 16), every dtype, PDL on and off ----

DECODE_MODULES = {"qkv": (4096, (4096, 1024, 1024)), "o": (4096, (4096,)), "gate_up": (4096, (14336, 14336)),
                  "down": (14336, (4096,))}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("T", [1, 32, 128])
@pytest.mark.parametrize("module", list(DECODE_MODULES))
def test_linear_lora_decode_shapes(fl, module, T, dtype):
    K, widths = DECODE_MODULES[module]
    gen = case_generator(f"fused-linear-decode-{module}-{T}")
    L, R = 32, 16
    offsets = [0]
    for width in widths:
        offsets.append(offsets[-1] + width)
    N = offsets[-1]
    token_lora = _slots(gen, T, list(range(L)) + [-1]).to(DEVICE)
    p = testing.make_sgmv(token_lora.cpu().to(torch.int32), num_slots=L, K=K, N=N, max_rank=R, dtype=dtype,
                          device=DEVICE, gen=gen, ranks=[16, 8] * 16,
                          slice_offsets=offsets if len(widths) > 1 else None)
    w = (torch.randn(N, K, generator=gen) / K ** 0.5).to(dtype).to(DEVICE)
    args = dict(y=p.y.fill_(float("nan")), x=p.x, w=w, bias=None, lora_a=p.lora_a, lora_b=p.lora_b,
                token_lora=token_lora, lora_ranks=p.lora_ranks, lora_scales=p.lora_scales, slice_offsets=offsets,
                scale=1.0)
    assert _run_and_check(fl, args) == ""
    with_pdl = args["y"].clone()
    args["y"].fill_(float("nan"))
    fl.linear_lora(**args, pdl=False)
    assert torch.equal(args["y"], with_pdl)  # PDL changes when programs start, never what they compute


@pytest.mark.gpu
def test_linear_lora_float32_output_from_bf16(fl):
    args = _problem("qkv_mixed", torch.bfloat16, "y-fp32", y_dtype=torch.float32)
    assert _run_and_check(fl, args) == ""


@pytest.mark.gpu
def test_linear_lora_graph_replay(fl):
    """Captured once, replayed twice on new inputs: the counters come back to zero inside the graph."""
    args = _problem("qkv_mixed", torch.bfloat16, "graph")
    fl.linear_lora(**args)  # allocates the counters outside the capture
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fl.linear_lora(**args)
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(2):
        args["x"].normal_()
        args["y"].fill_(float("nan"))
        before = args["y"].clone()
        graph.replay()
        torch.cuda.synchronize()
        ref = reference_linear_lora(**{k: v for k, v in args.items() if k != "y"})
        assert testing.check_against_reference(args["y"], before, ref, torch.bfloat16) == ""


@pytest.mark.gpu
def test_decode_step_fused_routes_match_the_oracle(fl):
    """The decode-step bench's fused routes and parts on a small 2-layer model: checked against its float64 oracle
    before they are timed (bench_step records a failure otherwise)."""
    from lora_ops.bench import decode_step
    model = decode_step.ModelShape("small", 512, 512, 128, 1024, 2)
    records, failures = [], []
    decode_step.bench_step(model, decode_step.Step(32, 4, 16), "cuda", records, failures, lambda line: None,
                           only=["fused-triton", "fused-triton-nopdl"], parts=True)
    assert failures == []
    assert {"fused-triton", "fused-triton-nopdl", "fused-gemm-only-triton", "shrink-only-triton"} <= \
        {r["backend"] for r in records}
