"""The `strategy_config` block of an `fsdp2_train` role (`examples/config/fsdp2*.yaml`), as a typed schema.

The micro batch, accumulation, clipping, learning rate and schedule, activation checkpointing and the model's
dtype come from the role's `training_args` and `model_args`, as they do for DeepSpeed: the block holds only what
FSDP2 adds. The checks that need the torch in use or the role's rank count are the backend's `check_config`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from roll.configs.schema import check

# Keys of a DeepSpeed block that mean nothing to FSDP2, with where their setting lives for an fsdp2_train role.
DEEPSPEED_ONLY_KEYS = {
    "zero_optimization": "FSDP2 shards parameters, gradients and optimizer states like ZeRO-3 (shard_size)",
    "train_batch_size": "set training_args.per_device_train_batch_size and gradient_accumulation_steps",
    "train_micro_batch_size_per_gpu": "set training_args.per_device_train_batch_size",
    "gradient_accumulation_steps": "set training_args.gradient_accumulation_steps",
    "gradient_clipping": "set training_args.max_grad_norm",
    "bf16": "set model_args.dtype (and param_dtype)",
    "fp16": "FSDP2 in roll trains in bf16 or fp32: set model_args.dtype",
    "tensor_parallel": "FSDP2 in roll shards over data-parallel ranks only",
    "offload_optimizer": "set cpu_offload: true",
    "offload_param": "set cpu_offload: true",
    "steps_per_print": "roll logs its own metrics",
    "wall_clock_breakdown": "roll times its own phases",
}


@dataclass
class FSDP2Config:
    """How `fully_shard` wraps each decoder layer and the root module of an `fsdp2_train` role.

    `shard_size` ranks hold one copy of the model between them (0: all the role's ranks); fewer make a
    replicate x shard mesh (HSDP). `param_dtype` is what forward and backward compute in (`auto`: the role's
    `model_args.dtype`) while the sharded parameters and the optimizer stay in fp32; gradients are reduced in
    `reduce_dtype`. `cpu_offload` keeps the sharded parameters, gradients and optimizer states in host memory
    (torch's `CPUOffloadPolicy`; the optimizer steps on the CPU).
    """

    shard_size: int = field(default=0, metadata=check(ge=0, hint="0 shards over every rank of the role"))
    reshard_after_forward: bool = True
    param_dtype: Literal["auto", "fp32", "bf16"] = "auto"
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    cpu_offload: bool = False
