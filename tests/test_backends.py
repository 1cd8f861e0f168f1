"""Backend selection as data (docs/design.md §3): what serves the CUDA key by default and with LORA_OPS_BACKEND=triton,
and what a missing or broken Triton does: lora_ops still imports, info says why, and the suite fails (broken)
or records a skip (not installed)."""
import os
import subprocess
import sys

import pytest

import lora_ops
from lora_ops import backends

from conftest import triton_backend

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

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


def test_forced_triton_serves_every_cuda_op():
    triton_backend()
    out = _run("triton")
    assert out[0] == ",".join(f"{op}=triton" for op in backends.OPS)
    for line in out[1:]:
        assert "registered at" in line and ".py" in line, line  # the CUDA kernel now comes from Python


def test_default_uses_compiled_cuda_kernels_and_triton_for_the_rest():
    triton_backend()
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
    # the serving routes of each measured shape, by rank class
    for model in ("llama3-8b", "qwen2-7b", "llama3-70b-tp8"):
        assert f"  {model}, R <= 32: " in text and f"  {model}, larger R: " in text


# An installed but broken triton: a `triton` package that fails to import, ahead of the real one on the path.
# A missing triton: the module hide_triton (a prelude, or a pytest plugin) makes `import triton` raise
# ModuleNotFoundError.
BROKEN_TRITON = 'raise ImportError("simulated broken triton install")\n'
HIDE_TRITON = 'import sys\nsys.modules["triton"] = None\n'


def _python(tmp_path, args, broken_triton=False):
    """Run python with `args` in the repository root, hide_triton importable, the fake broken triton first if
    broken_triton."""
    (tmp_path / "fake" / "triton").mkdir(parents=True)
    (tmp_path / "fake" / "triton" / "__init__.py").write_text(BROKEN_TRITON)
    (tmp_path / "helpers").mkdir()
    (tmp_path / "helpers" / "hide_triton.py").write_text(HIDE_TRITON)
    path = [tmp_path / "fake"] * broken_triton + [tmp_path / "helpers"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(map(str, path)))
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True)


INFO_SCRIPT = """
import warnings
warnings.simplefilter("always")
import lora_ops
from lora_ops import backends, info
print("triton_error:", type(backends.triton_error).__name__)
print(info.report())
"""


# (broken triton package?, prelude, expected reason): triton fails to import; lora_ops.triton lacks an op
BROKEN = {
    "import": (True, "", "ImportError: simulated broken triton install"),
    "register": (False, 'import sys, types\nsys.modules["lora_ops.triton"] = types.ModuleType("lora_ops.triton")\n',
                 "AttributeError: module 'lora_ops.triton' has no attribute 'sgmv'"),
}


@pytest.mark.parametrize("failure", list(BROKEN))
def test_broken_triton_keeps_lora_ops_importable_and_says_why(tmp_path, failure):
    broken_triton, prelude, reason = BROKEN[failure]
    run = _python(tmp_path, ["-c", prelude + INFO_SCRIPT], broken_triton)
    assert run.returncode == 0, run.stderr
    assert f"triton_error: {reason.split(':')[0]}" in run.stdout
    assert f"triton: installed but failed to load: {reason}" in run.stdout
    assert "RuntimeWarning: lora_ops: the Triton backend is installed but failed to load" in run.stderr


def test_missing_triton_is_a_quiet_absence(tmp_path):
    run = _python(tmp_path, ["-c", "import hide_triton\n" + INFO_SCRIPT])
    assert run.returncode == 0, run.stderr
    assert "triton_error: NoneType" in run.stdout
    assert "triton: not installed" in run.stdout
    assert "Warning" not in run.stderr


# One parity test with its cpu, triton-interpret and (skipped here) cuda cases.
PYTEST = ["-m", "pytest", "-p", "no:cacheprovider", "-ra", "tests/test_sgmv.py::test_sgmv_per_token_routing"]


def test_broken_triton_fails_the_suite(tmp_path):
    run = _python(tmp_path, PYTEST, broken_triton=True)
    assert run.returncode == 1, run.stdout
    assert "ERROR tests/test_sgmv.py::test_sgmv_per_token_routing[triton-interpret]" in run.stdout, run.stdout
    assert "simulated broken triton install" in run.stdout
    assert "1 passed" in run.stdout


def test_missing_triton_skips_with_a_reason(tmp_path):
    run = _python(tmp_path, [*PYTEST[:2], "-p", "hide_triton", *PYTEST[2:]])
    assert run.returncode == 0, run.stdout
    assert "SKIPPED [1] tests/test_sgmv.py" in run.stdout and "triton backend absent: not installed" in run.stdout
    assert "1 passed" in run.stdout
