#!/usr/bin/env bash
# The README's main command: installs what it needs on first use, then runs the embedded default on
# an embedded Ray: an SFT warm start of a tiny model (skipped when its export already exists), then
# GRPO on held-out-checked arithmetic. Arguments are Hydra overrides of the RLVR run, e.g.
# `bash scripts/run.sh max_steps=50`; those starting with `sft.` go to the warm start, without the
# prefix (`sft.max_steps=100`); `-v` shows both runs' detail on the console.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo_root/scripts/setup_env.sh"
source "$repo_root/scripts/cpu_env.sh"
cd "$repo_root"
sft_args=()
rlvr_args=()
for arg in "$@"; do
  if [[ "$arg" == -v || "$arg" == --verbose ]]; then sft_args+=("$arg"); rlvr_args+=("$arg")
  elif [[ "$arg" == sft.* ]]; then sft_args+=("${arg#sft.}"); else rlvr_args+=("$arg"); fi
done
"$venv/bin/python" examples/start_sft_pipeline.py ${sft_args[@]+"${sft_args[@]}"}
exec "$venv/bin/python" examples/start_rlvr_pipeline.py ${rlvr_args[@]+"${rlvr_args[@]}"}
