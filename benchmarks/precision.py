"""bf16 against fp32 on this machine: what `model_args.dtype: auto` picks, and the speeds behind the choice.

For a compare_trl model shape it times, in fp32 and in bf16, the GEMM of the update's shape and one training step
of the model itself on a micro-batch (forward and backward over `--rows` samples at full length, then AdamW), with
the CPU's bf16 instruction sets from /proc/cpuinfo. `auto` takes bf16 only where those instructions exist
(`roll.platforms.cpu.CpuPlatform.preferred_dtype`); the timings show what that choice is worth here.

    python benchmarks/precision.py [--model small|medium] [--threads N] [--rows 8] [--write-docs]

`--write-docs` rewrites this model's block of docs/performance.md: the one for CPUs with bf16 instructions or the one
for CPUs without, whichever this machine is.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import doc_tables  # noqa: E402
from benchmarks.compare_trl import MODELS, PROMPTS, SAMPLES  # noqa: E402
from benchmarks.compute_floor import PROMPT_TOKENS, gemm_rate  # noqa: E402

DOC = REPO_ROOT / "docs" / "performance.md"
# A CPU with bf16 instructions and one without each keep their own table (`-bf16` for the first).
BLOCKS = tuple(f"precision-{model}{suffix}" for model in sorted(MODELS) for suffix in ("", "-bf16"))
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build_parser() -> argparse.ArgumentParser:
    """The command line: the model shape, the threads and --write-docs."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--rows", type=int, default=8, help="samples in the timed micro-batch")
    parser.add_argument("--steps", type=int, default=2, help="timed training steps per precision (best is kept)")
    parser.add_argument("--write-docs", action="store_true", help="rewrite this model's block of docs/performance.md")
    return parser


def train_step_seconds(model_dir: Path, dtype: torch.dtype, rows: int, new_tokens: int, steps: int) -> float:
    """The best wall time of a forward, backward and AdamW step over `rows` samples (prompt and `new_tokens`),
    weights in `dtype`."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    tokens = torch.randint(3, model.config.vocab_size, (rows, PROMPT_TOKENS + new_tokens))
    best = float("inf")
    for _ in range(steps + 1):  # the first is a warm-up
        started = time.perf_counter()
        model(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        best = min(best, time.perf_counter() - started)
    return best


def precision_report(model: str, threads: int, rows: int, steps: int) -> list[str]:
    """The table of GEMM rates and step times by precision, and what `auto` picks on this CPU."""
    from roll.models.tiny import TinyModelSpec, make_tiny_model
    from roll.platforms.cpu import NATIVE_BF16_FLAGS, CpuPlatform, cpu_flags

    torch.set_num_threads(threads)
    shape, new_tokens = MODELS[model]
    tokens = PROMPTS * SAMPLES * (PROMPT_TOKENS + new_tokens)
    with tempfile.TemporaryDirectory() as root:
        model_dir = make_tiny_model(Path(root) / model, TinyModelSpec(**shape), seed=0)
        timings = {
            name: (
                gemm_rate(tokens, shape["hidden_size"], shape["intermediate_size"], dtype=dtype),
                train_step_seconds(model_dir, dtype, rows, new_tokens, steps),
            )
            for name, dtype in DTYPES.items()
        }
    flags = sorted(NATIVE_BF16_FLAGS & cpu_flags()) or ["none"]
    (fp32_rate, fp32_step), (bf16_rate, bf16_step) = timings["fp32"], timings["bf16"]
    lines = [
        f"{model}: bf16 instruction sets on this CPU: {', '.join(flags)}; `model_args.dtype: auto` picks "
        f"{CpuPlatform().preferred_dtype()}; {threads} threads",
        "",
        f"| precision | GEMM `[{tokens}, {shape['hidden_size']}] x [{shape['hidden_size']}, "
        f"{shape['intermediate_size']}]` GFLOP/s | training step of {rows} samples (s) |",
        "|---|---|---|",
    ]
    lines += [f"| {name} | {rate / 1e9:.1f} | {step:.2f} |" for name, (rate, step) in timings.items()]
    lines += ["", f"bf16 / fp32 speed: GEMM {bf16_rate / fp32_rate:.2f}x, training step {fp32_step / bf16_step:.2f}x."]
    return lines


def main() -> None:
    """Print (and with --write-docs record) the precision table."""
    args = build_parser().parse_args()
    lines = precision_report(args.model, args.threads, args.rows, args.steps)
    command = doc_tables.command_line(__file__, sys.argv[1:])
    print(f"{doc_tables.provenance(command)}\n\n" + "\n".join(lines))
    if args.write_docs:
        from roll.platforms.cpu import NATIVE_BF16_FLAGS, cpu_flags

        suffix = "-bf16" if NATIVE_BF16_FLAGS & cpu_flags() else ""
        doc_tables.write_block(DOC, f"precision-{args.model}{suffix}", command, "\n".join(lines))


if __name__ == "__main__":
    main()
