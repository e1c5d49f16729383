#!/usr/bin/env bash
# The main job: two nodes in two processes on loopback, real NIXL; every byte verified.
# Extra arguments go to `p2pkv demo` (see `p2pkv demo --help`).
set -euo pipefail
cd "$(dirname "$0")/.."
# This checkout in its .venv: a caller's PYTHONPATH (another checkout, another
# environment's packages) would shadow it.
unset PYTHONPATH PYTHONHOME
P2PKV_VLLM=${P2PKV_VLLM:-0} bash scripts/setup.sh  # the demo does not need vLLM
exec .venv/bin/p2pkv demo "$@"
