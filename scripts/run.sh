#!/usr/bin/env bash
# The README's main command: installs what it needs on first use, then runs the embedded default on
# an embedded Ray: an SFT warm start of a tiny model (skipped when its export already exists), then
# GRPO on held-out-checked arithmetic. Extra arguments are Hydra overrides of the RLVR run, e.g.
# `bash scripts/run.sh max_steps=50`.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo_root/scripts/setup_env.sh"
source "$repo_root/scripts/cpu_env.sh"
cd "$repo_root"
"$venv/bin/python" examples/start_sft_pipeline.py
exec "$venv/bin/python" examples/start_rlvr_pipeline.py "$@"
