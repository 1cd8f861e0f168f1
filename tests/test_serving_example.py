"""examples/serving.py, the README's serving example, runs as a user would run it and checks itself against PEFT."""
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
