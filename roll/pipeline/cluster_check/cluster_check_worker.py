"""A worker that exercises what every real role relies on: collectives and DataProto dispatch."""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from roll.distributed.executor.worker import Worker
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto


class ClusterCheckWorker(Worker):
    """Joins its role's process group, all-reduces, and scores DataProto shards."""

    @register(Dispatch.ONE_TO_ALL)
    def init_process_group(self) -> str:
        """Join the role's torch.distributed group over the platform's backend; return the backend."""
        if not dist.is_initialized():
            dist.init_process_group(
                backend=self.platform.dist_backend,
                store=self.rendezvous_store(),
                rank=self.rank,
                world_size=self.world_size,
                timeout=datetime.timedelta(seconds=120),
            )
        return dist.get_backend()

    @register(Dispatch.ONE_TO_ALL)
    def all_reduce_ranks(self) -> int:
        """Sum of every rank's index over the group: world * (world - 1) / 2 when all ranks take part."""
        value = torch.tensor([self.rank], dtype=torch.int64)
        dist.all_reduce(value)
        return int(value.item())

    @register(Dispatch.DP_COMPUTE)
    def score(self, batch: DataProto) -> DataProto:
        """Per-sample masked mean of `input_ids`, tagged with the data-parallel rank that computed it."""
        ids = batch.batch["input_ids"].float()
        mask = batch.batch["attention_mask"].float()
        mean = (ids * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        dp_rank = torch.full_like(mean, self.rank_info.dp_rank, dtype=torch.int64)
        return DataProto.from_dict(tensors={"score": mean, "dp_rank": dp_rank})

    @register(Dispatch.RANK0)
    def lead_rank(self) -> int:
        """The rank that answers RANK0 calls (always 0)."""
        return self.rank

    @register(Dispatch.ALL_TO_ALL)
    def double(self, value: int) -> int:
        """Twice this rank's own argument: each rank gets a different one."""
        return 2 * value

    @register(Dispatch.ONE_TO_ALL)
    def destroy_process_group(self) -> None:
        """Leave the process group before the actor is killed."""
        if dist.is_initialized():
            dist.destroy_process_group()
