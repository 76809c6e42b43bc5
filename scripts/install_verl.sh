#!/usr/bin/env bash
# Install verl (pinned) into its own venv, .venv-verl (git-ignored), for the verl stack adapter
# (harnesses/verl/). verl 0.9.1 pins transformers<5.11, unlike qualify's and TRL's
# environments, so it never shares either:
#   bash scripts/install_verl.sh [VENV]    # then: qualify run contracts/tiny-qwen3-verl.toml \
#                                          #           --launcher verl=.venv-verl/bin/python
# The steps every stack's venv shares (torch, qualify's runtime deps, the harness SDK) are
# scripts/stack_venv.sh's.
# - uvicorn and fastapi: verl's engine workers import them (checkpoint_engine -> rollout.utils)
#   without declaring them.
set -euo pipefail
source "$(dirname "$0")/stack_venv.sh"
stack_venv_begin "${1:-${QUALIFY_VERL_VENV:-.venv-verl}}"
pip install -q verl==0.9.1
pip install -q uvicorn fastapi
stack_venv_end torch verl transformers tensordict
