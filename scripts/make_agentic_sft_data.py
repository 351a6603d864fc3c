"""Transcripts of a built-in environment for an agentic recipe's SFT warm start.

    python scripts/make_agentic_sft_data.py guess_number   # -> data/guess_number_sft/
    python scripts/make_agentic_sft_data.py calculator     # -> data/calculator_sft/
    python scripts/make_agentic_sft_data.py frozen_lake    # -> data/frozen_lake_sft/

Each row is one turn: `prompt` is the episode so far exactly as the multi-turn rollout tokenises it without a
chat template (each observation and a newline; each earlier action followed by the tokenizer's EOS token as
text), `answer` the next action (SFT appends EOS). Writes train.jsonl and eval.jsonl.

- guess_number: bisection against every secret in 1..n (train.jsonl holds each row `--copies` times).
- calculator: multiplication problems from seeds 0.. (eval from seeds after them, still below the RL recipe's
  held-out seeds), a `--tool-share` of them solved with `<calc a*b>` and the others answered directly; with
  `--system`, each after an agent's system prompt (examples/agents/calculator_agent.py's warm start).
- frozen_lake: non-slippery random 4x4 maps from seeds 0.. (eval from seeds after them), played by a shortest-path
  expert that takes a random move with probability `--epsilon` (the rows hold the moves taken).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from roll.envs.builtin.arithmetic import tool_use_rows
from roll.envs.builtin.frozen_lake import noisy_expert_rows
from roll.envs.builtin.guess_number import bisection_rows


def build_parser() -> argparse.ArgumentParser:
    """The command line: the task and its generation knobs."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=("guess_number", "calculator", "frozen_lake"))
    parser.add_argument("--output-dir", help="where the files go (default: data/<task>_sft)")
    parser.add_argument("--eos", default="<eos>", help="the policy tokenizer's EOS token (tiny:// models: <eos>)")
    parser.add_argument("--n", type=int, default=16, help="guess_number: secrets range over 1..n (env.kwargs.n)")
    parser.add_argument("--copies", type=int, default=4, help="guess_number: copies of each row in train.jsonl")
    parser.add_argument("--problems", type=int, default=4000, help="calculator, frozen_lake: training episodes")
    parser.add_argument("--eval-problems", type=int, default=200, help="calculator, frozen_lake: evaluation ones")
    parser.add_argument("--tool-share", type=float, default=0.3, help="calculator: share of problems using the tool")
    parser.add_argument("--min-digits", type=int, default=2, help="calculator: env.kwargs.min_digits")
    parser.add_argument("--max-digits", type=int, default=2, help="calculator: env.kwargs.max_digits")
    parser.add_argument(
        "--system", default="", help="calculator: an agent's system prompt, on a line before each problem"
    )
    parser.add_argument("--epsilon", type=float, default=0.5, help="frozen_lake: the expert's random-move rate")
    parser.add_argument("--max-turns", type=int, default=10, help="frozen_lake: env.kwargs.max_turns")
    return parser


def transcripts(args: argparse.Namespace) -> dict[str, list[dict[str, str]]]:
    """The rows of train.jsonl and eval.jsonl for `args.task`."""
    if args.task == "guess_number":
        rows = bisection_rows(args.n, args.eos)
        return {"train.jsonl": rows * args.copies, "eval.jsonl": rows}
    for name in ("tool_share", "epsilon"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            raise SystemExit(f"--{name.replace('_', '-')}={getattr(args, name)} must be in [0, 1]")

    def rows(first: int, count: int) -> list[dict[str, str]]:
        seeds = range(first, first + count)
        if args.task == "frozen_lake":
            return noisy_expert_rows(seeds, args.epsilon, args.eos, args.max_turns)
        return tool_use_rows(seeds, args.tool_share, args.eos, args.min_digits, args.max_digits, args.system)

    return {"train.jsonl": rows(0, args.problems), "eval.jsonl": rows(args.problems, args.eval_problems)}


def main() -> None:
    """Parse the arguments, write the files and list them."""
    args = build_parser().parse_args()
    out = Path(args.output_dir or f"data/{args.task}_sft")
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in transcripts(args).items():
        path = out / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
        print(path)


if __name__ == "__main__":
    main()
