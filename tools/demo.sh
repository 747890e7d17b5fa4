#!/usr/bin/env bash
# The README's first command: sets up the virtual environment (tools/setup-venv.sh), then runs
# tools/demo.py — a curriculum training run with dynamic data generation (scores recorded as
# outcomes, rows drawn by Learnability) that is SIGKILLed mid-run and resumed from its last
# checkpoint, checked against an uninterrupted run; it ends with the pass rate per step and
# `dynstate stats`. Output goes to ./demo-out/.
# Arguments go to the demo, e.g. `bash tools/demo.sh --s3` or `bash tools/demo.sh --steps 30`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-venv.sh
# shellcheck disable=SC1091
. "${DYNSTATE_VENV:-.venv}/bin/activate"
exec python tools/demo.py "$@"
