"""Generation tokens/s of the vllm, hf_infer and deepspeed_infer strategies, each beside its raw engine.

    python benchmarks/generation_throughput.py [--prompts 64 --new-tokens 32 --repeats 4 --dtype bf16]

For a tiny (~0.3M parameters) and a small (~50M) Qwen2 built locally, every engine runs in its own
process: the strategy is created by name as a worker would create it, then `strategy.generate` and
the engine it wraps (`LLM.generate` on the prompt token ids, or `model.generate` on the padded batch)
are timed alternately (ABBA) on the same greedy prompts, after two warm-up calls each; the fastest
repeat counts. Tokens are the generated ones up to and including EOS, so early stops count the same
for both. `vllm_compiled` is vLLM with torch.compile (`enforce_eager: false`). Prints a markdown
table; see docs/inference_engines.md for the numbers and the choice of default engine on CPU. `--write-docs`
rewrites the table of this prompt count and length there.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import doc_tables  # noqa: E402
from roll.models.tiny import TinyModelSpec, make_tiny_model  # noqa: E402

DOC = REPO_ROOT / "docs" / "inference_engines.md"
PACKAGES = ("torch", "transformers", "deepspeed", "vllm")
# The prompt counts x new tokens docs/inference_engines.md has tables of.
DOC_SHAPES = ((64, 32), (512, 32))

MODELS = {
    "tiny": TinyModelSpec(),
    "small": TinyModelSpec(hidden_size=640, num_layers=8, num_heads=10, num_kv_heads=5, intermediate_size=2560),
}
ENGINES = {  # benchmark name -> (strategy name, strategy_config)
    "hf_infer": ("hf_infer", {}),
    "deepspeed_infer": ("deepspeed_infer", None),  # the examples/config ZeRO-3 block
    "vllm": ("vllm", {}),
    "vllm_compiled": ("vllm", {"enforce_eager": False}),
}


def deepspeed_zero3_block() -> dict:
    """The `deepspeed_zero3` block of examples/config, as a role references it."""
    import yaml

    return yaml.safe_load((REPO_ROOT / "examples/config/deepspeed_zero3.yaml").read_text())["deepspeed_zero3"]


def prompt_texts(count: int) -> list[str]:
    """Arithmetic prompts of 4 to 9 characters, so the batch is left-padded."""
    return [f"{i % 97}+{(i * 37) % 1000}*{i % 7}=" for i in range(count)]


def run_case(engine: str, model_dir: str, args: argparse.Namespace) -> dict:
    """Start one strategy in this process and time it against its raw engine; return the measurements."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", ROLL_NUM_THREADS=str(args.threads))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), VLLM_LOGGING_LEVEL="WARNING")
    from roll.configs.worker_config import GeneratingArguments, ModelArguments, StrategyArguments, WorkerConfig
    from roll.distributed.executor.worker import Worker
    from roll.distributed.scheduler.protocol import DataProto
    from roll.distributed.strategy.registry import strategy_class
    from roll.models.model_providers import load_model, load_tokenizer

    strategy_name, block = ENGINES[engine]
    config = WorkerConfig(
        worker_cls="roll.distributed.executor.worker.Worker",
        world_size=1,
        infer_batch_size=args.prompts,
        model_args=ModelArguments(model_name_or_path=model_dir, dtype=args.dtype),
        strategy_args=StrategyArguments(strategy_name, deepspeed_zero3_block() if block is None else block),
    )
    config.resolve("actor_infer", 0)
    strategy = strategy_class(strategy_name)(Worker(config))
    started = time.perf_counter()
    strategy.initialize(lambda: load_model(config.model_args))
    startup = time.perf_counter() - started

    tokenizer = load_tokenizer(model_dir)
    encoded = tokenizer(prompt_texts(args.prompts), padding=True, return_tensors="pt")
    batch = DataProto.from_dict(tensors={k: encoded[k] for k in ("input_ids", "attention_mask")})
    generating = GeneratingArguments(max_new_tokens=args.new_tokens, do_sample=False)

    def wrapped() -> int:
        return int(strategy.generate(batch, generating).response_lengths.sum())

    raw = raw_engine_call(strategy, strategy_name, encoded, generating, tokenizer)
    for _ in range(2):  # warm-up: allocations, kernel selection, ZeRO-3's module trace
        wrapped(), raw()
    timings: dict[str, list[float]] = {"strategy": [], "raw": []}
    tokens: dict[str, int] = {}
    calls = [("strategy", wrapped), ("raw", raw)]
    for repeat in range(args.repeats):
        for kind, call in calls if repeat % 2 == 0 else calls[::-1]:  # ABBA: neither side always goes first
            started = time.perf_counter()
            tokens[kind] = call()
            timings[kind].append(time.perf_counter() - started)
    strategy.shutdown()
    return {
        "startup_s": startup,
        # The fastest repeat: other processes on a shared machine only ever add time.
        **{f"{kind}_tps": tokens[kind] / min(times) for kind, times in timings.items()},
        "tokens": tokens["strategy"],
        "raw_tokens": tokens["raw"],
    }


def raw_engine_call(
    strategy: Any, strategy_name: str, encoded: Any, generating: Any, tokenizer: Any
) -> Callable[[], int]:
    """The engine the strategy wraps, called directly on the same prompts; returns generated tokens."""
    if strategy_name == "vllm":
        from vllm import SamplingParams

        mask = encoded["attention_mask"].bool()
        prompts = [{"prompt_token_ids": row[m].tolist()} for row, m in zip(encoded["input_ids"], mask, strict=True)]
        params = SamplingParams(temperature=0.0, max_tokens=generating.max_new_tokens, detokenize=False)

        def call() -> int:
            outputs = strategy.llm.generate(prompts, params, use_tqdm=False)
            return sum(len(sample.token_ids) for output in outputs for sample in output.outputs)

        return call
    model = strategy.model if strategy_name == "hf_infer" else strategy.unwrapped_model

    def call() -> int:
        with torch.no_grad():
            output = model.generate(
                **encoded,
                max_new_tokens=generating.max_new_tokens,
                do_sample=False,
                pad_token_id=tokenizer.pad_token_id,
                eos_token_id=tokenizer.eos_token_id,
            )
        # Tokens up to and including the first EOS (these models have one EOS id), else all of them.
        is_eos = output[:, encoded["input_ids"].shape[1] :] == tokenizer.eos_token_id
        return int(torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, is_eos.shape[1]).sum())

    return call


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parameter_count(model_dir: str) -> int:
    """Parameters of the saved model, from the safetensors header (no weights loaded)."""
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        return sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())  # noqa: SIM118 (no __iter__)


def block(prompts: int, new_tokens: int) -> str:
    """The block of docs/inference_engines.md with the table of `prompts` x `new_tokens`."""
    return f"generation_throughput-{prompts}x{new_tokens}"


BLOCKS = tuple(block(*shape) for shape in DOC_SHAPES)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES))
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "roll-generation-benchmark"))
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite this shape's table in {DOC.name}")
    parser.add_argument("--case", nargs=2, metavar=("ENGINE", "MODEL_DIR"), help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.case:
        print(json.dumps(run_case(args.case[0], args.case[1], args)))
        return
    options = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in ("prompts", "new_tokens", "repeats", "dtype")]
    lines = [
        f"{args.prompts} prompts x {args.new_tokens} new tokens, greedy, {args.dtype}, {args.threads} threads:\n",
        "| model | params | engine | start-up s | strategy tok/s | raw engine tok/s | wrapper overhead |",
        "|---|---:|---|---:|---:|---:|---:|",
    ]
    print("\n".join(lines), flush=True)
    for model in args.models:
        model_dir = str(make_tiny_model(Path(args.workdir) / model, MODELS[model]))
        params = parameter_count(model_dir)
        for engine in args.engines:
            command = [sys.executable, __file__, *options, f"--threads={args.threads}", "--case", engine, model_dir]
            done = subprocess.run(command, capture_output=True, text=True, check=False)
            if done.returncode:
                lines.append(f"| {model} | {params / 1e6:.2f}M | {engine} | failed: {done.stderr.strip()[-300:]} |||||")
            else:
                r = json.loads(done.stdout.strip().splitlines()[-1])
                overhead = 1 - r["strategy_tps"] / r["raw_tps"]
                lines.append(
                    f"| {model} | {params / 1e6:.2f}M | {engine} | {r['startup_s']:.1f} | {r['strategy_tps']:,.0f} "
                    f"| {r['raw_tps']:,.0f} | {overhead:+.1%} |"
                )
            print(lines[-1], flush=True)
    command = doc_tables.command_line(__file__, sys.argv[1:])
    print(doc_tables.provenance(command, PACKAGES))
    if args.write_docs:
        doc_tables.write_block(DOC, block(args.prompts, args.new_tokens), command, "\n".join(lines), PACKAGES)


if __name__ == "__main__":
    main()
