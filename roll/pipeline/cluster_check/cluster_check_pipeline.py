"""The cluster check: start every role, prove collectives and batch dispatch work, report placement.

It is the quickest way to see that a Ray cluster, a device mapping and colocation work before a
real pipeline runs on them (`python examples/start_cluster_check.py ray_address=<head>:6379`).
"""

from __future__ import annotations

import logging
import time

import torch

from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.base.pipeline import BasePipeline
from roll.pipeline.cluster_check.cluster_check_config import ClusterCheckConfig

logger = logging.getLogger(__name__)


def make_check_batch(batch_size: int, sequence_length: int, seed: int) -> DataProto:
    """Random token ids with left padding of varying length, like a batch of prompts."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(1, 1000, (batch_size, sequence_length), generator=generator)
    pad = torch.randint(0, sequence_length // 2 + 1, (batch_size,), generator=generator)
    attention_mask = (torch.arange(sequence_length)[None, :] >= pad[:, None]).long()
    return DataProto.from_dict(
        tensors={"input_ids": input_ids * attention_mask, "attention_mask": attention_mask},
        non_tensors={"sample_id": [f"sample-{i}" for i in range(batch_size)]},
    )


def expected_scores(batch: DataProto) -> torch.Tensor:
    """What every worker must compute for `batch`, computed on the driver."""
    ids, mask = batch.batch["input_ids"].float(), batch.batch["attention_mask"].float()
    return (ids * mask).sum(-1) / mask.sum(-1).clamp(min=1)


class ClusterCheckPipeline(BasePipeline):
    """Starts `actor_train` (and `actor_infer` when configured), checks each, prints a report."""

    config: ClusterCheckConfig

    def run(self) -> dict[str, dict[str, object]]:
        """Run the checks; return per-role results and raise RuntimeError on any wrong answer."""
        report: dict[str, dict[str, object]] = {}
        for name in self.config.roles():
            started = time.perf_counter()
            cluster = self.start_cluster(name)
            placement = cluster.describe()
            backends = set(cluster.init_process_group())
            world = cluster.world_size
            sums = cluster.all_reduce_ranks()
            if sums != [world * (world - 1) // 2] * world:
                raise RuntimeError(f"{name}: all_reduce of rank ids gave {sums}")
            for round_index in range(self.config.rounds):
                batch = make_check_batch(self.config.batch_size, self.config.sequence_length, round_index)
                pending = cluster.score(batch, blocking=False)
                scores = pending.get(timeout=120)
                if not torch.allclose(scores.batch["score"], expected_scores(batch)):
                    raise RuntimeError(f"{name}: DP_COMPUTE scores differ from the driver's in round {round_index}")
            if cluster.lead_rank() != 0 or cluster.double(list(range(world))) != [2 * r for r in range(world)]:
                raise RuntimeError(f"{name}: RANK0 or ALL_TO_ALL dispatch returned wrong results")
            cluster.destroy_process_group()
            report[name] = {
                "workers": placement,
                "backend": ",".join(sorted(backends)),
                "dp_ranks_in_order": scores.batch["dp_rank"].tolist(),
                "seconds": round(time.perf_counter() - started, 2),
            }
            self._log_role(name, report[name])
        print(
            f"cluster check passed: {len(report)} role(s) on {self.config.total_devices} device(s)",
            flush=True,
        )
        return report

    def _log_role(self, name: str, result: dict[str, object]) -> None:
        lines = [f"role {name}: backend {result['backend']}, {result['seconds']} s"]
        for worker in result["workers"]:  # type: ignore[union-attr]
            lines.append(
                f"  rank {worker['rank']} on {worker['host']} pid {worker['pid']} device {worker['device']} "
                f"visible [{worker['visible_devices']}] threads {worker['threads']}"
            )
        print("\n".join(lines), flush=True)
