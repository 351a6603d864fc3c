"""Config of the cluster check: two roles and the batch that travels through them."""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.schema import ConfigError
from roll.configs.worker_config import WorkerConfig
from roll.pipeline.base_config import PipelineConfig

CHECK_WORKER = "roll.pipeline.cluster_check.cluster_check_worker.ClusterCheckWorker"


@dataclass
class ClusterCheckConfig(PipelineConfig):
    """A training-like role and a colocated inference-like role; `batch_size` rows per round."""

    exp_name: str = "cluster_check"
    batch_size: int = 8
    sequence_length: int = 16
    rounds: int = 2
    actor_train: WorkerConfig = field(default_factory=lambda: WorkerConfig(worker_cls=CHECK_WORKER))
    actor_infer: WorkerConfig | None = None

    def validate(self) -> None:
        """Check the roles, then that the batch splits over every role's data-parallel ranks."""
        super().validate()
        if self.batch_size < 1 or self.sequence_length < 1 or self.rounds < 1:
            raise ConfigError("batch_size, sequence_length and rounds must be at least 1")
        for role in self.roles().values():
            self.check_divisible("batch_size", self.batch_size, role)
