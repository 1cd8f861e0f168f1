# Sourced by scripts/install.sh, test.sh and main.sh: which Python they use, and how much they print.
#
# Python: the scripts install into a virtualenv, never into a system Python (PEP 668). $PYTHON (default
# python3) is used as it is when it runs inside one (an activated venv or conda env); otherwise the
# repository's .venv is used, created from it on first use with --system-site-packages, so that a torch
# already installed for that Python is reused rather than downloaded again. Through apt-get, when absent:
# python3 (only when $PYTHON is unset) and python3.X-venv (Debian and Ubuntu ship venv's ensurepip apart).
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

# Installs Debian/Ubuntu packages with apt-get (through sudo when not root), or says which ones and exits.
apt_install() {
  if command -v apt-get >/dev/null && { [ "$(id -u)" = 0 ] || command -v sudo >/dev/null; }; then
    local sudo
    sudo=$([ "$(id -u)" = 0 ] || echo sudo)
    say "installing system packages with apt-get: $*"
    quietly $sudo apt-get update -qq
    quietly $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@"
  else
    say "missing system packages: $*; install them (Debian/Ubuntu: apt-get install $*)"
    exit 1
  fi
}

# Sets PY (and puts its bin directory first on PATH: pip's ninja and cmake live there).
select_python() {
  local base=${PYTHON:-python3}
  if ! command -v "$base" >/dev/null; then
    if [ "$base" != python3 ]; then
      say "$base not found (PYTHON=$base): point PYTHON at a Python >= 3.10"
      exit 1
    fi
    apt_install python3
  fi
  local version
  version=$("$base" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if ! "$base" -c 'import sys; sys.exit(sys.version_info < (3, 10))'; then
    say "$(command -v "$base") is Python $version; lora_ops needs >= 3.10 (set PYTHON=...)"
    exit 1
  fi
  local venv='import os, sys; sys.exit(sys.prefix == sys.base_prefix and os.environ.get("CONDA_PREFIX") != sys.prefix)'
  if "$base" -c "$venv"; then
    PY=$("$base" -c 'import sys; print(sys.executable)')
  else
    if [ ! -x .venv/bin/python ]; then
      # Debian and Ubuntu ship venv's ensurepip apart from Python, in python3.X-venv.
      "$base" -c 'import ensurepip, venv' 2>/dev/null || apt_install "python$version-venv"
      say "creating .venv from $(command -v "$base") (python -m venv); everything installs there"
      if ! quietly "$base" -m venv --system-site-packages .venv; then
        rm -rf .venv
        say "$base -m venv failed: its venv module or ensurepip is missing." \
          "On Debian/Ubuntu: apt-get install python$version-venv"
        exit 1
      fi
    fi
    PY=$PWD/.venv/bin/python
  fi
  PATH="$(dirname "$PY"):$PATH"
  export PATH
}
