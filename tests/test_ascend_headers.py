"""The Ascend kernels type-checked against asc-devkit's own AscendC headers (scripts/check_ascend_headers.py).

Needs a checkout of asc-devkit (gitcode.com/cann/asc-devkit; GitHub mirror mirror-cann/asc-devkit) named by LORA_OPS_ASC_DEVKIT; skipped without one (CI
has none: it is not on a package registry). The second test alters a copy of the kernels in ways the CPU model
would not notice unless it declared the API the same way, and checks that the script fails on each: the check
proves it can fail, and that its stand-ins for the compiler's intrinsics never cover a kernel's own mistake.
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

pytestmark = pytest.mark.skipif(not DEVKIT, reason="LORA_OPS_ASC_DEVKIT (an asc-devkit checkout) not set")


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), DEVKIT, *args], capture_output=True, text=True)


def test_kernels_compile_against_asc_devkit():
    result = _run()
    assert result.returncode == 0, result.stdout[-4000:]
    assert result.stdout.count(": ok") == 8  # four kernel files, each as the cube and as the vector core


# (file, text in it, replacement, the core whose pass sees it)
ALTERATIONS = {
    "load_data_params_arity": ("kernel_common.h", "LoadData2DParams{0, static_cast<uint8_t>(n_frac), 1, 0, 0, false, 0}",
                               "LoadData2DParams{0, static_cast<uint8_t>(n_frac), 1, 0, 0, false, 0, 0, 0}", "AIC"),
    "pad_params_arity": ("kernel_common.h", "DataCopyPadExtParams<float>{false, 0, 0, 0.f}",
                         "DataCopyPadExtParams<float>{false, 0, 0, 0.f, 1}", "AIV"),
    "misnamed_api": ("build_segments.cpp", "DataCopyPad(chunk_,", "DataCopyPadded(chunk_,", "AIV"),
    "misnamed_event": ("kernel_common.h", "HardEvent::MTE1_MTE2", "HardEvent::MTE1_MTE9", "AIC"),
    # A snake_case call in a kernel looks like an intrinsic: the script must not stand in for it.
    "undeclared_intrinsic_in_kernel": ("build_segments.cpp", "DataCopyPad(chunk_,",
                                       "copy_gm_to_ubuf_bogus(0); DataCopyPad(chunk_,", "AIV"),
}


@pytest.mark.parametrize("name", sorted(ALTERATIONS))
def test_a_wrong_api_use_fails(tmp_path, name):
    file, old, new, core = ALTERATIONS[name]
    kernels = tmp_path / "ascend"
    shutil.copytree(ROOT / "csrc" / "ascend", kernels)
    text = (kernels / file).read_text()
    assert old in text, f"{file} no longer contains {old!r}: update the alteration"
    (kernels / file).write_text(text.replace(old, new, 1))
    result = _run("--kernels", str(kernels))
    assert result.returncode == 1
    failed = {tuple(line.replace(":", "").split()[:2]) for line in result.stdout.splitlines()
              if line.endswith(": FAILED")}
    # kernel_common.h is shared: sgmv.cpp includes it
    assert (file if file.endswith(".cpp") else "sgmv.cpp", core) in failed, result.stdout[-4000:]
