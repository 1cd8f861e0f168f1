"""The probes kept beside the bench (benchmarks/): the prefill sgmv's phase-trace and boundary patches still
apply to this tree's kernels (they are diffs against them: a kernel change that breaks their context must refresh
them), the trace's script reads the lines its patch prints, and the boundary probe's error tells its build from the
kernel's."""
import importlib.util
import os
import re
import shutil
import subprocess

import pytest
import torch

import lora_ops
from lora_ops import testing

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCH = os.path.join(ROOT, "benchmarks", "sgmv_phase_trace.patch")
BOUNDARY_PATCH = os.path.join(ROOT, "benchmarks", "sgmv_boundary_probe.patch")


def _script(name):
    spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "benchmarks", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(shutil.which("git") is None, reason="git applies the patch")
@pytest.mark.parametrize("patch", [PATCH, BOUNDARY_PATCH], ids=["phase_trace", "boundary"])
def test_probe_patch_applies_to_the_prefill_kernels(patch):
    out = subprocess.run(["git", "apply", "--check", patch], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, (f"{out.stderr}refresh {patch} against the kernels: apply it on a branch where it "
                                 "still applies, carry the change over, and write the diff again")


def test_boundary_patch_removes_both_kernels_cluster_sums():
    with open(BOUNDARY_PATCH) as f:
        added = [line for line in f.read().splitlines() if line.startswith("+") and not line.startswith("+++")]
    # sgmv_mma.cu's and sgmv_wgmma.cu's sums, and the cluster barriers that end them (a sum skipped while its end
    # still waits would hang)
    assert sum("plan.cluster < 0" in line for line in added) == 4


def test_boundary_probe_error_tells_the_probe_from_the_kernel(monkeypatch):
    probe = _script("sgmv_boundary_probe")
    gen = torch.Generator().manual_seed(62)
    p = testing.make_sgmv(testing.random_token_slots(64, [0, 1, 2], gen), num_slots=4, K=256, N=128, max_rank=16,
                          dtype=torch.bfloat16, device="cpu", gen=gen)
    assert probe.relative_error(p) < 1e-2  # the CPU kernel: bf16 rounding only
    monkeypatch.setattr(lora_ops.ops, "sgmv", lambda y, *args: y)  # a build that adds nothing
    assert probe.relative_error(p) > 0.5


def test_phase_trace_script_reads_the_patch_lines(capsys):
    with open(PATCH) as f:
        (fmt,) = re.findall(r'printf\("(TRACE [^"]*)\\n"', f.read())
    fields = fmt.split()
    assert len(fields) == 16 and fields[8:] == ["%llu"] * 8  # kernel, rank tile, SM, block, tile, member, group, t0-7
    # CTA i of a one-wave 128-position launch: starts at i ns, shrink 7 us, sum 2 us, expand 9 us + 3i ns; no cluster
    lines = [f"TRACE 2 128 {i % 132} {i} {i // 7} {i % 7} 0 {1000 + i} {2000 + i} {9000 + i} {11000 + i} "
             f"{20000 + 4 * i} 0 0 0" for i in range(448)]
    _script("sgmv_phase_trace").report("case", lines)
    text = capsys.readouterr().out
    assert "case: wgmma, 128 positions, rank tile 128, 448 working CTAs on 132 SMs, span 20.8 us" in text
    assert "CTA starts p10/p50/p90/max 0.0/0.2/0.4/0.4 us" in text
    assert "shrink 7.00 (p90 7.00)" in text and "sum+convert 2.00 (p90 2.00)" in text
    assert "expand 9.67 (p90 10.21)" in text
    # clusters of 7 (tile i // 7): member m drains its shrink m us after the first, the sum ends 2 us after the last:
    # its barrier 0.5 us, the partials 0.25 + 0.25 m, the sums 1 - 0.25 m, the conversion 0.25
    lines = [f"TRACE 2 128 {i % 132} {i} {i // 7} {i % 7} 0 1000 2000 {9000 + 1000 * (i % 7)} 17000 20000 15500 "
             f"{15750 + 250 * (i % 7)} 16750" for i in range(448)]
    _script("sgmv_phase_trace").report("skew", lines)
    text = capsys.readouterr().out
    assert ("boundary: wait for the last member 3.00 (p90 6.00), then the sum 2.00 (p90 2.00): barrier 0.50, "
            "partials landed 1.00, sums landed 0.25, convert 0.25") in text
