#!/usr/bin/env bash
# Install verl (pinned) into its own venv, .venv-verl (git-ignored), for the verl stack adapter
# (harnesses/verl/). verl 0.9.1 pins transformers<5.11, unlike qualify's and TRL's
# environments, so it never shares either:
#   bash scripts/install_verl.sh [VENV]    # then: qualify run contracts/tiny-qwen3-verl.toml \
#                                          #           --launcher verl=.venv-verl/bin/python
#
# - torch 2.13.0: pip takes the CPU wheel first (a plain `torch` would take a CUDA build).
# - uvicorn and fastapi: verl's engine workers import them (checkpoint_engine -> rollout.utils)
#   without declaring them.
# - the adapter imports qualify's file and contract modules from the checkout (PYTHONPATH), so
#   the venv gets qualify's runtime dependencies only, not qualify itself, and the harness
#   SDK (sdk/, qualify_harness) that harnesses/common.py builds on.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${QUALIFY_VERL_VENV:-.venv-verl}}"
PY="${PYTHON:-python3.11}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q verl==0.9.1
pip install -q uvicorn fastapi
pip install -q safetensors numpy jsonschema psutil
pip install -q --no-deps --no-build-isolation -e sdk
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for dist in ("torch", "verl", "transformers", "tensordict"):
    print(f"installed: {dist} {md.version(dist)}")
PY
