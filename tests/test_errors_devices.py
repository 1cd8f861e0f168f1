"""Device checks of every tensor argument, and the per-slot length checks, through each route that runs them.

A device mismatch needs a second device. Without a GPU the 'meta' device plays it, beside CPU tensors:
- route "check": the shared C++ check routine itself (torch.ops.lora_ops._check_*), which every backend calls;
- route "triton": the Triton entry points (lora_ops.triton.*), which call it before launching;
- route "dispatcher": the public op; a call with one meta argument is routed to the Meta kernel, which must run
  the same checks (docs/design.md §2: "a Meta kernel that runs the host argument checks").
With a GPU the real case runs: one CPU tensor among CUDA ones, through the dispatcher (CUDA kernels) and Triton.
"""
import pytest
import torch

import lora_ops

from conftest import triton_backend

L = 3  # slots / groups


def _sgmv_args():
    T, K, N, R = 4, 16, 12, 4
    return dict(y=torch.randn(T, N), x=torch.randn(T, K), lora_a=torch.randn(L, R, K), lora_b=torch.randn(L, N, R),
                seg_indptr=torch.tensor([0, 2, T], dtype=torch.int32),
                seg_lora=torch.tensor([0, 2], dtype=torch.int32),
                token_indices=torch.tensor([3, 1, 0, 2], dtype=torch.int32),
                lora_ranks=torch.tensor([4, 2, 1], dtype=torch.int32), lora_scales=torch.ones(L),
                slice_offsets=None)


def _gg_args():
    T, K, N = 4, 16, 12
    return dict(y=torch.randn(T, N), x=torch.randn(T, K), w=torch.randn(L, N, K),
                seg_indptr=torch.tensor([0, 2, T], dtype=torch.int32),
                seg_weight=torch.tensor([0, 2], dtype=torch.int32),
                token_indices=torch.tensor([3, 1, 0, 2], dtype=torch.int32),
                n_sizes=torch.tensor([12, 5, 1], dtype=torch.int32),
                k_sizes=torch.tensor([16, 3, 7], dtype=torch.int32))


MAKE_ARGS = {"sgmv": _sgmv_args, "grouped_gemm": _gg_args}
TENSOR_ARGS = {op: [k for k, v in make().items() if k != "y" and isinstance(v, torch.Tensor)]
               for op, make in MAKE_ARGS.items()}


def _call(route, op, args):
    if route == "check":  # the check op takes the op's arguments up to the last tensor-or-list one, positionally
        getattr(torch.ops.lora_ops, f"_check_{op}").default(*args.values())
    elif route.startswith("triton"):
        getattr(triton_backend(), op)(**args)
    else:
        getattr(lora_ops, op)(**args)


# "dispatcher" with one meta argument reaches the Meta kernels, which run the host checks as the CPU kernels do.
CPU_ROUTES = ["check", "triton", "dispatcher"]
GPU_ROUTES = [pytest.param(r, marks=pytest.mark.gpu) for r in ("dispatcher-cuda", "triton-cuda")]


def _cases():
    return [(op, name) for op in MAKE_ARGS for name in TENSOR_ARGS[op]]


@pytest.mark.parametrize("route", CPU_ROUTES)
@pytest.mark.parametrize("op,name", _cases())
def test_argument_on_another_device(route, op, name):
    args = MAKE_ARGS[op]()
    args[name] = args[name].to("meta")
    with pytest.raises(ValueError, match=rf"lora_ops\.{op}: {name} is on meta but y is on cpu; "
                                         r"all tensors must be on one device"):
        _call(route, op, args)


@pytest.mark.parametrize("route", CPU_ROUTES)
@pytest.mark.parametrize("op", list(MAKE_ARGS))
def test_y_on_another_device(route, op):
    args = MAKE_ARGS[op]()
    args["y"] = args["y"].to("meta")
    with pytest.raises(ValueError, match=rf"lora_ops\.{op}: x is on cpu but y is on meta"):
        _call(route, op, args)


@pytest.mark.parametrize("route", GPU_ROUTES)
@pytest.mark.parametrize("op,name", _cases())
def test_argument_on_cpu_beside_cuda(route, op, name):
    args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in MAKE_ARGS[op]().items()}
    args[name] = args[name].cpu()
    with pytest.raises(ValueError, match=rf"lora_ops\.{op}: {name} is on cpu but y is on cuda:0; "
                                         r"all tensors must be on one device"):
        _call(route, op, args)


@pytest.mark.parametrize("route", ["dispatcher", "triton"])
@pytest.mark.parametrize("op,name", [("sgmv", "lora_ranks"), ("sgmv", "lora_scales"),
                                     ("grouped_gemm", "n_sizes"), ("grouped_gemm", "k_sizes")])
@pytest.mark.parametrize("length", [L - 1, L + 1])
def test_per_slot_tensor_length(route, op, name, length):
    """A per-slot tensor shorter than the pool would be read past its end by a kernel; longer is a caller bug."""
    args = MAKE_ARGS[op]()
    args[name] = torch.ones(length, dtype=args[name].dtype)
    with pytest.raises(ValueError, match=rf"lora_ops\.{op}: {name} must (have |be 1-D with L = ){L} entries"):
        _call(route, op, args)
