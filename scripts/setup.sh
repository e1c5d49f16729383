#!/usr/bin/env bash
# Idempotent set-up: .venv with p2pkv, the real NIXL data plane (nixl-cu13), the test
# tools and a lean vLLM 0.33.0. Re-runs are quick: each step has its own stamp.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# A .venv that an interrupted run left half-built (Ctrl-C during `python -m venv` leaves
# bin/python without pip or bin/activate, which venv writes last), or whose Python is gone,
# is made again from scratch; a complete one is kept.
if ! { [ -f .venv/bin/activate ] && .venv/bin/python -c "import pip" 2>/dev/null; }; then
  [ ! -e .venv ] || echo "setup.sh: .venv is incomplete (an interrupted run?): rebuilding .venv" >&2
  "$PY" -m venv --clear .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.p2pkv-setup
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setting up .venv (first run: about a minute)" >&2
  python -m pip install -q --upgrade pip
  # nixl-cu13 requires torch: install the CPU build first, so that no CUDA build (with its
  # nvidia-* wheels, gigabytes) is pulled in. A mirror or wheel directory that carries the
  # "+cpu" build serves it as it is; PyPI has none (its Linux torch is the CUDA build), so
  # then it comes from PyTorch's CPU index (P2PKV_TORCH_INDEX overrides that index).
  if ! python -c "import torch" 2>/dev/null; then
    python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
      || python -m pip install -q --index-url "${P2PKV_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}" \
        "torch==2.13.0"
  fi
  python -m pip install -q -e ".[nixl,test]"
  echo "$want" > "$stamp"
fi
# vLLM 0.33.0, lean (its own stamp): only tests/test_vllm_tier.py and bench/vllm_tier.py need
# it. P2PKV_VLLM=0 skips it; those tests then skip with the reason.
if [ "${P2PKV_VLLM:-1}" != 0 ]; then
  bash scripts/setup-vllm.sh .venv
fi
