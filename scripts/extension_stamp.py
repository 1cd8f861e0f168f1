"""Whether lora_ops/_C.so must be (re)built for this Python, and why, in one line (scripts/install.sh calls it).

    python scripts/extension_stamp.py check    prints "up to date: ..." (exit 0) or "<what>: <why>" (exit 1)
    python scripts/extension_stamp.py record   after a successful build: the state `check` saw becomes the stamp

The stamp (build/extension-stamp.json) holds what the last build was made from: a hash of every file under
csrc/ and of setup.py, the backends setup.py chose (its own _configure: CUDA or not, arch list, toolkit), torch's
version and the Python. A build is needed when any of those differ, when _C.so is missing, or when this Python
does not have lora_ops installed (editable) from this checkout.
"""
import contextlib
import hashlib
import importlib.metadata
import io
import json
import os
import sys
import urllib.parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STAMP = os.path.join(ROOT, "build", "extension-stamp.json")
PENDING = STAMP + ".pending"


def _sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()[:16]


def _state():
    sys.path.insert(0, ROOT)
    import setup  # setup.py's own backend choice, so that this never disagrees with what it builds

    with contextlib.redirect_stdout(io.StringIO()):
        info = setup._configure()
    files = {"setup.py": _sha(os.path.join(ROOT, "setup.py"))}
    for folder, _, names in os.walk(os.path.join(ROOT, "csrc")):
        for name in names:
            path = os.path.join(folder, name)
            files[os.path.relpath(path, ROOT)] = _sha(path)
    return {"python": sys.executable, "torch": info["torch"], "backends": info["backends"], "files": files}


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


def main(command):
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
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else "check"))
