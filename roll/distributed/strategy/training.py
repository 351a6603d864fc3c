"""What the training backends (DeepSpeed, FSDP2) share: seeding, the optimizer's parameter groups, the shape of an
optimizer step, collectives over the role's ranks, the config-time checks of the training arguments and the
Hugging Face export written from gathered weights."""

from __future__ import annotations

import copy
import os
import random
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch

from roll.configs.schema import ConfigError
from roll.configs.worker_config import TrainingArguments, WorkerConfig
from roll.models.hf_weights import is_peft_model
from roll.platforms import current_platform


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def adamw_groups(model: torch.nn.Module, args: TrainingArguments) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """AdamW's parameter groups (no weight decay on biases and norms) and its hyper-parameters from `args`."""
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        if param.requires_grad:
            (no_decay if param.ndim < 2 or "norm" in name.lower() else decay).append(param)
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    hyper = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    return groups, hyper


def rows_per_step(worker_config: WorkerConfig, rows: int) -> tuple[int, int]:
    """(micro batch, accumulation) of the role; ValueError when `rows` is not a whole number of optimizer steps."""
    args = worker_config.training_args
    micro, accumulation = args.per_device_train_batch_size, args.gradient_accumulation_steps
    if rows % (micro * accumulation):
        raise ValueError(
            f"{worker_config.name}: a shard of {rows} rows is not a whole number of optimizer "
            f"steps of {micro} (per_device_train_batch_size) x {accumulation} (gradient_accumulation_steps)"
        )
    return micro, accumulation


def enable_gradient_checkpointing(model: torch.nn.Module) -> None:
    """Recompute each decoder layer's activations in backward (non-reentrant: FSDP2 and ZeRO-3 need it)."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if hasattr(model, "enable_input_require_grads"):
        model.enable_input_require_grads()  # frozen embeddings (LoRA) still need grads to flow


def mean_over_ranks(metrics: dict[str, float], world_size: int, device: torch.device) -> dict[str, float]:
    """`metrics` averaged over every rank of the default group, so every rank reports the global value."""
    keys = sorted(metrics)
    values = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(values)
    return {k: v / world_size for k, v in zip(keys, values.tolist(), strict=True)}


def write_hf_export(
    model: torch.nn.Module, weights: Iterable[tuple[str, torch.Tensor]], rank: int, output_dir: str
) -> str:
    """Rank 0 writes a Hugging Face directory of `model`'s config with `weights` (which every rank iterates: they
    may be gathered collectively); the other ranks wait for it."""
    state_dict = {}
    for name, tensor in weights:
        if rank == 0:
            state_dict[name] = tensor.cpu()
    if rank == 0:
        os.makedirs(output_dir, exist_ok=True)
        plain = model.get_base_model() if is_peft_model(model) else model
        plain.save_pretrained(output_dir, state_dict=state_dict, safe_serialization=True)
        stored = {tensor.dtype for tensor in state_dict.values() if tensor.is_floating_point()}
        recorded = getattr(plain.config, "dtype", None)  # a diffusers pipeline's config records none
        if len(stored) == 1 and recorded is not None and recorded != (dtype := stored.pop()):
            # config.json records the module's dtype; FSDP2's module holds fp32 shards while bf16 weights are stored.
            config = copy.deepcopy(plain.config)
            config.dtype = dtype
            config.save_pretrained(output_dir)
    torch.distributed.barrier()
    return output_dir


def check_dtype_supported(worker_config: WorkerConfig, precision: str, field: str = "") -> None:
    """Raise ConfigError when the run's devices cannot compute in `precision` (fp16, bf16), naming `field` (by
    default the role's `model_args.dtype`).

    The platform answers for its own devices: CPU features are checked only when the run's platform is the CPU
    (a CPU without AVX512-FP16/AMX-FP16 has no fp16 kernels; one without AVX512-BF16/AMX none for bf16).
    """
    platform = current_platform()
    reason = platform.dtype_unsupported_reason(precision) if precision in ("fp16", "bf16") else ""
    if reason:
        device = "device" if platform.is_accelerator else "CPU"
        others = " or ".join(d for d in ("bf16", "fp32", "fp16") if d != precision and platform.supports_dtype(d))
        field = field or f"{worker_config.name}.model_args.dtype"
        raise ConfigError(f"{field}={precision} is not supported on this {device} ({reason}); use {others}")


def check_schedule(worker_config: WorkerConfig) -> None:
    """A decaying LR schedule knows the optimizer steps it decays over."""
    args = worker_config.training_args
    if args.lr_scheduler_type != "constant" and args.max_steps < 1:
        raise ConfigError(
            f"{worker_config.name}.training_args.lr_scheduler_type={args.lr_scheduler_type} needs "
            f"{worker_config.name}.training_args.max_steps (the number of optimizer steps it decays over)"
        )
