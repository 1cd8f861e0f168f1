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


def test_a_killed_runs_file_is_restored_newer_than_its_objects(tmp_path, monkeypatch):
    """The original a killed in-place run left beside its mutated file goes back dated now: an object compiled from
    the mutated file is newer than the original's own date, and a build would keep it."""
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    import mutate
    m = next(m for m in mutate.MUTATIONS if m.file.endswith(mutate.CPP_SUFFIXES))
    path = tmp_path / m.file
    path.parent.mkdir(parents=True)
    path.write_text("mutated")
    backup = tmp_path / (m.file + mutate.ORIGINAL_SUFFIX)
    backup.write_text("original")
    os.utime(backup, (1_000_000, 1_000_000))  # written before the mutation, as _run_one writes it
    assert mutate.restore_originals(str(tmp_path)) == [str(path)]
    assert path.read_text() == "original" and not backup.exists()
    assert path.stat().st_mtime > 1_000_000 + 86400
    assert mutate.restore_originals(str(tmp_path)) == []
