# Sourced by scripts/install.sh, test.sh and main.sh: which Python they use, and how much they print.
#
# Python: the scripts install into a virtualenv, never into a system Python (PEP 668). $PYTHON (default
# python3) is used as it is when it runs inside one (an activated venv or conda env); otherwise the
# repository's .venv is used, created from it on first use with --system-site-packages, so that a torch
# already installed for that Python is reused rather than downloaded again.
# Output: one line per action taken; LORA_OPS_VERBOSE=1, or -v / --verbose among the arguments, shows the
# output of every tool (pip, the compiler, cmake, ctest).

for arg in "$@"; do
  case $arg in -v | --verbose) LORA_OPS_VERBOSE=1 ;; esac
done
export LORA_OPS_VERBOSE=${LORA_OPS_VERBOSE:-0}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore

say() { echo "lora_ops: $*"; }

# Runs a command with its output hidden, unless verbose or the command fails.
quietly() {
  if [ "$LORA_OPS_VERBOSE" = 1 ]; then "$@"; return; fi
  local log rc=0
  log=$(mktemp)
  "$@" >"$log" 2>&1 || rc=$?
  [ "$rc" = 0 ] || cat "$log" >&2
  rm -f "$log"
  return "$rc"
}

# Sets PY (and puts its bin directory first on PATH: pip's ninja and cmake live there).
select_python() {
  local base=${PYTHON:-python3}
  if ! command -v "$base" >/dev/null; then
    say "$base not found: install Python >= 3.10 (Debian/Ubuntu: apt-get install python3 python3-venv)"
    exit 1
  fi
  local venv='import os, sys; sys.exit(sys.prefix == sys.base_prefix and os.environ.get("CONDA_PREFIX") != sys.prefix)'
  if "$base" -c "$venv"; then
    PY=$("$base" -c 'import sys; print(sys.executable)')
  else
    if [ ! -x .venv/bin/python ]; then
      say "creating .venv from $(command -v "$base") (python -m venv); everything installs there"
      if ! quietly "$base" -m venv --system-site-packages .venv; then
        rm -rf .venv
        local version
        version=$("$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
        say "$base -m venv failed: its venv module or ensurepip is missing." \
          "On Debian/Ubuntu: apt-get install python$version-venv"
        exit 1
      fi
    fi
    PY=$PWD/.venv/bin/python
  fi
  if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    say "$PY is Python $("$PY" -c 'import sys; print(sys.version.split()[0])'); lora_ops needs >= 3.10 (set PYTHON=...)"
    exit 1
  fi
  PATH="$(dirname "$PY"):$PATH"
  export PATH
}
