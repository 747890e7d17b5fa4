#!/usr/bin/env bash
# The README's test command: sets up the virtual environment and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-venv.sh
# The browser tests of `dynstate serve` drive Debian's Chromium (Playwright never downloads a
# browser here). Without it they fail, so say so now rather than skip them.
if ! command -v chromium >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ] && command -v sudo >/dev/null 2>&1; then sudo="sudo"; fi
  if ! { $sudo apt-get update -qq &&
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq chromium; } >/dev/null; then
    echo "test.sh: could not install the chromium package (the serve browser tests need it)" >&2
    exit 1
  fi
fi
# shellcheck disable=SC1091
. "${DYNSTATE_VENV:-.venv}/bin/activate"
ruff check dynstate tests tools examples
ruff format --check dynstate tests tools examples
mypy  # [tool.mypy] in pyproject.toml: the dynstate package
# Two workers (CI has 2 cores; the long tests mostly wait on subprocesses). Each module runs
# whole on one worker (its module fixtures built once; verl's V1 drivers one at a time), the
# modules with the most slow tests first (tests/conftest.py keeps that order, not xdist's).
python -m pytest -q --durations=30 -n 2 --dist loadfile --no-loadscope-reorder "$@"
