"""The probes kept beside the bench (benchmarks/): the prefill sgmv's phase-trace patch still applies to this tree's
kernels (it is a diff against them: a kernel change that breaks its context must refresh it), and its script reads
the lines the patch prints."""
import importlib.util
import os
import re
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCH = os.path.join(ROOT, "benchmarks", "sgmv_phase_trace.patch")


def _trace_script():
    spec = importlib.util.spec_from_file_location("sgmv_phase_trace", os.path.join(ROOT, "benchmarks",
                                                                                   "sgmv_phase_trace.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("git") is None, reason="git applies the patch")
def test_phase_trace_patch_applies_to_the_prefill_kernels():
    out = subprocess.run(["git", "apply", "--check", PATCH], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, f"{out.stderr}refresh {PATCH} against the kernels (its script's docstring says how)"


def test_phase_trace_script_reads_the_patch_lines(capsys):
    with open(PATCH) as f:
        (fmt,) = re.findall(r'printf\("(TRACE [^"]*)\\n"', f.read())
    fields = fmt.split()
    assert len(fields) == 13 and fields[8:] == ["%llu"] * 5  # kernel, rank tile, SM, block, tile, member, group, t0-4
    # CTA i of a one-wave 128-position launch: starts at i ns, shrink 7 us, sum 2 us, expand 9 us + 3i ns
    lines = [f"TRACE 2 128 {i % 132} {i} {i // 7} {i % 7} 0 {1000 + i} {2000 + i} {9000 + i} {11000 + i} "
             f"{20000 + 4 * i}" for i in range(448)]
    _trace_script().report("case", lines)
    text = capsys.readouterr().out
    assert "case: wgmma, 128 positions, rank tile 128, 448 working CTAs on 132 SMs, span 20.8 us" in text
    assert "CTA starts p10/p50/p90/max 0.0/0.2/0.4/0.4 us" in text
    assert "shrink 7.00 (p90 7.00)" in text and "sum+convert 2.00 (p90 2.00)" in text
    assert "expand 9.67 (p90 10.21)" in text
