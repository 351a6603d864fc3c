"""Config of the cluster check: two roles and the batch that travels through them."""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.schema import check
from roll.configs.worker_config import WorkerConfig
from roll.pipeline.base.pipeline_config import EXP_NAME, PipelineConfig

CHECK_WORKER = "roll.pipeline.cluster_check.cluster_check_worker.ClusterCheckWorker"


@dataclass
class ClusterCheckConfig(PipelineConfig):
    """A training-like role and a colocated inference-like role; `batch_size` rows per round."""

    exp_name: str = field(default="cluster_check", metadata=check(EXP_NAME))
    batch_size: int = field(default=8, metadata=check(ge=1))
    sequence_length: int = field(default=16, metadata=check(ge=1))
    rounds: int = field(default=2, metadata=check(ge=1))
    actor_train: WorkerConfig = field(default_factory=lambda: WorkerConfig(worker_cls=CHECK_WORKER))
    actor_infer: WorkerConfig | None = None

    def validate(self) -> None:
        """Check the roles, then that the batch splits over every role's data-parallel ranks."""
        super().validate()
        for role in self.roles().values():
            self.check_divisible("batch_size", self.batch_size, role)
