"""Schemas of one role (worker cluster): its model, strategy, training and generation arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from roll.configs.device_mapping import parse_device_mapping
from roll.configs.schema import ConfigError

Dtype = Literal["fp32", "bf16", "fp16"]


@dataclass
class ModelArguments:
    """Where a role's model comes from and how it is loaded; `lora_rank` > 0 trains LoRA adapters only."""

    model_name_or_path: str = ""
    dtype: Dtype = "bf16"
    attn_implementation: str = "sdpa"
    lora_rank: int = 0
    lora_alpha: int = 16
    lora_dropout: float = 0.0
    lora_target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass
class StrategyArguments:
    """Which backend a role's workers hold and that backend's own configuration block.

    `strategy_config` is passed to the backend as it is (for DeepSpeed, the ZeRO config that
    `examples/config/deepspeed_zero*.yaml` define and a role references with `${deepspeed_zero3}`).
    """

    strategy_name: str = "hf_infer"
    strategy_config: dict[str, Any] = field(default_factory=dict)
    # Where a colocated role's states go while other roles use its devices: host memory, or files
    # under offload_dir ("nvme") so that host memory is freed too.
    offload_device: Literal["cpu", "nvme"] = "cpu"
    offload_dir: str = ""


@dataclass
class TrainingArguments:
    """Optimisation settings of a training role."""

    learning_rate: float = 1e-5
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_epsilon: float = 1e-8
    per_device_train_batch_size: int = 1
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    warmup_steps: int = 0
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    max_steps: int = 0  # optimizer steps the schedule spans; linear and cosine need it
    seed: int = 42
    gradient_checkpointing: bool = False


@dataclass
class GeneratingArguments:
    """Sampling settings of a generating role."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    num_return_sequences: int = 1
    do_sample: bool = True
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class WorkerConfig:
    """One role: `world_size` Ray actors of `worker_cls`, placed on `device_mapping`.

    A role with a `device_mapping` owns `num_devices_per_worker` devices per worker; roles whose
    mappings overlap are colocated on those devices. A role without one (e.g. CPU reward workers)
    gives `world_size` instead and is placed wherever Ray finds room.
    """

    worker_cls: str = ""
    device_mapping: str | int | list[int] | None = None
    world_size: int | None = None
    num_devices_per_worker: int = 1
    num_cpus_per_worker: float = 1.0
    infer_batch_size: int = 8
    model_args: ModelArguments = field(default_factory=ModelArguments)
    strategy_args: StrategyArguments | None = None
    training_args: TrainingArguments = field(default_factory=TrainingArguments)
    generating_args: GeneratingArguments = field(default_factory=GeneratingArguments)
    env_vars: dict[str, str] = field(default_factory=dict)
    name: str = field(default="", init=False)
    devices: list[int] = field(default_factory=list, init=False)

    def resolve(self, name: str, total_devices: int) -> None:
        """Name the role, parse its devices and check them against the cluster; raise ConfigError.

        The strategy block is the backend's to check (`PipelineConfig.validate` asks the registry).
        """
        self.name = name
        if not self.worker_cls:
            raise ConfigError(f"{name}.worker_cls is empty: set it to the dotted path of a Worker class")
        if self.num_devices_per_worker < 1:
            raise ConfigError(f"{name}.num_devices_per_worker must be at least 1")
        if self.device_mapping is None:
            self._resolve_world_size_only(name)
        else:
            self._resolve_devices(name, total_devices)

    def _resolve_world_size_only(self, name: str) -> None:
        if self.world_size is None or self.world_size < 1:
            raise ConfigError(f"{name} needs a device_mapping (e.g. {name}.device_mapping=0-1) or a world_size")
        self.devices = []

    def _resolve_devices(self, name: str, total_devices: int) -> None:
        devices = parse_device_mapping(self.device_mapping, f"{name}.device_mapping")
        beyond = [d for d in devices if d >= total_devices]
        if beyond:
            raise ConfigError(
                f"{name}.device_mapping uses device(s) {beyond} but the cluster has {total_devices} "
                f"(0-{total_devices - 1}); fix {name}.device_mapping or raise num_nodes/devices_per_node"
            )
        per_worker = self.num_devices_per_worker
        if len(devices) % per_worker:
            raise ConfigError(
                f"{name}.device_mapping has {len(devices)} devices, not a multiple of "
                f"{name}.num_devices_per_worker={per_worker}"
            )
        implied = len(devices) // per_worker
        if self.world_size is not None and self.world_size != implied:
            raise ConfigError(
                f"{name}.world_size={self.world_size} contradicts {name}.device_mapping "
                f"({len(devices)} devices / {per_worker} per worker = {implied}); drop one of them"
            )
        self.devices = devices
        self.world_size = implied

    @property
    def dp_size(self) -> int:
        """Data-parallel size: workers that each take a different slice of a batch."""
        return self.world_size or 1
