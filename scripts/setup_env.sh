#!/usr/bin/env bash
# Creates .venv and installs roll into it, once: a stamp holding the hash of the requirement files and the device
# makes later calls return at once until either changes. Sourced by run.sh and test.sh.
#   ROLL_VENV     where the virtual environment lives (default: <repo>/.venv)
#   ROLL_PYTHON   the interpreter that creates it (default: python3)
#   ROLL_DEVICE   cpu or cuda: which stack to install (default: the one the environment holds, else cuda when
#                 nvidia-smi lists a GPU, else cpu)
#   ROLL_TORCH_INDEX  the wheel index of that device's torch build, used when pip's own configuration does not
#                 provide it (default: PyTorch's index, https://download.pytorch.org/whl/cpu or .../whl/cu128)
#   ROLL_INSTALL_CHECK=1  only check: fail instead of installing when the environment is not current
#   ROLL_INSTALL_PLAN=1   only print the pip installs this machine would run, one per line, and stop
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# Resolved: DeepSpeed builds its ops with the source paths of the interpreter's prefix, so a venv reached
# through a symlink (a second checkout sharing it) would rebuild them, and the real path would rebuild them back.
venv="$(realpath -m "${ROLL_VENV:-$repo_root/.venv}")"
python_bin="${ROLL_PYTHON:-python3}"

device_file="$venv/.roll-install-device"
if [[ -z "${ROLL_DEVICE:-}" && -f "$device_file" ]]; then
  ROLL_DEVICE="$(cat "$device_file")"  # a GPU image's environment stays as it is on a node without GPUs
elif [[ -z "${ROLL_DEVICE:-}" ]]; then
  ROLL_DEVICE=cpu
  if command -v nvidia-smi >/dev/null && nvidia-smi -L 2>/dev/null | grep -q '^GPU'; then ROLL_DEVICE=cuda; fi
fi
case "$ROLL_DEVICE" in
  cpu) device_requirements=requirements_cpu.txt torch_build=cpu default_index=https://download.pytorch.org/whl/cpu ;;
  cuda) device_requirements=requirements_gpu.txt torch_build=cu128 default_index=https://download.pytorch.org/whl/cu128 ;;
  *) echo "[roll] ROLL_DEVICE=$ROLL_DEVICE is not one of: cpu, cuda" >&2; return 2 2>/dev/null || exit 2 ;;
esac
requirement_files=(requirements_torch.txt requirements_common.txt "$device_requirements" requirements_dev.txt pyproject.toml)

# DeepSpeed's just-in-time ops (CPU Adam, the fused Adam of ZeRO stage 0, shared-memory collectives) are
# built once per environment here, at install time, so concurrent workers never race to build or load them.
export TORCH_EXTENSIONS_DIR="$venv/torch_extensions"
# The venv's tools come first: its ninja (1.13) hashes build commands differently from a system ninja
# (1.11 on these machines), so processes finding different ninjas would rebuild the ops back and forth.
export PATH="$venv/bin:$PATH"

stamp_value="$(cd "$repo_root" && { echo "$ROLL_DEVICE"; cat "${requirement_files[@]}"; } | sha256sum | cut -d' ' -f1)"
stamp_file="$venv/.roll-install-stamp"

if [[ "${ROLL_INSTALL_PLAN:-0}" != 1 && -f "$stamp_file" && "$(cat "$stamp_file")" == "$stamp_value" ]]; then
  return 0 2>/dev/null || exit 0
fi
if [[ "${ROLL_INSTALL_PLAN:-0}" != 1 && "${ROLL_INSTALL_CHECK:-0}" == 1 ]]; then
  echo "[roll] $venv is not installed for these requirements: run bash scripts/setup_env.sh" >&2
  return 1 2>/dev/null || exit 1
fi

cd "$repo_root"
torch_version="$(sed -n 's/^torch==\([0-9.]*\)$/\1/p' requirements_torch.txt)"
torch_pin="torch==${torch_version}${torch_build:++$torch_build}"
torch_index="${ROLL_TORCH_INDEX:-$default_index}"
planning_python="$python_bin"
[[ -x "$venv/bin/python" ]] && planning_python="$venv/bin/python"
# pip's own configuration (a local wheel directory, a mirror) may already hold this torch build; PyPI holds only
# the CUDA build of a Linux torch, so elsewhere the build comes from its own index, beside the usual ones.
torch_source=()
if ! "$planning_python" -m pip install --disable-pip-version-check --dry-run --no-deps --ignore-installed -q \
  "$torch_pin" >/dev/null 2>&1; then
  torch_source=(--extra-index-url "$torch_index")
fi
plan=(
  "setuptools wheel"
  "${torch_source[*]} $torch_pin"
  # deepspeed is an sdist that imports torch while building: it must see the torch installed above.
  "${torch_source[*]} --no-build-isolation -r requirements_common.txt -r $device_requirements -r requirements_dev.txt"
  "--no-build-isolation --no-deps -e ."
)
if [[ "${ROLL_INSTALL_PLAN:-0}" == 1 ]]; then
  printf '%s\n' "${plan[@]}" | sed 's/  */ /g; s/^ //'
  return 0 2>/dev/null || exit 0
fi

echo "[roll] installing the $ROLL_DEVICE stack into $venv (first run, or a requirement changed) ..." >&2
[[ -x "$venv/bin/python" ]] || "$python_bin" -m venv "$venv"
pip_install() {
  # pip's find-links / extra-index entries for directories absent on this machine are noise.
  "$venv/bin/python" -m pip install --disable-pip-version-check -q "$@" 2>&1 \
    | grep -v "is neither a file nor a directory" || true
  return "${PIPESTATUS[0]}"
}
# DeepSpeed's async I/O op (ZeRO-Infinity's NVMe offload) links libaio: Debian's libaio-dev, installed here when it
# is missing and this user may; without it an nvme offload is a config error that names this fix.
if [[ ! -e /usr/include/libaio.h ]] && command -v apt-get >/dev/null && [[ "$(id -u)" == 0 ]]; then
  { apt-get install -y -qq libaio-dev || { apt-get update -qq && apt-get install -y -qq libaio-dev; }; } >/dev/null 2>&1 \
    || echo "[roll] could not install libaio-dev: ZeRO-Infinity's NVMe offload stays unavailable" >&2
fi
for step in "${plan[@]}"; do
  read -r -a step_args <<<"$step"
  pip_install "${step_args[@]}"
done
if [[ "$ROLL_DEVICE" == cpu ]]; then
  # torchvision/torchaudio/torchcodec from PyPI break next to the CPU torch (torchvision::nms missing,
  # then transformers cannot import its models): roll uses none of them.
  "$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
fi
# DeepSpeed told its accelerator on CPU: its "Setting accelerator to CPU" warning asks nothing of the user.
accelerator=()
[[ "$ROLL_DEVICE" == cpu ]] && accelerator=(DS_ACCELERATOR=cpu)
env ${accelerator[@]+"${accelerator[@]}"} "$venv/bin/python" - <<'PY'
import torch, deepspeed, ray, transformers, hydra  # noqa: F401  (fail here, not in the first job)
from deepspeed.ops.op_builder import AsyncIOBuilder
from deepspeed.ops.op_builder.cpu import CPUAdamBuilder, FusedAdamBuilder, ShareMemCommBuilder
if not torch.cuda.is_available():  # the CPU accelerator's ops; CUDA builds its own on first use
    for builder in (CPUAdamBuilder(), FusedAdamBuilder(), ShareMemCommBuilder()):
        builder.load(verbose=False)
if AsyncIOBuilder().is_compatible(verbose=False):  # needs libaio (above)
    AsyncIOBuilder().load(verbose=False)
print(f"[roll] torch {torch.__version__}, deepspeed {deepspeed.__version__}, ray {ray.__version__}, "
      f"transformers {transformers.__version__}")
PY
echo "$ROLL_DEVICE" > "$device_file"
echo "$stamp_value" > "$stamp_file"
