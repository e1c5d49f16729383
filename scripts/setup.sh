#!/usr/bin/env bash
# Idempotent set-up: .venv with p2pkv, the real NIXL data plane (nixl-cu13), the test
# tools and a lean vLLM 0.33.0. Re-runs are quick: each step has its own stamp.
set -euo pipefail
cd "$(dirname "$0")/.."
# .venv is this checkout's alone: a PYTHONPATH or PYTHONHOME of the caller's (another
# environment's site-packages, another checkout) would count as installed to pip and
# to the checks below, and leave .venv without what it holds.
unset PYTHONPATH PYTHONHOME
# Ctrl-C stops the set-up: pip exits 1 on it, not by the signal, which bash alone goes past
# (the torch install below took it for "no such build" and went on to the fallback index).
trap 'echo "setup.sh: interrupted (the next run starts where this one stopped)" >&2; exit 130' INT
# The Python of .venv: $PYTHON if set, else the first of python3, python3.14 ... python3.11
# that is 3.11 or newer (python3 may be older where a newer one is installed beside it).
version='import sys; print("%d.%d.%d" % sys.version_info[:3])'
new_enough() {  # prints the version of Python $1; true if it is >= 3.11
  local v
  v=$("$1" -c "$version" 2>/dev/null) || return 1
  echo "$v"
  [[ $v =~ ^3\.([0-9]+)\. ]] && [ "${BASH_REMATCH[1]}" -ge 11 ]
}
pick_python() {
  local c v found=""
  if [ -n "${PYTHON:-}" ]; then set -- "$PYTHON"; else set -- python3 python3.14 python3.13 python3.12 python3.11; fi
  for c in "$@"; do
    command -v "$c" >/dev/null 2>&1 || continue
    if v=$(new_enough "$c"); then PY=$c; return 0; fi
    found+="${found:+, }$c is ${v:-unusable}"
  done
  echo "setup.sh: p2pkv needs Python >= 3.11; ${found:-no python3 found} (PYTHON=/path/to/python3.x names one)" >&2
  exit 1
}
# A .venv that an interrupted run left half-built (Ctrl-C during `python -m venv` leaves
# bin/python without pip or bin/activate, which venv writes last), whose Python is gone or
# older than 3.11, is made again from scratch; a complete one is kept.
if ! { [ -f .venv/bin/activate ] \
  && .venv/bin/python -c 'import pip, sys; sys.exit(sys.version_info < (3, 11))' 2>/dev/null; }; then
  pick_python
  [ ! -e .venv ] || echo "setup.sh: .venv is incomplete or its Python too old: rebuilding .venv with $PY" >&2
  "$PY" -m venv --clear .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.p2pkv-setup
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
# The stamp says only that an install once finished: what p2pkv[nixl,test] needs, all the
# way down (torch included), must still be there; a package removed since (pip uninstall,
# an interrupted upgrade) is installed again instead of failing the demo on an ImportError.
missing=$(python - 2>/dev/null <<'PY'
import importlib.metadata as md

from pip._vendor.packaging.requirements import Requirement

todo, seen, missing = [("p2pkv", ("nixl", "test"))], set(), []
while todo:
    name, extras = todo.pop()
    if name.lower().replace("_", "-") in seen:
        continue
    seen.add(name.lower().replace("_", "-"))
    try:
        requires = md.distribution(name).requires or []
    except md.PackageNotFoundError:
        missing.append(name)
        continue
    for text in requires:
        req = Requirement(text)
        if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in extras or ("",)):
            todo.append((req.name, tuple(req.extras)))
print(" ".join(sorted(missing)))
PY
) || missing="(its packages could not be listed)"
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ] || [ -n "$missing" ]; then
  if [ -n "$missing" ] && [ -f "$stamp" ]; then
    echo "setup.sh: .venv lacks $missing: installing again" >&2
  fi
  echo "setting up .venv (first run: about a minute)" >&2
  python -m pip install -q --upgrade pip
  # nixl-cu13 requires torch: install the CPU build first, so that no CUDA build (with its
  # nvidia-* wheels, gigabytes) is pulled in. A mirror or wheel directory that carries the
  # "+cpu" build serves it as it is; PyPI has none (its Linux torch is the CUDA build), so
  # then it comes from PyTorch's CPU index (P2PKV_TORCH_INDEX overrides that index).
  if ! python -c "import torch" 2>/dev/null; then
    torch_index=${P2PKV_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}
    python -m pip install -q "torch==2.13.0+cpu" 2>/dev/null \
      || python -m pip install -q --index-url "$torch_index" "torch==2.13.0" || {
        echo "setup.sh: torch 2.13.0 (CPU) came from neither pip's configured index nor" \
          "$torch_index: is the index reachable? (P2PKV_TORCH_INDEX names another)" >&2
        exit 1
      }
  fi
  python -m pip install -q -e ".[nixl,test]"
  echo "$want" > "$stamp"
fi
# vLLM 0.33.0, lean (its own stamp): only tests/test_vllm_tier.py and bench/vllm_tier.py need
# it. P2PKV_VLLM=0 skips it; those tests then skip with the reason.
if [ "${P2PKV_VLLM:-1}" != 0 ]; then
  bash scripts/setup-vllm.sh .venv
fi
