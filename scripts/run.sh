#!/usr/bin/env bash
# The README's main command: installs what it needs on first use, then runs the main job on an
# embedded Ray. Extra arguments are Hydra overrides, e.g. `bash scripts/run.sh seed=7`.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo_root/scripts/setup_env.sh"
source "$repo_root/scripts/cpu_env.sh"
cd "$repo_root"
exec "$venv/bin/python" examples/start_cluster_check.py "$@"
