"""fsdp2_train: a model sharded by torch's FSDP2 (`fully_shard` per decoder layer and at the root).

Parameters, gradients and optimizer states are sharded over a device mesh of the role's ranks (one dimension, or
replicate x shard when `shard_size` is below the rank count); forward and backward gather one layer at a time.
The block it reads is `roll.configs.fsdp2_config.FSDP2Config`; the optimizer, LR schedule, micro-batches and the
global-batch normalisation are DeepSpeed's (`training.py`, `hf_compute.py`, `micro_batches.py`), so the two
backends give the same losses on the same rows. With `model_args.lora_rank` > 0 the model provider's PEFT model is
what gets sharded: each adapter with the layer it adapts, the frozen base weights sharded all the same, AdamW over
the adapters only, and the export and weight sync send full weights with the adapters merged, as DeepSpeed does.
`FSDP2Sharded` is what it shares with fsdp2_infer (`fsdp2_infer_strategy.py`): the config check, the process group,
the sharding, phase offloading of the shards and the full weights gathered from them. FSDP2 itself is imported
inside the methods that run it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import torch

from roll.configs.fsdp2_config import DEEPSPEED_ONLY_KEYS, FSDP2Config
from roll.configs.schema import ConfigError, from_dict
from roll.configs.worker_config import WorkerConfig
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.fsdp2_offload import StateOffloader
from roll.distributed.strategy.hf_compute import ShardedModelCompute, optimizer_step_losses
from roll.distributed.strategy.lr_schedule import lr_lambda
from roll.distributed.strategy.micro_batches import DataParallel, token_budget
from roll.distributed.strategy.strategy import ForwardFunc, ModelProvider, StrategyHost, TrainStrategy
from roll.distributed.strategy.training import (
    adamw_groups,
    check_dtype_supported,
    check_schedule,
    enable_gradient_checkpointing,
    mean_over_ranks,
    rows_per_step,
    seed_everything,
    write_hf_export,
)
from roll.models.hf_weights import hf_named_weights
from roll.models.model_providers import dtype_from_name
from roll.utils.staged_checkpoint import (
    check_checkpoint_backend,
    resolve_checkpoint,
    restore_rng,
    staged_checkpoint,
)

BACKEND = "fsdp2_train"  # recorded in its checkpoints' marker: a DeepSpeed checkpoint is not loaded as one
# What each option of the block needs from torch.distributed.fsdp ("" : every block).
TORCH_FEATURES = {"": ("fully_shard", "MixedPrecisionPolicy", "OffloadPolicy"), "cpu_offload": ("CPUOffloadPolicy",)}


def parse_fsdp2_config(worker_config: WorkerConfig, backend: str = BACKEND) -> FSDP2Config:
    """The role's block as `FSDP2Config`; a ConfigError names a DeepSpeed-only key, a wrong value, a mesh that does
    not divide the role's ranks, a precision its devices lack or an option the torch in use does not have. For
    fsdp2_train (the `backend` checked for) also fp16 (no loss scaler) and an LR schedule without its step count; for
    fsdp2_infer `reshard_after_forward=false` (nothing would reshard) and LoRA."""
    training = backend == BACKEND
    role = worker_config.name
    where = f"{role}.strategy_args.strategy_config"
    block = dict(worker_config.strategy_args.strategy_config or {})
    for key in block:
        if key in DEEPSPEED_ONLY_KEYS:
            raise ConfigError(
                f"{where}.{key} is a DeepSpeed key, not an FSDP2 one ({DEEPSPEED_ONLY_KEYS[key]}); "
                "reference ${fsdp2} or ${fsdp2_cpuoffload}"
            )
    config = from_dict(FSDP2Config, block, where)
    world = worker_config.world_size or 1
    if world % (config.shard_size or world):
        raise ConfigError(
            f"{where}.shard_size={config.shard_size} does not divide {role}'s {world} rank(s); set it to a divisor "
            f"of {world} (0: all of them) or change {role}.device_mapping"
        )
    if not training and not config.reshard_after_forward:
        raise ConfigError(
            f"{where}.reshard_after_forward=false: {backend} runs no backward pass, which is where FSDP2 reshards, "
            "so every rank would keep the whole model gathered; leave it true"
        )
    if not training and worker_config.model_args.lora_rank:
        raise ConfigError(
            f"{role}.model_args.lora_rank={worker_config.model_args.lora_rank}: {backend} serves a frozen model, and "
            "LoRA adapters would rename its weights away from those the trainer syncs; set lora_rank=0"
        )
    dtype = worker_config.model_args.dtype
    if training and dtype == "fp16":
        raise ConfigError(
            f"{role}.model_args.dtype=fp16: fsdp2_train has no loss scaler; use bf16 (or fp32), or deepspeed_train"
        )
    explicit = f"{where}.param_dtype" if config.param_dtype != "auto" else ""  # else model_args.dtype is named
    check_dtype_supported(worker_config, compute_dtype_name(config, dtype), explicit)
    _check_torch_features(config, where, backend)
    if training:
        check_schedule(worker_config)
    return config


def compute_dtype_name(config: FSDP2Config, model_dtype: str) -> str:
    """The precision forward and backward run in: `param_dtype`, or the model's dtype for `auto`."""
    return model_dtype if config.param_dtype == "auto" else config.param_dtype


def _check_torch_features(config: FSDP2Config, where: str, backend: str) -> None:
    import torch.distributed.fsdp as fsdp

    for option, names in TORCH_FEATURES.items():
        if option and not getattr(config, option):
            continue
        missing = [name for name in names if not hasattr(fsdp, name)]
        if missing:
            field = f"{where}.{option}" if option else where.replace("strategy_config", f"strategy_name={backend}")
            raise ConfigError(
                f"{field}: torch {torch.__version__} has no torch.distributed.fsdp.{', '.join(missing)} "
                "(FSDP2 needs torch 2.6 or newer)"
            )


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor, or the tensor itself."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The model's repeated blocks, each sharded on its own: the classes transformers never splits across devices."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [module for module in model.modules() if type(module).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules) to shard by")
    return layers


class FSDP2Sharded:
    """What fsdp2_train and fsdp2_infer share: the role's process group, the model under `fully_shard` (each decoder
    layer, then the root) over the role's mesh, phase offloading of its shards and the full weights gathered from
    them. The backend sets `model` (through `_shard`) and `export_dtype`, and names the state kinds it offloads."""

    strategy_name: ClassVar[str]
    worker: StrategyHost
    worker_config: WorkerConfig
    config: FSDP2Config
    device: torch.device
    model: torch.nn.Module | None
    export_dtype: torch.dtype
    offloader: StateOffloader

    def _join(self) -> None:
        """Join the role's process group on this rank's device, seed, and read the block (`parse_fsdp2_config`)."""
        worker, platform = self.worker, self.worker.platform
        if not torch.distributed.is_initialized():
            torch.distributed.init_process_group(
                platform.dist_backend, store=worker.rendezvous_store(), rank=worker.rank, world_size=worker.world_size
            )
        platform.set_device(worker.local_rank)
        self.device = torch.device(platform.device_name(worker.local_rank))
        seed_everything(self.worker_config.training_args.seed)
        self.config = parse_fsdp2_config(self.worker_config, self.strategy_name)
        self.offloader = StateOffloader()

    def _shard(self, model: torch.nn.Module, compute: torch.dtype) -> None:
        """`fully_shard` each decoder layer of `model`, then its root, computing in `compute` over the parameters'
        own dtype (cast per layer by `MixedPrecisionPolicy`); `model` becomes `self.model`."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        stored = next(model.parameters()).dtype
        shard = {
            "mesh": self._device_mesh(),
            "reshard_after_forward": self.config.reshard_after_forward,
            "mp_policy": MixedPrecisionPolicy(
                param_dtype=None if compute == stored else compute,
                reduce_dtype=dtype_from_name(self.config.reduce_dtype),
            ),
            # Pinned host memory needs an accelerator; on a CPU platform the shards are host memory either way.
            "offload_policy": CPUOffloadPolicy(pin_memory=self.worker.platform.is_accelerator)
            if self.config.cpu_offload
            else OffloadPolicy(),
        }
        for layer in decoder_layers(model):
            fully_shard(layer, **shard)
        # The root unit is the Hugging Face model inside a PEFT one (which holds no parameters of its own): PEFT's
        # generate calls the inner model's, which would skip a PeftModel root's hooks and leave its weights sharded.
        fully_shard(model.get_base_model() if self.worker_config.model_args.lora_rank else model, **shard)
        self.model = model

    def _device_mesh(self) -> Any:
        """The role's ranks as one shard dimension, or (replicate, shard) when `shard_size` is below their count."""
        from torch.distributed.device_mesh import init_device_mesh

        world = self.worker.world_size
        shard = self.config.shard_size or world
        device_type = self.worker.platform.device_type
        if shard == world:
            return init_device_mesh(device_type, (world,), mesh_dim_names=("shard",))
        return init_device_mesh(device_type, (world // shard, shard), mesh_dim_names=("replicate", "shard"))

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        """The Hugging Face model (a PEFT model around it under LoRA), its layers and root under `fully_shard`."""
        return self.model

    def _offloadable_states(self) -> dict[str, list[torch.Tensor]]:
        """This rank's tensors that phase offloading moves, by state kind."""
        return {"model_params": [_local(p) for p in self.model.parameters()]}

    def offload_states(self, include: set[str] | None = None) -> dict[str, float]:
        """Move this rank's state shards (all kinds when `include` is None) off the device: to host memory, or with
        `offload_device=nvme` to a spill file under `offload_dir` (`fsdp2_offload.py`)."""
        if not self.offload_moves_states():
            return {}
        args = self.worker_config.strategy_args
        states = self._offloadable_states()
        states = {kind: tensors for kind, tensors in states.items() if include is None or kind in include}
        metrics = self.offloader.offload(states, args.offload_device, args.offload_dir)
        self.worker.platform.empty_cache()
        return metrics

    def load_states(self, include: set[str] | None = None) -> dict[str, float]:
        """Bring the offloaded states (all kinds when `include` is None) back to their device, bit for bit."""
        return self.offloader.reload(include) if self.offload_moves_states() else {}

    def offload_moves_states(self) -> bool:
        """On an accelerator (unless `cpu_offload` keeps the states in host memory already), and to NVMe anywhere;
        on a CPU platform offloading to host memory would move nothing."""
        if self.worker_config.strategy_args.offload_device == "nvme":
            return True
        return self.worker.platform.is_accelerator and not self.config.cpu_offload

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight in full by Hugging Face name, in the role's dtype, LoRA merged: each gathered from the ranks'
        shards (every rank must iterate to the end together) and copied, one tensor at a time."""
        # A LoRA layer's merge (W + scaling * B @ A) runs on the DTensor shards; its result is gathered like a weight.
        for name, tensor in hf_named_weights(self.model):
            full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
            yield name, full.detach().to(self.export_dtype, copy=True)

    def shutdown(self) -> None:
        """Drop the model and leave the process group, so another role can start in this process."""
        if hasattr(self, "offloader"):  # not when initialize failed before building it
            self.offloader.close()
        self.model = None
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()


class FSDP2TrainStrategy(FSDP2Sharded, ShardedModelCompute, TrainStrategy):
    """A model (or its LoRA adapters) under `fully_shard` with AdamW, the role's LR schedule, DCP checkpoints and
    full-weight export."""

    strategy_name = BACKEND

    @classmethod
    def check_config(cls, worker_config: WorkerConfig) -> None:
        """The role's FSDP2 block, precision and schedule (see `parse_fsdp2_config`)."""
        parse_fsdp2_config(worker_config)

    def initialize(self, model_provider: ModelProvider) -> None:
        """Join the process group, load the model (a PEFT model under LoRA), shard each decoder layer and the root,
        build the optimizer over the trainable parameters."""
        self._join()
        args = self.worker_config.training_args
        model = model_provider()
        self.weight_shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
        self.export_dtype = model.dtype  # what the role loads and exports in; the shards and AdamW keep fp32
        compute = dtype_from_name(compute_dtype_name(self.config, self.worker_config.model_args.dtype))
        model.float()  # the adapters too: MixedPrecisionPolicy casts every parameter of a layer to param_dtype alike
        if args.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        model.config.use_cache = False
        self._shard(model, compute)
        groups, hyper = adamw_groups(self.model, args)
        self.optimizer = torch.optim.AdamW(groups, **hyper)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lr_lambda(args))
        self.global_step = 0

    def train_step(self, batch: DataProto, loss_func: ForwardFunc) -> dict[str, float]:
        """One optimizer step per `per_device_train_batch_size` x `gradient_accumulation_steps` rows of `batch`.

        As deepspeed_train: the mean of a step's micro-batch losses is back-propagated, each micro-batch is told its
        step's counts over every rank (`step_normalised`), FSDP2 averages the gradients over the ranks, they are
        clipped to `max_grad_norm` and AdamW steps. Gradients are reduce-scattered after every micro-batch, as
        ZeRO-3 does, so a rank holds only its shard of them between micro-batches.
        """
        micro, accumulation = rows_per_step(self.worker_config, len(batch))
        self.model.train()
        budget = token_budget(self.worker_config)
        data_parallel = DataParallel(self.worker.world_size, None, self.device)
        sums: dict[str, float] = defaultdict(float)
        step_batches = batch.split(micro * accumulation)
        micro_count = 0
        for step_batch in step_batches:
            losses = optimizer_step_losses(
                self.model, step_batch, loss_func, micro, self.device, budget, self._agree_count, None, data_parallel
            )
            for loss, metrics, _ in losses:
                micro_count += 1
                loss.backward()
                sums["loss"] += loss.item()
                for key, value in metrics.items():
                    sums[key] += value.float().mean().item()
            sums["grad_norm"] += self._clip_gradients()
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=True)
            self.global_step += 1
        steps = len(step_batches)
        result = {k: v / (steps if k in ("grad_norm", "loss") else micro_count) for k, v in sums.items()}
        result = mean_over_ranks(result, self.worker.world_size, self.device)
        result["lr"] = self.scheduler.get_last_lr()[0]
        result["global_step"] = float(self.global_step)
        return result

    def _clip_gradients(self) -> float:
        """The global norm of the gradients before clipping them to `max_grad_norm` (0: not clipped)."""
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        if not grads:
            return math.nan
        max_norm = self.worker_config.training_args.max_grad_norm
        norm = torch.nn.utils.get_total_norm(grads)
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor over the mesh
        if max_norm > 0:
            # On each rank's shard: torch's clip_grads_with_norm_ left DTensor gradients unscaled (torch 2.13, gloo).
            scale = torch.clamp(max_norm / (norm + 1e-6), max=1.0)
            for grad in grads:
                _local(grad).mul_(scale.to(_local(grad).device))
        return norm.item()

    def _offloadable_states(self) -> dict[str, list[torch.Tensor]]:
        """The parameter shards, their gradients and AdamW's states."""
        params = list(self.model.parameters())
        return {
            "model_params": [_local(p) for p in params],
            "grads": [_local(p.grad) for p in params if p.grad is not None],
            "optimizer_states": [
                _local(value)
                for state in self.optimizer.state.values()
                for value in state.values()
                if isinstance(value, torch.Tensor)
            ],
        }

    def export_hf(self, output_dir: str) -> str:
        """Rank 0 writes a Hugging Face directory in the role's dtype from the gathered weights."""
        return write_hf_export(self.model, self.iter_hf_weights(), self.worker.rank, output_dir)

    def save_checkpoint(self, save_dir: str, tag: str) -> str:
        """Every rank writes its shards of the model and optimizer through torch.distributed.checkpoint, rank 0 the
        LR schedule and step; the checkpoint appears (and becomes `latest`) only when complete."""
        import torch.distributed.checkpoint as dcp

        meta = {"backend": BACKEND, "dp_size": self.worker.world_size}
        with staged_checkpoint(save_dir, tag, meta) as staging:
            dcp.save(self._sharded_state(), checkpoint_id=str(staging / "state"))
            if self.worker.rank == 0:
                trainer = {"scheduler": self.scheduler.state_dict(), "global_step": self.global_step}
                torch.save(trainer, staging / "trainer.pt")
        return str(Path(save_dir) / tag)

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> str:
        """Resume model, optimizer, schedule, step and RNG from a checkpoint of this backend (DCP reshards one
        written by another number of ranks)."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        path = resolve_checkpoint(load_dir, tag)
        check_checkpoint_backend(path, BACKEND)
        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(path / "state"))
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        trainer = torch.load(path / "trainer.pt", weights_only=False)
        self.scheduler.load_state_dict(trainer["scheduler"])
        self.global_step = int(trainer["global_step"])
        restore_rng(path, self.worker.rank)
        return str(path)

    def _sharded_state(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        return {"model": model_state, "optim": optim_state}

    def shutdown(self) -> None:
        """Drop the model and optimizer and leave the process group, so another role can start in this process."""
        self.optimizer = self.scheduler = None
        super().shutdown()
