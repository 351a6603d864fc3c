"""Where a pipeline's prompts and demonstrations come from (shared by RLVR and SFT)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DataArguments:
    """Where prompts come from: JSONL files, or the built-in arithmetic task when both are empty."""

    train_file: str = ""
    eval_file: str = ""
    max_prompt_length: int = 16
    task_seed: int = 0
