"""What the built package must be: a wheel of lora_ops holds its data files beside its modules (setup.py's
PACKAGE_DATA): an installed, not editable, copy reads them from its own directory. Without its op table, `import
lora_ops` raised FileNotFoundError from a wheel before session 42 (the editable installs that the tests use read the
source tree). And _C shares torch's OpenMP runtime. The GPU job's prebuilt extension (scripts/device_prebuild.sh) is
put in place only where it was built from the sources it serves."""
import glob
import importlib.util
import json
import lzma
import os
import runpy
import subprocess
import sys

import pytest
import torch

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


def _extension_stamp():
    spec = importlib.util.spec_from_file_location("extension_stamp", os.path.join(ROOT, "scripts", "extension_stamp.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("cuda", [{"built": False, "reason": "no cuBLASLt"},
                                  {"built": True, "grouped_gemm_sm90": {"built": False}}], ids=["no_cuda", "no_sm90"])
def test_a_prebuilt_without_the_gpu_kernels_is_not_stamped(tmp_path, cuda, capsys):
    """device_prebuild.sh's stamp-prebuilt refuses (exit 1, no stamp) a build that lacks the CUDA kernels or the
    sm_90a GEMMs, which the device machine would otherwise run silently on other paths."""
    if torch.version.cuda is None:
        pytest.skip("this torch has no CUDA: a CPU-only build serves it")
    stamp = _extension_stamp()
    (tmp_path / "_C.so").write_bytes(b"not a library")
    (tmp_path / "_build_info.json").write_text(json.dumps({"backends": {"cuda": cuda}}))
    assert stamp.main("stamp-prebuilt", str(tmp_path)) == 1
    assert not (tmp_path / "stamp.json").exists()
    assert "not stamping" in capsys.readouterr().out


@pytest.mark.parametrize("mismatch", [None, "xz", "source", "torch", "python", "no_library", "no_cuda"])
def test_prebuilt_extension_is_used_only_where_built_from_these_sources(tmp_path, mismatch, capsys):
    """gpu_run.sh's and ab.sh's use-prebuilt: the stamp written beside a prebuilt _C.so (or its xz-compressed copy,
    several of which fit one carry) must match the tree's sources (notes aside), torch's version and Python's minor
    version, and a torch with CUDA needs a build with the CUDA kernels; then the library lands in the tree's
    lora_ops/, else nothing is copied and the job builds (exit 1)."""
    stamp = _extension_stamp()
    prebuilt, tree = tmp_path / "device", tmp_path / "tree"  # tree: an A/B revision's copy of these sources
    prebuilt.mkdir()
    (tree / "lora_ops").mkdir(parents=True)
    for name in ("csrc", "setup.py"):
        (tree / name).symlink_to(os.path.join(ROOT, name))
    library = b"not a library"
    if mismatch == "xz":
        with lzma.open(prebuilt / "_C.so.xz", "wb") as f:
            f.write(library)
    else:
        (prebuilt / "_C.so").write_bytes(library)
    built = {"built": True, "grouped_gemm_sm90": {"built": True}}
    (prebuilt / "_build_info.json").write_text(json.dumps({"backends": {"cuda": built}}))
    assert stamp.main("stamp-prebuilt", str(prebuilt)) == 0
    key = json.loads((prebuilt / "stamp.json").read_text())
    assert "csrc/cuda/lora_linear_sm90.cu" in key["files"] and not any(p.endswith(".md") for p in key["files"])
    if mismatch == "source":
        key["files"]["csrc/cuda/lora_linear_sm90.cu"] = "0" * 16
    elif mismatch == "torch":
        key["torch"] = "2.11.0+cu130" if key["torch"] != "2.11.0+cu130" else "2.14.1+cu130"
    elif mismatch == "python":
        key["python"] = "3.0"
    elif mismatch == "no_library":
        (prebuilt / "_C.so").unlink()
    elif mismatch == "no_cuda":
        if torch.version.cuda is None:
            pytest.skip("this torch has no CUDA: a CPU-only build serves it")
        (prebuilt / "_build_info.json").write_text(json.dumps({"backends": {"cuda": {"built": False, "reason": "x"}}}))
    (prebuilt / "stamp.json").write_text(json.dumps(key))
    used = stamp.use_prebuilt(str(prebuilt), str(tree)) == 0
    said = capsys.readouterr().out
    assert used == (mismatch in (None, "xz")), said
    assert sorted(os.listdir(tree / "lora_ops")) == (["_C.so", "_build_info.json"] if used else [])
    assert not used or (tree / "lora_ops" / "_C.so").read_bytes() == library
    if mismatch == "source":
        assert "lora_linear_sm90.cu" in said
