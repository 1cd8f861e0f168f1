"""The planted-bug list (scripts/mutate.py) stays in step with the code: every mutation's snippet occurs exactly
once in its file. A stale entry is a test that silently stopped existing."""
import json
import os
import signal
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


def test_a_run_ended_by_sigterm_puts_the_file_and_the_build_back(tmp_path, monkeypatch):
    """`timeout` ends a device call's run with SIGTERM: the mutated file and the build made from it go back before
    the process exits (the tests after such a run failed on its bug while the default action skipped the restore).
    In a process of its own, whose SIGTERM arrives while its tests run."""
    driver = tmp_path / "driver.py"
    driver.write_text(f"""
import argparse, os, signal, sys
sys.path.insert(0, {os.path.join(ROOT, "scripts")!r})
import mutate
tree = sys.argv[1]
m = next(m for m in mutate.MUTATIONS if m.file.endswith(mutate.CPP_SUFFIXES))
path, built = os.path.join(tree, m.file), os.path.join(tree, "_C.so")
os.makedirs(os.path.dirname(path))
open(path, "w").write("before\\n" + m.original + "\\nafter\\n")
open(built, "wb").write(b"pristine build")

def build(scratch, env, log_path):
    assert m.replacement in open(path).read()  # the planted bug is in place while it builds and tests
    open(built, "wb").write(b"build of the planted bug")
    return True

def run_tests(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)  # the call's limit, while the tests run
    sys.exit("SIGTERM did not stop the run")

mutate.build, mutate.run_tests = build, run_tests
mutate.stop_on_sigterm()
args = argparse.Namespace(fast=True, timeout=60.0, workers=0, gpu=False)
mutate._run_one(m, tree, {{}}, tree, args, {{built: b"pristine build"}}, [])
""")
    tree = tmp_path / "tree"
    run = subprocess.run([sys.executable, str(driver), str(tree)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 128 + signal.SIGTERM, run.stderr
    monkeypatch.syspath_prepend(os.path.join(ROOT, "scripts"))
    import mutate
    m = next(m for m in mutate.MUTATIONS if m.file.endswith(mutate.CPP_SUFFIXES))
    assert (tree / m.file).read_text() == "before\n" + m.original + "\nafter\n"
    assert not (tree / (m.file + mutate.ORIGINAL_SUFFIX)).exists()
    assert (tree / "_C.so").read_bytes() == b"pristine build"


def test_an_in_place_run_ends_on_a_build_of_the_restored_sources(tmp_path):
    """After its last C++ bug an in-place run rebuilds the checkout from the restored sources: putting back only the
    linked library left that bug's objects in the build directory, and the GPU machine's next call, whose copied
    sources are dated before them, linked them again (its unmutated baseline failed on the bug). In a process of its
    own (main installs a SIGTERM handler), on a git tree of the mutation's file and test files."""
    driver = tmp_path / "driver.py"
    driver.write_text(f"""
import json, os, subprocess, sys
sys.path.insert(0, {os.path.join(ROOT, "scripts")!r})
import mutate
tree = sys.argv[1]
m = next(m for m in mutate.MUTATIONS if m.file.endswith(mutate.CPP_SUFFIXES) and not m.needs_gpu)
for f, text in [(m.file, "before\\n" + m.original + "\\nafter\\n")] + [(t, "") for t in m.tests]:
    os.makedirs(os.path.dirname(os.path.join(tree, f)), exist_ok=True)
    open(os.path.join(tree, f), "w").write(text)
subprocess.run(["git", "init", "-q", tree], check=True)
builds = []

def build(scratch, env, log_path):
    builds.append("planted" if m.replacement in open(os.path.join(tree, m.file)).read() else "restored")
    return True

def run_tests(scratch, env, test_paths, log_path, *args, **kwargs):
    return (0, []) if log_path.endswith("baseline.log") else (1, ["a test"])

mutate.ROOT, mutate.build, mutate.run_tests = tree, build, run_tests
rc = mutate.main(["--only", m.id, "--in-place", "--fast"])
print(json.dumps(dict(rc=rc, builds=builds)))
""")
    tree = tmp_path / "tree"
    tree.mkdir()
    run = subprocess.run([sys.executable, str(driver), str(tree)], capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result == dict(rc=0, builds=["planted", "restored"]), run.stdout
