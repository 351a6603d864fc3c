"""Data files read with Hugging Face `datasets`, and the user's columns mapped onto roll's.

roll's columns: `messages` (the prompt as a conversation of {role, content} ending with a user turn),
`answer` (what a reward checks), `demonstration` (the response SFT imitates) and `domain` (which
reward cluster scores the row).
"""

from __future__ import annotations

import csv
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import datasets

from roll.configs.data_config import DEFAULT_DOMAIN, DEFAULT_DOMAIN_KEY, DataArguments
from roll.configs.schema import ConfigError

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
ROLES = ("system", "user", "assistant")


@contextmanager
def quiet_progress() -> Iterator[None]:
    """`datasets` without its progress bars (one per map and split; the pipeline shows its own progress)."""
    enabled = datasets.is_progress_bar_enabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if enabled:
            datasets.enable_progress_bars()


def read_table(files: str | list[str], source: str) -> datasets.Dataset:
    """The rows of one file, of several files of one format, or of a `save_to_disk` directory.

    `source` names the setting in errors, e.g. "data.train_file='train.parquet'".
    """
    paths = [Path(files)] if isinstance(files, str) else [Path(f) for f in files]
    for path in paths:
        if not path.exists():
            raise ConfigError(f"{source}: no such file or directory ({path.resolve()})")
    if len(paths) == 1 and paths[0].is_dir():
        return _from_disk(paths[0], source)
    suffixes = {path.suffix.lower() for path in paths}
    unknown = sorted(suffixes - set(_BUILDERS))
    if unknown or any(path.is_dir() for path in paths):
        raise ConfigError(
            f"{source}: cannot read {unknown[0] if unknown else 'a directory in a list'}; give .jsonl, .json, "
            ".parquet or .csv files, or one directory written by save_to_disk"
        )
    builders = {_BUILDERS[suffix] for suffix in suffixes}
    if len(builders) > 1:
        raise ConfigError(f"{source}: the files mix formats ({', '.join(sorted(suffixes))}); give files of one format")
    (builder,) = builders
    if all(_blank(path) for path in paths):
        raise ConfigError(f"{source}: it holds no problems")
    # CSV has no types: pandas would turn an answer "0.50" into 0.5 and "007" into 7, so every column is text.
    features = _text_columns(next(p for p in paths if not _blank(p))) if builder == "csv" else None
    try:
        table = datasets.load_dataset(builder, data_files=[str(p) for p in paths], split="train", features=features)
    except Exception as exc:  # datasets and pyarrow raise many types; the user needs the first line
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{source}: cannot read it as {builder} ({reason})") from exc
    return _nonempty(table, source)


def _blank(path: Path) -> bool:
    """Whether a file holds nothing but whitespace (which `datasets` fails on instead of reading no rows)."""
    with path.open("rb") as f:
        while chunk := f.read(1 << 16):
            if chunk.strip():
                return False
    return True


def _text_columns(path: Path) -> datasets.Features:
    """Every column of the CSV file `path` (named by its header row) as text."""
    with path.open(newline="", encoding="utf-8-sig") as f:  # -sig: a BOM (Excel) is not part of the first name
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def _from_disk(path: Path, source: str) -> datasets.Dataset:
    try:
        table = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise ConfigError(f"{source}: {path} is not a directory written by save_to_disk ({exc})") from exc
    if isinstance(table, datasets.DatasetDict):
        splits = ", ".join(table)
        raise ConfigError(f"{source}: {path} holds the splits {splits}; point it at one split's directory")
    return _nonempty(table, source)


def _nonempty(table: datasets.Dataset, source: str) -> datasets.Dataset:
    if len(table) == 0:
        raise ConfigError(f"{source}: it holds no problems")
    return table


def to_conversations(table: datasets.Dataset, data: DataArguments, source: str) -> datasets.Dataset:
    """`table` mapped onto roll's columns through `data.prompt_key`, `data.answer_key` and `data.domain_key`."""
    columns = table.column_names

    def missing(key: str, setting: str) -> ConfigError:
        existing = ", ".join(repr(c) for c in columns)
        return ConfigError(f"{source}: no column {key!r} ({setting}); its columns are {existing}")

    if data.prompt_key not in columns:
        raise missing(data.prompt_key, "data.prompt_key")
    prompt = table.features[data.prompt_key]
    conversational = _is_conversation(prompt)
    if not conversational and not (isinstance(prompt, datasets.Value) and prompt.dtype in ("string", "large_string")):
        raise ConfigError(
            f"{source}: column {data.prompt_key!r} (data.prompt_key) holds {prompt}, "
            "not text or a conversation (a list of {role, content})"
        )
    if data.answer_key not in columns and not conversational:
        raise missing(data.answer_key, "data.answer_key")
    if data.domain_key not in columns and data.domain_key != DEFAULT_DOMAIN_KEY:
        raise missing(data.domain_key, "data.domain_key")
    keys = {"prompt_key": data.prompt_key, "answer_key": data.answer_key, "domain_key": data.domain_key}
    return table.map(
        _normalize,
        with_indices=True,
        fn_kwargs={**keys, "source": source},
        remove_columns=columns,
        desc="reading problems",
    )


def _is_conversation(feature: Any) -> bool:
    inner = getattr(feature, "feature", None)
    # LargeList: parquet written with 64-bit offsets (polars' default) reads as one.
    is_list = isinstance(feature, (datasets.List, datasets.LargeList))
    return is_list and isinstance(inner, dict) and {"role", "content"} <= set(inner)


def _normalize(
    row: dict[str, Any], index: int, prompt_key: str, answer_key: str, domain_key: str, source: str
) -> dict[str, Any]:
    prompt = row[prompt_key]
    where = f"{source} row {index}"
    if isinstance(prompt, str):
        messages, demonstration = [{"role": "user", "content": prompt}], None
    else:
        messages, demonstration = split_conversation(prompt, where)
    answer = row.get(answer_key)
    if answer is None:
        answer = demonstration
    if answer is None:
        raise ConfigError(f"{where}: no {answer_key!r} (data.answer_key) and no trailing assistant turn to use instead")
    domain = row.get(domain_key)
    return {
        "messages": messages,
        "answer": str(answer),
        "demonstration": str(answer) if demonstration is None else demonstration,
        "domain": DEFAULT_DOMAIN if domain is None else str(domain),
    }


def split_conversation(turns: list[dict[str, Any]], where: str) -> tuple[list[dict[str, str]], str | None]:
    """(the prompt turns, ending with a user turn; the trailing assistant turn's content or None)."""
    messages = [{"role": str(turn["role"]), "content": str(turn["content"])} for turn in turns]
    for turn in messages:
        if turn["role"] not in ROLES:
            raise ConfigError(f"{where}: role {turn['role']!r} is not one of {', '.join(ROLES)}")
    demonstration = messages.pop()["content"] if messages and messages[-1]["role"] == "assistant" else None
    if not messages or messages[-1]["role"] != "user":
        raise ConfigError(f"{where}: a conversation must end with a user turn, optionally followed by the answer")
    return messages, demonstration
