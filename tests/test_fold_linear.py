"""fold_linear (the fold route's GEMM, y = x · weightᵀ + bias): torch's linear on every backend, its errors and
its gradient, opcheck and torch.compile; on CUDA the sm_90a CUTLASS kernel (csrc/cuda/fold_linear_sm90.cu, a
GEMM that lets the lora_expand after it start early) where it serves, named through the profiler, against the
float64 product, bitwise deterministic and under CUDA-graph replay, and elsewhere cuBLASLt (its own call) or
at::linear."""
import os
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F

import lora_ops
from lora_ops import backends, reference, testing

from conftest import aten_op_names, case_generator, cuda_kernel_names, misaligned



def _inputs(T, K, N, dtype, device, bias=False, key="fold"):
    gen = case_generator(f"fold_linear-{key}-{T}-{K}-{N}")
    x = torch.randn(T, K, generator=gen).to(dtype).to(device)
    w = torch.randn(N, K, generator=gen).to(dtype).to(device)
    b = torch.randn(N, generator=gen).to(dtype).to(device) if bias else None
    return x, w, b


@pytest.mark.parametrize("shape", [(5, 24), (2, 3, 24), (0, 24)], ids=["2d", "3d", "empty"])
@pytest.mark.parametrize("bias", [False, True], ids=["no_bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fold_linear_is_torchs_linear_on_cpu(shape, bias, dtype):
    gen = case_generator(f"fold_linear-cpu-{shape}")
    x = torch.randn(*shape, generator=gen).to(dtype)
    w = torch.randn(40, 24, generator=gen).to(dtype)
    b = torch.randn(40, generator=gen).to(dtype) if bias else None
    assert torch.equal(lora_ops.fold_linear(x, w, b), F.linear(x, w, b))


def _slot_windows(T, slots_used, num_slots, key):
    """token_lora over `slots_used` (and a row without a slot when T allows), and build_segments' seg_indptr."""
    gen = case_generator(f"fold_linear-slots-{key}")
    token_lora = testing.random_token_slots(T, slots_used, gen) if slots_used else \
        torch.full((T,), -1, dtype=torch.int32)
    if T > len(slots_used) and slots_used:
        token_lora[0] = -1
    return token_lora, lora_ops.build_segments(token_lora, num_slots).seg_indptr


def test_fold_linear_with_slot_windows_on_cpu_computes_every_row():
    """On CPU the slot windows change nothing: at::linear over every row of weight, the unused slots' too."""
    x, w, _ = _inputs(6, 24, 40 + 8 * 3, torch.float32, "cpu")
    _, seg_indptr = _slot_windows(6, [1], 8, "cpu")
    assert torch.equal(lora_ops.fold_linear(x, w, None, seg_indptr, 3), F.linear(x, w))


@pytest.mark.parametrize("case", ["float_indptr", "2d_indptr", "empty_indptr", "slot_rows_0", "too_many_slots",
                                  "huge_slot_rows", "slot_rows_alone", "weight_3d", "other_device"])
def test_fold_linear_slot_window_errors_name_the_argument(case):
    x, w = torch.randn(4, 24), torch.randn(40, 24)
    seg, slot_rows = torch.zeros(9, dtype=torch.int32), 4
    match = {"float_indptr": "seg_indptr must be int32 or int64", "2d_indptr": "seg_indptr must be 1-D",
             "empty_indptr": "seg_indptr must have num_slots \\+ 1 >= 1 entries",
             "slot_rows_0": "slot_rows .* must be >= 1", "too_many_slots": "8 slots of slot_rows = 6 rows",
             "huge_slot_rows": "slots of slot_rows = 4611686018427387904", "slot_rows_alone": "without seg_indptr",
             "weight_3d": "weight must be 2-D", "other_device": "seg_indptr is on meta but weight is on cpu"}[case]
    if case == "float_indptr":
        seg = seg.float()
    elif case == "2d_indptr":
        seg = seg.view(3, 3)
    elif case == "empty_indptr":
        seg = seg[:0]
    elif case == "slot_rows_0":
        slot_rows = 0
    elif case == "too_many_slots":
        slot_rows = 6  # 8 slots x 6 rows > 40
    elif case == "huge_slot_rows":
        slot_rows = 2 ** 62  # 8 x 2^62 wraps int64: checked by division
    elif case == "slot_rows_alone":
        seg = None
    elif case == "weight_3d":
        w = w.view(2, 20, 24)
    elif case == "other_device":
        seg = seg.to("meta")
    error = TypeError if case == "float_indptr" else ValueError
    with pytest.raises(error, match=match):
        lora_ops.fold_linear(x, w, None, seg, slot_rows)


def test_fold_linear_raises_torchs_errors():
    x, w = torch.randn(4, 24), torch.randn(40, 23)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        lora_ops.fold_linear(x, w)


@pytest.mark.parametrize("wants_grad", ["x", "weight", "bias"])
def test_fold_linear_gradient_is_linears(wants_grad):
    """Where a gradient is wanted (of any one argument, the bias alone too) fold_linear is at::linear, autograd and
    all: the same gradients as F.linear, through torch's own backward node, with no warning."""
    gen = case_generator("fold_linear-grad")
    args = [torch.randn(*s, generator=gen, dtype=torch.float64) for s in ((2, 3, 6), (5, 6), (5,))]
    which = ("x", "weight", "bias").index(wants_grad)
    args[which].requires_grad_(True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = lora_ops.fold_linear(*args)
        (grad,) = torch.autograd.grad(out.square().sum(), [args[which]])
    assert out.grad_fn is not None and "Backward" in type(out.grad_fn).__name__
    (expected,) = torch.autograd.grad(F.linear(*args).square().sum(), [args[which]])
    assert torch.equal(grad, expected)
    assert torch.autograd.gradcheck(lora_ops.fold_linear, args)


def test_fold_linear_without_grad_leaves_no_graph():
    x, w = torch.randn(4, 8, requires_grad=True), torch.randn(6, 8)
    with torch.no_grad():
        assert lora_ops.fold_linear(x, w).grad_fn is None


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_opcheck_fold_linear(device):
    for bias in (False, True):
        x, w, b = _inputs(8, 64, 48, torch.bfloat16 if device == "cuda" else torch.float32, device, bias)
        torch.library.opcheck(torch.ops.lora_ops.fold_linear.default, (x, w, b))
    # every slot used (the output is then specified everywhere, as opcheck compares whole outputs)
    x, w, _ = _inputs(8, 64, 32 + 8 * 2, torch.bfloat16 if device == "cuda" else torch.float32, device)
    _, seg_indptr = _slot_windows(8, list(range(8)), 8, "opcheck")
    torch.library.opcheck(torch.ops.lora_ops.fold_linear.default, (x, w, None, seg_indptr.to(device), 2))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fold_linear_compiles_without_graph_breaks(device):
    torch._dynamo.reset()
    f = torch.compile(lambda x, w, seg: lora_ops.fold_linear(x, w, None, seg, 2) * 2, fullgraph=True, dynamic=True)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for T in (8, 16):
        x, w, _ = _inputs(T, 64, 32 + 8 * 2, dtype, device)
        _, seg_indptr = _slot_windows(T, list(range(8)), 8, f"compile-{T}")
        seg_indptr = seg_indptr.to(device)
        assert torch.equal(f(x, w, seg_indptr), lora_ops.fold_linear(x, w, None, seg_indptr, 2) * 2)


# ---- CUDA ----

def _ran_cutlass(keys) -> bool:
    """CUTLASS's kernel among the profiler's names (mangled on the H200 image: _ZN7cutlass13device_kernel...)."""
    return any("cutlass" in k and "device_kernel" in k and "GemmUniversal" in k for k in keys)


def _assert_product(y, x, w, b=None):
    ref = reference.fold_linear(x, w, b)
    assert y.dtype == x.dtype and y.shape == ref.shape
    torch.testing.assert_close(y.double(), ref, rtol=2 ** -7, atol=1e-2)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 7, 16, 17, 32, 33, 64, 65])  # 16 | 17 | 33: the three tiles
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_cutlass_kernel_up_to_64_tokens(T, dtype, monkeypatch):
    """The automatic choice: the CUTLASS kernel up to 64 tokens, cuBLASLt past them; the product within the output
    dtype's rounding of the float64 one."""
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    x, w, _ = _inputs(T, 520, 1040, dtype, "cuda")
    y, ran = cuda_kernel_names(lambda: lora_ops.fold_linear(x, w))
    _assert_product(y, x, w)
    assert _ran_cutlass(ran) == (backends.sm90_kernels_run() and T <= 64), ran


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["bias", "n_not_in_eights", "k_not_in_eights", "float32", "strided_x",
                                  "unaligned_w", "forced_cublas"])
def test_at_linear_where_the_kernel_does_not_serve(case, monkeypatch):
    """A bias, sizes not in eights, float32, a non-contiguous x, an unaligned weight or a forced cuBLAS: no CUTLASS
    kernel (cuBLASLt or at::linear), the same product."""
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    N = 1001 if case == "n_not_in_eights" else 1040
    K = 517 if case == "k_not_in_eights" else 520
    dtype = torch.float32 if case == "float32" else torch.bfloat16
    x, w, b = _inputs(16, K, N, dtype, "cuda", bias=case == "bias", key=case)
    if case == "strided_x":
        x = torch.cat([x, x], dim=1)[:, ::2]
    if case == "unaligned_w":
        w = torch.zeros(N * K + 1, dtype=dtype, device="cuda")[1:].view(N, K).copy_(w)  # 2 bytes off 16
    if case == "forced_cublas":
        monkeypatch.setenv("LORA_OPS_CUDA_LINEAR_KERNEL", "cublas")
    y, ran = cuda_kernel_names(lambda: lora_ops.fold_linear(x, w, b))
    if dtype == torch.float32:
        torch.testing.assert_close(y, F.linear(x, w, b))
    else:
        _assert_product(y, x, w, b)
    assert not _ran_cutlass(ran), ran


@pytest.mark.gpu
def test_forced_cutlass_serves_any_token_count(monkeypatch):
    if not backends.sm90_kernels_run():
        pytest.skip("the sm_90a kernels are not built, or not a 9.0 device")
    monkeypatch.setenv("LORA_OPS_CUDA_LINEAR_KERNEL", "cutlass")
    x, w, _ = _inputs(300, 520, 1040, torch.bfloat16, "cuda")
    y, ran = cuda_kernel_names(lambda: lora_ops.fold_linear(x, w))
    _assert_product(y, x, w)
    assert _ran_cutlass(ran), ran


@pytest.mark.gpu
def test_unknown_kernel_name_is_an_error(monkeypatch):
    monkeypatch.setenv("LORA_OPS_CUDA_LINEAR_KERNEL", "cutlas")
    x, w, _ = _inputs(4, 64, 48, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="LORA_OPS_CUDA_LINEAR_KERNEL = 'cutlas'"):
        lora_ops.fold_linear(x, w)


def _ran_at_linear(f):
    """(f(), whether it ran at::linear), from the profiler's operator names: fold_linear's own cuBLASLt call is no
    ATen operator, at::linear's product is aten::mm or aten::addmm."""
    out, names = aten_op_names(f)
    assert "lora_ops::fold_linear" in names, names  # the profiler saw the call
    return out, bool(names & {"aten::linear", "aten::mm", "aten::addmm"})


@pytest.mark.gpu
@pytest.mark.parametrize("blas", [None, "cublaslt", "cublas"], ids=["auto", "cublaslt", "cublas"])
@pytest.mark.parametrize("T,bias,dtype", [(16, True, torch.bfloat16), (65, False, torch.float16),
                                          (128, False, torch.bfloat16), (128, True, torch.float16),
                                          (129, False, torch.bfloat16), (300, True, torch.bfloat16)])
def test_blas_past_the_cutlass_kernel(T, bias, dtype, blas, monkeypatch):
    """The calls the CUTLASS kernel does not take (past 64 tokens, a bias): on cuBLASLt through fold_linear's own
    handle at 65-128 tokens on a 9.x device, or at any count with LORA_OPS_CUDA_FOLD_BLAS=cublaslt; on at::linear
    (cuBLAS) elsewhere, or at any count with =cublas. Either way the product within the dtype's rounding, bitwise
    the same on every call and under graph replay, and the process's preferred BLAS library untouched."""
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    if blas is None:
        monkeypatch.delenv("LORA_OPS_CUDA_FOLD_BLAS", raising=False)
    else:
        monkeypatch.setenv("LORA_OPS_CUDA_FOLD_BLAS", blas)
    before = torch.backends.cuda.preferred_blas_library()
    x, w, b = _inputs(T, 1024, 2048 + 520, dtype, "cuda", bias=bias, key="blas")
    y, ran_linear = _ran_at_linear(lambda: lora_ops.fold_linear(x, w, b))
    _assert_product(y, x, w, b)
    lt_measured = 64 < T <= 128 and torch.cuda.get_device_capability()[0] == 9
    assert ran_linear == (blas == "cublas" or (blas is None and not lt_measured))
    assert torch.backends.cuda.preferred_blas_library() == before
    assert all(torch.equal(y, lora_ops.fold_linear(x, w, b)) for _ in range(3))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = lora_ops.fold_linear(x, w, b)
    graph.replay()
    assert torch.equal(captured, y)


@pytest.mark.gpu
@pytest.mark.parametrize("blas", [None, "cublaslt"], ids=["auto", "cublaslt"])
def test_forced_blas_skips_the_cutlass_kernel_at_any_count(blas, monkeypatch):
    """LORA_OPS_CUDA_LINEAR_KERNEL=cublas: no CUTLASS kernel, at 16 tokens either; the library cuBLAS, or cuBLASLt
    where LORA_OPS_CUDA_FOLD_BLAS=cublaslt forces it (the automatic choice's cuBLASLt at 65-128 tokens too is
    forced off: "cublas" means cuBLAS unless both are named)."""
    monkeypatch.setenv("LORA_OPS_CUDA_LINEAR_KERNEL", "cublas")
    if blas is None:
        monkeypatch.delenv("LORA_OPS_CUDA_FOLD_BLAS", raising=False)
    else:
        monkeypatch.setenv("LORA_OPS_CUDA_FOLD_BLAS", blas)
    for T in (16, 96):
        x, w, _ = _inputs(T, 1024, 2048 + 520, torch.bfloat16, "cuda", key="forced-blas")
        y, ran_linear = _ran_at_linear(lambda: lora_ops.fold_linear(x, w))
        _assert_product(y, x, w)
        assert ran_linear == (blas is None), T
        _, ran = cuda_kernel_names(lambda: lora_ops.fold_linear(x, w))
        assert not _ran_cutlass(ran), (T, ran)


@pytest.mark.gpu
def test_cublaslt_takes_16_byte_aligned_operands_only(monkeypatch):
    """After a call on cuBLASLt with every operand aligned, the same shape with an x 2 bytes off 16 runs on
    at::linear, and gives the product: an algorithm kept from the aligned call could need more alignment than it
    has."""
    monkeypatch.setenv("LORA_OPS_CUDA_FOLD_BLAS", "cublaslt")
    x, w, _ = _inputs(96, 1024, 2048 + 520, torch.bfloat16, "cuda", key="align")
    y, ran_linear = _ran_at_linear(lambda: lora_ops.fold_linear(x, w))
    _assert_product(y, x, w)
    assert not ran_linear
    x_off = misaligned(x)
    y, ran_linear = _ran_at_linear(lambda: lora_ops.fold_linear(x_off, w))
    _assert_product(y, x, w)
    assert ran_linear


@pytest.mark.gpu
@pytest.mark.parametrize("blas", [None, "cublaslt", "cublas"], ids=["auto", "cublaslt", "cublas"])
@pytest.mark.parametrize("off", ["bias", "x", "x_bias_1_by_n"])  # a [1, N] bias: at::linear broadcasts it too
def test_an_operand_2_bytes_off_16_leaves_cublaslt_for_at_linear(off, blas, monkeypatch, full_precision_reduction):
    """fold_linear's own cuBLASLt call takes 16-byte-aligned operands only, the kernels measured: with x or a bf16
    bias 2 bytes off 16 it runs at::linear (ATen's addmm, its bias in the epilogue), on either library and at 16
    tokens too, and every output is within its rounding of the float64 sum. The numbers there are torch's: with its
    default reduced-precision reduction, 5.9% of them were 2-3 ulps further off (the fixture says why)."""
    if blas is None:
        monkeypatch.delenv("LORA_OPS_CUDA_FOLD_BLAS", raising=False)
    else:
        monkeypatch.setenv("LORA_OPS_CUDA_FOLD_BLAS", blas)
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    for T in (16, 96):
        x, w, b = _inputs(T, 1024, 2048 + 520, torch.bfloat16, "cuda", bias=True, key="align")
        xx, bb = x, b
        if off == "bias":
            bb = misaligned(b)
        else:
            xx = misaligned(x)
            bb = b.view(1, -1) if off == "x_bias_1_by_n" else b
        y, names = aten_op_names(lambda: lora_ops.fold_linear(xx, w, bb))
        _assert_product(y, x, w, b)
        assert "aten::addmm" in names, (T, names)


@pytest.mark.gpu
def test_cublaslt_first_call_of_the_process_inside_a_graph_capture():
    """A process's first fold_linear on cuBLASLt may come inside a CUDA graph capture (the handle, the heuristic's
    query and the workspace are made then): the capture holds, and its replay writes the product."""
    code = """if True:
        import torch, lora_ops
        x = torch.randn(96, 1024, device="cuda").to(torch.bfloat16)
        w = torch.randn(2568, 1024, device="cuda").to(torch.bfloat16)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = lora_ops.fold_linear(x, w)
        y.zero_()
        graph.replay()
        torch.cuda.synchronize()
        err = ((y.double() - x.double() @ w.double().t()).abs() / (1 + (x.double() @ w.double().t()).abs())).max()
        assert err < 2 ** -7, float(err)
        print("replayed")
    """
    env = dict(os.environ, LORA_OPS_CUDA_FOLD_BLAS="cublaslt")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and "replayed" in run.stdout, run.stderr[-3000:]


@pytest.mark.gpu
def test_unknown_blas_name_is_an_error(monkeypatch):
    monkeypatch.setenv("LORA_OPS_CUDA_FOLD_BLAS", "lt")
    x, w, _ = _inputs(80, 64, 48, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match="LORA_OPS_CUDA_FOLD_BLAS = 'lt'"):
        lora_ops.fold_linear(x, w)


@pytest.mark.gpu
@pytest.mark.parametrize("T", [8, 32, 48, 80])  # 80: at::linear's GEMM before the expand
def test_deterministic_and_graph_replay(T, monkeypatch):
    """Bitwise the same result on every call (no split-K); then the fold route's pair, fold_linear and the CUDA
    lora_expand launched to start before the GEMM ends, captured in a CUDA graph and replayed on new inputs: y
    equals the float64 base product plus the expand of the h the GEMM wrote (a read of y or h before the GEMM
    finished would not), and an eager run of the pair on the new inputs bitwise."""
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    L, R, N, K = 32, 16, 4096, 4096
    x, w, _ = _inputs(T, K, N + L * R, torch.bfloat16, "cuda", key="graph")
    w.div_(16)
    first = lora_ops.fold_linear(x, w)
    assert all(torch.equal(first, lora_ops.fold_linear(x, w)) for _ in range(3))
    gen = case_generator(f"fold_linear-graph-b-{T}")
    lora_b = torch.randn(L, N, R, generator=gen).to(torch.bfloat16).cuda()
    slots = torch.randint(-1, L, (T,), generator=gen, dtype=torch.int32).cuda()
    seg_indptr = lora_ops.build_segments(slots, L).seg_indptr
    used = sorted(set(slots.tolist()) - {-1})
    specified = torch.cat([torch.arange(N)] + [torch.arange(N + s * R, N + (s + 1) * R) for s in used]).cuda()

    def step():  # as the serving layer's fold route: fold_linear skips the unused slots' windows
        out = lora_ops.fold_linear(x, w, None, seg_indptr, R)
        lora_ops.lora_expand(out[:, :N], out[:, N:].view(T, L, R), lora_b, None, slots, scale=0.5)
        return out

    _, ran = cuda_kernel_names(step)
    assert _ran_cutlass(ran) == (backends.sm90_kernels_run() and T <= 64), ran
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    x.copy_(_inputs(T, K, N + L * R, torch.bfloat16, "cuda", key="graph-new")[0])
    graph.replay()
    torch.cuda.synchronize()
    h = captured[:, N:].double().view(T, L, R)
    _assert_product(captured[:, specified[N:]], x, w[specified[N:]])
    base = reference.fold_linear(x, w[:N])
    delta = torch.zeros_like(base)
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            delta[t] = 0.5 * h[t, slot] @ lora_b[slot].double().t()
    expected = base + delta
    assert ((captured[:, :N].double() - expected).norm() / expected.norm()).item() < 1e-2
    assert torch.equal(captured[:, specified], step()[:, specified])


# fold_linear_sm90.cu: 64-row tiles in clusters of 2 along W's rows, of one past 16 tokens where slot windows span
# 64 rows or more; a cluster is skipped when no row uses a slot whose window it touches
def _cluster_rows(T, slot_rows):
    return 64 if T > 16 and slot_rows >= 64 else 128


@pytest.mark.gpu
@pytest.mark.parametrize("T", [1, 5, 32, 48])  # one case per tile (16, 32 and 64 tokens)
@pytest.mark.parametrize("base_rows,slot_rows,K",
                         [(1024, 16, 256), (1040, 48, 256), (4096, 64, 256), (1040, 96, 256), (1024, 16384, 64)],
                         ids=["r16", "qkv_r16_base_mid_cluster", "r64", "qkv_r32_tiles_across_windows",
                              "over_32_tiles_per_cta"])
def test_cutlass_kernel_skips_the_unused_slots(T, base_rows, slot_rows, K, monkeypatch):
    """With the step's seg_indptr, the base rows and every used slot's window are the float64 product, and on the
    CUTLASS kernel the clusters of rows that only unused slots' windows touch are not computed: the output's
    memory, poisoned with NaN before (the caching allocator hands the same block back), keeps its NaN there.
    The last case gives each CTA ~62 tiles (8208 over the H200's 132 SMs): the scheduler judges each CTA's first
    32, so some skippable clusters are skipped and the later ones are computed."""
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    num_slots = 32
    gen = case_generator(f"fold_linear-skip-{T}-{slot_rows}")
    used = sorted(torch.randperm(num_slots, generator=gen)[:max(1, min(T - 1, 3))].tolist())
    if slot_rows == 48:
        used[-1] = num_slots - 1  # the last slot: its window ends W, in a cluster of its own
    token_lora, seg_indptr = _slot_windows(T, used, num_slots, f"skip-{T}-{slot_rows}")
    rows = base_rows + num_slots * slot_rows
    x, w, _ = _inputs(T, K, rows, torch.bfloat16, "cuda", key="skip")
    seg_indptr = seg_indptr.cuda()  # before the poisoned block is freed: nothing else may take it
    poisoned = torch.full((T, rows), float("nan"), dtype=torch.bfloat16, device="cuda")
    poisoned_ptr = poisoned.data_ptr()
    del poisoned
    y, ran = cuda_kernel_names(lambda: lora_ops.fold_linear(x, w, None, seg_indptr, slot_rows))
    ref = reference.fold_linear(x, w)
    needed = torch.zeros(rows, dtype=torch.bool)
    needed[:base_rows] = True
    for slot in set(token_lora.tolist()) - {-1}:
        needed[base_rows + slot * slot_rows:base_rows + (slot + 1) * slot_rows] = True
    torch.testing.assert_close(y[:, needed].double(), ref[:, needed], rtol=2 ** -7, atol=1e-2)
    if not backends.sm90_kernels_run():
        assert not _ran_cutlass(ran) and not y.isnan().any()
        return
    assert _ran_cutlass(ran), ran
    assert y.data_ptr() == poisoned_ptr, "the caching allocator did not reuse the poisoned block"
    computed = needed.clone()
    cluster_rows = _cluster_rows(T, slot_rows)
    for first in range(0, rows, cluster_rows):
        computed[first:first + cluster_rows] = needed[first:first + cluster_rows].any()
    assert not y[:, computed].isnan().any()
    assert (~computed).any()  # every case leaves whole clusters of unused slots
    skipped = y[:, ~computed].isnan()
    if -(-rows // 64) <= 32 * torch.cuda.get_device_properties(y.device).multi_processor_count:
        assert skipped.all(), f"{(~skipped).sum().item()} skippable values computed"
    else:
        assert skipped.any() and not skipped.all()


@pytest.mark.gpu
def test_garbage_seg_indptr_reads_in_bounds_and_computes_the_base_rows(monkeypatch):
    """Any seg_indptr values (negative, huge, descending) only choose which slot windows are computed: the base rows
    are the product, and compute-sanitizer (scripts/gpu_run.sh) sees every read in bounds. (Which kernel ran is not
    asserted here: under compute-sanitizer the profiler cannot run; the skip test above asserts it.)"""
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    gen = case_generator("fold_linear-garbage")
    x, w, _ = _inputs(16, 256, 1024 + 16 * 48, torch.bfloat16, "cuda", key="garbage")
    for seg_indptr in (torch.randint(-2 ** 31, 2 ** 31 - 1, (17,), generator=gen, dtype=torch.int64),
                       torch.arange(16, -1, -1, dtype=torch.int32), torch.zeros(17, dtype=torch.int32),
                       torch.tensor([0, 2 ** 40] * 8 + [-(2 ** 40)]), torch.zeros(1, dtype=torch.int32)):
        y = lora_ops.fold_linear(x, w, None, seg_indptr.cuda(), 48)
        torch.testing.assert_close(y[:, :1024].double(), reference.fold_linear(x, w[:1024]), rtol=2 ** -7,
                                   atol=1e-2)


@pytest.mark.gpu
def test_gradient_on_cuda_is_linears(monkeypatch):
    """At a decode size where the inference path runs the CUTLASS kernel, a weight that wants a gradient takes
    at::linear: the output and the gradient are F.linear's, bitwise."""
    monkeypatch.delenv("LORA_OPS_CUDA_LINEAR_KERNEL", raising=False)
    x, w, _ = _inputs(16, 520, 1040, torch.bfloat16, "cuda", key="grad")
    w.requires_grad_(True)
    out = lora_ops.fold_linear(x, w)
    expected = F.linear(x, w)
    assert torch.equal(out, expected)
    assert torch.equal(torch.autograd.grad(out.sum(), [w])[0], torch.autograd.grad(expected.sum(), [w])[0])
