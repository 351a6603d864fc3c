"""vllm: generation by a vLLM engine that runs inside the worker's actor, with in-place weight syncs.

The engine core runs in the actor's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`) unless
`strategy_config.multiprocessing` is set, so weight buckets reach the model runner as plain tensors
through `LLM.collective_rpc`; across processes they travel as safetensors files in /dev/shm. Over a
weight-broadcast group every engine worker (one per tensor-parallel shard) is a member itself and
receives each bucket straight from the trainer.
"""

from __future__ import annotations

import gc
import os
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from roll.configs.model_dir import read_model_dir
from roll.configs.schema import ConfigError
from roll.configs.worker_config import GeneratingArguments, WorkerConfig
from roll.distributed.strategy.cpu_kv_cache import cpu_kv_cache_bytes
from roll.distributed.strategy.engine_strategy import ENGINE_DTYPES, EngineConfig, EngineStrategy, Samples
from roll.distributed.strategy.response_scores import ScoredSequence
from roll.distributed.strategy.strategy import ModelProvider
from roll.distributed.weight_sync.buckets import NamedTensors, TensorSpec
from roll.models.model_providers import dtype_from_name
from roll.models.tiny import resolve_model_path

if TYPE_CHECKING:
    from vllm import SamplingParams

WORKER_EXTENSION = "roll.third_party.vllm.worker_extension.WeightSyncExtension"
DEFAULT_MAX_LOGPROBS = 20  # vLLM's ModelConfig.max_logprobs


@dataclass
class VllmConfig(EngineConfig):
    """`strategy_config` of a vllm role (the shared engine keys, and these).

    On GPUs `gpu_memory_utilization` of each device holds weights and KV cache; on CPU the KV cache
    takes `kv_cache_space_gb` GiB of host memory (any size > 0; null: room for 256 sequences of the longest
    length, at most 1 GiB, `roll.distributed.strategy.cpu_kv_cache`). `enforce_eager=None`
    means eager on CPU (torch.compile costs ~20 s of start-up for ~20 % more tokens/s on a tiny
    model) and CUDA graphs on GPUs. `multiprocessing` runs the engine core in a process of its own.
    `max_logprobs` caps the top log-probs a request may ask for (vLLM's own default 20 when null; a
    teacher's pipeline raises it to the top-k it scores, -1: no cap). `engine_kwargs` go to `vllm.LLM`
    (e.g. `max_num_seqs`).
    """

    gpu_memory_utilization: float = 0.6
    kv_cache_space_gb: float | None = None
    enforce_eager: bool | None = None
    multiprocessing: bool = False
    max_logprobs: int | None = None


class VllmStrategy(EngineStrategy):
    """A vLLM `LLM` engine on this worker's devices (or cores), for generation only."""

    strategy_name = "vllm"
    engine_name = "vllm"
    config_cls = VllmConfig
    reserved_engine_kwargs = frozenset(
        {
            "model",
            "dtype",
            "seed",
            "tensor_parallel_size",
            "gpu_memory_utilization",
            "max_model_len",
            "enforce_eager",
            "enable_sleep_mode",
            "worker_extension_cls",
            "max_logprobs",
            "logprobs_mode",
            "kv_cache_memory_bytes",
        }
    )

    @classmethod
    def _check_engine_config(cls, config: VllmConfig, where: str) -> None:
        if not 0 < config.gpu_memory_utilization <= 1:
            raise ConfigError(f"{where}.gpu_memory_utilization={config.gpu_memory_utilization} must be in (0, 1]")
        if config.kv_cache_space_gb is not None and not config.kv_cache_space_gb > 0:
            raise ConfigError(
                f"{where}.kv_cache_space_gb={config.kv_cache_space_gb} must be a size in GiB > 0 (such as 0.25), "
                "or null for the space the engine's sequences can fill (at most 1 GiB)"
            )
        if config.max_logprobs is not None and config.max_logprobs < -1:
            raise ConfigError(f"{where}.max_logprobs={config.max_logprobs} must be -1 (no cap), 0 or more")

    @classmethod
    def fit_top_k(cls, worker_config: WorkerConfig, k: int) -> None:
        """Raise vLLM's `max_logprobs` to `k` when the role leaves it unset; a ConfigError when it is set lower."""
        config = cls.parse_config(worker_config)
        where = f"{worker_config.name}.strategy_args.strategy_config.max_logprobs"
        if config.max_logprobs is None:
            worker_config.strategy_args.strategy_config["max_logprobs"] = max(k, DEFAULT_MAX_LOGPROBS)
        elif config.max_logprobs != -1 and config.max_logprobs < k:
            raise ConfigError(
                f"{where}={config.max_logprobs} caps the top log-probs below the {k} this role scores per position; "
                f"set it to {k} or more (or remove it: roll then sets it)"
            )

    def initialize(self, model_provider: ModelProvider) -> None:
        """Start the engine on `model_args.model_name_or_path`; vLLM loads it, so `model_provider` is not called."""
        self.config = self.parse_config(self.worker_config)
        model_args = self.worker_config.model_args
        path = resolve_model_path(model_args.model_name_or_path)  # tiny:// references included
        # vLLM reads these when it is imported and when the engine starts.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if self.config.multiprocessing else "0"
        # vLLM's usage report probes the CPU (a second of CPU time) and posts it online from every engine; roll
        # sends none, as with Ray's (`VLLM_NO_USAGE_STATS=0` in the role's env_vars turns it back on).
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        accelerator = self.worker.platform.is_accelerator
        if accelerator:
            device_kwargs = {
                "gpu_memory_utilization": self.config.gpu_memory_utilization,
                "enable_sleep_mode": self.config.enable_sleep_mode,
            }
        else:
            # vLLM's variable takes whole GiB and would override the engine argument, which takes any size.
            os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
            facts = read_model_dir(path, f"{self.worker_config.name}.model_args.model_name_or_path", path)
            device_kwargs = {
                "kv_cache_memory_bytes": cpu_kv_cache_bytes(
                    self.config.kv_cache_space_gb,
                    facts.kv_bytes_per_token(model_args.dtype),
                    self.config.max_model_len or facts.max_positions,
                )
            }
            if self.config.tensor_parallel_size > 1:
                # vLLM would pin each TP process to a NUMA node of its own and refuse with fewer nodes than
                # processes; roll sizes threads per worker itself (ROLL_NUM_THREADS), so no pinning.
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
        if self.config.tensor_parallel_size > 1:
            # TP workers as child processes of this actor, on the devices (or cores) the actor was given;
            # inside a Ray actor vLLM would otherwise pick its Ray executor.
            device_kwargs["distributed_executor_backend"] = "mp"
        from vllm import LLM

        enforce_eager = self.config.enforce_eager if self.config.enforce_eager is not None else not accelerator
        if self.config.max_logprobs is not None:
            device_kwargs["max_logprobs"] = self.config.max_logprobs
        # vLLM's start runs a full garbage collection five times; over the objects of this process's imports
        # (torch, transformers, roll) they took about 1.2 CPU-seconds. Frozen, a collection skips them.
        gc.freeze()
        try:
            self.llm = LLM(
                model=path,
                dtype=ENGINE_DTYPES[model_args.dtype],
                seed=self.worker_config.training_args.seed + self.worker.rank,
                tensor_parallel_size=self.config.tensor_parallel_size,
                max_model_len=self.config.max_model_len,
                enforce_eager=enforce_eager,
                worker_extension_cls=WORKER_EXTENSION,
                # Log-probs of the raw model (prompt log-probs are never processed; sampled ones would be).
                logprobs_mode="raw_logprobs",
                **device_kwargs,
                **self.config.engine_kwargs,
            )
        finally:
            gc.unfreeze()  # what became garbage meanwhile is collected as usual from here on
        self.dtype = dtype_from_name(model_args.dtype)
        # vLLM's CPU worker ignores sleep (it only pauses the scheduler and keeps the weights), so it needs
        # no sleep mode there.
        self._init_engine_state(
            path,
            can_sleep=self.config.enable_sleep_mode or not accelerator,
            sleep_drops_weights=self.config.sleep_level == 2 and accelerator,
        )
        self.in_process = not self.config.multiprocessing and self.config.tensor_parallel_size == 1

    def _sample(self, prompts: list[list[int]], args: GeneratingArguments, with_log_probs: bool) -> Samples:
        outputs = self.llm.generate(
            [{"prompt_token_ids": ids} for ids in prompts],
            self._sampling_params(args, len(prompts), with_log_probs),
            use_tqdm=False,
        )
        samples = [sample for output in outputs for sample in output.outputs]
        log_probs = None
        if with_log_probs:
            # vLLM's default `raw_logprobs`: log-softmax of the logits before temperature, top-k and top-p.
            log_probs = [
                [position[token].logprob for token, position in zip(sample.token_ids, sample.logprobs, strict=True)]
                for sample in samples
            ]
        return Samples(
            token_ids=[list(sample.token_ids) for sample in samples],
            truncated=[sample.finish_reason == "length" for sample in samples],
            log_probs=log_probs,
        )

    def _score(self, sequences: list[list[int]], starts: list[int], top_k: int) -> list[ScoredSequence]:
        """vLLM's prompt log-probs: at each position after the first, the sequence's own id and the `top_k` most
        likely (the `Logprob.rank` 1..k entries), from the raw logits whatever the sampling parameters."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=top_k, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": ids} for ids in sequences], params, use_tqdm=False)
        scored = []
        for ids, start, output in zip(sequences, starts, outputs, strict=True):
            positions = output.prompt_logprobs[start:]  # entry i: token i given tokens < i (entry 0 is None)
            token = [position[ids[start + i]].logprob for i, position in enumerate(positions)]
            top = [
                [(t, entry.logprob) for t, entry in sorted(position.items(), key=lambda item: item[1].rank)][:top_k]
                for position in positions
            ]
            scored.append(ScoredSequence(token=token, top=top))
        return scored

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

    # ---- weight sync: vLLM's layerwise reload (see roll.third_party.vllm.worker_extension) --------

    def _begin_sync(self) -> None:
        self.llm.collective_rpc("roll_begin_weight_sync")

    def _deliver(self, named_tensors: NamedTensors) -> None:
        bucket = self._in_engine_dtype(named_tensors)
        if self.in_process:
            self.llm.collective_rpc("roll_load_weights", args=(bucket,))
            return
        from safetensors.torch import save_file

        shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
        with tempfile.NamedTemporaryFile(dir=shm, prefix="roll-weights-", suffix=".safetensors") as file:
            save_file({name: t.contiguous() for name, t in bucket}, file.name)
            self.llm.collective_rpc("roll_load_weights", args=(file.name,))

    def _deliver_broadcast(self, specs: list[TensorSpec]) -> None:
        self.llm.collective_rpc("roll_receive_bucket", args=([spec.to_json() for spec in specs],))

    def _finish_sync(self) -> None:
        self.llm.collective_rpc("roll_finish_weight_sync")
        self.llm.reset_prefix_cache()  # cached KV blocks were computed with the old weights

    def join_weight_broadcast(
        self, master_addr: str, master_port: int, ranks: tuple[int, ...], world_size: int, backend: str
    ) -> None:
        """Every engine worker joins the group itself, engine worker i taking `ranks[i]`."""
        self.llm.collective_rpc(
            "roll_join_weight_broadcast", args=(master_addr, master_port, ranks, world_size, backend)
        )

    # ---- sleep and wake: on CPU vLLM's sleep only pauses the scheduler and clears the prefix cache ----

    def _sleep(self) -> None:
        self.llm.sleep(level=self.config.sleep_level)

    def _wake(self) -> None:
        self.llm.wake_up()

    def shutdown(self) -> None:
        """Stop the engine and release its memory and process groups."""
        from roll.third_party.vllm.engine import shutdown_engine

        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            shutdown_engine(llm)
