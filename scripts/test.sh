#!/usr/bin/env bash
# The test command: set-up, then lint (ruff), types (mypy --strict), and the test suite.
# Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
# This checkout in its .venv: a caller's PYTHONPATH (another checkout, another
# environment's packages or pytest plugins) would shadow it.
unset PYTHONPATH PYTHONHOME
bash scripts/setup.sh
. .venv/bin/activate
ruff check
ruff format --check
mypy
python -m pytest "$@"
