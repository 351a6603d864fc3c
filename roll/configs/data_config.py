"""Where a pipeline's prompts, demonstrations and preference data come from (RLVR and SFT; DPO and RM)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from roll.configs.schema import SEED, Rule, any_value, check, checked_in_validate

_DATA_FILE = (
    "a .jsonl, .json, .parquet or .csv file, a list of such files, a directory written by `datasets`' "
    "save_to_disk, a hub dataset id (org/name[@revision][?subset=<name>&split=<name>]), or empty for the built-in "
    "task: whether it exists, parses and holds a batch is the filesystem's (or the hub's)"
)
_COLUMN = check(nonempty=True, expect="a column name of the data files")
# A missing domain column is an error only when the user named one; the default column is optional.
DEFAULT_DOMAIN_KEY = "domain"
DEFAULT_DOMAIN = "math"


@dataclass
class SourceArguments:
    """What every pipeline's data shares: the files (or the built-in arithmetic task when both are empty), the
    prompt column and how prompts become the model's input (chat template, lengths)."""

    train_file: str | list[str] = field(default="", metadata=checked_in_validate(_DATA_FILE, "/no/such/train.jsonl"))
    eval_file: str | list[str] = field(default="", metadata=checked_in_validate(_DATA_FILE, "/no/such/eval.jsonl"))
    # The prompt column holds text, or a conversation (a list of {role, content}, e.g. `messages`) whose
    # trailing assistant turn is the demonstration.
    prompt_key: str = field(default="prompt", metadata=_COLUMN)
    # null: on when the tokenizer has a chat template; true requires one.
    apply_chat_template: bool | None = field(
        default=None, metadata=check(bad="yes", expect="true, false or null (on when the tokenizer has one)")
    )
    system_prompt: str = field(
        default="", metadata=any_value("any text, put first in every prompt as a system turn; empty: none")
    )
    max_prompt_length: int = field(default=16, metadata=check(ge=1))
    # What happens to a prompt longer than max_prompt_length (and, in SFT and DPO, a response longer than
    # max_response_length): dropped with a count logged, or a config error.
    too_long: Literal["drop", "error"] = "drop"
    task_seed: int = field(default=0, metadata=check(SEED))
    # The built-in task's operands run from 0 to this (19: 800 problems, 160 held out; 49: 5000, 1000 held out).
    task_max_operand: int = field(
        default=19, metadata=check(ge=1, le=199, hint="the task holds 2 x (n + 1)**2 problems, one in five held out")
    )
    # Rows with images (a vision-language model's data): the column of each row's images (paths, bytes or a hub
    # image column) for image parts that do not name their own, and the limits every image is checked against
    # when the data is read.
    images_key: str = field(default="images", metadata=_COLUMN)
    max_images_per_prompt: int = field(default=4, metadata=check(ge=1))
    max_image_pixels: int = field(
        default=1024 * 1024, metadata=check(ge=28 * 28, hint="width x height of the largest image a row may hold")
    )


@dataclass
class DataArguments(SourceArguments):
    """Where prompts come from (data files read with Hugging Face `datasets`, or the built-in arithmetic task
    when both files are empty) and how they become the model's input (columns, chat template, lengths)."""

    # The built-in task when both files are empty: `a op b=` answered directly, or `a op b+c=` worked in two
    # steps, one a line (`a op b=s`, `s+c=t`: the steps a process reward model of rm_prm_arithmetic.yaml scores).
    # A vision-language model's built-in tasks (`roll.datasets.visual_shapes`): `visual_count` counts the squares in
    # a picture, `visual_colour` names the colour of the framed one of two squares.
    task: Literal["arithmetic", "two_step_arithmetic", "visual_count", "visual_colour"] = "arithmetic"
    # Optional for conversations ending with an assistant turn (that turn is then the answer).
    answer_key: str = field(default="answer", metadata=_COLUMN)
    domain_key: str = field(default=DEFAULT_DOMAIN_KEY, metadata=_COLUMN)
    # Every training batch holds each domain's share by weight (e.g. {math: 3, code: 1}); empty: rows are drawn
    # from all the data alike. The weights must name exactly the training data's domains.
    domain_weights: dict[str, float] = field(
        default_factory=dict,
        metadata=check(
            items=Rule(gt=0, expect="a positive weight"),
            keys=Rule(pattern=r"[\w.-]+", expect="a domain name"),
            bad={"math": 0},
        ),
    )


# The rows of preference-style training data: pairs (a prompt, a chosen and a rejected response), unpaired
# completions labelled desirable or not (KTO), or responses made of steps, each labelled correct or not (a
# process reward model).
PreferenceDataFormat = Literal["pairs", "unpaired", "steps"]
# The data fields that apply to one format only.
FORMAT_FIELDS: dict[str, tuple[str, ...]] = {
    "pairs": ("chosen_key", "rejected_key"),
    "unpaired": ("completion_key", "label_key"),
    "steps": ("steps_key", "step_labels_key", "step_separator"),
}
# The model's rows per example of each format: a pair is its chosen and its rejected response.
ROWS_PER_EXAMPLE: dict[str, int] = {"pairs": 2, "unpaired": 1, "steps": 1}


@dataclass
class PreferenceDataArguments(SourceArguments):
    """Preference data in one of three formats (`format`), from data files or, when both are empty, built from the
    arithmetic task: pairs (the correct answer chosen over a wrong one near it), unpaired completions (one answer
    per problem, labelled desirable when correct) or step-labelled responses (a multi-step sum)."""

    format: PreferenceDataFormat = "pairs"
    # Each holds the response as text, or as a conversation whose last turn is the assistant's response.
    chosen_key: str = field(default="chosen", metadata=_COLUMN)
    rejected_key: str = field(default="rejected", metadata=_COLUMN)
    # format=unpaired (TRL's KTO columns): the completion (as chosen_key), and its label: 1/true when desirable.
    completion_key: str = field(default="completion", metadata=_COLUMN)
    label_key: str = field(default="label", metadata=_COLUMN)
    # format=steps (TRL's process-supervision columns): the list of steps and the list of their labels (1/true:
    # the step is correct); the response is the steps, each followed by `step_separator`.
    steps_key: str = field(default="completions", metadata=_COLUMN)
    step_labels_key: str = field(default="labels", metadata=_COLUMN)
    step_separator: str = field(
        default="\n", metadata=check(nonempty=True, expect="the text after each step, e.g. '\\n' or ' ки'")
    )
