"""Schemas of one role (worker cluster): its model, strategy, training and generation arguments.

Every field declares the values it accepts (`roll.configs.schema.Rule`); relations between fields are
checked by the pipeline config's `validate()`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from roll.configs.device_mapping import parse_device_mapping
from roll.configs.schema import DOTTED_PATH, SEED, ConfigError, Rule, any_value, check, checked_in_validate
from roll.platforms import resolve_dtype

logger = logging.getLogger(__name__)

# "auto": bf16 where the run's devices compute it in hardware, else fp32 (`Platform.preferred_dtype`).
Dtype = Literal["auto", "fp32", "bf16", "fp16"]
ATTENTION_IMPLEMENTATIONS = ("eager", "sdpa", "flash_attention_2", "flash_attention_3", "flex_attention")
NAME = Rule(nonempty=True, expect="a non-empty name")
# Empty until a role sets it (resolve() then demands it).
WORKER_CLS = Rule(pattern=f"({DOTTED_PATH.pattern})?", expect=DOTTED_PATH.expect)


@dataclass
class ModelArguments:
    """Where a role's model comes from and how it is loaded; `lora_rank` > 0 trains LoRA adapters only."""

    model_name_or_path: str = field(
        default="",
        metadata=checked_in_validate(
            "a local Hugging Face directory, a hub id (org/name[@revision]) or a tiny:// reference: whether it "
            "exists and parses is the filesystem's (or the hub's)",
            bad="/no/such/model/directory",
        ),
    )
    dtype: Dtype = "auto"
    attn_implementation: str = field(default="sdpa", metadata=check(choices=ATTENTION_IMPLEMENTATIONS))
    lora_rank: int = field(default=0, metadata=check(ge=0, hint="0 trains the full model"))
    lora_alpha: int = field(default=16, metadata=check(gt=0))
    lora_dropout: float = field(default=0.0, metadata=check(ge=0, lt=1))
    lora_target_modules: list[str] = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata=check(nonempty=True, items=NAME, expect="the names of the modules LoRA adapts, e.g. [q_proj, v_proj]"),
    )
    # A vision-language model's vision tower (and its merger into the decoder) keeps its weights in training
    # when true, as most VLM RL recipes do; false trains it with the rest. Text models have none to freeze.
    freeze_vision_tower: bool = True


@dataclass
class StrategyArguments:
    """Which backend a role's workers hold and that backend's own configuration block.

    `strategy_config` is passed to the backend as it is (for DeepSpeed, the ZeRO config that
    `examples/config/deepspeed_zero*.yaml` define and a role references with `${deepspeed_zero3}`).
    """

    strategy_name: str = field(
        default="hf_infer",
        metadata=checked_in_validate("one of the registered backends, which live above the config layer", "hf_infre"),
    )
    strategy_config: dict[str, Any] = field(
        default_factory=dict,
        metadata=checked_in_validate("the backend's check_config checks its own block", {"train_batch_size": 3}),
    )
    # Where a colocated role's states go while other roles use its devices: host memory, or files
    # under offload_dir ("nvme") so that host memory is freed too.
    offload_device: Literal["cpu", "nvme"] = "cpu"
    offload_dir: str = field(
        default="",
        metadata=any_value("any directory (created on first use); validate() requires one when offload_device=nvme"),
    )


@dataclass
class TrainingArguments:
    """Optimisation settings of a training role."""

    learning_rate: float = field(default=1e-5, metadata=check(gt=0, le=1))
    weight_decay: float = field(default=0.0, metadata=check(ge=0))
    adam_beta1: float = field(default=0.9, metadata=check(ge=0, lt=1))
    adam_beta2: float = field(default=0.999, metadata=check(ge=0, lt=1))
    adam_epsilon: float = field(default=1e-8, metadata=check(gt=0))
    per_device_train_batch_size: int = field(default=1, metadata=check(ge=1))
    gradient_accumulation_steps: int = field(default=1, metadata=check(ge=1))
    max_grad_norm: float = field(default=1.0, metadata=check(ge=0, hint="0 turns gradient clipping off"))
    warmup_steps: int = field(default=0, metadata=check(ge=0))
    lr_scheduler_type: Literal["constant", "linear", "cosine"] = "constant"
    # Optimizer steps the schedule spans; linear and cosine need it.
    max_steps: int = field(default=0, metadata=check(ge=0, hint="0 is only for the constant schedule"))
    seed: int = field(default=42, metadata=check(SEED))
    gradient_checkpointing: bool = False


@dataclass
class GeneratingArguments:
    """Sampling settings of a generating role.

    Greedy decoding is `do_sample=false`. Sampling at temperature 0 or with top_k=1 is greedy in
    disguise: the pipeline config's `validate()` refuses it, naming that fix, rather than leave it
    to an engine to reject or reinterpret.
    """

    max_new_tokens: int = field(default=64, metadata=check(ge=1))
    temperature: float = field(default=1.0, metadata=check(ge=0, hint="for greedy decoding set do_sample=false"))
    top_p: float = field(default=1.0, metadata=check(gt=0, le=1, hint="1 turns nucleus sampling off"))
    top_k: int = field(default=-1, metadata=check(ge=-1, hint="-1 or 0 turns top-k sampling off"))
    num_return_sequences: int = field(default=1, metadata=check(ge=1))
    do_sample: bool = True
    stop_strings: list[str] = field(
        default_factory=list, metadata=check(items=Rule(nonempty=True, expect="a non-empty stop string"))
    )
    seed: int | None = field(default=None, metadata=check(SEED))


@dataclass
class WorkerConfig:
    """One role: `world_size` Ray actors of `worker_cls`, placed on `device_mapping`.

    A role with a `device_mapping` owns `num_devices_per_worker` devices per worker; roles whose
    mappings overlap are colocated on those devices. A role without one (e.g. CPU reward workers)
    gives `world_size` instead and is placed wherever Ray finds room.
    """

    worker_cls: str = field(default="", metadata=check(WORKER_CLS))
    device_mapping: str | int | list[int] | None = field(
        default=None, metadata=check(parse=parse_device_mapping, bad="3-1")
    )
    world_size: int | None = field(default=None, metadata=check(ge=1))
    num_devices_per_worker: int = field(default=1, metadata=check(ge=1))
    num_cpus_per_worker: float = field(default=1.0, metadata=check(gt=0))
    infer_batch_size: int = field(default=8, metadata=check(ge=1, hint="rows per forward or generation micro-batch"))
    # Micro-batches of the train step and the forward passes formed by tokens instead of rows: at most this
    # many tokens each (rows x longest real prompt + longest real response), padding trimmed. None keeps
    # per_device_train_batch_size / infer_batch_size rows per micro-batch.
    max_tokens_per_microbatch: int | None = field(
        default=None, metadata=check(ge=1, hint="null keeps fixed-size micro-batches")
    )
    # Several sequences concatenated into one row of up to max_tokens_per_microbatch tokens (no padding),
    # attention kept inside each sequence. Without a budget: see resolve_token_budget.
    sequence_packing: bool = False
    model_args: ModelArguments = field(default_factory=ModelArguments)
    strategy_args: StrategyArguments | None = None
    training_args: TrainingArguments = field(default_factory=TrainingArguments)
    generating_args: GeneratingArguments = field(default_factory=GeneratingArguments)
    env_vars: dict[str, str] = field(
        default_factory=dict,
        metadata=check(
            keys=Rule(pattern=r"[A-Za-z_][A-Za-z0-9_]*", expect="an environment variable name"),
            bad={"NOT A NAME": "1"},
        ),
    )
    name: str = field(default="", init=False)
    devices: list[int] = field(default_factory=list, init=False)
    # Ranks that hold one model replica between them (tensor parallelism across workers); the strategy
    # registry sets it from the backend's block when it checks the role.
    model_parallel_size: int = field(default=1, init=False)

    def resolve(self, name: str, total_devices: int) -> None:
        """Name the role, parse its devices and check them against the cluster; raise ConfigError.

        The strategy block is the backend's to check (`PipelineConfig.validate` asks the registry). A dtype of
        "auto" becomes the run's platform's choice here, so every backend and estimate sees a precision.
        """
        self.name = name
        if self.model_args.dtype == "auto":
            self.model_args.dtype = resolve_dtype("auto")
            logger.info("%s.model_args.dtype=auto -> %s on this machine", name, self.model_args.dtype)
        if not self.worker_cls:
            raise ConfigError(f"{name}.worker_cls is empty: set it to the dotted path of a Worker class")
        if self.device_mapping is None:
            self._resolve_world_size_only(name)
        else:
            self._resolve_devices(name, total_devices)

    def _resolve_world_size_only(self, name: str) -> None:
        if self.world_size is None:
            raise ConfigError(f"{name} needs a device_mapping (e.g. {name}.device_mapping=0-1) or a world_size")
        self.devices = []

    def _resolve_devices(self, name: str, total_devices: int) -> None:
        devices = parse_device_mapping(self.device_mapping, f"{name}.device_mapping", total_devices)
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

    def resolve_token_budget(self, tokens: int, spelled_out: str) -> None:
        """Check the token budget against the longest possible sequence of `tokens` (`spelled_out` by field).

        Packing without a budget packs up to the tokens of the role's largest padded micro-batch:
        max(per_device_train_batch_size, infer_batch_size) rows of `tokens`.
        """
        if self.sequence_packing and self.max_tokens_per_microbatch is None:
            self.max_tokens_per_microbatch = (
                max(self.training_args.per_device_train_batch_size, self.infer_batch_size) * tokens
            )
        budget = self.max_tokens_per_microbatch
        if budget is not None and budget < tokens:
            raise ConfigError(
                f"{self.name}.max_tokens_per_microbatch={budget} is less than the longest possible sequence, "
                f"{spelled_out} = {tokens} tokens; raise {self.name}.max_tokens_per_microbatch to at least {tokens}"
            )

    @property
    def dp_size(self) -> int:
        """Data-parallel size: groups of `model_parallel_size` workers that each take a different slice of a batch."""
        return (self.world_size or 1) // self.model_parallel_size
