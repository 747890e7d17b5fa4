#!/usr/bin/env bash
# The README's test command: sets up the virtual environment and runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-venv.sh
# shellcheck disable=SC1091
. "${DYNSTATE_VENV:-.venv}/bin/activate"
ruff check dynstate tests tools examples
ruff format --check dynstate tests tools examples
python -m pytest -q --durations=20 "$@"
