"""vllm: generation by a vLLM engine that runs inside the worker's actor, with in-place weight syncs.

The engine core runs in the actor's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) unless
`strategy_config.multiprocessing` is set, so weight buckets reach the model runner as plain tensors
through `LLM.collective_rpc`; across processes they travel as safetensors files in /dev/shm.
`generate` returns hf_infer's layout exactly: each left-padded prompt row repeated
`num_return_sequences` times (prompt-major), followed by its generated ids right-padded with the
pad id to `max_new_tokens`.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

from roll.configs.schema import ConfigError, closest_spelling, from_dict
from roll.configs.worker_config import GeneratingArguments, WorkerConfig
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.strategy import ForwardFunc, InferenceStrategy, ModelProvider
from roll.models.model_providers import dtype_from_name
from roll.platforms import Platform

if TYPE_CHECKING:
    from vllm import SamplingParams

NamedTensors = list[tuple[str, torch.Tensor]]
WORKER_EXTENSION = "roll.third_party.vllm.worker_extension.WeightSyncExtension"
ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # model_args.dtype -> engine dtype
# LLM arguments roll derives from the role's config; engine_kwargs may not set them a second way.
_RESERVED_ENGINE_KWARGS = {
    "model",
    "dtype",
    "seed",
    "tensor_parallel_size",
    "gpu_memory_utilization",
    "max_model_len",
    "enforce_eager",
    "enable_sleep_mode",
    "worker_extension_cls",
}


@dataclass
class VllmConfig:
    """`strategy_config` of a vllm role.

    On GPUs `gpu_memory_utilization` of each device holds weights and KV cache; on CPU the KV cache
    takes `kv_cache_space_gb` GiB of host memory (`VLLM_CPU_KVCACHE_SPACE`). `enforce_eager=None`
    means eager on CPU (torch.compile costs ~20 s of start-up for ~20 % more tokens/s on a tiny
    model) and CUDA graphs on GPUs. `sleep_level` 1 keeps a host copy of the weights while asleep,
    2 drops them, so a full weight sync must follow `load_states`. `engine_kwargs` go to `vllm.LLM`
    as they are (e.g. `max_num_seqs`, `logprobs_mode`).
    """

    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.6
    kv_cache_space_gb: int = 1
    max_model_len: int | None = None
    enforce_eager: bool | None = None
    enable_sleep_mode: bool = True
    sleep_level: Literal[1, 2] = 1
    multiprocessing: bool = False
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def parse_vllm_config(worker_config: WorkerConfig) -> VllmConfig:
    """The role's `strategy_config` as a VllmConfig; a ConfigError names a wrong key or value."""
    where = f"{worker_config.name}.strategy_args.strategy_config"
    config = from_dict(VllmConfig, dict(worker_config.strategy_args.strategy_config), where)
    if config.tensor_parallel_size > worker_config.num_devices_per_worker:
        raise ConfigError(
            f"{where}.tensor_parallel_size={config.tensor_parallel_size} needs that many devices per worker: "
            f"set {worker_config.name}.num_devices_per_worker={config.tensor_parallel_size}"
        )
    if not 0 < config.gpu_memory_utilization <= 1:
        raise ConfigError(f"{where}.gpu_memory_utilization={config.gpu_memory_utilization} must be in (0, 1]")
    if config.kv_cache_space_gb < 1:
        raise ConfigError(f"{where}.kv_cache_space_gb={config.kv_cache_space_gb} must be a whole number of GiB >= 1")
    reserved = sorted(_RESERVED_ENGINE_KWARGS & config.engine_kwargs.keys())
    if reserved:
        raise ConfigError(
            f"{where}.engine_kwargs sets {reserved}, which roll derives from model_args and strategy_config; "
            "set them there instead"
        )
    return config


def check_vllm_config(worker_config: WorkerConfig) -> None:
    """Config-time check of a vllm role (for the factory's CONFIG_CHECKS; imports no vLLM)."""
    parse_vllm_config(worker_config)


def check_named_tensors(named_tensors: NamedTensors, shapes: dict[str, tuple[int, ...]], owner: str) -> None:
    """Raise before anything is loaded: KeyError for a name the model lacks, ValueError for a wrong shape."""
    for name, tensor in named_tensors:
        if name not in shapes:
            raise KeyError(f"{owner}: the model has no weight {name!r}{closest_spelling(name, shapes)}")
        if tuple(tensor.shape) != tuple(shapes[name]):
            raise ValueError(
                f"{owner}: weight {name!r} has shape {tuple(tensor.shape)} but the model's is {tuple(shapes[name])}"
            )


def hf_weight_shapes(model_path: str) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """Shapes of every Hugging Face weight name of the model (tied aliases included), and the names a full sync sends.

    Built on the meta device from the config alone, so it costs no memory whatever the model size.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    return shapes, frozenset(name for name, _ in model.named_parameters())


def generation_pad_token_id(model_path: str) -> int:
    """The pad id `model.generate` pads with (the generation config's pad id, else its eos id), as hf_infer uses."""
    try:
        config = GenerationConfig.from_pretrained(model_path)
    except OSError:
        config = GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path))
    pad = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    return pad[0] if isinstance(pad, list) else pad


def prompt_token_ids(batch: DataProto) -> list[list[int]]:
    """The attended ids of each left-padded prompt row of `batch`."""
    input_ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
    return [row[row_mask].tolist() for row, row_mask in zip(input_ids, mask, strict=True)]


def pack_generations(
    input_ids: torch.Tensor,
    responses: list[list[int]],
    args: GeneratingArguments,
    pad_token_id: int,
    log_probs: list[list[float]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hf_infer's layout from per-sample token lists ordered prompt-major, and the log-probs padded with 0."""
    n, width = args.num_return_sequences, args.max_new_tokens
    if len(responses) != len(input_ids) * n:
        raise RuntimeError(f"the engine returned {len(responses)} samples for {len(input_ids)} prompts x {n}")
    generated = torch.full((len(responses), width), pad_token_id, dtype=input_ids.dtype)
    sampled_log_probs = None if log_probs is None else torch.zeros(len(responses), width)
    for row, ids in enumerate(responses):
        generated[row, : len(ids)] = torch.tensor(ids[:width], dtype=input_ids.dtype)
        if sampled_log_probs is not None:
            sampled_log_probs[row, : len(ids)] = torch.tensor(log_probs[row][:width])
    return torch.cat([input_ids.repeat_interleave(n, dim=0), generated], dim=1), sampled_log_probs


def memory_in_use(platform: Platform) -> int:
    """Device bytes in use (engines' sleep allocators bypass torch's statistics), or the host RSS on CPU."""
    if platform.is_accelerator:
        free, total = getattr(torch, platform.device_type).mem_get_info()
        return total - free
    return platform.memory_stats().allocated


class VllmStrategy(InferenceStrategy):
    """A vLLM `LLM` engine on this worker's devices (or cores), for generation only."""

    strategy_name = "vllm"

    def initialize(self, model_provider: ModelProvider) -> None:
        """Start the engine on `model_args.model_name_or_path`; vLLM loads it, so `model_provider` is not called."""
        self.config = parse_vllm_config(self.worker_config)
        model_args = self.worker_config.model_args
        path = model_args.model_name_or_path
        # vLLM reads these when it is imported and when the engine starts.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.config.multiprocessing else "0"
        accelerator = self.worker.platform.is_accelerator
        if accelerator:
            device_kwargs = {
                "gpu_memory_utilization": self.config.gpu_memory_utilization,
                "enable_sleep_mode": self.config.enable_sleep_mode,
            }
            if self.config.tensor_parallel_size > 1:
                # TP workers as child processes of this actor, on the devices the actor was given.
                device_kwargs["distributed_executor_backend"] = "mp"
        else:
            os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(self.config.kv_cache_space_gb)
            device_kwargs = {}
        from vllm import LLM

        enforce_eager = self.config.enforce_eager if self.config.enforce_eager is not None else not accelerator
        self.llm = LLM(
            model=path,
            dtype=ENGINE_DTYPES[model_args.dtype],
            seed=self.worker_config.training_args.seed + self.worker.rank,
            tensor_parallel_size=self.config.tensor_parallel_size,
            max_model_len=self.config.max_model_len,
            enforce_eager=enforce_eager,
            worker_extension_cls=WORKER_EXTENSION,
            **device_kwargs,
            **self.config.engine_kwargs,
        )
        self.dtype = dtype_from_name(model_args.dtype)
        self.weight_shapes, self.sync_weights = hf_weight_shapes(path)
        self.pad_token_id = generation_pad_token_id(path)
        self.in_process = not self.config.multiprocessing and self.config.tensor_parallel_size == 1
        self.missing_weights: set[str] = set()  # weights the engine still lacks; generation waits for them
        self.sync_open = False
        self.asleep = False
        # vLLM's CPU worker ignores sleep (it only pauses the scheduler), so it needs no sleep mode there.
        self._can_sleep = self.config.enable_sleep_mode or not accelerator

    def forward_step(self, batch: DataProto, forward_func: ForwardFunc) -> dict[str, torch.Tensor]:
        """Not supported: vLLM exposes no logits for given sequences."""
        raise NotImplementedError(
            f"{self.worker_config.name}: the vllm strategy only generates. Compute log-probs of given sequences "
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

        The log-probs are vLLM's default `raw_logprobs`: log-softmax of the model's logits before
        temperature, top-k and top-p, i.e. what an hf/deepspeed forward pass gives for the same tokens.
        """
        output_ids, log_probs = self._generate(batch, generating_args, with_log_probs=True)
        return output_ids, log_probs

    def _generate(
        self, batch: DataProto, args: GeneratingArguments, with_log_probs: bool
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        self._check_serving()
        prompts = prompt_token_ids(batch)
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts],
            self._sampling_params(args, len(prompts), with_log_probs),
            use_tqdm=False,
        )
        samples = [sample for output in outputs for sample in output.outputs]
        responses = [list(sample.token_ids) for sample in samples]
        log_probs = None
        if with_log_probs:
            log_probs = [
                [position[token].logprob for token, position in zip(sample.token_ids, sample.logprobs, strict=True)]
                for sample in samples
            ]
        return pack_generations(batch.batch["input_ids"], responses, args, self.pad_token_id, log_probs)

    def _sampling_params(
        self, args: GeneratingArguments, num_prompts: int, with_log_probs: bool
    ) -> SamplingParams | list[SamplingParams]:
        """One SamplingParams for the batch, or one per prompt when a seed makes each prompt's samples reproducible."""
        from vllm import SamplingParams

        common: dict[str, Any] = {
            "n": args.num_return_sequences,
            "max_tokens": args.max_new_tokens,
            "stop": list(args.stop_strings) or None,
            "include_stop_str_in_output": True,
            "detokenize": bool(args.stop_strings),  # text is only needed to find stop strings
            "logprobs": 0 if with_log_probs else None,
        }
        if args.do_sample:
            common.update(temperature=args.temperature, top_p=args.top_p, top_k=max(args.top_k, 0))
        else:
            common.update(temperature=0.0)
        if args.seed is None:
            return SamplingParams(**common)
        # vLLM seeds the i-th sample of a request with seed + i, so prompts are spaced n apart.
        n = args.num_return_sequences
        return [SamplingParams(**common, seed=args.seed + i * n) for i in range(num_prompts)]

    def _check_serving(self) -> None:
        owner = self.worker_config.name
        if self.asleep:
            raise RuntimeError(f"{owner}: the vllm engine is asleep; call load_states() before generating")
        if self.missing_weights:
            missing = sorted(self.missing_weights)
            raise RuntimeError(
                f"{owner}: the vllm engine lacks {len(missing)} weight(s) (e.g. {missing[:3]}) of an incomplete weight "
                "sync, or dropped by a level-2 sleep; load them with load_weights() before generating"
            )

    def load_weights(self, named_tensors: NamedTensors) -> None:
        """Load one bucket of a weight sync (Hugging Face names, any dtype) into the engine in place.

        A sync is the buckets that together hold every weight of the model once; the engine serves
        the new weights as soon as the last one arrives (layers are rebuilt from all of their parts,
        so a sync cannot leave weights out). Names and shapes are checked before anything is sent:
        an unknown name raises KeyError and a wrong shape ValueError, both naming the weight; a
        weight sent twice in one sync raises ValueError.
        """
        owner = self.worker_config.name
        if self.asleep:
            raise RuntimeError(f"{owner}: the vllm engine is asleep; call load_states() before load_weights()")
        check_named_tensors(named_tensors, self.weight_shapes, owner)
        names: set[str] = set()
        for name, _ in named_tensors:
            loaded = self.sync_open and name in self.sync_weights and name not in self.missing_weights
            if name in names or loaded:
                raise ValueError(f"{owner}: weight {name!r} was sent twice in one weight sync")
            names.add(name)
        if not self.sync_open:
            self.llm.collective_rpc("roll_begin_weight_sync")
            self.sync_open = True
            self.missing_weights = set(self.sync_weights)
        self._send(named_tensors)
        self.missing_weights -= names
        if not self.missing_weights:
            self.llm.collective_rpc("roll_finish_weight_sync")
            self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights
            self.sync_open = False

    def _send(self, named_tensors: NamedTensors) -> None:
        bucket = [(name, t.to(self.dtype) if t.is_floating_point() else t) for name, t in named_tensors]
        if self.in_process:
            self.llm.collective_rpc("roll_load_weights", args=(bucket,))
            return
        from safetensors.torch import save_file

        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.NamedTemporaryFile(dir=shm, prefix="roll-weights-", suffix=".safetensors") as file:
            save_file({name: t.contiguous() for name, t in bucket}, file.name)
            self.llm.collective_rpc("roll_load_weights", args=(file.name,))

    def offload_states(self, include: set[str] | None = None) -> dict[str, float]:
        """Sleep the engine at `sleep_level`: KV cache dropped, weights offloaded (1) or dropped (2).

        Returns the device bytes freed. On CPU vLLM's sleep only pauses the scheduler and clears
        the prefix cache (host memory stays as it is), so this reports about 0.
        """
        if self.asleep or not self._can_sleep:
            return {}
        before = memory_in_use(self.worker.platform)
        self.llm.sleep(level=self.config.sleep_level)
        self.asleep = True
        return {"engine": float(max(before - memory_in_use(self.worker.platform), 0))}

    def load_states(self, include: set[str] | None = None) -> dict[str, float]:
        """Wake the engine; after a level-2 sleep the next generation waits for a full weight sync."""
        if not self.asleep:
            return {}
        before = memory_in_use(self.worker.platform)
        self.llm.wake_up()
        self.asleep = False
        if self.config.sleep_level == 2 and self.worker.platform.is_accelerator:
            self.missing_weights = set(self.sync_weights)
        return {"engine": float(max(memory_in_use(self.worker.platform) - before, 0))}

    def shutdown(self) -> None:
        """Stop the engine and release its memory and process groups."""
        from roll.third_party.vllm.engine import shutdown_engine

        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            shutdown_engine(llm)
