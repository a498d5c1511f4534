#!/usr/bin/env bash
# Set up meshpilot on a fresh machine: a virtual environment in .venv with torch 2.13.0 (CPU build, pinned:
# an unpinned torch pulls several GB of CUDA packages) and meshpilot installed editable with its test tools.
# Idempotent: re-running after the first time only re-installs when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "bootstrap: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
stamp=.venv/.meshpilot-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "bootstrap: installing torch==2.13.0 and meshpilot[test] into .venv (first run takes a few minutes)"
  .venv/bin/python -m pip install -q --disable-pip-version-check torch==2.13.0
  .venv/bin/python -m pip install -q --disable-pip-version-check -e '.[test]'
  echo "$want" > "$stamp"
fi
