"""Whether lora_ops/_C.so must be (re)built for this Python, and why, in one line (scripts/install.sh calls it).

    python scripts/extension_stamp.py check    prints "up to date: ..." (exit 0) or "<what>: <why>" (exit 1)
    python scripts/extension_stamp.py record   after a successful build: the state `check` saw becomes the stamp
    python scripts/extension_stamp.py stamp-prebuilt DIR   DIR holds _C.so and _build_info.json built from this
                                               tree by this Python (scripts/device_prebuild.sh): record what from,
                                               or refuse (exit 1) a build without the CUDA kernels or sm_90a GEMMs
    python scripts/extension_stamp.py use-prebuilt DIR [TREE]   put DIR's extension (its _C.so or _C.so.xz) in
                                               TREE's lora_ops/ (default: this checkout's; exit 0) where it was built
                                               from TREE's sources for this Python's minor version and torch; else
                                               say why not (exit 1) and leave lora_ops/ alone

The stamp (build/extension-stamp.json) holds what the last build was made from: a hash of every file under
csrc/ and of setup.py, the backends setup.py chose (its own _configure: CUDA or not, arch list, toolkit), torch's
version and the Python. A build is needed when any of those differ, when _C.so is missing, or when this Python
does not have lora_ops installed (editable) from this checkout.

A prebuilt extension (gpu_run.sh on the device machine) is matched by its sources, torch's version and Python's
minor version only: it was built elsewhere (another toolkit path, no GPU), and the tree it serves is imported from
its checkout (PYTHONPATH), not installed.
"""
import contextlib
import hashlib
import importlib.metadata
import io
import json
import lzma
import os
import shutil
import sys
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP = os.path.join(ROOT, "build", "extension-stamp.json")
PENDING = STAMP + ".pending"


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _source_hashes(root=ROOT):
    files = {"setup.py": _sha(os.path.join(root, "setup.py"))}
    for folder, _, names in os.walk(os.path.join(root, "csrc")):
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, root)] = _sha(path)
    return files


def _state():
    sys.path.insert(0, ROOT)
    import setup  # setup.py's own backend choice, so that this never disagrees with what it builds

    with contextlib.redirect_stdout(io.StringIO()):
        info = setup._configure()
    return {"python": sys.executable, "torch": info["torch"], "backends": info["backends"], "files": _source_hashes()}


PREBUILT_FILES = ("_C.so", "_build_info.json")


def _prebuilt_key(root=ROOT):
    import torch

    # the sources only: a note (csrc/**/*.md) written after the build does not change what it would build
    files = {path: sha for path, sha in _source_hashes(root).items() if not path.endswith(".md")}
    return {"python": "%d.%d" % sys.version_info[:2], "torch": torch.__version__, "files": files}


def _kernels_lacking(folder):
    """Why the prebuilt's _build_info.json says it would not serve a torch with CUDA, or None: the device machine
    wants the CUDA kernels and the sm_90a GEMMs (a build without them runs, slower and on other paths)."""
    import torch

    if torch.version.cuda is None:
        return None
    with open(os.path.join(folder, "_build_info.json")) as f:
        cuda = json.load(f)["backends"].get("cuda", {})
    if not cuda.get("built"):
        return f"built without the CUDA kernels ({cuda.get('reason', 'no reason given')})"
    if not cuda.get("grouped_gemm_sm90", {}).get("built"):
        return "built without the sm_90a GEMMs"
    return None


def stamp_prebuilt(folder):
    lacking = _kernels_lacking(folder)
    if lacking:
        print(f"not stamping the prebuilt extension in {folder}: {lacking}")
        return 1
    with open(os.path.join(folder, "stamp.json"), "w") as f:
        json.dump(_prebuilt_key(), f, indent=1)
    return 0


def _prebuilt_file(folder, name):
    """The folder's copy of `name`, plain or xz-compressed (device_prebuild.sh with PREBUILT_XZ=1: several builds in
    one carry), or None."""
    for path in (os.path.join(folder, name), os.path.join(folder, name + ".xz")):
        if os.path.exists(path):
            return path
    return None


def use_prebuilt(folder, tree=ROOT):
    try:
        with open(os.path.join(folder, "stamp.json")) as f:
            built = json.load(f)
    except FileNotFoundError:
        print(f"no prebuilt extension in {folder}")
        return 1
    here = _prebuilt_key(tree)
    reasons = [f"{key} {built[key]} there, {here[key]} here" for key in ("python", "torch") if built[key] != here[key]]
    changed = sorted(p for p in set(here["files"]) | set(built["files"]) if here["files"].get(p) != built["files"].get(p))
    if changed:
        reasons.append(f"built from other sources ({', '.join(changed[:3])}{' ...' if len(changed) > 3 else ''})")
    found = {name: _prebuilt_file(folder, name) for name in PREBUILT_FILES}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        reasons.append(f"{', '.join(missing)} missing")
    elif lacking := _kernels_lacking(folder):
        reasons.append(lacking)
    if reasons:
        print(f"not using the prebuilt extension in {folder}: {'; '.join(reasons)}")
        return 1
    target = os.path.join(tree, "lora_ops")
    for name, path in found.items():
        opener = lzma.open if path.endswith(".xz") else open
        with opener(path, "rb") as src, open(os.path.join(target, name), "wb") as dst:
            shutil.copyfileobj(src, dst)
    os.chmod(os.path.join(target, "_C.so"), 0o755)
    print(f"using the prebuilt extension in {folder} for {tree} (torch {here['torch']}, Python {here['python']}, "
          f"{len(here['files'])} source files as built)")
    return 0


def _kernels(state):
    cuda = state["backends"]["cuda"]
    return f"CPU + CUDA kernels (arch {cuda['arch_list']})" if cuda["built"] else \
        f"CPU kernels (no CUDA: {cuda['reason']})"


def _what(state):
    return f"lora_ops/_C.so with {_kernels(state)}, torch {state['torch']}"


def _installed_from_here():
    try:
        url = json.loads(importlib.metadata.distribution("lora_ops").read_text("direct_url.json") or "{}")
    except importlib.metadata.PackageNotFoundError:
        return False
    where = urllib.parse.unquote(urllib.parse.urlparse(url.get("url", "")).path)
    return url.get("dir_info", {}).get("editable", False) and os.path.realpath(where) == os.path.realpath(ROOT)


def _reasons(state, old):
    if not os.path.exists(os.path.join(ROOT, "lora_ops", "_C.so")):
        return ["there is no lora_ops/_C.so yet"]
    if old is None:
        return ["no record of the last build (build/extension-stamp.json)"]
    reasons = [f"{key} was {old[key]}, now {state[key]}" for key in ("python", "torch") if old[key] != state[key]]
    if old["backends"] != state["backends"]:
        reasons.append(f"the last build had {_kernels(old)}")
    changed = sorted(p for p in set(state["files"]) | set(old["files"]) if state["files"].get(p) != old["files"].get(p))
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        reasons.append(f"{', '.join(changed[:3])}{more} changed")
    if not _installed_from_here():
        reasons.append(f"lora_ops is not installed (editable, from {ROOT}) in {sys.prefix}")
    return reasons


def main(command, *args):
    if command == "stamp-prebuilt":
        return stamp_prebuilt(*args)
    if command == "use-prebuilt":
        return use_prebuilt(*args)
    if command == "record":
        os.replace(PENDING, STAMP)
        return 0
    state = _state()
    old = None
    if os.path.exists(STAMP):
        with open(STAMP) as f:
            old = json.load(f)
    reasons = _reasons(state, old)
    if not reasons:
        print(f"up to date: {_what(state)}; its {len(state['files'])} source files unchanged")
        return 0
    os.makedirs(os.path.dirname(STAMP), exist_ok=True)
    with open(PENDING, "w") as f:
        json.dump(state, f, indent=1)
    print(f"building {_what(state)}: {'; '.join(reasons)}")
    return 1


if __name__ == "__main__":
    sys.exit(main(*(sys.argv[1:] or ["check"])))
