#!/usr/bin/env bash
# Install TRL (pinned) into its own venv, .venv-trl (git-ignored), for the TRL stack adapter
# (harnesses/trl/). TRL 1.16.0 brings transformers 5.25, above qualify's own transformers
# pin, so it never shares qualify's environment:
#   bash scripts/install_trl.sh [VENV]     # then: qualify run contracts/tiny-qwen3-trl.toml \
#                                          #           --launcher trl=.venv-trl/bin/python
#
# - torch 2.13.0: pip takes the CPU wheel on disk first (a plain `torch` would take a CUDA build).
# - the adapter imports qualify's file and contract modules from the checkout (PYTHONPATH), so
#   the venv gets qualify's runtime dependencies only, not qualify itself, and the harness
#   SDK (sdk/, qualify_harness) that harnesses/common.py builds on.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${1:-${QUALIFY_TRL_VENV:-.venv-trl}}"
PY="${PYTHON:-python3.11}"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q trl==1.16.0
pip install -q safetensors numpy jsonschema psutil
pip install -q --no-deps --no-build-isolation -e sdk
"$VENV/bin/python" - <<'PY'
import importlib.metadata as md
for dist in ("torch", "trl", "transformers", "accelerate"):
    print(f"installed: {dist} {md.version(dist)}")
PY
