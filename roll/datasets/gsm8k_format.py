"""The arithmetic task written in GSM8K's exact format, as a parquet table and as `messages`-style JSONL.

GSM8K rows are `{"question": ..., "answer": "<worked solution>\\n#### <number>"}`; the same problems as
conversations are `{"messages": [{"role": "user", ...}, {"role": "assistant", ...}]}`. Both load through
`data.train_file` with only column settings changed, so they stand in for the real files on CPU.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path

import datasets

from roll.datasets.arithmetic import Problem, arithmetic_problems
from roll.datasets.sources import quiet_progress

_WORDS = {"+": "plus", "-": "minus", "*": "times"}


def gsm8k_record(problem: Problem) -> dict[str, str]:
    """`problem` (an `a op b=` arithmetic prompt) as a GSM8K question and worked answer ending in `#### N`."""
    match = re.fullmatch(r"(\d+)([+\-*])(\d+)=", problem.prompt)
    if match is None:
        raise ValueError(f"{problem.prompt!r} is not an arithmetic prompt like '3+4='")
    a, op, b = match.groups()
    return {
        "question": f"What is {a} {_WORDS[op]} {b}?",
        "answer": f"{a} {op} {b} = {problem.answer}\n#### {problem.answer}",
    }


def messages_record(record: dict[str, str]) -> dict[str, list[dict[str, str]]]:
    """A GSM8K record as a conversation: the question from the user, the worked answer from the assistant."""
    return {
        "messages": [
            {"role": "user", "content": record["question"]},
            {"role": "assistant", "content": record["answer"]},
        ]
    }


def write_gsm8k_format(
    output_dir: str | Path, max_operand: int = 19, operations: str = "+-", seed: int = 0
) -> dict[str, Path]:
    """Write train/test splits as `{split}.parquet` (GSM8K columns) and `{split}_messages.jsonl`; return the paths."""
    root = Path(output_dir)
    root.mkdir(parents=True, exist_ok=True)
    train, test = arithmetic_problems(max_operand=max_operand, operations=operations, seed=seed)
    paths = {}
    for split, problems in (("train", train), ("test", test)):
        records = _records(problems)
        paths[f"{split}.parquet"] = root / f"{split}.parquet"
        with quiet_progress():
            datasets.Dataset.from_list(records).to_parquet(str(paths[f"{split}.parquet"]))
        paths[f"{split}_messages.jsonl"] = root / f"{split}_messages.jsonl"
        lines = (json.dumps(messages_record(record)) + "\n" for record in records)
        paths[f"{split}_messages.jsonl"].write_text("".join(lines))
    return paths


def _records(problems: Sequence[Problem]) -> list[dict[str, str]]:
    return [gsm8k_record(problem) for problem in problems]
