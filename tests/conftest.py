import os

import pytest
import torch

# Without a GPU the Triton kernels run under the interpreter (docs/design.md §5); this must precede importing triton.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import lora_ops  # noqa: E402
from lora_ops import backends  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
HAS_TRITON = "triton" not in backends.unavailable


class Impl:
    """One way to run the ops: through the dispatcher on a device, or the Triton entry points directly."""

    def __init__(self, name, device, module, dtypes):
        self.name, self.device, self.module, self.dtypes = name, device, module, dtypes

    def __repr__(self):
        return self.name


def _impls():
    all_dtypes = (torch.float32, torch.float16, torch.bfloat16)
    impls = [pytest.param(Impl("cpu", "cpu", lora_ops.ops, all_dtypes), id="cpu")]
    if HAS_TRITON:
        import lora_ops.triton as lt
        if HAS_CUDA:
            impls.append(pytest.param(Impl("triton", "cuda", lt, all_dtypes), id="triton", marks=pytest.mark.gpu))
        else:
            # The interpreter mishandles bf16 (docs/design.md §5): fp32 only there.
            impls.append(pytest.param(Impl("triton-interpret", "cpu", lt, (torch.float32,)), id="triton-interpret"))
    impls.append(pytest.param(Impl("cuda", "cuda", lora_ops.ops, all_dtypes), id="cuda", marks=pytest.mark.gpu))
    return impls


IMPLS = _impls()


@pytest.fixture(params=IMPLS)
def impl(request):
    return request.param


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
