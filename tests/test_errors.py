"""Every host-side check of docs/design.md §2: the error type and a message naming the argument and the expectation.

The checks live once in csrc/common/checks.cpp; they are exercised through the CPU op and, for a sample,
through the Triton entry points (which call the same routine via torch.ops.lora_ops._check_*)."""
import subprocess
import sys

import pytest
import torch

import lora_ops
import lora_ops.ops as ops
from lora_ops import backends, testing

from conftest import gpu_where_present


def sgmv_args(T=4, K=16, N=12, L=3, R=4, S=1, dtype=torch.float32):
    return dict(y=torch.randn(T, N, dtype=dtype), x=torch.randn(T, K, dtype=dtype),
                lora_a=torch.randn(L, S * R, K, dtype=dtype), lora_b=torch.randn(L, N, R, dtype=dtype),
                seg_indptr=torch.tensor([0, 2, T], dtype=torch.int32), seg_lora=torch.tensor([0, 2], dtype=torch.int32))


def gg_args(T=4, K=16, N=12, L=3, dtype=torch.float32):
    return dict(y=torch.randn(T, N, dtype=dtype), x=torch.randn(T, K, dtype=dtype), w=torch.randn(L, N, K, dtype=dtype),
                seg_indptr=torch.tensor([0, 2, T], dtype=torch.int32), seg_weight=torch.tensor([0, 2], dtype=torch.int32))


SGMV_ERRORS = {
    "y_dim": (dict(y=torch.randn(4, 12, 1)), ValueError, r"y must be 2-D \[T, N\], got shape \[4, 12, 1\]"),
    "x_dim": (dict(x=torch.randn(64)), ValueError, r"x must be 2-D"),
    "a_dim": (dict(lora_a=torch.randn(3, 4)), ValueError, r"lora_a must be 3-D \[L, S\*R, K\]"),
    "b_dim": (dict(lora_b=torch.randn(3, 12)), ValueError, r"lora_b must be 3-D \[L, N, R\]"),
    "x_dtype": (dict(x=torch.ones(4, 16, dtype=torch.int32)), TypeError, r"x must be float16, bfloat16 or float32, got Int"),
    "a_dtype": (dict(lora_a=torch.randn(3, 4, 16, dtype=torch.float16)), TypeError, r"lora_a must have x's dtype Float, got Half"),
    "b_dtype": (dict(lora_b=torch.randn(3, 12, 4, dtype=torch.bfloat16)), TypeError, r"lora_b must have x's dtype Float, got BFloat16"),
    "y_dtype": (dict(y=torch.randn(4, 12, dtype=torch.float16)), TypeError, r"y must be float32 or x's dtype \(Float\), got Half"),
    "rows": (dict(y=torch.randn(5, 12)), ValueError, r"y has 5 rows but x has 4"),
    "a_k": (dict(lora_a=torch.randn(3, 4, 15)), ValueError, r"lora_a must be \[L, S\*R, K\] with K = x.size\(1\) = 16, got shape \[3, 4, 15\]"),
    "b_slots": (dict(lora_b=torch.randn(2, 12, 4)), ValueError, r"lora_b must have L = lora_a.size\(0\) = 3 slots"),
    "b_n": (dict(lora_b=torch.randn(3, 11, 4)), ValueError, r"lora_b must be \[L, N, R\] with N = y.size\(1\) = 12"),
    "b_r": (dict(lora_b=torch.randn(3, 12, 5)), ValueError, r"lora_b must be \[L, N, R\] with R = lora_a.size\(1\) / S = 4, got shape \[3, 12, 5\]"),
    "slices_count": (dict(slice_offsets=list(range(11))), ValueError, r"slice_offsets must have 2 to 9 entries, got 11"),
    "slices_ends": (dict(slice_offsets=[0, 6, 11]), ValueError, r"slice_offsets must start at 0 and end at N = 12"),
    "slices_order": (dict(slice_offsets=[0, 8, 4, 12], lora_a=torch.randn(3, 12, 16)), ValueError, r"slice_offsets must be non-decreasing"),
    "slices_rank": (dict(slice_offsets=[0, 6, 12], lora_a=torch.randn(3, 5, 16)), ValueError, r"lora_a.size\(1\) = 5 must be S\*R for S = 2"),
    "x_stride": (dict(x=torch.randn(16, 4).t()), ValueError, r"x must have unit stride in its last dimension"),
    "y_stride": (dict(y=torch.randn(12, 4).t()), ValueError, r"y must have unit stride in its last dimension"),
    "a_stride": (dict(lora_a=torch.randn(3, 16, 4).transpose(1, 2)), ValueError, r"lora_a must have unit stride"),
    "b_stride": (dict(lora_b=torch.randn(3, 4, 12).transpose(1, 2)), ValueError, r"lora_b must have unit stride"),
    "y_overlap": (dict(y=torch.randn(1, 12).expand(4, 12)), ValueError, r"y rows overlap in memory"),
    "indptr_dtype": (dict(seg_indptr=torch.tensor([0.0, 2.0, 4.0])), TypeError, r"seg_indptr must be int32 or int64, got Float"),
    "indptr_dim": (dict(seg_indptr=torch.zeros(3, 1, dtype=torch.int32)), ValueError, r"seg_indptr must be 1-D"),
    "indptr_empty": (dict(seg_indptr=torch.zeros(0, dtype=torch.int32), seg_lora=torch.zeros(0, dtype=torch.int32)),
                     ValueError, r"seg_indptr must have num_segments \+ 1 >= 1 entries, got 0"),
    "seg_len": (dict(seg_lora=torch.zeros(3, dtype=torch.int32)), ValueError, r"seg_lora must have 2 entries \(one per segment"),
    "seg_dtype": (dict(seg_lora=torch.zeros(2, dtype=torch.int16)), TypeError, r"seg_lora must be int32 or int64, got Short"),
    "idx_dtype": (dict(token_indices=torch.zeros(4)), TypeError, r"token_indices must be int32 or int64"),
    "idx_dim": (dict(token_indices=torch.zeros(2, 2, dtype=torch.int32)), ValueError, r"token_indices must be 1-D"),
    "ranks_len": (dict(lora_ranks=torch.zeros(2, dtype=torch.int32)), ValueError, r"lora_ranks must have 3 entries \(one per slot"),
    "ranks_dtype": (dict(lora_ranks=torch.zeros(3)), TypeError, r"lora_ranks must be int32 or int64"),
    "scales_dtype": (dict(lora_scales=torch.zeros(3, dtype=torch.float64)), TypeError, r"lora_scales must be float32, got Double"),
    "scales_len": (dict(lora_scales=torch.zeros(4)), ValueError, r"lora_scales must be 1-D with L = 3 entries"),
}

GG_ERRORS = {
    "y_dim": (dict(y=torch.randn(4)), ValueError, r"y must be 2-D"),
    "x_dim": (dict(x=torch.randn(4, 16, 1)), ValueError, r"x must be 2-D"),
    "w_dim": (dict(w=torch.randn(12, 16)), ValueError, r"w must be 3-D \[L, N, K\]"),
    "w_dtype": (dict(w=torch.ones(3, 12, 16, dtype=torch.int8)), TypeError, r"w must be float16, bfloat16 or float32, got Char"),
    "x_dtype": (dict(x=torch.randn(4, 16, dtype=torch.float16), w=torch.randn(3, 12, 16, dtype=torch.bfloat16),
                     y=torch.randn(4, 12, dtype=torch.bfloat16)), TypeError, r"x must be float32 or w's dtype \(BFloat16\), got Half"),
    "y_dtype": (dict(y=torch.randn(4, 12, dtype=torch.float64)), TypeError, r"y must be float32 or w's dtype \(Float\), got Double"),
    "rows": (dict(x=torch.randn(3, 16)), ValueError, r"y has 4 rows but x has 3"),
    "w_shape": (dict(w=torch.randn(3, 12, 15)), ValueError, r"w must be \[L, N, K\] with N = y.size\(1\) = 12 and K = x.size\(1\) = 16, got shape \[3, 12, 15\]"),
    "x_stride": (dict(x=torch.randn(16, 4).t()), ValueError, r"x must have unit stride"),
    "w_stride": (dict(w=torch.randn(3, 16, 12).transpose(1, 2)), ValueError, r"w must have unit stride"),
    "y_overlap": (dict(y=torch.randn(1, 12).expand(4, 12)), ValueError, r"y rows overlap"),
    "seg_len": (dict(seg_weight=torch.zeros(1, dtype=torch.int32)), ValueError, r"seg_weight must have 2 entries"),
    "n_sizes_len": (dict(n_sizes=torch.zeros(5, dtype=torch.int32)), ValueError, r"n_sizes must have 3 entries \(one per group"),
    "k_sizes_dtype": (dict(k_sizes=torch.zeros(3, dtype=torch.float16)), TypeError, r"k_sizes must be int32 or int64"),
}


def _backends():
    """The public ops and, where importable, the Triton entry points (same C++ check routine)."""
    if "triton" in lora_ops.backends.unavailable:
        return [ops]
    import lora_ops.triton as lt
    return [ops, lt]


CASES = [("sgmv", sgmv_args, name, case) for name, case in SGMV_ERRORS.items()] + \
        [("grouped_gemm", gg_args, name, case) for name, case in GG_ERRORS.items()]


@pytest.mark.parametrize("op,make_args,case", [c[:2] + c[3:] for c in CASES], ids=[f"{c[0]}-{c[2]}" for c in CASES])
def test_argument_error(op, make_args, case):
    change, exc, msg = case
    args = make_args()
    args.update(change)
    for mod in _backends():
        with pytest.raises(exc, match=rf"lora_ops\.{op}: " + msg):
            getattr(mod, op)(**args)


@pytest.mark.parametrize("token_lora,num_slots,exc,msg", [
    (torch.zeros(3, dtype=torch.int32), -1, ValueError, r"num_slots must be >= 0, got -1"),
    (torch.zeros(3), 2, TypeError, r"token_lora must be int32 or int64, got Float"),
    (torch.zeros(3, 1, dtype=torch.int32), 2, ValueError, r"token_lora must be 1-D"),
])
def test_build_segments_error(token_lora, num_slots, exc, msg):
    for mod in _backends():
        with pytest.raises(exc, match=r"lora_ops\.build_segments: " + msg):
            mod.build_segments(token_lora, num_slots)


def _expand_args():
    return dict(y=torch.randn(4, 12), h=torch.randn(4, 3, 4), lora_b=torch.randn(3, 12, 4),
                seg_indptr=torch.tensor([0, 2, 4], dtype=torch.int32), seg_lora=torch.tensor([0, 2], dtype=torch.int32))


OPS_WRITING_Y = {
    "sgmv": (lambda: sgmv_args(), ["y", "x", "lora_a", "lora_b"]),
    "lora_expand": (_expand_args, ["y", "h", "lora_b"]),
    "grouped_gemm": (lambda: gg_args(), ["y", "x", "w"]),
}


@pytest.mark.parametrize("name", list(OPS_WRITING_Y))
@pytest.mark.parametrize("prefix", ["", "_triton_"])
def test_ops_refuse_inputs_that_require_grad(name, prefix):
    """The ops have no backward: with grad mode on, an argument that requires grad is named and refused (the
    Triton twins too, before any backend), and under no_grad the same call runs."""
    make, tensors = OPS_WRITING_Y[name]
    op = getattr(torch.ops.lora_ops, prefix + name).default
    for arg in tensors:
        args = make()
        args[arg].requires_grad_()
        with pytest.raises(RuntimeError, match=rf"lora_ops::{prefix}{name}: {arg} requires grad, and the op has no "
                                                r"backward"):
            op(**args)
    if not prefix:  # the Triton twins are registered for CUDA only
        args = make()
        for arg in tensors:
            args[arg].requires_grad_()
        with torch.no_grad():
            op(**args)


@pytest.mark.parametrize("made_inside", ["y", "every_argument"])
@pytest.mark.parametrize("name", list(OPS_WRITING_Y))
def test_an_inference_tensor_y_is_refused_before_it_is_written(name, made_inside):
    """Outside inference mode, y made inside it cannot take an in-place update: refused, naming y, before the kernel
    writes it (a retry after the error would otherwise add the delta twice), also where every argument was made
    inside it (no Autograd key: only the ADInplaceOrView kernel sees the call); inside inference mode the call
    runs."""
    make, _ = OPS_WRITING_Y[name]
    args = make()
    with torch.inference_mode():
        for key in ["y"] if made_inside == "y" else list(args):
            args[key] = args[key].clone()
    before = args["y"].clone()
    op = getattr(torch.ops.lora_ops, name).default
    with pytest.raises(RuntimeError, match=rf"lora_ops::{name}: y is an inference tensor"):
        op(**args)
    assert torch.equal(args["y"], before)
    with torch.inference_mode():
        op(**args)


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("name", list(OPS_WRITING_Y))
def test_ops_bump_the_version_of_y(name, mode):
    """A backward that saved y before an op wrote it is refused, as after a native in-place op, whether the op ran
    under no_grad or under inference_mode (which skips the Autograd keys of a normal tensor's write, not its
    version)."""
    make, _ = OPS_WRITING_Y[name]
    args = make()
    w = torch.ones(args["y"].shape[1], requires_grad=True)
    loss = (args["y"] * w).sum()  # saves y
    version = args["y"]._version
    with getattr(torch, mode)():
        getattr(torch.ops.lora_ops, name).default(**args)
    assert args["y"]._version > version
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def _overlapping_outputs():
    """(op, make_args, the argument y shares memory with): y a shifted window of x's rows, x itself, a window of w,
    of h."""
    def sgmv_shifted():
        args, buf = sgmv_args(), torch.randn(5, 16)
        return dict(args, x=buf[:4], y=buf[1:, :12])

    def gg_y_is_x():
        args = gg_args(K=16, N=16)
        return dict(args, y=args["x"])

    def gg_window_of_w():
        args = gg_args()
        return dict(args, y=args["w"][1, :4, :12])

    def expand_shifted():
        args, buf = _expand_args(), torch.randn(5, 12)
        return dict(args, y=buf[1:], h=buf[:-1].view(4, 3, 4))

    return [("sgmv", sgmv_shifted, "x"), ("grouped_gemm", gg_y_is_x, "x"), ("grouped_gemm", gg_window_of_w, "w"),
            ("lora_expand", expand_shifted, "h")]


@pytest.mark.parametrize("op,make_args,name", _overlapping_outputs(), ids=lambda v: getattr(v, "__name__", str(v)))
def test_output_sharing_memory_with_an_input_is_refused(op, make_args, name):
    """y is written in place while the op reads its inputs: parts of one call would read what others wrote (a
    wrong, order-dependent answer), so y overlapping an input is an error naming it, on every backend."""
    for mod in _backends():
        with pytest.raises(ValueError, match=rf"lora_ops\.{op}: y shares memory with {name}; the output must not "
                                             r"overlap an input"):
            getattr(mod, op)(**make_args())


def test_output_overlapping_an_input_through_another_storage_is_refused():
    """Two storages over one memory (numpy views, torch.frombuffer) are compared by address, not by storage."""
    import numpy as np
    memory = np.zeros((5, 16), dtype=np.float32)
    args = sgmv_args()
    x, y = torch.from_numpy(memory[:4]), torch.from_numpy(memory[1:, :12])
    with pytest.raises(ValueError, match=r"lora_ops\.sgmv: y shares memory with x"):
        lora_ops.sgmv(**dict(args, x=x, y=y))


@pytest.mark.parametrize("T", [1, 4])
def test_output_beside_an_input_in_one_buffer_is_accepted(T):
    """One buffer holding y and an input side by side is not an overlap: the fold route's y = out[:, :N] and
    h = out[:, N:] (each row's columns disjoint), and rows of one buffer split between x and y. Each result is
    the one with separate tensors."""
    L, R, N = 3, 4, 12
    out = torch.randn(T, N + L * R)
    args = _expand_args()
    seg = dict(seg_indptr=torch.tensor([0, T], dtype=torch.int32), seg_lora=torch.tensor([1], dtype=torch.int32))
    y, h = out[:, :N], out[:, N:].view(T, L, R)
    expected = y.clone()
    lora_ops.lora_expand(expected, h.clone(), args["lora_b"], **seg)
    lora_ops.lora_expand(y, h, args["lora_b"], **seg)
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    torch.testing.assert_close(out[:, N:], h.reshape(T, -1), rtol=0, atol=0)  # h untouched

    args = sgmv_args()
    for x, y in ((lambda b: (b[:4], b[4:, :12]))(torch.randn(8, 16)),  # rows apart
                 (lambda b: (b[:, :16], b[:, 16:]))(torch.randn(4, 28))):  # columns apart in each row
        x.copy_(args["x"])
        expected = y.clone()
        lora_ops.sgmv(**dict(args, y=expected))
        lora_ops.sgmv(**dict(args, x=x, y=y))
        torch.testing.assert_close(y, expected, rtol=0, atol=0)


def test_lora_expand_overlapping_rows_of_y():
    for mod in _backends():
        with pytest.raises(ValueError, match=r"lora_ops\.lora_expand: y rows overlap in memory"):
            mod.lora_expand(**dict(_expand_args(), y=torch.randn(1, 12).expand(4, 12)))


def test_lora_expand_row_extent_names_y():
    args = {k: v.to("meta") for k, v in _expand_args().items()}
    args.update(y=torch.zeros(2 ** 31, 12, device="meta"), h=torch.zeros(2 ** 31, 3, 4, device="meta"))
    with pytest.raises(ValueError, match=r"lora_expand: y.size\(0\) = 2147483648 exceeds the int32 index range"):
        lora_ops.lora_expand(**args)


@pytest.mark.gpu
def test_device_mismatch():
    args = sgmv_args()
    args = {k: v.cuda() for k, v in args.items()}
    args["x"] = args["x"].cpu()
    with pytest.raises(ValueError, match=r"x is on cpu but y is on cuda:0; all tensors must be on one device"):
        ops.sgmv(**args)


@pytest.mark.gpu
def test_cuda_build_segments_slot_limit():
    """The CUDA kernel's shared-memory bound on num_slots is a clear error, and the bound itself runs."""
    if backends.cuda_served_by.get("build_segments") != "cuda":
        pytest.skip("the CUDA build_segments kernel is not built")
    top = testing.cuda_build_segments_max_slots(1)  # the device's own bound (14519 slots on an H200)
    token_lora = torch.tensor([0, top - 1, -1, top - 1], dtype=torch.int32, device="cuda")
    seg = ops.build_segments(token_lora, top)
    assert seg.seg_indptr[-1].item() == 3 and seg.token_indices.tolist() == [0, 1, 3, 2]
    with pytest.raises(ValueError, match=rf"lora_ops\.build_segments: num_slots = {top + 1} exceeds the CUDA "
                                         rf"kernel's shared-memory histogram \(max {top}\)"):
        ops.build_segments(token_lora, top + 1)


def test_debug_mode_rejects_bad_metadata():
    """LORA_OPS_DEBUG=1 reads device metadata back and raises instead of skipping/clamping."""
    script = r"""
import torch, lora_ops
def run(**kw):
    a = dict(y=torch.randn(4, 8), x=torch.randn(4, 8), lora_a=torch.randn(2, 4, 8), lora_b=torch.randn(2, 8, 4),
             seg_indptr=torch.tensor([0, 2, 4], dtype=torch.int32), seg_lora=torch.tensor([0, 1], dtype=torch.int32))
    a.update(kw)
    try:
        lora_ops.sgmv(**a)
        return "ok"
    except ValueError as e:
        return str(e).splitlines()[0]
print(run())
print(run(seg_indptr=torch.tensor([0, 3, 2], dtype=torch.int32)))
print(run(seg_lora=torch.tensor([0, 2], dtype=torch.int32)))
print(run(token_indices=torch.tensor([0, 1, 9, 2], dtype=torch.int32)))
print(run(token_indices=torch.tensor([0, 1, 1, 2], dtype=torch.int32)))
print(run(lora_ranks=torch.tensor([4, 5], dtype=torch.int32)))
print(run(seg_indptr=torch.tensor([7], dtype=torch.int32), seg_lora=torch.tensor([], dtype=torch.int32)))
"""
    out = subprocess.run([sys.executable, "-c", script], env={**__import__("os").environ, "LORA_OPS_DEBUG": "1"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "ok"
    assert "seg_indptr[1:3] = [3, 2] is not a non-decreasing range" in out[1]
    assert "seg_lora[1] = 2 is not below the number of slots 2" in out[2]
    assert "token_indices[2] = 9 is outside [0, 4)" in out[3]
    assert "row 1 appears in more than one segment position" in out[4]
    assert "lora_ranks[1] = 5 is outside [0, R = 4]" in out[5]
    assert "seg_indptr[0] = 7 is outside [0, 4]" in out[6]  # no segment: its one entry is still checked


def test_debug_mode_checks_original_int64_values_and_group_sizes():
    """LORA_OPS_DEBUG=1 validates the values as given (int64 beyond int32 included, not their int32 form) and the
    per-group n_sizes/k_sizes, through the C++ op and through the Triton entry points (same check routine)."""
    script = r"""
import os, torch
if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
import lora_ops
mods = [lora_ops]
if "triton" not in lora_ops.backends.unavailable:
    import lora_ops.triton
    mods.append(lora_ops.triton)
big = 2 ** 32
i64 = lambda v: torch.tensor(v, dtype=torch.int64)
def err(fn, **kw):
    try:
        fn(**kw)
        return "ok"
    except ValueError as e:
        return str(e).splitlines()[0]
for mod in mods:
    def sgmv(**kw):
        a = dict(y=torch.randn(4, 8), x=torch.randn(4, 8), lora_a=torch.randn(2, 4, 8), lora_b=torch.randn(2, 8, 4),
                 seg_indptr=i64([0, 2, 4]), seg_lora=i64([0, 1]))
        a.update(kw)
        return err(mod.sgmv, **a)
    def gg(**kw):
        a = dict(y=torch.randn(4, 8), x=torch.randn(4, 6), w=torch.randn(3, 8, 6), seg_indptr=i64([0, 4]),
                 seg_weight=i64([2]))
        a.update(kw)
        return err(mod.grouped_gemm, **a)
    print(sgmv())
    print(sgmv(seg_lora=i64([0, big])))
    print(sgmv(seg_indptr=i64([0, big + 2, 4])))
    print(sgmv(token_indices=i64([0, 1, big + 3, 2])))
    print(sgmv(lora_ranks=i64([4, big + 1])))
    print(sgmv(seg_indptr=i64([0, 4, 0])))
    print(gg(n_sizes=i64([8, 8, 99]), k_sizes=i64([6, 6, 6])))
    print(gg(n_sizes=i64([8, -5, 8])))
    print(gg(k_sizes=i64([6, 6, big + 2])))
"""
    out = subprocess.run([sys.executable, "-c", script], env={**__import__("os").environ, "LORA_OPS_DEBUG": "1"},
                         capture_output=True, text=True, check=True).stdout.splitlines()
    expected = ["ok", "seg_lora[1] = 4294967296 is not below the number of slots 2",
                "seg_indptr[0:2] = [0, 4294967298] is not a non-decreasing range inside [0, 4]",
                "token_indices[2] = 4294967299 is outside [0, 4)", "lora_ranks[1] = 4294967297 is outside [0, R = 4]",
                "seg_indptr[1:3] = [4, 0] is not a non-decreasing range",
                "n_sizes[2] = 99 is outside [0, N = 8]", "n_sizes[1] = -5 is outside [0, N = 8]",
                "k_sizes[2] = 4294967298 is outside [0, K = 6]"]
    assert len(out) == len(expected) * len(_backends())
    for got, want in zip(out, expected * len(_backends())):
        assert want in got, (got, want)


@gpu_where_present
@pytest.mark.skipif("triton" in backends.unavailable, reason="Triton not installed")
def test_triton_refuses_sizes_its_kernels_cannot_launch():
    """Past CUDA's 65535 column programs, or a rank whose block passes Triton's 2**20 elements, the Triton entry
    points raise a ValueError naming the size (the C++ kernels loop and take them); under the interpreter here, so
    nothing is launched either way."""
    import lora_ops.triton as tr

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    i32 = lambda v: torch.tensor(v, dtype=torch.int32, device=dev)
    N = 128 * 65535 + 1  # grouped_gemm's column blocks are at most 128 wide
    y, x, w = torch.zeros(1, N, device=dev), torch.ones(1, 1, device=dev), torch.ones(1, N, 1, device=dev)
    with pytest.raises(ValueError, match=rf"grouped_gemm \(Triton\): y's N = {N} columns need 65536 column programs"):
        tr.grouped_gemm(y, x, w, i32([0, 1]), i32([0]))
    R = 8193  # fp16: BLOCK_R 16384 x 128 columns
    p = testing.make_sgmv(torch.tensor([0], dtype=torch.int32), num_slots=1, K=16, N=16, max_rank=R,
                          dtype=torch.float16, device=dev, gen=torch.Generator().manual_seed(0))
    with pytest.raises(ValueError, match=rf"sgmv \(Triton\): the rank R = {R} needs a block of 2097152 elements"):
        tr.sgmv(*p.args())


@pytest.mark.parametrize("name", list(OPS_WRITING_Y))
@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_a_scale_beyond_float32_is_refused(name, device):
    """The kernels multiply by scale (alpha) in float32: a finite value it cannot hold would make every delta inf
    where the float64 result is finite. Refused naming it, by the real kernels and by the Meta ones alike."""
    make, _ = OPS_WRITING_Y[name]
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in make().items()}
    arg = "alpha" if name == "grouped_gemm" else "scale"
    op = getattr(torch.ops.lora_ops, name).default
    with pytest.raises(ValueError, match=rf"lora_ops::{name}: {arg} = 1e\+39 is beyond float32's range"):
        op(**dict(args, **{arg: 1e39}))
    op(**dict(args, **{arg: 3e38}))  # within it


def test_lora_expand_rank_times_slices_overflow_is_refused():
    """An empty lora_b (N = 0) may have any rank R: S*R must not wrap around int64 into a shape h matches."""
    y, lora_b = torch.zeros(2, 0), torch.empty(1, 0, 2 ** 62)
    h = torch.zeros(2, 1, 0)
    seg = [torch.tensor(v, dtype=torch.int32) for v in ([0, 2], [0])]
    with pytest.raises(ValueError, match=r"lora_b's rank R = 4611686018427387904 times S = 4 slices overflows int64"):
        lora_ops.lora_expand(y, h, lora_b, *seg, slice_offsets=[0, 0, 0, 0, 0])
