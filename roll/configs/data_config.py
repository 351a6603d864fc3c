"""Where a pipeline's prompts and demonstrations come from (shared by RLVR and SFT)."""

from __future__ import annotations

from dataclasses import dataclass, field

from roll.configs.schema import SEED, check, checked_in_validate

_DATA_FILE = (
    "a JSONL file of prompt/answer records, or empty for the built-in task: whether it exists, parses and holds "
    "a batch is the filesystem's"
)


@dataclass
class DataArguments:
    """Where prompts come from: JSONL files, or the built-in arithmetic task when both are empty."""

    train_file: str = field(default="", metadata=checked_in_validate(_DATA_FILE, "/no/such/train.jsonl"))
    eval_file: str = field(default="", metadata=checked_in_validate(_DATA_FILE, "/no/such/eval.jsonl"))
    max_prompt_length: int = field(default=16, metadata=check(ge=1))
    task_seed: int = field(default=0, metadata=check(SEED))
