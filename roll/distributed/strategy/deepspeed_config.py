"""The DeepSpeed config of a role: `auto` fields filled from its arguments, everything else checked.

Pure functions on plain dicts; nothing here imports DeepSpeed, so configs are validated on the
driver before any actor starts. A value the user wrote is never changed: if it disagrees with the
role's arguments the result is a ConfigError naming both fields.
"""

from __future__ import annotations

import copy
from typing import Any

from roll.configs.schema import ConfigError, closest_spelling
from roll.configs.worker_config import WorkerConfig
from roll.distributed.strategy.training import check_dtype_supported, check_schedule

AUTO = "auto"
# The keys of DeepSpeed 0.19's `tensor_parallel` block (TPTrainingConfig) that a training role may set, so a
# misspelt one fails before Ray starts. Left out: dtype (roll sets the precision), the vocabulary-parallel
# loss backend (roll keeps full logits) and the inference-only kernel injection.
TENSOR_PARALLEL_KEYS = (
    "autotp_size",
    "tp_overlap_comm",
    "vocab_parallel_lm_head",
    "tp",
    "tensor_parallel",
    "partition_config",
    "preset_model",
    "keep_module_on_host",
)


def resolve_deepspeed_config(worker_config: WorkerConfig, training: bool) -> dict[str, Any]:
    """The DeepSpeed config dict for a role, with every `auto` replaced; raise ConfigError on conflicts."""
    role = worker_config.name
    block = worker_config.strategy_args.strategy_config if worker_config.strategy_args else {}
    config = copy.deepcopy(block)
    args = worker_config.training_args
    where, source = f"{role}.strategy_args.strategy_config", f"{role}.training_args"
    tp_size = _check_tensor_parallel(config, worker_config, training, where)
    dp_size = (worker_config.world_size or 1) // tp_size
    micro = args.per_device_train_batch_size if training else 1
    accumulation = args.gradient_accumulation_steps if training else 1
    _fill(config, "train_micro_batch_size_per_gpu", micro, where, f"{source}.per_device_train_batch_size")
    _fill(config, "gradient_accumulation_steps", accumulation, where, f"{source}.gradient_accumulation_steps")
    _fill(config, "gradient_clipping", args.max_grad_norm, where, f"{source}.max_grad_norm")
    expected = config["train_micro_batch_size_per_gpu"] * config["gradient_accumulation_steps"] * dp_size
    if config.get("train_batch_size", AUTO) == AUTO:
        config["train_batch_size"] = expected
    if config["train_batch_size"] != expected:
        raise ConfigError(
            f"{where}.train_batch_size={config['train_batch_size']} must equal micro batch "
            f"{config['train_micro_batch_size_per_gpu']} x accumulation {config['gradient_accumulation_steps']} x "
            f"data-parallel size {dp_size}{_tp_note(tp_size)} = {expected}; set it to auto or fix {role}.training_args"
        )
    dtype = worker_config.model_args.dtype
    for precision in ("bf16", "fp16"):
        section = config.setdefault(precision, {})
        _fill(section, "enabled", dtype == precision, f"{where}.{precision}", f"{role}.model_args.dtype={dtype}")
    if config["bf16"]["enabled"] and config["fp16"]["enabled"]:
        raise ConfigError(f"{where}: bf16 and fp16 cannot both be enabled")
    if config["fp16"]["enabled"]:
        config["fp16"].setdefault("loss_scale", 0)  # 0 = dynamic loss scaling
    _check_zero(config, where)
    config.setdefault("steps_per_print", 10**9)  # roll logs its own metrics
    config.setdefault("wall_clock_breakdown", False)
    return config


def _fill(section: dict[str, Any], key: str, value: Any, where: str, source: str) -> None:
    current = section.get(key, AUTO)
    if current == AUTO:
        section[key] = value
    elif current != value:
        raise ConfigError(f"{where}.{key}={current!r} disagrees with {source} ({value!r}); set it to auto")


def _check_zero(config: dict[str, Any], where: str) -> None:
    zero = config.setdefault("zero_optimization", {"stage": 0})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise ConfigError(f"{where}.zero_optimization.stage={stage!r} must be 0, 1, 2 or 3")
    for key, allowed_stages in (("offload_optimizer", (1, 2, 3)), ("offload_param", (3,))):
        device = zero.get(key, {}).get("device", "none")
        if device not in ("none", "cpu", "nvme"):
            raise ConfigError(f"{where}.zero_optimization.{key}.device={device!r} must be none, cpu or nvme")
        if device != "none" and stage not in allowed_stages:
            raise ConfigError(
                f"{where}.zero_optimization.{key} needs ZeRO stage {' or '.join(map(str, allowed_stages))}, "
                f"not {stage}; pick a deepspeed_zero2/3 block or drop the offload"
            )
        if device == "nvme" and not zero[key].get("nvme_path"):
            raise ConfigError(f"{where}.zero_optimization.{key}.nvme_path must name a directory for nvme offload")
        if device == "nvme":
            reason = async_io_unavailable_reason()
            if reason:
                raise ConfigError(f"{where}.zero_optimization.{key}.device=nvme (ZeRO-Infinity) cannot run: {reason}")


def async_io_unavailable_reason() -> str | None:
    """Why DeepSpeed's async I/O op, which ZeRO-Infinity's NVMe offload swaps through, cannot build here; None if
    it can."""
    from deepspeed.ops.op_builder import AsyncIOBuilder

    if AsyncIOBuilder().is_compatible(verbose=False):
        return None
    return (
        "DeepSpeed's async_io op needs libaio's headers and library (Debian: apt-get install libaio-dev, which "
        "scripts/setup_env.sh does as root); or offload to cpu"
    )


def _check_tensor_parallel(config: dict[str, Any], worker_config: WorkerConfig, training: bool, where: str) -> int:
    """Check the `tensor_parallel` block (DeepSpeed AutoTP) against the role; return the tensor-parallel size.

    AutoTP shards the linear layers of each model replica over `autotp_size` consecutive ranks; the
    role's ranks then form world_size / autotp_size data-parallel groups. The LM head must keep whole
    vocabulary rows on every rank (roll's losses read full logits), so `vocab_parallel_lm_head`, which
    DeepSpeed turns on by itself for some tied-embedding models, is set to false.
    """
    block = config.get("tensor_parallel")
    if block is None:
        return 1
    field = f"{where}.tensor_parallel"
    if not isinstance(block, dict):
        raise ConfigError(f"{field}={block!r} must be a mapping such as {{autotp_size: 2}}")
    for key in block:
        if key not in TENSOR_PARALLEL_KEYS:
            raise ConfigError(
                f"{field}.{key} is not a tensor_parallel key a roll training role passes to DeepSpeed"
                f"{closest_spelling(key, TENSOR_PARALLEL_KEYS)}; valid: {', '.join(TENSOR_PARALLEL_KEYS)}"
            )
    size = block.get("autotp_size", 0)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise ConfigError(f"{field}.autotp_size={size!r} must be a whole number of ranks (0 or 1 turns AutoTP off)")
    if size <= 1:
        return 1
    role, world = worker_config.name, worker_config.world_size or 1
    if not training:
        raise ConfigError(
            f"{field}.autotp_size={size}: AutoTP is a deepspeed_train option in roll; drop the tensor_parallel "
            f"block from {role}'s strategy_config (deepspeed_infer shards with ZeRO-3)"
        )
    if world % size:
        raise ConfigError(
            f"{field}.autotp_size={size} does not divide {role}'s {world} rank(s); set it to a divisor of {world} "
            f"or change {role}.device_mapping"
        )
    if worker_config.model_args.lora_rank:
        raise ConfigError(
            f"{field}.autotp_size={size} with {role}.model_args.lora_rank={worker_config.model_args.lora_rank}: "
            "AutoTP does not shard PEFT's LoRA layers; set lora_rank=0 or drop the tensor_parallel block"
        )
    if block.setdefault("vocab_parallel_lm_head", False) is not False:
        raise ConfigError(
            f"{field}.vocab_parallel_lm_head={block['vocab_parallel_lm_head']!r}: roll's losses need full-vocabulary "
            "logits on every rank; set it to false or remove it"
        )
    return size


def _tp_note(tp_size: int) -> str:
    return f" (ranks / tensor_parallel.autotp_size {tp_size})" if tp_size > 1 else ""


def tensor_parallel_size(config: dict[str, Any]) -> int:
    """Ranks that share one model replica under AutoTP (1 without a tensor_parallel block)."""
    return max(1, int((config.get("tensor_parallel") or {}).get("autotp_size", 0) or 0))


def zero_stage(config: dict[str, Any]) -> int:
    """The ZeRO stage of a resolved config."""
    return int(config.get("zero_optimization", {}).get("stage", 0))


def offloads_optimizer(config: dict[str, Any]) -> bool:
    """Whether the optimizer states (and step) live on the host or NVMe."""
    device = config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device", "none")
    return device in ("cpu", "nvme")


def check_precision_supported(worker_config: WorkerConfig, config: dict[str, Any]) -> None:
    """Raise ConfigError when the run's devices cannot compute in the 16-bit precision `config` enables (DeepSpeed
    would refuse it only inside a started worker: `Type fp16 is not supported on your device`)."""
    for precision in ("fp16", "bf16"):
        if config[precision]["enabled"]:
            check_dtype_supported(worker_config, precision)


def check_train_config(worker_config: WorkerConfig) -> None:
    """Config-time check of a deepspeed_train role."""
    check_precision_supported(worker_config, resolve_deepspeed_config(worker_config, training=True))
    check_schedule(worker_config)


def check_infer_config(worker_config: WorkerConfig) -> None:
    """Config-time check of a deepspeed_infer role: a ZeRO-3 block without optimizer offload."""
    config = resolve_deepspeed_config(worker_config, training=False)
    check_precision_supported(worker_config, config)
    if zero_stage(config) != 3:
        raise ConfigError(
            f"{worker_config.name}.strategy_args.strategy_config: deepspeed_infer needs ZeRO stage 3 "
            f"(got {zero_stage(config)}); reference ${{deepspeed_zero3}} or ${{deepspeed_zero3_cpuoffload}}"
        )
