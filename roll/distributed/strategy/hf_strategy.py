"""hf_infer: plain transformers for log-probs and generation, one full model per worker."""

from __future__ import annotations

import torch

from roll.configs.schema import ConfigError
from roll.configs.worker_config import GeneratingArguments, WorkerConfig
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.hf_compute import forward_in_micro_batches, generate_in_micro_batches
from roll.distributed.strategy.hf_sampled_log_probs import SampledLogProbs
from roll.distributed.strategy.micro_batches import token_budget
from roll.distributed.strategy.strategy import ForwardFunc, Generation, InferenceStrategy, ModelProvider
from roll.distributed.weight_sync.buckets import NamedTensors, spec_of


class HfInferStrategy(InferenceStrategy):
    """The model in eval mode on this worker's device, KV cache on for generation."""

    strategy_name = "hf_infer"

    @classmethod
    def check_config(cls, worker_config: WorkerConfig) -> None:
        """hf_infer has no options of its own: a `strategy_config` key is a mistake (meant for another backend)."""
        keys = sorted(worker_config.strategy_args.strategy_config)
        if keys:
            raise ConfigError(
                f"{worker_config.name}.strategy_args.strategy_config sets {keys}, but hf_infer takes no options; "
                "remove them, or choose the backend they belong to in strategy_args.strategy_name"
            )

    def initialize(self, model_provider: ModelProvider) -> None:
        """Build the model and move it to this worker's device."""
        self.device = torch.device(self.worker.platform.device_name(self.worker.local_rank))
        self.model = model_provider().to(self.device).eval()
        self.model.config.use_cache = True
        self.weight_shapes = {name: tuple(p.shape) for name, p in self.model.named_parameters(remove_duplicate=False)}

    def forward_step(self, batch: DataProto, forward_func: ForwardFunc) -> dict[str, torch.Tensor]:
        """Metrics of `forward_func` over micro-batches of `infer_batch_size` rows or of the role's token budget."""
        return forward_in_micro_batches(
            self.model,
            batch,
            forward_func,
            self.worker_config.infer_batch_size,
            self.device,
            token_budget(self.worker_config),
        )

    def generate(self, batch: DataProto, generating_args: GeneratingArguments) -> Generation:
        """Sampled (or greedy) continuations of the prompts in `batch`, with their lengths and stop reasons."""
        return self._generate(self.model, batch, generating_args)

    def generate_with_log_probs(self, batch: DataProto, generating_args: GeneratingArguments) -> Generation:
        """`generate`'s samples, with the log-prob of each generated token `[B * n, max_new_tokens]` (0 after it).

        The log-probs are the model's own, before temperature, top-k and top-p, as vLLM's and SGLang's
        (see `roll.distributed.strategy.hf_sampled_log_probs`).
        """
        recorder = SampledLogProbs(self.model)
        generation = self._generate(recorder, batch, generating_args)
        generation.log_probs = recorder.log_probs(generation.response_lengths, generating_args.max_new_tokens)
        return generation

    def _generate(
        self, model: torch.nn.Module | SampledLogProbs, batch: DataProto, args: GeneratingArguments
    ) -> Generation:
        return generate_in_micro_batches(
            model,
            batch,
            args,
            self.worker_config.infer_batch_size,
            self.device,
            model_path=self.worker_config.model_args.model_name_or_path,
        )

    def load_weights(self, named_tensors: NamedTensors, share: bool = False) -> None:
        """Copy full weights by Hugging Face name into the model after checking every name and shape.

        With `share`, a tensor of the parameter's dtype and device becomes the parameter's data instead (the
        model's own storage is let go); the others are copied.
        """
        self.check_weights([spec_of(name, tensor) for name, tensor in named_tensors])
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in named_tensors:
                param = params[name]
                if share and (tensor.dtype, tensor.device) == (param.dtype, param.device):
                    param.data = tensor
                else:
                    param.copy_(tensor.to(device=param.device, dtype=param.dtype))

    def shutdown(self) -> None:
        """Drop the model."""
        self.model = None
