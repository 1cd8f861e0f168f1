"""What the built package must be: a wheel of lora_ops holds its data files beside its modules (setup.py's
PACKAGE_DATA): an installed, not editable, copy reads them from its own directory. Without its op table, `import
lora_ops` raised FileNotFoundError from a wheel before session 42 (the editable installs that the tests use read the
source tree). And _C shares torch's OpenMP runtime."""
import glob
import os
import runpy
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_data_file_of_the_package_goes_into_a_wheel():
    setup = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="lora_ops_setup")  # defines, does not build
    package = os.path.join(ROOT, "lora_ops")
    listed = {p for pattern in setup["PACKAGE_DATA"]["lora_ops"] for p in glob.glob(os.path.join(package, pattern))}
    data = set(glob.glob(os.path.join(package, "*.json")) + glob.glob(os.path.join(package, "op_tables", "*.json"))
               + glob.glob(os.path.join(package, "route_tables", "*.json")))
    assert {os.path.join(package, "route_tables", "h200.json"), os.path.join(package, "op_tables", "h200.json")} <= data
    assert data <= listed, f"not packaged: {sorted(os.path.relpath(p, package) for p in data - listed)}"


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings (Linux)")
def test_one_openmp_runtime_in_the_process():
    """_C is built with OpenMP (its CPU kernels' at::parallel_for is serial without it) and its libgomp.so.1 is the
    copy torch loaded: two runtimes would each keep a thread pool and ignore the other's torch.set_num_threads."""
    import lora_ops
    with open(lora_ops.LIBRARY_PATH, "rb") as f:
        assert b"libgomp.so.1" in f.read(), "_C is not linked with OpenMP"
    script = ("import torch, lora_ops\n"
              "print(sorted({l.split()[-1] for l in open('/proc/self/maps') if 'libgomp' in l}))")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    assert len(eval(out)) == 1, out
