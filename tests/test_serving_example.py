"""examples/serving.py, the README's serving example, and lora_ops.demo, the README's main job, run as a user would
run them and check themselves against PEFT."""
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_serving_example_runs_quietly_and_matches_peft():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, os.path.join("examples", "serving.py")], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert run.stderr == ""  # no warnings interleaved with the output
    error = float(re.search(r"logits vs PEFT, relative error (\S+)", run.stdout).group(1))
    assert error < 1e-5
    generated = re.findall(r"^ *(\w+): prompt \[.*\] -> \[(.*)\]$", run.stdout, re.M)
    assert [name for name, _ in generated] == ["sql", "base", "chat", "code"]
    assert all(len(tokens.split(",")) == 8 for _, tokens in generated)


def test_the_demo_runs_quietly_and_matches_peft():
    """python -m lora_ops.demo (scripts/main.sh's job), shortened: PARITY: PASS, and the error it prints is the
    tolerance's side of it (the verdict is checked, not only printed)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    run = subprocess.run([sys.executable, "-m", "lora_ops.demo", "--device", "cpu", "--prompt-len", "8",
                          "--new-tokens", "4"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stderr == ""
    assert run.stdout.rstrip().endswith("PARITY: PASS")
    error = float(re.search(r"relative error (\S+) \(tolerance", run.stdout).group(1))
    assert error < 1e-5
