"""sglang: generation by an `sglang.Engine` inside the worker's actor, with in-place weight updates.

SGLang ships GPU builds only, so it is imported when a worker initialises, never by `import roll`.
The engine's scheduler runs in child processes; weight buckets reach it through
`Engine.update_weights_from_tensor`, which serialises the tensors for every tensor-parallel rank,
or over the weight-broadcast group, which every tensor-parallel rank joins
(`init_weights_update_group`) and receives from (`update_weights_from_distributed`). A weight sync
is one SGLang weight-update session (`begin_weight_update` ... `end_weight_update`, SGLang >= 0.5.23).

Scoring given sequences (a teacher's or the reference's log-probs) uses the input log-probs of a one-token
generate call (`return_logprob`, `logprob_start_len`, `top_logprobs_num`). Untested on a real engine: it is
written to SGLang's documented API and tested against a fake engine only.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from roll.configs.schema import ConfigError
from roll.configs.worker_config import GeneratingArguments, WorkerConfig
from roll.distributed.strategy.engine_strategy import ENGINE_DTYPES, EngineConfig, EngineStrategy, Samples
from roll.distributed.strategy.response_scores import ScoredSequence
from roll.distributed.strategy.strategy import ModelProvider
from roll.distributed.weight_sync.broadcast import GROUP_NAME
from roll.distributed.weight_sync.buckets import NamedTensors, TensorSpec
from roll.models.model_providers import dtype_from_name
from roll.models.tiny import resolve_model_path
from roll.platforms import current_platform


@dataclass
class SglangConfig(EngineConfig):
    """`strategy_config` of an sglang role (the shared engine keys, and `mem_fraction_static`).

    `mem_fraction_static` of each GPU holds weights and KV cache. With `enable_sleep_mode`,
    offload_states/load_states release and resume the engine's GPU memory. `engine_kwargs` go to
    `sglang.Engine`.
    """

    mem_fraction_static: float = 0.6


def sampling_params(args: GeneratingArguments) -> dict[str, Any]:
    """SGLang sampling parameters of one request (one sample: roll repeats prompts itself)."""
    params: dict[str, Any] = {"max_new_tokens": args.max_new_tokens, "n": 1, "stop": list(args.stop_strings) or None}
    if args.do_sample:
        params.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k if args.top_k > 0 else -1)
    else:
        params["temperature"] = 0.0  # SGLang turns this into top_k=1
    return params


class SglangStrategy(EngineStrategy):
    """An SGLang engine on this worker's GPUs, for generation only."""

    strategy_name = "sglang"
    engine_name = "sglang"
    config_cls = SglangConfig
    reserved_engine_kwargs = frozenset(
        {
            "model_path",
            "dtype",
            "random_seed",
            "tp_size",
            "mem_fraction_static",
            "context_length",
            "enable_memory_saver",
            "enable_weights_cpu_backup",
        }
    )

    @classmethod
    def check_config(cls, worker_config: WorkerConfig) -> None:
        """The engine block parses, and the run's platform has devices SGLang runs on: it has no CPU build."""
        super().check_config(worker_config)
        platform = current_platform().name
        if platform == "cpu":
            raise ConfigError(
                f"{worker_config.name}.strategy_args.strategy_name='sglang' needs GPUs (SGLang has GPU builds only) "
                f"and this run's platform is {platform}: use vllm or hf_infer on CPU, or run on GPUs"
            )

    @classmethod
    def _check_engine_config(cls, config: SglangConfig, where: str) -> None:
        if not 0 < config.mem_fraction_static < 1:
            raise ConfigError(f"{where}.mem_fraction_static={config.mem_fraction_static} must be in (0, 1)")

    def initialize(self, model_provider: ModelProvider) -> None:
        """Start the engine on `model_args.model_name_or_path`; SGLang loads it, so `model_provider` is not called."""
        self.config = self.parse_config(self.worker_config)
        model_args = self.worker_config.model_args
        path = resolve_model_path(model_args.model_name_or_path)  # tiny:// references included
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
        self._init_engine_state(
            path, can_sleep=self.config.enable_sleep_mode, sleep_drops_weights=self.config.sleep_level == 2
        )

    def _sample(self, prompts: list[list[int]], args: GeneratingArguments, with_log_probs: bool) -> Samples:
        n = args.num_return_sequences
        # One request per sample, prompt-major, so the row order does not depend on how SGLang expands `n`.
        rows = [ids for ids in prompts for _ in range(n)]
        params: dict[str, Any] | list[dict[str, Any]] = sampling_params(args)
        if args.seed is not None:
            params = [{**params, "sampling_seed": args.seed + row} for row in range(len(rows))]
        results = self.engine.generate(input_ids=rows, sampling_params=params, return_logprob=with_log_probs)
        log_probs = None
        if with_log_probs:
            log_probs = [[entry[0] for entry in result["meta_info"]["output_token_logprobs"]] for result in results]
        return Samples(
            token_ids=[list(result["output_ids"]) for result in results],
            # SGLang's finish_reason: {"type": "stop" (EOS, stop string), "length" or "abort", ...}.
            truncated=[(result["meta_info"].get("finish_reason") or {}).get("type") == "length" for result in results],
            log_probs=log_probs,
        )

    def _score(self, sequences: list[list[int]], starts: list[int], top_k: int) -> list[ScoredSequence]:
        """SGLang's input log-probs from `logprob_start_len` = start - 1 (UNTESTED on a real engine).

        `meta_info.input_token_logprobs` holds (log-prob, id, text) per input token from there (None for a token
        without a predecessor) and `input_top_logprobs` a list of such per position; whether the entry of the start
        token itself is included changed between SGLang versions, so the last len - start entries are read and
        their ids checked against the sequence.
        """
        results = self.engine.generate(
            input_ids=sequences,
            # The model's own distribution even where SGLang would scale or truncate input log-probs by sampling.
            sampling_params={"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1},
            return_logprob=True,
            logprob_start_len=[start - 1 for start in starts],
            top_logprobs_num=top_k,
        )
        scored = []
        for ids, start, result in zip(sequences, starts, results, strict=True):
            meta, count = result["meta_info"], len(ids) - start
            entries = meta["input_token_logprobs"][-count:]
            if [entry[1] for entry in entries] != ids[start:] or any(entry[0] is None for entry in entries):
                raise RuntimeError(
                    f"{self.worker_config.name}: sglang's input_token_logprobs do not line up with the scored ids "
                    f"(expected ids {ids[start:]}, got {[entry[1] for entry in entries]})"
                )
            tops = meta["input_top_logprobs"][-count:] if top_k else [[] for _ in range(count)]
            top = [[(int(t), float(log_prob)) for log_prob, t, _ in position] for position in tops]
            scored.append(ScoredSequence(token=[float(entry[0]) for entry in entries], top=top))
        return scored

    # ---- weight sync: one SGLang weight-update session per sync ---------------------------------

    def _expect_success(self, result: Any, what: str) -> None:
        # SGLang answers (success, message) tuples or dicts, depending on the call.
        success, message = (result["success"], result["message"]) if isinstance(result, dict) else result[:2]
        if not success:
            raise RuntimeError(f"{self.worker_config.name}: sglang {what} failed: {message}")

    def _begin_sync(self) -> None:
        self._expect_success(self.engine.begin_weight_update(), "begin_weight_update")

    def _deliver(self, named_tensors: NamedTensors) -> None:
        bucket = self._in_engine_dtype(named_tensors)
        result = self.engine.update_weights_from_tensor(named_tensors=bucket, flush_cache=False)
        self._expect_success(result, "update_weights_from_tensor")

    def _deliver_broadcast(self, specs: list[TensorSpec]) -> None:
        result = self.engine.update_weights_from_distributed(
            names=[spec.name for spec in specs],
            dtypes=[spec.dtype for spec in specs],
            shapes=[list(spec.shape) for spec in specs],
            group_name=GROUP_NAME,
            flush_cache=False,
        )
        self._expect_success(result, "update_weights_from_distributed")

    def _finish_sync(self) -> None:
        self._expect_success(self.engine.end_weight_update(), "end_weight_update")
        self.engine.flush_cache()  # cached KV blocks were computed with the old weights

    def join_weight_broadcast(
        self, master_addr: str, master_port: int, ranks: tuple[int, ...], world_size: int, backend: str
    ) -> None:
        """SGLang's tensor-parallel ranks join the group as `ranks[0] + tp_rank` (SGLang's rank_offset)."""
        result = self.engine.init_weights_update_group(
            master_address=master_addr,
            master_port=master_port,
            rank_offset=ranks[0],
            world_size=world_size,
            group_name=GROUP_NAME,
            backend=backend,
        )
        self._expect_success(result, "init_weights_update_group")

    # ---- sleep and wake: SGLang releases and resumes its GPU memory ----------------------------

    def _sleep(self) -> None:
        self.engine.release_memory_occupation()

    def _wake(self) -> None:
        self.engine.resume_memory_occupation()

    def shutdown(self) -> None:
        """Stop the engine's processes and free its GPU memory."""
        engine, self.engine = getattr(self, "engine", None), None
        if engine is not None:
            engine.shutdown()
