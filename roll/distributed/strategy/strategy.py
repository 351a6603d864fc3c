"""The strategy contract: what every backend that owns a role's model must do.

A worker holds one strategy. Inference strategies run forward passes (log-probs, values, scores)
and generation; train strategies add optimisation, checkpoints and a stream of full weights for
syncing inference engines. Backends live one per file; each registers itself under its
`strategy_name` when its class is defined, and `roll.distributed.strategy.registry` finds it by name.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch

from roll.configs.worker_config import GeneratingArguments, WorkerConfig
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.rank_layout import RankInfo
from roll.distributed.strategy.response_scores import log_probs_forward, top_k_forward
from roll.distributed.weight_sync.broadcast import BroadcastGroup
from roll.distributed.weight_sync.buckets import NamedTensors, TensorSpec, tensor_bytes
from roll.models.hf_weights import check_weight_shapes
from roll.platforms import Platform

# model(...) output -> (loss, per-sample or scalar metrics). For forward_step the loss is ignored
# and each metric is a per-sample tensor; for train_step the loss is what is back-propagated: the
# strategy back-propagates the mean of an optimizer step's micro-batch losses, and the gradients are
# averaged over the data-parallel ranks. Under a token budget
# (`max_tokens_per_microbatch`) a micro-batch is narrower than the batch (padding trimmed), and its
# rows may be in another order (results are put back in the batch's order).
ForwardFunc = Callable[[DataProto, Any], tuple[torch.Tensor | None, dict[str, torch.Tensor]]]
# meta_info keys train_step sets on each micro-batch: what its optimizer step's losses divide by over every
# data-parallel rank (`micro_batches.step_counts`), how many micro-batches this rank's part of the step has,
# and how many data-parallel ranks average their gradients. A loss normalised over the whole global step
# (e.g. token-mean over all the step's tokens on every rank) uses them (`micro_batches.step_normalised`): the
# micro-batches of one step may differ in rows and tokens, and so may the ranks' parts of it.
STEP_COUNTS = "step_counts"
MICRO_BATCHES_IN_STEP = "micro_batches_in_step"
DATA_PARALLEL_SIZE = "data_parallel_size"
ModelProvider = Callable[[], torch.nn.Module]
# Every backend class by its strategy_name, filled as backend modules are imported.
REGISTERED_STRATEGIES: dict[str, type[InferenceStrategy]] = {}


@dataclass
class Generation:
    """What a strategy generated for a batch of prompts: `num_return_sequences` samples per prompt, prompt-major.

    `output_ids` `[B * n, prompt + max_new_tokens]`: each left-padded prompt row, then its sample's tokens,
    right-padded with the pad id the strategy generated with. `response_lengths` `[B * n]`: the tokens the
    engine sampled, the final EOS or stop-string token included. `truncated` `[B * n]` bool: the sample was
    cut at max_new_tokens (no EOS, no stop string). `log_probs` `[B * n, max_new_tokens]` (from
    `generate_with_log_probs` only): the engine's log-prob of each sampled token, 0 after the length.
    """

    output_ids: torch.Tensor
    response_lengths: torch.Tensor
    truncated: torch.Tensor
    log_probs: torch.Tensor | None = None


class StrategyHost(Protocol):
    """What a strategy reads from the worker that holds it (its role's config, its rank, its devices)."""

    worker_config: WorkerConfig
    rank: int
    world_size: int
    local_rank: int
    platform: Platform
    rank_info: RankInfo


class InferenceStrategy(ABC):
    """A backend that computes with a model it owns: forward passes and generation.

    A concrete subclass with a `strategy_name` is registered under that name: the name a role's
    `strategy_args.strategy_name` selects it by.
    """

    strategy_name: ClassVar[str] = ""
    # Ranks the backend takes in a weight-broadcast group: one per tensor-parallel shard of its engine.
    weight_sync_shards: int = 1

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        name = cls.__dict__.get("strategy_name")  # subclasses that do not name themselves are not backends
        if name:
            taken = REGISTERED_STRATEGIES.get(name)
            if taken is not None and taken.__qualname__ != cls.__qualname__:
                raise TypeError(f"strategy name {name!r} is taken by {taken.__qualname__}")
            REGISTERED_STRATEGIES[name] = cls

    @classmethod
    def trains(cls) -> bool:
        """Whether the backend optimises its model (its workers load it trainable)."""
        return issubclass(cls, TrainStrategy)

    @classmethod
    def model_parallel_size(cls, worker_config: WorkerConfig) -> int:
        """Ranks of the role that hold one model replica between them (1: every rank holds the whole model)."""
        return 1

    @classmethod
    def check_config(cls, worker_config: WorkerConfig) -> None:
        """Config-time check of the role's `strategy_config` (raise ConfigError naming the key); imports no engine."""

    @classmethod
    def fit_top_k(cls, worker_config: WorkerConfig, k: int) -> None:
        """Config time: let the role's backend return `k` top log-probs per position from `response_top_k` (a
        ConfigError naming the key when its config caps them lower). Forward passes have no cap."""

    def __init__(self, worker: StrategyHost) -> None:
        self.worker = worker
        self.worker_config = worker.worker_config
        self.weight_shapes: dict[str, tuple[int, ...]] = {}  # full shape of every weight a sync may send
        self.weight_group: BroadcastGroup | None = None

    @abstractmethod
    def initialize(self, model_provider: ModelProvider) -> None:
        """Build the model (through `model_provider`) and the backend around it."""

    @abstractmethod
    def forward_step(self, batch: DataProto, forward_func: ForwardFunc) -> dict[str, torch.Tensor]:
        """Run `forward_func` on micro-batches of `batch` without gradients; concatenate its metrics."""

    def response_log_probs(self, batch: DataProto) -> torch.Tensor:
        """The log-prob of each response token of `batch` `[B, R]` at the batch's log-prob temperature
        (`roll.distributed.strategy.response_scores`)."""
        return self.forward_step(batch, log_probs_forward)["log_probs"]

    def response_top_k(
        self, batch: DataProto, k: int, vocab_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The `k` most likely ids at each response position of `batch` and their log-probs, `[B, R, k]` each, most
        likely first; with `vocab_size` the softmax is over the first `vocab_size` ids only."""
        scores = self.forward_step(batch, top_k_forward(k, vocab_size))
        return scores["top_indices"], scores["top_log_probs"]

    @abstractmethod
    def generate(self, batch: DataProto, generating_args: GeneratingArguments) -> Generation:
        """The prompts' samples: ids with each sample's length and stop reason (see `Generation`)."""

    def offload_states(self, include: set[str] | None = None) -> dict[str, float]:
        """Move the backend's states off the device; return metrics with the bytes moved per state kind.

        Keys containing `/moved_bytes/` count bytes moved; a backend with nothing to move returns {}.
        """
        return {}

    def load_states(self, include: set[str] | None = None) -> dict[str, float]:
        """Bring offloaded states back to the device; return metrics as `offload_states` does."""
        return {}

    def offload_moves_states(self) -> bool:
        """Whether `offload_states` can move anything on this worker, for as long as it runs: a role whose offload
        never does is not called between phases. By default, whether the backend has an `offload_states` of its own."""
        return type(self).offload_states is not InferenceStrategy.offload_states

    def load_weights(self, named_tensors: NamedTensors, share: bool = False) -> None:
        """Copy full weights by Hugging Face name (any dtype) into the model in place.

        Every name and shape is checked (`check_weights`) before anything is copied. `share` says the tensors are a
        training role's own parameters in this process (`TrainStrategy.yields_live_weights`): a backend may then
        use them as its weights instead of copying them. By default it copies all the same.
        """
        raise NotImplementedError(f"{self.worker_config.name}: strategy {self.strategy_name!r} takes no weight syncs")

    def check_weights(self, specs: list[TensorSpec]) -> None:
        """Raise KeyError for a weight name the model lacks and ValueError for a wrong shape, naming it."""
        check_weight_shapes(((s.name, s.shape) for s in specs), self.weight_shapes, self.worker_config.name)

    def join_weight_broadcast(
        self, master_addr: str, master_port: int, ranks: tuple[int, ...], world_size: int, backend: str
    ) -> None:
        """Join the weight-broadcast group with `ranks` (one per shard); by default this process takes `ranks[0]`."""
        device = self.worker.platform.device_name(self.worker.local_rank)
        self.weight_group = BroadcastGroup(master_addr, master_port, ranks[0], world_size, backend, device)

    def receive_weight_bucket(self, specs: list[TensorSpec]) -> int:
        """Receive the announced bucket over the weight-broadcast group and load it; return its bytes."""
        bucket = self.weight_group.receive_bucket(specs)
        self.load_weights(bucket)
        return sum(tensor_bytes(tensor) for _, tensor in bucket)

    def shutdown(self) -> None:
        """Release the model and any process group or engine the backend started."""


class TrainStrategy(InferenceStrategy):
    """An inference strategy that also trains: optimizer, LR schedule, checkpoints, weight export."""

    # Whether every rank must run `iter_hf_weights` together (parameters gathered collectively).
    weights_gathered_collectively: bool = True

    @abstractmethod
    def train_step(self, batch: DataProto, loss_func: ForwardFunc) -> dict[str, float]:
        """Optimise on this rank's shard: micro-batches, accumulation, one or more optimizer steps."""

    @abstractmethod
    def save_checkpoint(self, save_dir: str, tag: str) -> str:
        """Write a resumable checkpoint `save_dir/tag` atomically; return its path."""

    @abstractmethod
    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> str:
        """Resume from `load_dir/tag` (the latest complete one when tag is None); return its path."""

    @abstractmethod
    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full parameters by Hugging Face name, one at a time, on every rank; valid until the model changes."""

    def yields_live_weights(self) -> bool:
        """Whether `iter_hf_weights` yields the parameters' own tensors, which each optimizer step updates in place
        and no phase moves off the device. An inference role in this process may then keep them as its weights
        (`load_weights(share=True)`) and the sync copies nothing."""
        return False

    @abstractmethod
    def export_hf(self, output_dir: str) -> str:
        """Save a plain Hugging Face model directory that transformers and vLLM load."""
