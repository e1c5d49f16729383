#!/usr/bin/env bash
# Lean, CPU-only install of vLLM 0.33.0 into an existing venv (default: .venv), for the tests
# and the bench that drive vLLM's tiering manager. p2pkv itself never needs vLLM.
#
# Rules: pip never resolves vLLM's own dependency set (that pulls CUDA torch 2.14 and the nvidia
# stack, ~9 GB): vLLM and its heavy import-time deps go in with --no-deps, and every install runs
# under a constraints file that pins the torch and numpy already in the venv, so pip can neither
# replace torch nor downgrade numpy. pip warns that vLLM wants torch 2.14: expected.
#
# Idempotent: a stamp file (hash of the pin list and of the venv's torch/numpy) skips everything.
# Usage: bash scripts/setup-vllm.sh [VENV]
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PYV="$VENV/bin/python"

read -r -d '' NODEPS <<'PINS' || true
nixl==1.5.1
vllm==0.33.0
msgspec==0.23.0 pyzmq==27.3.0 cbor2==6.3.0 psutil==7.2.2 pybase64==1.5.1
cachetools==8.0.2 cloudpickle==3.1.3 uvloop==0.23.0 py-cpuinfo==9.0.0
prometheus_client==0.26.0 partial-json-parser==0.2.1.1.post7 llguidance==1.7.6
regex==2026.11.19 pyyaml==6.0.4 blake3==1.0.11 setproctitle==1.3.8
openai-harmony==0.0.8 pillow==13.0.0 tqdm==4.70.1 xgrammar==0.2.8 apache-tvm-ffi==0.1.11
PINS
read -r -d '' WITHDEPS <<'PINS' || true
pydantic==2.14.4 urllib3==2.8.0 requests==2.34.2 aiohttp==3.14.5
transformers==5.20.2 openai==3.57.0 fastapi==0.136.3
PINS

# What the venv already holds and must keep (public versions: "2.13.0+cpu" -> "2.13.0").
held=$("$PYV" - <<'PY'
import importlib.metadata as md
for name in ("torch", "numpy"):
    print(f"{name}=={md.version(name).split('+')[0]}")
PY
)
stamp="$VENV/.p2pkv-vllm"
want=$(printf '%s\n' "$NODEPS" "$WITHDEPS" "$held" | sha256sum | cut -d' ' -f1)
if [ "$(cat "$stamp" 2>/dev/null)" = "$want" ]; then exit 0; fi

echo "installing vLLM 0.33.0 (lean, CPU) into $VENV (first run: about two minutes)" >&2
cons="$VENV/p2pkv-vllm-constraints.txt"
printf '%s\n' "$held" > "$cons"
PIP=("$PYV" -m pip install -q -c "$cons")
# shellcheck disable=SC2086  # the pin lists are word lists
"${PIP[@]}" --no-deps $NODEPS
# shellcheck disable=SC2086
"${PIP[@]}" $WITHDEPS

# Smoke: the tiering stack and the built-in p2p tier import, torch/numpy are the held ones.
"$PYV" - "$held" <<'PY'
import importlib.metadata as md
import sys

import vllm.v1.kv_offload.tiering.factory  # noqa: F401
import vllm.v1.kv_offload.tiering.manager  # noqa: F401
import vllm.v1.kv_offload.tiering.p2p.manager  # noqa: F401
import vllm.v1.kv_offload.tiering.spec  # noqa: F401

for pin in sys.argv[1].split():
    name, version = pin.split("==")
    have = md.version(name).split("+")[0]
    assert have == version, f"{name} changed: {have} != {version}"
PY
echo "$want" > "$stamp"
