#!/usr/bin/env bash
# Creates .venv and installs roll into it, once: a stamp holding the hash of the requirement files
# makes later calls return at once until a requirement changes. Sourced by run.sh and test.sh.
#   ROLL_VENV   where the virtual environment lives (default: <repo>/.venv)
#   ROLL_PYTHON the interpreter that creates it (default: python3)
#   ROLL_INSTALL_CHECK=1  only check: fail instead of installing when the environment is not current
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Resolved: DeepSpeed builds its ops with the source paths of the interpreter's prefix, so a venv reached
# through a symlink (a second checkout sharing it) would rebuild them, and the real path would rebuild them back.
venv="$(realpath -m "${ROLL_VENV:-$repo_root/.venv}")"
python_bin="${ROLL_PYTHON:-python3}"
requirement_files=(requirements_torch.txt requirements_common.txt requirements_cpu.txt requirements_dev.txt pyproject.toml)

# DeepSpeed's just-in-time ops (CPU Adam, the fused Adam of ZeRO stage 0, shared-memory collectives) are
# built once per environment here, at install time, so concurrent workers never race to build or load them.
export TORCH_EXTENSIONS_DIR="$venv/torch_extensions"
# The venv's tools come first: its ninja (1.13) hashes build commands differently from a system ninja
# (1.11 on these machines), so processes finding different ninjas would rebuild the ops back and forth.
export PATH="$venv/bin:$PATH"

stamp_value="$(cd "$repo_root" && cat "${requirement_files[@]}" | sha256sum | cut -d' ' -f1)"
stamp_file="$venv/.roll-install-stamp"

if [[ -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp_value" ]]; then
  return 0 2>/dev/null || exit 0
fi

if [[ "${ROLL_INSTALL_CHECK:-0}" == 1 ]]; then
  echo "[roll] $venv is not installed for these requirements: run bash scripts/setup_env.sh" >&2
  return 1 2>/dev/null || exit 1
fi
echo "[roll] installing into $venv (first run, or a requirement changed) ..." >&2
[[ -x "$venv/bin/python" ]] || "$python_bin" -m venv "$venv"
pip_install() {
  # pip's find-links / extra-index entries for directories absent on this machine are noise.
  "$venv/bin/python" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
    | grep -v "is neither a file nor a directory" || true
  return "${PIPESTATUS[0]}"
}
find_links=()
[[ -d /opt/wheels ]] && find_links=(--find-links /opt/wheels)

cd "$repo_root"
# DeepSpeed's async I/O op (ZeRO-Infinity's NVMe offload) links libaio: Debian's libaio-dev, installed here when it
# is missing and this user may; without it an nvme offload is a config error that names this fix.
if [[ ! -e /usr/include/libaio.h ]] && command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
  { apt-get install -y -qq libaio-dev || { apt-get update -qq && apt-get install -y -qq libaio-dev; }; } >/dev/null 2>&1 \
    || echo "[roll] could not install libaio-dev: ZeRO-Infinity's NVMe offload stays unavailable" >&2
fi
pip_install "${find_links[@]}" setuptools wheel
pip_install "${find_links[@]}" -r requirements_torch.txt
pip_install "${find_links[@]}" --no-build-isolation -r requirements_common.txt -r requirements_cpu.txt -r requirements_dev.txt
pip_install --no-build-isolation --no-deps -e .
# torchvision/torchaudio/torchcodec from PyPI break next to the CPU torch (torchvision::nms missing,
# then transformers cannot import its models): roll uses none of them.
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
"$venv/bin/python" - <<'PY'
import torch, deepspeed, ray, transformers, hydra  # noqa: F401  (fail here, not in the first job)
from deepspeed.ops.op_builder import AsyncIOBuilder
from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, FusedAdamBuilder, ShareMemCommBuilder
for builder in (CPUAdamBuilder(), FusedAdamBuilder(), ShareMemCommBuilder()):
    builder.load(verbose=False)
if AsyncIOBuilder().is_compatible(verbose=False):  # needs libaio (above)
    AsyncIOBuilder().load(verbose=False)
print(f"[roll] torch {torch.__version__}, deepspeed {deepspeed.__version__}, ray {ray.__version__}, "
      f"transformers {transformers.__version__}")
PY
echo "$stamp_value" > "$stamp_file"
