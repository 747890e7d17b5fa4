#!/usr/bin/env bash
# The README's first command: sets up the virtual environment and runs the demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/setup-venv.sh
# shellcheck disable=SC1091
. "${DYNSTATE_VENV:-.venv}/bin/activate"
exec dynstate demo "$@"
