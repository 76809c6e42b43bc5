#!/usr/bin/env bash
# Build the SECOND environment of the worked example (examples/qualify-example-engine): a venv
# whose transformers differs from qualify's own (qualify pins transformers>=5.16.1,<5.20; the
# stack here pins 4.57.6, as real stacks pin theirs), holding the example engine installed
# from its own pyproject.toml (editable: its files stay in this checkout, where `qualify gate`
# sees an edit) and the harness SDK (sdk/). qualify itself is NOT installed there and the
# harness imports none of it: it runs on the SDK and talks to qualify through files.
#   bash scripts/install_example.sh [VENV_DIR]      (default: .venv-example)
# Then, from qualify's own environment:
#   qualify run examples/qualify-example-engine/contract.toml \
#       --launcher example_tp1=.venv-example/bin/python
# (the engine's spec must also be importable by qualify: pip install --no-deps -e
#  examples/qualify-example-engine in qualify's environment, or PYTHONPATH, see
#  docs/engine-guide.md).
set -euo pipefail
cd "$(dirname "$0")/.."
venv="${1:-.venv-example}"
python3.11 -m venv "$venv"
py="$venv/bin/python"
"$py" -m pip install -q torch==2.13.0           # the CPU wheel on disk (scripts/install.sh)
# the harness's own dependencies: transformers and the harness SDK's (torch, numpy,
# safetensors and the standard library only); no qualify module is imported there
"$py" -m pip install -q transformers==4.57.6 safetensors numpy
"$py" -m pip install -q --no-deps --no-build-isolation -e sdk
"$py" -m pip install -q --no-deps --no-build-isolation -e examples/qualify-example-engine
"$py" - <<'PY'
import importlib.metadata as md
for dist in ("torch", "transformers", "qualify-example-engine"):
    print(f"example venv: {dist} {md.version(dist)}")
PY
