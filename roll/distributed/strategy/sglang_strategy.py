"""sglang: generation by an `sglang.Engine` inside the worker's actor, with in-place weight updates.

SGLang ships GPU builds only, so it is imported when a worker initialises, never by `import roll`.
The engine's scheduler runs in child processes; weight buckets reach it through
`Engine.update_weights_from_tensor`, which serialises the tensors for every tensor-parallel rank.
`generate` returns hf_infer's layout (see `vllm_strategy`, whose batch conversion it shares).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from roll.configs.schema import ConfigError, from_dict
from roll.configs.worker_config import GeneratingArguments, WorkerConfig
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.strategy import ForwardFunc, InferenceStrategy, ModelProvider
from roll.distributed.strategy.vllm_strategy import (
    ENGINE_DTYPES,
    NamedTensors,
    check_named_tensors,
    generation_pad_token_id,
    hf_weight_shapes,
    memory_in_use,
    pack_generations,
    prompt_token_ids,
)
from roll.models.model_providers import dtype_from_name

# Engine arguments roll derives from the role's config; engine_kwargs may not set them a second way.
_RESERVED_ENGINE_KWARGS = {
    "model_path",
    "dtype",
    "random_seed",
    "tp_size",
    "mem_fraction_static",
    "context_length",
    "enable_memory_saver",
    "enable_weights_cpu_backup",
}


@dataclass
class SglangConfig:
    """`strategy_config` of an sglang role.

    `mem_fraction_static` of each GPU holds weights and KV cache. With `enable_sleep_mode`,
    offload_states/load_states release and resume the engine's GPU memory; `sleep_level` 1 keeps a
    host copy of the weights meanwhile, 2 drops them, so a full weight sync must follow
    `load_states`. `engine_kwargs` go to `sglang.Engine` as they are.
    """

    tensor_parallel_size: int = 1
    mem_fraction_static: float = 0.6
    max_model_len: int | None = None
    enable_sleep_mode: bool = True
    sleep_level: Literal[1, 2] = 1
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def parse_sglang_config(worker_config: WorkerConfig) -> SglangConfig:
    """The role's `strategy_config` as an SglangConfig; a ConfigError names a wrong key or value."""
    where = f"{worker_config.name}.strategy_args.strategy_config"
    config = from_dict(SglangConfig, dict(worker_config.strategy_args.strategy_config), where)
    if config.tensor_parallel_size > worker_config.num_devices_per_worker:
        raise ConfigError(
            f"{where}.tensor_parallel_size={config.tensor_parallel_size} needs that many devices per worker: "
            f"set {worker_config.name}.num_devices_per_worker={config.tensor_parallel_size}"
        )
    if not 0 < config.mem_fraction_static < 1:
        raise ConfigError(f"{where}.mem_fraction_static={config.mem_fraction_static} must be in (0, 1)")
    reserved = sorted(_RESERVED_ENGINE_KWARGS & config.engine_kwargs.keys())
    if reserved:
        raise ConfigError(
            f"{where}.engine_kwargs sets {reserved}, which roll derives from model_args and strategy_config; "
            "set them there instead"
        )
    return config


def check_sglang_config(worker_config: WorkerConfig) -> None:
    """Config-time check of an sglang role (for the factory's CONFIG_CHECKS; imports no SGLang)."""
    parse_sglang_config(worker_config)


def sampling_params(args: GeneratingArguments) -> dict[str, Any]:
    """SGLang sampling parameters of one request (one sample: roll repeats prompts itself)."""
    params: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "n": 1, "stop": list(args.stop_strings) or None}
    if args.do_sample:
        params.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k if args.top_k > 0 else -1)
    else:
        params["temperature"] = 0.0  # SGLang turns this into top_k=1
    return params


class SglangStrategy(InferenceStrategy):
    """An SGLang engine on this worker's GPUs, for generation only."""

    strategy_name = "sglang"

    def initialize(self, model_provider: ModelProvider) -> None:
        """Start the engine on `model_args.model_name_or_path`; SGLang loads it, so `model_provider` is not called."""
        self.config = parse_sglang_config(self.worker_config)
        model_args = self.worker_config.model_args
        path = model_args.model_name_or_path
        # Log-probs before temperature, like vLLM's raw_logprobs and hf forward passes (both spellings:
        # SGLang renamed the variable).
        for name in ("SGLANG_RETURN_ORIGINAL_LOGPROB", "RETURN_ORIGINAL_LOGPROB"):
            os.environ.setdefault(name, "1")
        try:
            import sglang
        except ImportError as exc:
            raise ImportError(
                f"{self.worker_config.name}: strategy 'sglang' needs the sglang package, which has GPU builds only "
                f"(pip install sglang on a CUDA machine); use 'vllm' or 'hf_infer' on CPU. Import error: {exc}"
            ) from exc
        self.engine = sglang.Engine(
            model_path=path,
            dtype=ENGINE_DTYPES[model_args.dtype],
            random_seed=self.worker_config.training_args.seed + self.worker.rank,
            tp_size=self.config.tensor_parallel_size,
            mem_fraction_static=self.config.mem_fraction_static,
            context_length=self.config.max_model_len,
            enable_memory_saver=self.config.enable_sleep_mode,
            enable_weights_cpu_backup=self.config.sleep_level == 1,
            **self.config.engine_kwargs,
        )
        self.dtype = dtype_from_name(model_args.dtype)
        self.weight_shapes, self.sync_weights = hf_weight_shapes(path)
        self.pad_token_id = generation_pad_token_id(path)
        self.missing_weights: set[str] = set()  # weights dropped by a level-2 sleep and not yet reloaded
        self.asleep = False

    def forward_step(self, batch: DataProto, forward_func: ForwardFunc) -> dict[str, torch.Tensor]:
        """Not supported: SGLang exposes no logits for given sequences."""
        raise NotImplementedError(
            f"{self.worker_config.name}: the sglang strategy only generates. Compute log-probs of given sequences "
            "with an hf_infer or deepspeed_infer role; the engine's log-probs of its own samples come from "
            "generate_with_log_probs"
        )

    def generate(self, batch: DataProto, generating_args: GeneratingArguments) -> torch.Tensor:
        """Prompt ids followed by generated ids, `[B * n, prompt + max_new_tokens]`, in hf_infer's layout."""
        return self._generate(batch, generating_args, with_log_probs=False)[0]

    def generate_with_log_probs(
        self, batch: DataProto, generating_args: GeneratingArguments
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`generate`'s ids, and the engine's log-prob of each generated token `[B * n, max_new_tokens]` (0 at padding).

        Log-probs are taken before temperature (SGLANG_RETURN_ORIGINAL_LOGPROB), as vLLM's and hf's are.
        """
        output_ids, log_probs = self._generate(batch, generating_args, with_log_probs=True)
        return output_ids, log_probs

    def _generate(
        self, batch: DataProto, args: GeneratingArguments, with_log_probs: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._check_serving()
        n = args.num_return_sequences
        # One request per sample, prompt-major, so the row order does not depend on how SGLang expands `n`.
        rows = [ids for ids in prompt_token_ids(batch) for _ in range(n)]
        params: dict[str, Any] | list[dict[str, Any]] = sampling_params(args)
        if args.seed is not None:
            params = [{**params, "sampling_seed": args.seed + row} for row in range(len(rows))]
        results = self.engine.generate(input_ids=rows, sampling_params=params, return_logprob=with_log_probs)
        responses = [list(result["output_ids"]) for result in results]
        log_probs = None
        if with_log_probs:
            log_probs = [[entry[0] for entry in result["meta_info"]["output_token_logprobs"]] for result in results]
        return pack_generations(batch.batch["input_ids"], responses, args, self.pad_token_id, log_probs)

    def _check_serving(self) -> None:
        owner = self.worker_config.name
        if self.asleep:
            raise RuntimeError(f"{owner}: the sglang engine is asleep; call load_states() before generating")
        if self.missing_weights:
            missing = sorted(self.missing_weights)
            raise RuntimeError(
                f"{owner}: the sglang engine dropped its weights in a level-2 sleep and still lacks {len(missing)} "
                f"(e.g. {missing[:3]}); load them with load_weights() before generating"
            )

    def load_weights(self, named_tensors: NamedTensors) -> None:
        """Copy Hugging Face-named weights (any dtype) into the engine in place; any subset may be sent.

        Names and shapes are checked before anything is sent: an unknown name raises KeyError and
        a wrong shape ValueError, both naming the weight.
        """
        owner = self.worker_config.name
        if self.asleep:
            raise RuntimeError(f"{owner}: the sglang engine is asleep; call load_states() before load_weights()")
        check_named_tensors(named_tensors, self.weight_shapes, owner)
        bucket = [(name, t.to(self.dtype) if t.is_floating_point() else t) for name, t in named_tensors]
        success, message = self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=True)
        if not success:
            raise RuntimeError(f"{owner}: sglang did not take the weights: {message}")
        self.missing_weights -= {name for name, _ in named_tensors}

    def offload_states(self, include: set[str] | None = None) -> dict[str, float]:
        """Release the engine's GPU memory (KV cache, CUDA graphs, weights); return the bytes freed."""
        if self.asleep or not self.config.enable_sleep_mode:
            return {}
        before = memory_in_use(self.worker.platform)
        self.engine.release_memory_occupation()
        self.asleep = True
        return {"engine": float(max(before - memory_in_use(self.worker.platform), 0))}

    def load_states(self, include: set[str] | None = None) -> dict[str, float]:
        """Resume the engine's GPU memory; after a level-2 sleep generation waits for a full weight sync."""
        if not self.asleep:
            return {}
        before = memory_in_use(self.worker.platform)
        self.engine.resume_memory_occupation()
        self.asleep = False
        if self.config.sleep_level == 2:
            self.missing_weights = set(self.sync_weights)
        return {"engine": float(max(memory_in_use(self.worker.platform) - before, 0))}

    def shutdown(self) -> None:
        """Stop the engine's processes and free its GPU memory."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()
