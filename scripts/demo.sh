#!/usr/bin/env bash
# The main job: two nodes in two processes on loopback, real NIXL; every byte verified.
# Extra arguments go to `p2pkv demo` (see `p2pkv demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/p2pkv demo "$@"
