"""The least time one compare_trl RL step can take on this machine: its matmul work at the measured GEMM rate.

For a compare_trl model shape (16 prompts x 8 samples, the prompt `a+b=` of at most 6 characters plus
BOS, `max new tokens` sampled) the step's floating-point work is counted from the model's shape:
generation (one forward per new token over its growing context), the reference's forward pass and the
update's forward and backward passes (3 forwards), every sample at full length, with no old log-probs
pass (one optimizer step per RL step, as both TRL and roll run it). The rate is what `torch.mm` reaches
in fp32 on this machine's cores for a matrix of the update's shape. Work / rate is a floor no framework
can beat on this machine; with `--trl-step-s` it prints the TRL / roll ratio that floor allows.

    python benchmarks/compute_floor.py [--model small|medium] [--threads N] [--trl-step-s 23.17] [--write-docs]

`--write-docs` rewrites this model's block of docs/performance.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import doc_tables  # noqa: E402
from benchmarks.compare_trl import MODELS, PROMPTS, SAMPLES  # noqa: E402

DOC = REPO_ROOT / "docs" / "performance.md"
BLOCKS = tuple(f"compute_floor-{model}" for model in sorted(MODELS))

PROMPT_TOKENS = 7  # BOS + the longest prompt, `49+49=`
VOCAB = 100  # the char tokenizer's size, rounded up: the head is a small share of the work


def forward_flops_per_token(shape: dict[str, int], context: float) -> float:
    """Multiply-adds x 2 of one token's forward pass: the linear layers, the head, and attention over `context`."""
    hidden, layers, inter = shape["hidden_size"], shape["num_layers"], shape["intermediate_size"]
    kv = hidden // shape["num_heads"] * shape["num_kv_heads"]
    linear = layers * (2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * inter) + hidden * VOCAB
    attention = layers * 2 * context * hidden  # scores and the weighted sum of values
    return 2 * (linear + attention)


def step_flops(shape: dict[str, int], new_tokens: int) -> dict[str, float]:
    """The floating-point work of one RL step by phase."""
    samples, total = PROMPTS * SAMPLES, PROMPT_TOKENS + new_tokens
    prefill = samples * PROMPT_TOKENS * forward_flops_per_token(shape, PROMPT_TOKENS / 2)
    decode = samples * sum(forward_flops_per_token(shape, PROMPT_TOKENS + t) for t in range(new_tokens))
    full_pass = samples * total * forward_flops_per_token(shape, total / 2)
    return {"generate": prefill + decode, "reference_log_probs": full_pass, "actor_update": 3 * full_pass}


def gemm_rate(rows: int, inner: int, cols: int, seconds: float = 3.0, dtype: torch.dtype = torch.float32) -> float:
    """FLOP/s of `torch.mm` on a `[rows, inner] x [inner, cols]` product in `dtype`, best of repeated timings."""
    a, b = torch.randn(rows, inner, dtype=dtype), torch.randn(inner, cols, dtype=dtype)
    torch.mm(a, b)  # warm-up: thread pool and allocation
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        started = time.perf_counter()
        torch.mm(a, b)
        best = min(best, time.perf_counter() - started)
    return 2 * rows * inner * cols / best


def build_parser() -> argparse.ArgumentParser:
    """The command line: the model shape, the threads, TRL's step time and --write-docs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="medium")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--trl-step-s", type=float, default=None, help="TRL's measured step time (compare_trl)")
    parser.add_argument("--write-docs", action="store_true", help="rewrite this model's block of docs/performance.md")
    return parser


def floor_report(model: str, threads: int, trl_step_s: float | None) -> list[str]:
    """The table of the step's work by phase at the measured GEMM rate, and the ratio the floor allows."""
    torch.set_num_threads(threads)
    shape, new_tokens = MODELS[model]
    work = step_flops(shape, new_tokens)
    tokens = PROMPTS * SAMPLES * (PROMPT_TOKENS + new_tokens)
    rate = gemm_rate(tokens, shape["hidden_size"], shape["intermediate_size"])
    lines = [
        f"{model}: {tokens} tokens a full pass; fp32 GEMM `[{tokens}, {shape['hidden_size']}] x "
        f"[{shape['hidden_size']}, {shape['intermediate_size']}]` on {threads} threads: {rate / 1e9:.1f} GFLOP/s",
        "",
        "| phase | TFLOP | at least (s) |",
        "|---|---|---|",
    ]
    lines += [f"| {phase} | {flops / 1e12:.3f} | {flops / rate:.2f} |" for phase, flops in work.items()]
    floor = sum(work.values()) / rate
    lines.append(f"| step | {sum(work.values()) / 1e12:.3f} | {floor:.2f} |")
    if trl_step_s:
        lines += ["", f"TRL at {trl_step_s:.2f} s/step: TRL / roll can be at most {trl_step_s / floor:.2f} here."]
    return lines


def main() -> None:
    """Print (and with --write-docs record) the step's work, the GEMM rate and the floor."""
    args = build_parser().parse_args()
    lines = floor_report(args.model, args.threads, args.trl_step_s)
    command = doc_tables.command_line(__file__, sys.argv[1:])
    print(f"{doc_tables.provenance(command)}\n\n" + "\n".join(lines))
    if args.write_docs:
        doc_tables.write_block(DOC, f"compute_floor-{args.model}", command, "\n".join(lines))


if __name__ == "__main__":
    main()
