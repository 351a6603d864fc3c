"""The pipeline base config: cluster shape, Ray connection, output, and the roles it declares.

`validate()` checks what single fields cannot: relations between fields, and what the config points
at (worker classes, model directories, data files, the machine's memory), all before Ray starts.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import psutil
from transformers import PreTrainedTokenizerBase

from roll.configs.data_config import DataArguments
from roll.configs.model_dir import ModelFacts, read_model_dir
from roll.configs.output_dirs import check_writable
from roll.configs.schema import SEED, ConfigError, Rule, any_value, check, closest_spelling
from roll.configs.worker_config import WorkerConfig
from roll.distributed.executor.cluster import resolve_worker_cls
from roll.distributed.scheduler.placement import ClusterShape, rank_placements
from roll.distributed.strategy.engine_strategy import EngineStrategy
from roll.distributed.strategy.registry import check_strategy_args, strategy_class
from roll.models.hub import resolve_model_id
from roll.models.model_providers import peek_tokenizer
from roll.models.tiny import TINY_SCHEME
from roll.pipeline.base.dry_run.backend_ranks import RankBreakdown
from roll.pipeline.base.dry_run.model_shape import tiny_shape
from roll.utils.external_trackers import TRACKER_PACKAGES, missing_packages
from roll.utils.imports import exception_line

# Used as a directory name under output_dir.
EXP_NAME = Rule(pattern=r"\w[\w.-]*", expect="a directory name of letters, digits, '_', '.' and '-'")


def _tracker_names(value: str | list[str], path: str) -> None:
    """One tracker name or a list of them."""
    for name in [value] if isinstance(value, str) else value:
        if name not in TRACKER_PACKAGES:
            choices = ", ".join(TRACKER_PACKAGES)
            raise ConfigError(
                f"{path}={value!r}: {name!r} is not one of {choices}{closest_spelling(name, TRACKER_PACKAGES)}"
            )


@dataclass
class PipelineConfig:
    """Fields every pipeline shares. Subclasses add their roles as `WorkerConfig` fields.

    A *device* is a GPU (or NPU) on accelerator nodes and a slot of `cpus_per_device` cores on CPU
    nodes; `devices_per_node` defaults to what this machine has (its GPUs, or its cores divided
    into slots).
    """

    exp_name: str = field(default="roll", metadata=check(EXP_NAME))
    seed: int = field(default=42, metadata=check(SEED))
    output_dir: str = field(
        default="./output", metadata=check(nonempty=True, expect="a directory for logs, checkpoints and exports")
    )
    # This run's logs, checkpoints and exports. Each job of a Hydra sweep (`-m`) gets the folder Hydra made for it.
    run_dir: str = field(default="", metadata=any_value("a directory; empty = <output_dir>/<exp_name>"))
    platform: Literal["auto", "cpu", "cuda", "rocm", "npu"] = "auto"
    num_nodes: int = field(default=1, metadata=check(ge=1))
    devices_per_node: int | None = field(
        default=None, metadata=check(ge=1, hint="leave it unset to use what this machine has")
    )
    cpus_per_device: int = field(default=1, metadata=check(ge=1))
    ray_address: str | None = field(
        default=None,
        metadata=check(
            pattern=r"auto|local|(ray://)?([^\s:/]+|\[[0-9A-Fa-f:]+\]):\d+",
            expect="a Ray address: auto, host:port or ray://host:port",
        ),
    )
    ray_namespace: str = field(
        default="roll", metadata=check(pattern=r"[\w.-]+", expect="a name of letters, digits, '_', '.' and '-'")
    )
    # How long Ray may take to grant the run's reservation (every actor's devices and CPUs) before the
    # run ends with a placement error instead of waiting.
    placement_timeout_s: float = field(
        default=120.0, metadata=check(gt=0, hint="seconds Ray may take to reserve the run's devices and CPUs")
    )
    # Roles on the same devices (same device_mapping, in-process strategies: hf_infer, DeepSpeed below ZeRO-3) run in
    # one process per device instead of one per role and rank: fewer imports at start-up, weight syncs in memory.
    # roll/distributed/executor/worker_host.py says which roles qualify.
    share_worker_processes: bool = True
    # Validate, print the plan (placement, batches, memory per rank) and exit without starting any actor.
    dry_run: bool = False
    # On CPU, refuse before Ray starts a run whose estimated node memory (the dry run's "memory per node")
    # exceeds what Ray's memory monitor allows; false runs it anyway (the estimate is docs/memory_estimate.md's).
    memory_check: bool = True
    # Experiment trackers: TensorBoard events and metrics.jsonl are always written; wandb, swanlab and mlflow
    # (one name or a list) also get the metrics, the config and sample tables.
    tracker: str | list[str] = field(default="tensorboard", metadata=check(parse=_tracker_names, bad="tensorbord"))

    @property
    def trackers(self) -> list[str]:
        """The requested trackers' names."""
        return [self.tracker] if isinstance(self.tracker, str) else list(self.tracker)

    @property
    def total_devices(self) -> int:
        """Devices in the whole cluster (valid after `validate`)."""
        return self.num_nodes * (self.devices_per_node or 0)

    def cluster_shape(self) -> ClusterShape:
        """The device grid the placement plan lays the roles on (valid after `validate`)."""
        from roll.platforms import get_platform

        platform = get_platform(self.platform)
        resource = platform.ray_resource if platform.is_accelerator else None
        return ClusterShape(self.num_nodes, self.devices_per_node or 1, self.cpus_per_device, resource)

    def roles(self) -> dict[str, WorkerConfig]:
        """The configured roles by name, in declaration order (roles set to null are left out).

        A mapping of roles (such as `rewards: {math: ..., code: ...}`) gives one role per entry,
        named `rewards.math`.
        """
        roles: dict[str, WorkerConfig] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if isinstance(value, WorkerConfig):
                roles[f.name] = value
            elif isinstance(value, dict):
                roles.update({f"{f.name}.{k}": v for k, v in value.items() if isinstance(v, WorkerConfig)})
        return roles

    def batch_plan(self) -> list[str]:
        """How one step's batch divides over the roles (for a dry run); pipelines with batches override it."""
        return []

    def sequence_lengths(self) -> tuple[int, int, int | None]:
        """Prompt tokens, response tokens and prompts per generation call of a step (None: per-rank batches).

        The dry run's memory estimate sizes activations and KV caches with them.
        """
        return 0, 0, None

    def rank_breakdown(self, name: str, role: WorkerConfig, platform: str) -> RankBreakdown | None:
        """What one rank of role `name` holds, when this pipeline counts it itself (a model the decoder arithmetic of
        `dry_run.backend_ranks` cannot count); None: the dry run counts it from the model's config.json."""
        return None

    def validate(self) -> None:
        """Resolve defaults that depend on the machine, check every role and fetch the models named by hub id; raise
        ConfigError."""
        from roll.platforms import PLATFORM_ENV, current_platform, detect_platform

        if self.platform == "auto":
            self.platform = detect_platform().name
        # Backends' checks ask current_platform() (e.g. whether a CPU computes fp16): the configured one, as
        # the workers will see it.
        os.environ[PLATFORM_ENV] = self.platform
        current_platform.cache_clear()
        if self.devices_per_node is None:
            self.devices_per_node = self._local_device_count()
        self.run_dir = self.run_dir or str(Path(self.output_dir) / self.exp_name)
        for setting, path in self.written_dirs().items():
            check_writable(setting, path)
        for name, package in missing_packages(self.trackers).items():
            raise ConfigError(
                f"tracker={name} needs the {package} package, which is not installed: pip install {package} "
                f"(or remove {name} from tracker)"
            )
        shape = self.cluster_shape()
        for name, role in self.roles().items():
            role.resolve(name, self.total_devices)
            rank_placements(name, role.devices, role.num_devices_per_worker, shape)
            try:
                resolve_worker_cls(role.worker_cls)
            except ValueError as exc:  # its message starts with "worker_cls"
                raise ConfigError(f"{name}.{exc}") from exc
            check_role_arguments(role)
            check_strategy_args(role)
        self.resolve_hub_models()

    def resolve_hub_models(self) -> None:
        """Fetch every model named by hub id (`org/name[@revision]`) now, in the driver, and put its local snapshot
        directory in the setting: workers then open local files only (roll/models/hub.py). An error names `pretrain`
        when the value is the one `pretrain` gives."""
        pretrain = getattr(self, "pretrain", "")
        warm_start = getattr(self, "warm_start", None)  # the diffusion pipeline's: it writes the actor's model itself
        written = warm_start.output_dir if warm_start is not None and warm_start.base_model else None
        settings = [
            (f"{name}.model_args.model_name_or_path", role.model_args, "model_name_or_path")
            for name, role in self.roles().items()
        ]
        if warm_start is not None:
            settings.append(("warm_start.base_model", warm_start, "base_model"))
        resolved: dict[str, str] = {}
        for setting, owner, attribute in settings:
            value = getattr(owner, attribute)
            if value and value != written and value not in resolved:
                resolved[value] = resolve_model_id(value, "pretrain" if value == pretrain else setting)
            setattr(owner, attribute, resolved.get(value, value))

    def written_dirs(self) -> dict[str, str]:
        """The directories the run writes to, by setting: output_dir, run_dir and the export directory if any."""
        dirs = {"output_dir": self.output_dir, "run_dir": self.run_dir}
        export = getattr(self, "model_export_dir", None)  # the pipelines that export a model
        return dirs | ({"export_dir": export} if export else {})

    def _local_device_count(self) -> int:
        from roll.platforms import current_platform, get_platform

        platform = current_platform() if self.platform == "auto" else get_platform(self.platform)
        if platform.is_accelerator:
            return platform.device_count()
        return max(1, (os.cpu_count() or 1) // self.cpus_per_device)

    def check_divisible(self, field_name: str, value: int, role: WorkerConfig) -> None:
        """Raise ConfigError unless batch size `value` splits evenly over `role`'s data-parallel ranks."""
        if value % role.dp_size:
            raise ConfigError(
                f"{field_name}={value} does not divide by {role.name}'s data-parallel size {role.dp_size}; "
                f"set {field_name} to a multiple of {role.dp_size} or change {role.name}.device_mapping"
            )

    def check_models(self, roles: Iterable[WorkerConfig]) -> dict[str, ModelFacts]:
        """Each role's model directory exists and parses (tiny:// references: their spec parses); sizes by role name."""
        by_path: dict[str, ModelFacts] = {}
        facts: dict[str, ModelFacts] = {}
        for role in roles:
            field_name, value = f"{role.name}.model_args.model_name_or_path", role.model_args.model_name_or_path
            if not value:
                raise ConfigError(
                    f"{field_name} is empty: set it to a local Hugging Face model directory, a hub id (org/name) or "
                    "a tiny:// reference such as tiny://qwen2"
                )
            if value in by_path:
                pass
            elif value.startswith(TINY_SCHEME):
                # The run builds a tiny:// model when it starts; its spec alone gives the sizes (a dry run of a
                # large spec would otherwise write gigabytes first).
                try:
                    by_path[value] = tiny_shape(value).facts
                except ValueError as exc:
                    raise ConfigError(f"{field_name}: {exc}") from exc
            else:
                by_path[value] = read_model_dir(value, field_name, value)
            facts[role.name] = by_path[value]
        return facts

    def check_lengths(self, facts: dict[str, ModelFacts], tokens: int, spelled_out: str) -> None:
        """A sequence of `tokens` (prompt + response, `spelled_out` by field) fits every model and token budget."""
        for role in self.roles().values():
            role.resolve_token_budget(tokens, spelled_out)
        for name, model in facts.items():
            if model.max_positions is not None and tokens > model.max_positions:
                raise ConfigError(
                    f"{spelled_out} = {tokens} tokens is more than {name}.model_args.model_name_or_path's "
                    f"max_position_embeddings={model.max_positions}; lower them"
                )

    def check_data(
        self,
        data: DataArguments,
        batch_size: int,
        batch_field: str,
        tokenizer_path: str,
        max_response_length: int | None = None,
    ) -> tuple[Sequence[object], Sequence[object]]:
        """The data read as the pipeline reads it, with `tokenizer_path`'s tokenizer (the data files, or the built-in
        task: its rows, chat template and lengths), and training holds one batch of `batch_field`; return (train,
        eval)."""
        # Imported here: `datasets` takes seconds to import, and only validation and the driver read data.
        from roll.datasets.prompt_dataset import load_splits
        from roll.models.processors import processor_for

        # A vision-language model's images are opened and checked against the limits here, before any worker starts.
        processor = processor_for(tokenizer_path)
        train, held_out = load_splits(data, checked_tokenizer(tokenizer_path), max_response_length, processor)
        if batch_size > len(train):
            source = f"data.train_file={data.train_file!r}" if data.train_file else "the built-in arithmetic task"
            raise ConfigError(
                f"{batch_field}={batch_size} is more than the {len(train)} training problems of {source}; "
                f"lower {batch_field} or add problems"
            )
        if data.domain_weights:
            check_domain_mix(data.domain_weights, Counter(e.domain for e in train), batch_size, batch_field)
        return train, held_out

    def check_generation_memory(
        self, role: WorkerConfig, model: ModelFacts, prompts: int, samples: int, tokens: int, lower: str
    ) -> None:
        """Refuse a generation whose KV cache clearly cannot fit in the host memory of a CPU node.

        `prompts` are split over the role's data-parallel ranks and generated `infer_batch_size` at a
        time, each with `samples` sequences of up to `tokens`. vLLM and SGLang bound their own cache
        and queue what does not fit; on accelerators the cache is in device memory, not checked here.
        """
        per_token = model.kv_bytes_per_token(role.model_args.dtype)
        if self.platform != "cpu" or per_token is None or role.strategy_args is None:
            return
        if issubclass(strategy_class(role.strategy_args.strategy_name), EngineStrategy):
            return
        workers = self._busiest_node_workers(role)
        per_worker = min(role.infer_batch_size, math.ceil(prompts / role.dp_size))
        needed = workers * per_worker * samples * tokens * per_token
        total = psutil.virtual_memory().total
        if needed > total:
            raise ConfigError(
                f"{role.name} would hold about {needed / 2**30:.1f} GiB of KV cache while generating ({workers} "
                f"workers x {per_worker} prompts x {samples} samples x {tokens} tokens x {per_token} bytes), more "
                f"than this machine's {total / 2**30:.1f} GiB of memory; lower {lower}"
            )

    def _busiest_node_workers(self, role: WorkerConfig) -> int:
        if not role.devices:
            return role.dp_size
        first_devices = role.devices[:: role.num_devices_per_worker]
        return max(Counter(d // self.devices_per_node for d in first_devices).values())


def checked_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    """`model_path`'s tokenizer, for the checks that need it (a tiny:// model is not built for it); a ConfigError
    with the reason when it does not load."""
    try:
        tokenizer = peek_tokenizer(model_path)
    except Exception as exc:  # transformers raises many types; the user needs the reason
        raise ConfigError(f"the tokenizer of {model_path!r} does not load: {exception_line(exc)}") from exc
    if tokenizer.eos_token_id is None:
        raise ConfigError(f"the tokenizer of {model_path!r} has no EOS token, which ends every training response")
    return tokenizer


def check_domain_mix(weights: dict[str, float], rows: Counter[str], batch_size: int, batch_field: str) -> None:
    """`data.domain_weights` names exactly the training data's domains and gives each enough rows of a batch."""
    from roll.datasets.prompt_dataset import domain_counts

    if set(weights) != set(rows):
        raise ConfigError(
            f"data.domain_weights names domain(s) {sorted(weights)} but the training data has {sorted(rows)}; "
            "give a weight to each domain of the data, and to no other"
        )
    try:
        counts = domain_counts(batch_size, weights)
    except ValueError as exc:
        raise ConfigError(f"data.domain_weights: {exc} ({batch_field}); raise its weight or {batch_field}") from exc
    short = {domain: rows[domain] for domain, count in counts.items() if rows[domain] < count}
    if short:
        raise ConfigError(
            f"data.domain_weights asks for {counts} rows per batch but the data has only {short}; "
            f"lower those weights or {batch_field}, or add rows"
        )


def check_role_arguments(role: WorkerConfig) -> None:
    """Relations between one role's own fields; raise ConfigError naming the field and the fix."""
    where = role.name
    generating = role.generating_args
    if generating.do_sample and generating.temperature == 0:
        raise ConfigError(
            f"{where}.generating_args.temperature=0 samples greedily: set {where}.generating_args.do_sample=false "
            "for greedy decoding, or a temperature > 0 to sample"
        )
    if generating.do_sample and generating.top_k == 1:
        raise ConfigError(
            f"{where}.generating_args.top_k=1 samples greedily: set {where}.generating_args.do_sample=false "
            "for greedy decoding, or top_k > 1 (-1 for all tokens)"
        )
    training = role.training_args
    if training.max_steps and training.warmup_steps > training.max_steps:
        raise ConfigError(
            f"{where}.training_args.warmup_steps={training.warmup_steps} is more than "
            f"{where}.training_args.max_steps={training.max_steps}, the steps the schedule spans; lower warmup_steps"
        )
    strategy = role.strategy_args
    if strategy is not None and strategy.offload_device == "nvme" and not strategy.offload_dir:
        raise ConfigError(
            f"{where}.strategy_args.offload_device=nvme needs {where}.strategy_args.offload_dir, a directory "
            "for the offloaded states"
        )
