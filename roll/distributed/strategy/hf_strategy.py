"""hf_infer: plain transformers for log-probs and generation, one full model per worker."""

from __future__ import annotations

import torch

from roll.configs.worker_config import GeneratingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.hf_compute import forward_in_micro_batches, generate_in_micro_batches
from roll.distributed.strategy.strategy import ForwardFunc, InferenceStrategy, ModelProvider


class HfInferStrategy(InferenceStrategy):
    """The model in eval mode on this worker's device, KV cache on for generation."""

    strategy_name = "hf_infer"

    def initialize(self, model_provider: ModelProvider) -> None:
        """Build the model and move it to this worker's device."""
        self.device = torch.device(self.worker.platform.device_name(self.worker.local_rank))
        self.model = model_provider().to(self.device).eval()
        self.model.config.use_cache = True

    def forward_step(self, batch: DataProto, forward_func: ForwardFunc) -> dict[str, torch.Tensor]:
        """Metrics of `forward_func` over micro-batches of `infer_batch_size`."""
        return forward_in_micro_batches(
            self.model, batch, forward_func, self.worker_config.infer_batch_size, self.device
        )

    def generate(self, batch: DataProto, generating_args: GeneratingArguments) -> torch.Tensor:
        """Sampled (or greedy) continuations of the prompts in `batch`."""
        return generate_in_micro_batches(
            self.model, batch, generating_args, self.worker_config.infer_batch_size, self.device
        )

    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy full weights by Hugging Face name into the model; a name or shape it lacks is an error."""
        params = dict(self.model.named_parameters())
        for name, tensor in named_tensors:
            target = params.get(name)
            if target is None:
                raise KeyError(f"hf_infer: the model has no parameter {name!r} to load")
            if target.shape != tensor.shape:
                raise ValueError(f"hf_infer: {name} has shape {tuple(target.shape)}, got {tuple(tensor.shape)}")
            with torch.no_grad():
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))

    def shutdown(self) -> None:
        """Drop the model."""
        self.model = None
