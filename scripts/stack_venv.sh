# Sourced by scripts/install_trl.sh and scripts/install_verl.sh: the steps every stack
# adapter's venv shares. The venv gets qualify's runtime dependencies only, not qualify
# itself (the adapter imports qualify's file and contract modules from the checkout, on
# PYTHONPATH), and the harness SDK (sdk/, qualify_harness) that harnesses/common.py builds on.
#
#   stack_venv_begin VENV        # cd to the checkout; create VENV (with $PYTHON, default
#                                # python3.11) unless it exists; upgrade pip; torch 2.13.0
#   pip install -q STACK==X.Y.Z  # the stack's own pins, into VENV
#   stack_venv_end DIST...       # qualify's runtime deps, the SDK (editable), then print
#                                # each DIST's installed version
#
# - torch 2.13.0: pip takes the CPU wheel on disk first (a plain `torch` would take a CUDA build).
cd "$(dirname "${BASH_SOURCE[0]}")/.."

stack_venv_begin() {
    VENV="$1"
    [ -x "$VENV/bin/python" ] || "${PYTHON:-python3.11}" -m venv "$VENV"
    pip install -q --upgrade pip
    pip install -q torch==2.13.0
}

pip() { "$VENV/bin/python" -m pip "$@"; }

stack_venv_end() {
    pip install -q safetensors numpy jsonschema psutil
    pip install -q --no-deps --no-build-isolation -e sdk
    "$VENV/bin/python" - "$@" <<'PY'
import importlib.metadata as md
import sys
for dist in sys.argv[1:]:
    print(f"installed: {dist} {md.version(dist)}")
PY
}
