#!/usr/bin/env bash
# The README's test command: installs what it needs on first use, lints, then runs the test suite.
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -m "not slow"` or `-k protocol`.
set -euo pipefail
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$repo_root/scripts/setup_env.sh"
source "$repo_root/scripts/cpu_env.sh"
cd "$repo_root"
"$venv/bin/ruff" check roll tests examples scripts benchmarks
"$venv/bin/ruff" format --check roll tests examples scripts benchmarks
if [[ " $* " == *" --cov"* ]]; then
  # Measure the processes the tests start as well, not only pytest's (pyproject.toml's [tool.coverage.run]).
  export COVERAGE_PROCESS_START="$repo_root/pyproject.toml" COVERAGE_FILE="$repo_root/.coverage"
fi
exec "$venv/bin/python" -m pytest "$@"
