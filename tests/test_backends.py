"""Backend selection as data (docs/design.md §3): what serves the CUDA key by default and with LORA_OPS_BACKEND=triton."""
import os
import subprocess
import sys

import pytest

import lora_ops
from lora_ops import backends

SCRIPT = r"""
import torch, lora_ops
from lora_ops import backends
print(",".join(f"{op}={backends.cuda_served_by[op]}" for op in backends.OPS))
for op in backends.OPS:
    table = torch._C._dispatch_dump(f"lora_ops::{op}")
    cuda = [l for l in table.splitlines() if l.startswith("CUDA")]
    print(op, cuda[0] if cuda else "CUDA: none")
"""


def _run(env_backend):
    env = {k: v for k, v in os.environ.items() if k != "LORA_OPS_BACKEND"}
    if env_backend:
        env["LORA_OPS_BACKEND"] = env_backend
    return subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                          check=True).stdout.splitlines()


@pytest.mark.skipif("triton" in backends.unavailable, reason="triton not importable")
def test_forced_triton_serves_every_cuda_op():
    out = _run("triton")
    assert out[0] == "sgmv=triton,grouped_gemm=triton,build_segments=triton"
    for line in out[1:]:
        assert "registered at" in line and ".py" in line, line  # the CUDA kernel now comes from Python


@pytest.mark.skipif("triton" in backends.unavailable, reason="triton not importable")
def test_default_uses_compiled_cuda_kernels_and_triton_for_the_rest():
    out = _run(None)
    served = dict(kv.split("=") for kv in out[0].split(","))
    for op in backends.OPS:
        assert served[op] == ("cuda" if backends.cuda_compiled[op] else "triton"), op


def test_info_reports_every_op_and_absent_backends():
    from lora_ops import info
    text = info.report()
    for op in backends.OPS:
        assert op in text
    assert "ascend" in text  # never built here: listed with its reason
    assert lora_ops.__version__ in text
