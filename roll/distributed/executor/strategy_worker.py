"""A worker that holds one strategy: model life cycle (offload, checkpoints, export) and the worker side of weight sync.

Every method another process calls is `@register`-ed. The driver calls them through the Cluster
(`roll.distributed.executor.weight_syncer.WeightSyncer` for a sync); the one peer-to-peer call is a
training rank handing a bucket to an inference worker on its node (`receive_colocated_bucket`,
through `roll.distributed.weight_sync.colocated.hand_over`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import ray

from roll.distributed.executor.worker import Worker
from roll.distributed.executor.worker_host import HostedWorker
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.strategy.registry import strategy_class
from roll.distributed.weight_sync.broadcast import (
    DEFAULT_TIMEOUT_S,
    BroadcastGroup,
    SyncHeaders,
    host_store,
    open_store,
    receive_weights,
    send_weights,
)
from roll.distributed.weight_sync.buckets import NamedTensors, iter_buckets, tensor_bytes
from roll.distributed.weight_sync.colocated import SharedBucket, hand_over, open_bucket
from roll.distributed.weight_sync.plan import BROADCAST_SOURCE
from roll.models.model_providers import ModelKind, load_model, load_tokenizer
from roll.models.processors import processor_for

if TYPE_CHECKING:
    import torch.distributed


class StrategyWorker(Worker):
    """A worker owning one strategy over one model of `model_kind`."""

    model_kind: ModelKind = "causal_lm"

    @register(Dispatch.ONE_TO_ALL)
    def initialize(self) -> None:
        """Create the strategy named in the config and build the model inside it."""
        config = self.worker_config
        backend = strategy_class(config.strategy_args.strategy_name)
        self.tokenizer = load_tokenizer(config.model_args.model_name_or_path)
        self.strategy = backend(self)
        self.strategy.initialize(lambda: load_model(config.model_args, self.model_kind, trainable=backend.trains()))
        # As a broadcast source: the group, its headers and receiving group ranks, per target role.
        self.broadcast_sources: dict[str, tuple[BroadcastGroup, SyncHeaders, list[int]]] = {}
        # Stores hosted for groups still forming (host_broadcast_store -> open_broadcast_source), per target role.
        self.broadcast_stores: dict[str, torch.distributed.TCPStore] = {}
        # As a broadcast receiver: the group's headers and this worker's first group rank.
        self.sync_headers: SyncHeaders | None = None
        self.sync_rank = -1

    def close(self) -> None:
        """Shut the strategy down (engines and their processes, process groups)."""
        strategy = getattr(self, "strategy", None)
        if strategy is not None:
            strategy.shutdown()

    @register(Dispatch.ONE_TO_ALL)
    def offload_states(self) -> dict[str, float]:
        """Move this worker's model states off the device."""
        return self.strategy.offload_states()

    @register(Dispatch.ONE_TO_ALL)
    def load_states(self) -> dict[str, float]:
        """Bring this worker's model states back to the device."""
        return self.strategy.load_states()

    @register(Dispatch.ONE_TO_ALL)
    def offload_moves_states(self) -> bool:
        """Whether `offload_states` can move anything on this worker (see the strategy's)."""
        return self.strategy.offload_moves_states()

    @register(Dispatch.ONE_TO_ALL)
    def save_checkpoint(self, save_dir: str, tag: str) -> str:
        """A resumable checkpoint of a training strategy."""
        return self.strategy.save_checkpoint(save_dir, tag)

    @register(Dispatch.ONE_TO_ALL)
    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> str:
        """Resume a training strategy."""
        return self.strategy.load_checkpoint(load_dir, tag)

    @register(Dispatch.ONE_TO_ALL)
    def export_hf(self, output_dir: str, chat_template: str | None = None) -> str:
        """Write a Hugging Face model directory (and the tokenizer, or a vision-language model's whole processor),
        the tokenizer with `chat_template` instead of its own when given (the agent endpoint's layout)."""
        path = self.strategy.export_hf(output_dir)
        if self.rank == 0:
            processor = processor_for(self.worker_config.model_args.model_name_or_path)
            saved = processor or self.tokenizer
            if chat_template is not None:
                saved = copy.copy(saved)  # the worker's own tokenizer keeps its template
                saved.chat_template = chat_template
            saved.save_pretrained(path)
        return path

    # ---- weight sync ------------------------------------------------------------------------

    @register(Dispatch.RANK0)
    def weight_sync_shards(self) -> int:
        """Ranks each worker's engine takes in a weight-broadcast group (its tensor-parallel shards)."""
        return self.strategy.weight_sync_shards

    @register(Dispatch.RANK0)
    def host_broadcast_store(self, target: str) -> tuple[str, int]:
        """Start hosting the store of the group that will broadcast weights to role `target`; return this node's
        address and the store's port for the members to connect to."""
        self.broadcast_stores[target] = host_store()
        return ray.util.get_node_ip_address(), self.broadcast_stores[target].port

    @register(Dispatch.RANK0)
    def open_broadcast_source(self, target: str, world_size: int, receivers: list[int]) -> None:
        """Form the group that broadcasts weights to role `target` as its rank 0, over the store
        `host_broadcast_store` started, sending to group ranks `receivers`.

        A training rank may feed several roles, one group each.
        """
        device = self.platform.device_name(self.local_rank)
        store = self.broadcast_stores.pop(target)
        backend = self.platform.dist_backend
        group = BroadcastGroup("", store.port, BROADCAST_SOURCE, world_size, backend, device, store=store)
        self.broadcast_sources[target] = (group, SyncHeaders(group.store), receivers)

    @register(Dispatch.ALL_TO_ALL)
    def join_weight_broadcast(self, address: str, port: int, world_size: int, ranks: tuple[int, ...] | None) -> None:
        """Join a weight-broadcast group with `ranks` (one per engine shard); None: this worker is not a member."""
        if ranks is None:
            return
        self.sync_headers = SyncHeaders(open_store(address, port, is_master=False, timeout_s=DEFAULT_TIMEOUT_S))
        self.sync_rank = ranks[0]
        self.strategy.join_weight_broadcast(address, port, ranks, world_size, self.platform.dist_backend)

    @register(Dispatch.ALL_TO_ALL)
    def send_weights(
        self, bucket_bytes: int, colocated: list[ray.actor.ActorHandle], broadcast_to: str | None
    ) -> dict[str, int]:
        """Stream the full weights in buckets to `colocated` inference workers and to the group of role `broadcast_to`.

        Returns the bytes handed over on the node and the bytes broadcast.
        """
        totals = {"colocated_bytes": 0, "broadcast_bytes": 0}
        if not (colocated or broadcast_to or self.strategy.weights_gathered_collectively):
            return totals
        weights = self.strategy.iter_hf_weights()
        # A worker hosted by this very process (worker_host.py) loads from this rank's tensors directly.
        local = [target.local() if isinstance(target, HostedWorker) else None for target in colocated]
        remote = [target for target, worker in zip(colocated, local, strict=True) if worker is None]
        in_process = [worker for worker in local if worker is not None]
        share = bool(in_process) and self.strategy.yields_live_weights()
        buckets = hand_over(iter_buckets(weights, bucket_bytes), remote, totals, in_process, share)
        try:
            if broadcast_to:
                group, headers, receivers = self.broadcast_sources[broadcast_to]
                totals["broadcast_bytes"] = send_weights(headers, group, buckets, receivers)
            else:
                for _ in buckets:  # a rank without routes still takes part in ZeRO-3's gathers
                    pass
        except Exception:
            if self.strategy.weights_gathered_collectively:
                # The other training ranks are gathering the remaining weights: take part to the end so
                # that they finish (and report) instead of waiting in a collective this rank left.
                for _ in weights:
                    pass
            raise
        return totals

    @register(Dispatch.ONE_TO_ALL)
    def receive_colocated_bucket(self, shared: SharedBucket) -> int:
        """Load a bucket a training rank on this worker's device handed over; return its bytes."""
        return self.load_bucket(open_bucket(shared))

    def load_bucket(self, bucket: NamedTensors, share: bool = False) -> int:
        """Load a bucket of full weights (a training rank in this process calls it directly, with `share` when they
        are its live parameters: `InferenceStrategy.load_weights`); return its bytes."""
        self.strategy.load_weights(bucket, share=share)
        return sum(tensor_bytes(tensor) for _, tensor in bucket)

    @register(Dispatch.ONE_TO_ALL)
    def receive_weight_broadcast(self) -> int:
        """Receive one sync over the broadcast group (checked bucket by bucket); return the bytes loaded.

        A worker outside the group returns 0 at once.
        """
        if self.sync_headers is None:
            return 0
        return receive_weights(
            self.sync_headers, self.sync_rank, self.strategy.check_weights, self.strategy.receive_weight_bucket
        )
