"""deepspeed_train and deepspeed_infer: a model owned by a DeepSpeed engine, ZeRO stage 0 to 3.

DeepSpeed is imported inside the methods that use it, so the strategy registry can look this backend
up (and check its config) without loading DeepSpeed.
"""

from __future__ import annotations

import functools
import math
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from roll.configs.worker_config import TrainingArguments, WorkerConfig
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.rank_layout import rank_layout
from roll.distributed.strategy.deepspeed_config import (
    check_infer_config,
    check_train_config,
    offloads_optimizer,
    resolve_deepspeed_config,
    tensor_parallel_size,
    zero_stage,
)
from roll.distributed.strategy.hf_compute import ShardedModelCompute, optimizer_step_losses
from roll.distributed.strategy.micro_batches import DataParallel, token_budget
from roll.distributed.strategy.strategy import (
    ForwardFunc,
    InferenceStrategy,
    ModelProvider,
    TrainStrategy,
)
from roll.distributed.strategy.training import (
    adamw_groups,
    enable_gradient_checkpointing,
    mean_over_ranks,
    rows_per_step,
    seed_everything,
    write_hf_export,
)
from roll.distributed.weight_sync.buckets import NamedTensors, spec_of
from roll.models.hf_weights import Gather, hf_named_weights
from roll.third_party.deepspeed import checkpoint as deepspeed_checkpoint
from roll.third_party.deepspeed.muon_import import import_muon_uncompiled
from roll.utils.console import prints_to_log, reapply_library_levels

if TYPE_CHECKING:
    import deepspeed


class DeepSpeedInferStrategy(ShardedModelCompute, InferenceStrategy):
    """A ZeRO-3 inference-only engine: parameters partitioned over ranks, gathered per forward."""

    strategy_name = "deepspeed_infer"
    training = False

    @classmethod
    def check_config(cls, worker_config: WorkerConfig) -> None:
        """The role's ZeRO block is valid for inference (stage 3 or none)."""
        check_infer_config(worker_config)

    def initialize(self, model_provider: ModelProvider) -> None:
        """Join the process group, build the model under ZeRO (partitioned at stage 3), wrap it."""
        import deepspeed
        from transformers.integrations import HfDeepSpeedConfig

        from roll.third_party.deepspeed.offload_states_patch import patch_engine
        from roll.third_party.deepspeed.state_fields import nvme_swapped_states

        reapply_library_levels()  # DeepSpeed's logger, made at WARNING on import: INFO again in a verbose run
        if not torch.distributed.is_initialized():
            # Over the store rank 0 already holds (Worker.open_rendezvous); DeepSpeed then adopts the group.
            torch.distributed.init_process_group(
                self.worker.platform.dist_backend,
                store=self.worker.rendezvous_store(),
                rank=self.worker.rank,
                world_size=self.worker.world_size,
            )
        with prints_to_log(__name__):  # the shared-memory op it loads on CPU, printed: detail for the log file
            deepspeed.init_distributed(dist_backend=self.worker.platform.dist_backend, dist_init_required=True)
        self.worker.platform.set_device(self.worker.local_rank)
        self.device = torch.device(self.worker.platform.device_name(self.worker.local_rank))
        seed_everything(self.worker_config.training_args.seed)
        self.ds_config = resolve_deepspeed_config(self.worker_config, training=self.training)
        self.zero_stage = zero_stage(self.ds_config)
        self.tp_size = tensor_parallel_size(self.ds_config)
        if self.tp_size > 1:
            self._join_tensor_parallel_layout()
        self.weights_gathered_collectively = self.zero_stage == 3 or self.tp_size > 1
        # transformers partitions weights while loading them as long as this object is alive. Not under AutoTP:
        # transformers 5.19 refuses to load a checkpoint while the DeepSpeed config has tensor_parallel ("Weight
        # conversions ... with DeepSpeed Tensor Parallelism are not yet implemented"), so each rank loads the
        # whole model and deepspeed.initialize shards it (AutoTP first, then ZeRO-3).
        partitions_on_load = self.zero_stage == 3 and self.tp_size == 1
        self._hf_ds_config = HfDeepSpeedConfig(self.ds_config) if partitions_on_load else None
        model = model_provider()
        # Read before the engine shards anything: ZeRO-3 leaves each parameter's full shape in ds_shape (its own
        # shape is the local partition's) and AutoTP replaces the layers it splits.
        self.weight_shapes = {
            name: tuple(getattr(p, "ds_shape", p.shape)) for name, p in model.named_parameters(remove_duplicate=False)
        }
        import_muon_uncompiled()  # before DeepSpeed imports it, compiling kernels no roll optimizer uses
        engine = self._build_engine(model)
        # ZeRO-Infinity: DeepSpeed's swapper keeps these states on NVMe and owns their buffers, so phase offloading
        # leaves the engine alone (offload_states and load_states move nothing).
        self.deepspeed_swaps = nvme_swapped_states(engine)
        self.engine = engine if self.deepspeed_swaps else patch_engine(engine)

    def _join_tensor_parallel_layout(self) -> None:
        """Take this rank's place in the dp x tp grid AutoTP builds: tensor-parallel ranks consecutive.

        DeepSpeed's mesh is (data_parallel, tensor_parallel) in row-major order, the order of
        `rank_layout`, so the cluster's DP_COMPUTE dispatch hands each tensor-parallel group one shard.
        """
        self.worker.rank_info = rank_layout(self.worker.world_size, self.tp_size)[self.worker.rank]
        # DeepSpeed 0.19 counts train_batch_size over every rank when it builds the engine but over the
        # data-parallel ranks when ZeRO-3 partitions the model; left out, it is derived from micro batch x
        # accumulation each time (resolve_deepspeed_config has checked the user's value).
        self.ds_config.pop("train_batch_size", None)

    def _build_engine(self, model: torch.nn.Module) -> deepspeed.DeepSpeedEngine:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=self.ds_config)
        engine.eval()
        return engine

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        """The Hugging Face model inside the engine."""
        return self.engine.module

    @property
    def forward_module(self) -> torch.nn.Module:
        """The engine: forward passes go through it (ZeRO-3's gathers are hooks on the module either way)."""
        return self.engine

    def offload_states(self, include: set[str] | None = None) -> dict[str, float]:
        """Move the engine's states (all kinds when `include` is None) to host memory or disk.

        On a CPU platform the states already live in host memory: offloading there would copy them and
        free nothing, so only `offload_device=nvme` moves anything (and frees host memory). Under ZeRO-Infinity
        (a ZeRO offload to nvme) DeepSpeed's own swapper holds the states on disk and nothing is moved.
        """
        strategy_args = self.worker_config.strategy_args
        if self._offload_is_a_no_op():
            return {}
        report = self.engine.offload_states(
            include=include, device=strategy_args.offload_device, nvme_dir=strategy_args.offload_dir or None
        )
        return report.as_metrics()

    def load_states(self, include: set[str] | None = None) -> dict[str, float]:
        """Bring offloaded states back to the device."""
        if self._offload_is_a_no_op():
            return {}
        return self.engine.reload_states(include=include).as_metrics()

    def offload_moves_states(self) -> bool:
        """False on a CPU platform offloading to host memory, and under ZeRO-Infinity (see `offload_states`)."""
        return not self._offload_is_a_no_op()

    def _offload_is_a_no_op(self) -> bool:
        on_host = not self.worker.platform.is_accelerator and self.worker_config.strategy_args.offload_device == "cpu"
        return on_host or bool(self.deepspeed_swaps)

    def load_weights(self, named_tensors: NamedTensors, share: bool = False) -> None:
        """Copy full weights by Hugging Face name into the model after checking every name and shape (`share` is
        not taken up: an engine's parameters are views into its own flat buffers).

        At ZeRO-3 every rank of the role must load the same buckets together: each parameter is
        gathered, overwritten with the full tensor and partitioned again.
        """
        if self.tp_size > 1:
            raise NotImplementedError(
                f"{self.worker_config.name}: loading synced weights into AutoTP shards is not supported; "
                "weights flow from a tensor-parallel training role, not into it"
            )
        self.check_weights([spec_of(name, tensor) for name, tensor in named_tensors])
        import deepspeed

        params = dict(self.unwrapped_model.named_parameters(remove_duplicate=False))
        for name, tensor in named_tensors:
            param = params[name]
            gathered = deepspeed.zero.GatheredParameters([param], modifier_rank=0, enabled=self.zero_stage == 3)
            with gathered, torch.no_grad():
                param.data.copy_(tensor.to(device=param.device, dtype=param.dtype))

    def yields_live_weights(self) -> bool:
        """True below ZeRO-3, without AutoTP or LoRA (the weights are then the parameters themselves, not gathered
        or merged copies), while offloading moves nothing (a CPU platform offloading to host memory)."""
        lora = self.worker_config.model_args.lora_rank > 0
        return not (self.weights_gathered_collectively or lora or self.offload_moves_states())

    def iter_hf_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Every weight in full by Hugging Face name, LoRA merged, on all ranks.

        At stage 3, and under AutoTP, parameters are gathered a group at a time (over the data-parallel
        ranks, then the tensor-parallel shards) and copied; otherwise the tensors are the parameters
        themselves, valid until the next optimizer step.
        """
        yield from hf_named_weights(self.unwrapped_model, self._weight_gather())

    def _weight_gather(self) -> Gather | None:
        if self.tp_size > 1:
            from roll.third_party.deepspeed.autotp import gathered_parameters

            return functools.partial(gathered_parameters, zero3=self.zero_stage == 3)
        if self.zero_stage == 3:
            import deepspeed

            return deepspeed.zero.GatheredParameters
        return None

    def shutdown(self) -> None:
        """Destroy the engine, leave the process group and reset the process-wide state the engine set up
        (transformers' ZeRO-3 loading, DeepSpeed's groups, counters and caches), so another role can start in this
        process as in a new one."""
        import deepspeed
        from transformers.integrations import unset_hf_deepspeed_config

        from roll.third_party.deepspeed.process_state import reset_after_engine

        self.engine.destroy()
        if self._hf_ds_config is not None:
            unset_hf_deepspeed_config()
            self._hf_ds_config = None
        if torch.distributed.is_initialized():
            # DeepSpeed's own call also drops the groups it caches, which would outlive the destroyed group.
            deepspeed.comm.destroy_process_group()
        reset_after_engine(self.engine.module)
        self.engine = None


class DeepSpeedTrainStrategy(DeepSpeedInferStrategy, TrainStrategy):
    """A training engine: ZeRO 0-3, optional CPU/NVMe offload, LR schedule, checkpoints, HF export."""

    strategy_name = "deepspeed_train"
    training = True

    @classmethod
    def check_config(cls, worker_config: WorkerConfig) -> None:
        """The role's ZeRO block and training arguments fit together."""
        check_train_config(worker_config)

    @classmethod
    def model_parallel_size(cls, worker_config: WorkerConfig) -> int:
        """AutoTP's `tensor_parallel.autotp_size` (1 without it): the ranks that share one model replica."""
        return tensor_parallel_size(worker_config.strategy_args.strategy_config)

    def _build_engine(self, model: torch.nn.Module) -> deepspeed.DeepSpeedEngine:
        import deepspeed

        from roll.distributed.strategy.lr_schedule import lr_lambda

        args = self.worker_config.training_args
        if args.gradient_checkpointing:
            enable_gradient_checkpointing(model)
        model.config.use_cache = False
        optimizer = self._make_optimizer(model, args)
        # A factory, so the schedule drives the optimizer DeepSpeed wraps (ZeRO regroups parameters).
        engine, *_ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=lambda wrapped: torch.optim.lr_scheduler.LambdaLR(wrapped, lr_lambda(args)),
            config=self.ds_config,
        )
        if engine.zero_optimization_stage() == 0 and self.worker.rank_info.dp_size == 1:
            # Alone in its data-parallel group, a rank has nothing to average its gradients with, yet DeepSpeed's
            # stage-0 all-reduce still flattens them into buckets of up to 5e8 elements: a whole extra copy of the
            # gradients (2 GB at 0.5B parameters in fp32) at every optimizer step.
            engine.enable_backward_allreduce = False
        self.global_step = 0
        return engine

    def _make_optimizer(self, model: torch.nn.Module, args: TrainingArguments) -> torch.optim.Optimizer:
        groups, hyper = adamw_groups(model, args)
        if offloads_optimizer(self.ds_config):
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, adamw_mode=True, **hyper)
        if self.worker.platform.device_type == "cuda":
            from deepspeed.ops.adam import FusedAdam

            return FusedAdam(groups, adam_w_mode=True, **hyper)
        return torch.optim.AdamW(groups, **hyper)

    def train_step(self, batch: DataProto, loss_func: ForwardFunc) -> dict[str, float]:
        """One optimizer step per `per_device_train_batch_size` x `gradient_accumulation_steps` rows of `batch`.

        Micro-batches are `per_device_train_batch_size` rows, or formed by the token budget within each
        step (so the optimizer steps the same number of times); the mean of a step's micro-batch losses
        is back-propagated and the engine averages the gradients over the data-parallel ranks. Each
        micro-batch is told its step's counts summed over those ranks (the engine's data-parallel group:
        under AutoTP not every rank), so a loss normalises over the global step (`step_normalised`).
        """
        micro, accumulation = rows_per_step(self.worker_config, len(batch))
        self.engine.train()
        budget = token_budget(self.worker_config)
        data_parallel = DataParallel(self.engine.dp_world_size, self.engine.data_parallel_group, self.device)
        sums: dict[str, float] = defaultdict(float)
        step_batches = batch.split(micro * accumulation)
        micro_count = 0
        for step_batch in step_batches:
            losses = optimizer_step_losses(
                self.engine,
                step_batch,
                loss_func,
                micro,
                self.device,
                budget,
                self._agree_count,
                self.engine.set_gradient_accumulation_boundary,
                data_parallel,
            )
            for loss, metrics, last in losses:
                micro_count += 1
                self.engine.backward(loss, scale_wrt_gas=False)
                unclipped_norm = self._stage0_grad_norm() if last and self.zero_stage == 0 else None
                self.engine.step()
                sums["loss"] += loss.item()
                for key, value in metrics.items():
                    sums[key] += value.float().mean().item()
            self.global_step += 1
            grad_norm = self.engine.get_global_grad_norm()
            grad_norm = unclipped_norm if grad_norm is None else grad_norm
            sums["grad_norm"] += float(grad_norm) if grad_norm is not None else math.nan
        steps = len(step_batches)
        result = {k: v / (steps if k in ("grad_norm", "loss") else micro_count) for k, v in sums.items()}
        # Tensor-parallel peers computed the same values, so the mean over all ranks is the data-parallel mean.
        result = mean_over_ranks(result, self.worker.world_size, self.device)
        result["lr"] = self.engine.get_lr()[0]
        result["global_step"] = float(self.global_step)
        return result

    def _stage0_grad_norm(self) -> float:
        """The all-reduced gradients' global norm (DeepSpeed's plain stage-0 optimizer records none)."""
        grads = [p.grad for p in self.engine.module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads).item() if grads else 0.0

    def save_checkpoint(self, save_dir: str, tag: str) -> str:
        """All ranks write their ZeRO shards and RNG state; the checkpoint appears only when complete."""
        return deepspeed_checkpoint.save(self.engine, save_dir, tag, {"global_step": self.global_step})

    def load_checkpoint(self, load_dir: str, tag: str | None = None) -> str:
        """Resume engine, optimizer, scheduler, RNG and step; a different data-parallel size is converted."""
        path, client_state = deepspeed_checkpoint.load(self.engine, load_dir, tag)
        self.global_step = int(client_state["global_step"])
        return path

    def export_hf(self, output_dir: str) -> str:
        """Rank 0 writes a Hugging Face directory (16-bit or fp32 as trained) from the gathered weights."""
        return write_hf_export(self.unwrapped_model, self.iter_hf_weights(), self.worker.rank, output_dir)
