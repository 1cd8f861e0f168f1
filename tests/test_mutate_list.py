"""The planted-bug list (scripts/mutate.py) stays in step with the code: every mutation's snippet occurs exactly
once in its file. A stale entry is a test that silently stopped existing."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_planted_bug_still_applies():
    run = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "mutate.py"), "--check"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
