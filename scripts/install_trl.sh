#!/usr/bin/env bash
# Install TRL (pinned) into its own venv, .venv-trl (git-ignored), for the TRL stack adapter
# (harnesses/trl/). TRL 1.16.0 brings transformers 5.25, above qualify's own transformers
# pin, so it never shares qualify's environment:
#   bash scripts/install_trl.sh [VENV]     # then: qualify run contracts/tiny-qwen3-trl.toml \
#                                          #           --launcher trl=.venv-trl/bin/python
# The steps every stack's venv shares (torch, qualify's runtime deps, the harness SDK) are
# scripts/stack_venv.sh's.
set -euo pipefail
source "$(dirname "$0")/stack_venv.sh"
stack_venv_begin "${1:-${QUALIFY_TRL_VENV:-.venv-trl}}"
pip install -q trl==1.16.0
stack_venv_end torch trl transformers accelerate
