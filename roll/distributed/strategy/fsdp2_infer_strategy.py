"""fsdp2_infer: a frozen model sharded by torch's FSDP2, for log-prob passes (a reference, old log-probs) and
generation, as deepspeed_infer serves them with ZeRO-3.

Each decoder layer and the root are under `fully_shard` over the role's mesh, from the same `${fsdp2}` or
`${fsdp2_cpuoffload}` block and helpers as fsdp2_train (`fsdp2_strategy.FSDP2Sharded`); the shards stay in the
role's `model_args.dtype` (no fp32 master copy: nothing trains), and a forward pass gathers one layer at a time.
It is a weight-sync target: every rank loads the full weights of each bucket and keeps its own slice of them.
FSDP2 itself is imported inside the methods that run it.
"""

from __future__ import annotations

import torch

from roll.configs.worker_config import WorkerConfig
from roll.distributed.strategy.fsdp2_strategy import FSDP2Sharded, _local, compute_dtype_name, parse_fsdp2_config
from roll.distributed.strategy.hf_compute import ShardedModelCompute
from roll.distributed.strategy.strategy import InferenceStrategy, ModelProvider
from roll.distributed.weight_sync.buckets import NamedTensors, spec_of
from roll.models.model_providers import dtype_from_name

BACKEND = "fsdp2_infer"


class FSDP2InferStrategy(FSDP2Sharded, ShardedModelCompute, InferenceStrategy):
    """A model in eval mode under `fully_shard`: forward passes and (ranks in step) generation, phase offloading of
    its parameter shards, and full weights loaded into them."""

    strategy_name = BACKEND
    weights_gathered_collectively = True  # a forward pass gathers each layer from every rank

    @classmethod
    def check_config(cls, worker_config: WorkerConfig) -> None:
        """The role's FSDP2 block and precision (see `parse_fsdp2_config`)."""
        parse_fsdp2_config(worker_config, BACKEND)

    def initialize(self, model_provider: ModelProvider) -> None:
        """Join the process group, load the model in the role's dtype and shard each decoder layer and the root."""
        self._join()
        model = model_provider().eval()
        self.weight_shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
        self.export_dtype = model.dtype
        model.requires_grad_(False)
        model.config.use_cache = True
        self._shard(model, dtype_from_name(compute_dtype_name(self.config, self.worker_config.model_args.dtype)))

    def load_weights(self, named_tensors: NamedTensors, share: bool = False) -> None:
        """Copy full weights by Hugging Face name into this rank's shards after checking every name and shape (`share`
        is not taken up: a shard is a slice of the weight, not the weight).

        No collective runs: each rank cuts its own slice from the full tensor, so the ranks may load at their own pace
        (every rank of the role still gets every bucket).
        """
        from torch.distributed.tensor import distribute_tensor

        self.check_weights([spec_of(name, tensor) for name, tensor in named_tensors])
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in named_tensors:
                param, local = params[name], _local(params[name])
                full = tensor.to(device=local.device, dtype=local.dtype)
                if hasattr(param, "device_mesh"):
                    # src_data_rank=None: the slice is cut here, not scattered from a rank.
                    full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                if full.shape != local.shape:  # copy_ would broadcast a wrong slice instead of failing
                    raise ValueError(f"{name}: slice {tuple(full.shape)} for a shard of {tuple(local.shape)}")
                local.copy_(full)
