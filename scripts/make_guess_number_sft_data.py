"""Bisection transcripts of guess_number for an SFT warm start: `python scripts/make_guess_number_sft_data.py`.

Each turn of each game (one game per secret in 1..n) is one row: `prompt` is the episode so far exactly as the
multi-turn rollout tokenises it without a chat template (`guess 1-n` + newline, then per earlier turn the guess,
the tokenizer's EOS token as text, the answer and a newline), `answer` is bisection's next guess (SFT appends
EOS). Writes train.jsonl (every row `--copies` times, so a batch fits) and eval.jsonl (every row once).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from roll.envs.builtin.guess_number import bisection_rows


def main() -> None:
    """Parse the arguments, write the files and list them."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output-dir", default="data/guess_number_sft", help="where the files go")
    parser.add_argument("--n", type=int, default=16, help="secrets range over 1..n (env.kwargs.n)")
    parser.add_argument("--eos", default="<eos>", help="the policy tokenizer's EOS token (tiny:// models: <eos>)")
    parser.add_argument("--copies", type=int, default=4, help="copies of each row in train.jsonl")
    args = parser.parse_args()
    rows = bisection_rows(args.n, args.eos)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name, copies in (("train.jsonl", args.copies), ("eval.jsonl", 1)):
        path = out / name
        path.write_text("".join(json.dumps(row) + "\n" for row in rows * copies))
        print(path)


if __name__ == "__main__":
    main()
