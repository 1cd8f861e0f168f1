"""The Ascend backend type-checked against the real headers (scripts/check_ascend_headers.py), without CANN.

- The host code (plan, launcher, registration) against torch_npu's headers, which scripts/install.sh takes out of
  the torch_npu wheel into build/torch_npu/include (LORA_OPS_TORCH_NPU_INCLUDE names another). Runs in CI.
- The kernels against asc-devkit's AscendC headers (gitcode.com/cann/asc-devkit; GitHub mirror
  mirror-cann/asc-devkit), named by LORA_OPS_ASC_DEVKIT; skipped without one (CI has none: it is on no package
  registry).

Each also alters a copy of the backend in ways the CPU model and its stand-ins would not notice unless they declared
the API the same way, and checks that the script fails on each: the check can fail, and its stand-ins for the
compiler's intrinsics never cover a kernel's own mistake.
"""
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "check_ascend_headers.py"
DEVKIT = os.environ.get("LORA_OPS_ASC_DEVKIT")
TORCH_NPU = pathlib.Path(os.environ.get("LORA_OPS_TORCH_NPU_INCLUDE", ROOT / "build" / "torch_npu" / "include"))

needs_devkit = pytest.mark.skipif(not DEVKIT, reason="LORA_OPS_ASC_DEVKIT (an asc-devkit checkout) not set")
needs_torch_npu = pytest.mark.skipif(not TORCH_NPU.is_dir(),
                                     reason=f"{TORCH_NPU} absent (scripts/install.sh fetches torch_npu's headers)")


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True)


def _failed(result):
    """(file, pass) of every failed compilation the script reported."""
    return {tuple(line.replace(":", "").split()[:2]) for line in result.stdout.splitlines()
            if line.endswith(": FAILED")}


def _altered(tmp_path, file, old, new):
    backend = tmp_path / "csrc" / "ascend"
    shutil.copytree(ROOT / "csrc" / "ascend", backend)
    (tmp_path / "csrc" / "common").symlink_to(ROOT / "csrc" / "common")  # the host code includes ../common
    text = (backend / file).read_text()
    assert old in text, f"{file} no longer contains {old!r}: update the alteration"
    (backend / file).write_text(text.replace(old, new))
    return backend


@needs_torch_npu
def test_host_compiles_against_torch_npu():
    result = _run("--torch-npu", str(TORCH_NPU))
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count(": ok") == 3


# (text in registration.cpp, replacement): each compiles against the stand-ins in cpu_model/standin
HOST_ALTERATIONS = {
    # at::device_of(const Tensor&), which torch_npu's headers bring in, makes a function of that name ambiguous
    # (what the CANN build would have failed on before session 42)
    "helper_named_like_at_device_of": ("launch_device(", "device_of("),
    "stream_accessor": (".stream()", ".raw_stream()"),
    "acl_device_info": ("ACL_DEVICE_INFO_AI_CORE_NUM", "ACL_DEVICE_INFO_AICORE_NUM"),
}


@needs_torch_npu
@pytest.mark.parametrize("name", sorted(HOST_ALTERATIONS))
def test_a_wrong_host_use_fails(tmp_path, name):
    old, new = HOST_ALTERATIONS[name]
    backend = _altered(tmp_path, "registration.cpp", old, new)
    result = _run("--torch-npu", str(TORCH_NPU), "--kernels", str(backend))
    assert result.returncode == 1
    assert _failed(result) == {("registration.cpp", "host")}, result.stdout[-4000:]


@needs_devkit
def test_kernels_compile_against_asc_devkit():
    result = _run("--devkit", DEVKIT)
    assert result.returncode == 0, result.stdout[-4000:]
    # four kernel files, each as the cube and as the vector core; the launch check's kernel types, struct
    # definitions and four host passes
    assert result.stdout.count(": ok") == 8 + 6


# (file, text in it, replacement, the pass that sees it: a core's, or the launch check's host pass)
KERNEL_ALTERATIONS = {
    "load_data_params_arity": ("kernel_common.h", "LoadData2DParams{0, static_cast<uint8_t>(n_frac), 1, 0, 0, false, 0}",
                               "LoadData2DParams{0, static_cast<uint8_t>(n_frac), 1, 0, 0, false, 0, 0, 0}", "AIC"),
    "pad_params_arity": ("kernel_common.h", "DataCopyPadExtParams<float>{false, 0, 0, 0.f}",
                         "DataCopyPadExtParams<float>{false, 0, 0, 0.f, 1}", "AIV"),
    "misnamed_api": ("build_segments.cpp", "DataCopyPad(chunk_,", "DataCopyPadded(chunk_,", "AIV"),
    "misnamed_event": ("kernel_common.h", "HardEvent::MTE1_MTE2", "HardEvent::MTE1_MTE9", "AIC"),
    # CANN's generated launch code names the kernel's struct parameters unqualified: one in a namespace is undeclared
    # there (what the CANN build would have failed on before session 42)
    "tiling_in_a_namespace": ("sgmv.cpp", "LoraOpsSgmvTiling tiling) {", "lora_ops::ascend::SgmvTiling tiling) {",
                              "launch"),
    # the build reads each kernel's type from the source to link its cores
    "kernel_type": ("grouped_gemm.cpp", "KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_MIX_AIC_1_2)",
                    "KERNEL_TASK_TYPE_DEFAULT(KERNEL_TYPE_AIV_ONLY)", "launch"),
    # A snake_case call in a kernel looks like an intrinsic: the script must not stand in for it.
    "undeclared_intrinsic_in_kernel": ("build_segments.cpp", "DataCopyPad(chunk_,",
                                       "copy_gm_to_ubuf_bogus(0); DataCopyPad(chunk_,", "AIV"),
}


@needs_devkit
@pytest.mark.parametrize("name", sorted(KERNEL_ALTERATIONS))
def test_a_wrong_api_use_fails(tmp_path, name):
    file, old, new, core = KERNEL_ALTERATIONS[name]
    backend = _altered(tmp_path, file, old, new)
    result = _run("--devkit", DEVKIT, "--kernels", str(backend))
    assert result.returncode == 1
    # kernel_common.h is shared: sgmv.cpp includes it; a kernel's type is checked for all files at once
    where = "kernel_types" if name == "kernel_type" else file if file.endswith(".cpp") else "sgmv.cpp"
    assert (where, core) in _failed(result), result.stdout[-4000:]
