"""Data files read with Hugging Face `datasets`, and the user's columns mapped onto roll's.

roll's columns: `messages` (the prompt as a conversation of {role, content} ending with a user turn),
`answer` (what a reward checks), `demonstration` (the response SFT imitates) and `domain` (which
reward cluster scores the row).

Every message about a row names it as the user finds it (`Source.row`): its file and line in a .jsonl,
.csv or JSON-lines .json file, its file and row in a JSON array, .parquet file or save_to_disk directory;
its row in the split of a hub dataset (a setting such as `data.train_file=org/name?subset=main&split=test`).
A file `datasets` cannot read is searched for its first malformed line, which the error then names.
"""

from __future__ import annotations

import csv
import functools
import json
from collections.abc import Callable, Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import datasets

from roll.configs.data_config import DEFAULT_DOMAIN, DEFAULT_DOMAIN_KEY, DataArguments
from roll.configs.schema import ConfigError
from roll.models.hub import HubRef, fetch, parse_hub_ref
from roll.utils.imports import exception_line

_BUILDERS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"}
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Source:
    """Where a split's rows come from: a setting and the files (or the hub dataset) it gives, or only a name for
    rows built in.

    `str(source)` is the setting with its value (`data.train_file='train.jsonl'`); `row(i)` names row `i`
    (from 0, over the files in order) by file and line, or file and row where the format has no lines.
    """

    setting: str
    files: tuple[str, ...] = ()
    listed: bool = False  # the setting's value is a list of files
    hub: HubRef | None = None  # the setting's value is a hub dataset id (files then holds that id)

    @classmethod
    def of(cls, setting: str, value: str | Sequence[str]) -> Source:
        """The files `setting` gives as `value`: one path, a list of them, or one hub dataset id."""
        if not isinstance(value, str):
            return cls(setting, tuple(value), listed=True)
        try:
            return cls(setting, (value,), hub=parse_hub_ref(value, "dataset"))
        except ValueError as exc:
            raise ConfigError(f"{setting}={value!r}: {exc}") from exc

    def __str__(self) -> str:
        if not self.files:
            return self.setting
        return f"{self.setting}={list(self.files) if self.listed else self.files[0]!r}"

    def file(self, position: int) -> str:
        """The `position`-th file as messages name it."""
        return f"{self.setting}[{position}]={self.files[position]!r}" if self.listed else str(self)

    def row(self, index: int) -> str:
        """Row `index` as a user finds it: `<file> line N` (or `<file> row N`); `<name> row N` for built-in rows and
        the rows of a hub dataset."""
        if self.hub is not None:
            return f"{self} row {index}"
        start = 0
        for position, path in enumerate(self.files):
            lines = record_lines(Path(path))
            count = len(lines) if lines is not None else _row_count(Path(path))
            if index < start + count:
                local = index - start
                return f"{self.file(position)} " + (f"line {lines[local]}" if lines is not None else f"row {local}")
            start += count
        return f"{self} row {index}"


class RowError(ValueError):
    """A malformed row; `named_rows` turns it into a ConfigError that names the row."""


def named_rows(normalize: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """`normalize(row, **keys)` as a `datasets` map function `(row, index, source, **keys)` whose RowError is a
    ConfigError naming the row where `source` holds it."""

    @functools.wraps(normalize)
    def named(row: dict[str, Any], index: int, source: Source, **keys: Any) -> dict[str, Any]:
        try:
            return normalize(row, **keys)
        except RowError as exc:
            raise ConfigError(f"{source.row(index)}: {exc}") from exc

    return named


def record_lines(path: Path) -> list[int] | None:
    """The line (from 1) where each row of data file `path` starts; None for formats without lines (parquet,
    a save_to_disk directory, a JSON array)."""
    suffix = path.suffix.lower()
    if path.is_dir() or suffix == ".parquet":
        return None
    with path.open(newline="", encoding="utf-8-sig") as f:
        if suffix == ".csv":
            reader = csv.reader(f)
            starts, end = [], 0
            for record in reader:
                if record:  # a blank line is no row
                    starts.append(end + 1)
                end = reader.line_num
            return starts[1:]  # the first is the header
        text = f.read()
    if text.lstrip().startswith("["):
        return None
    return [n for n, line in enumerate(text.split("\n"), 1) if line.strip()]


def _row_count(path: Path) -> int:
    """The rows of a data file without lines (see `record_lines`)."""
    if path.is_dir():
        return len(datasets.load_from_disk(str(path)))
    if path.suffix.lower() == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_metadata(path).num_rows
    return len(json.loads(path.read_text(encoding="utf-8-sig")))


def malformed_line(path: Path, columns: Collection[str] | None = None) -> tuple[int, str] | None:
    """The first malformed line of a .jsonl, .json or .csv file and what is wrong there (None: none found): a line
    that does not parse, or a value of another type than the column's first (of `columns`, default every one)."""
    suffix = path.suffix.lower()
    with path.open(newline="", encoding="utf-8-sig") as f:
        if suffix == ".csv":
            reader = csv.reader(f)
            header, end = None, 0
            for record in reader:
                start, end = end + 1, reader.line_num
                if record and header is None:
                    header = record
                elif record and len(record) != len(header):
                    return start, f"{len(record)} fields where the header has {len(header)}"
            return None
        text = f.read() if suffix in (".json", ".jsonl") else ""
    if text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            return exc.lineno, f"not valid JSON ({exc.msg}, column {exc.colno})"
        return None if all(isinstance(row, dict) for row in rows) else (1, "an array of other than objects")
    rows = {}
    for n, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            rows[n] = json.loads(line)
        except json.JSONDecodeError as exc:
            return n, f"not valid JSON ({exc.msg}, column {exc.colno})"
        if not isinstance(rows[n], dict):
            return n, f"{_KINDS.get(type(rows[n]), 'a value')}, not an object of columns"
    kinds: dict[str, tuple[str, int]] = {}  # each column's first kind of value, and its line
    for n, row in rows.items():
        for key, value in row.items() if columns is None else ((k, row[k]) for k in columns if k in row):
            kind, first = kinds.setdefault(key, (_KINDS.get(type(value), "null"), n))
            if value is not None and kind != "null" and _KINDS.get(type(value)) != kind:
                return n, f"column {key!r} holds {_KINDS.get(type(value))} where line {first} holds {kind}"
    return None


_KINDS = {str: "text", int: "a number", float: "a number", bool: "a boolean", list: "a list", dict: "an object"}


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


def read_table(source: Source) -> datasets.Dataset:
    """The rows of `source`'s files (one file, several files of one format, or a `save_to_disk` directory) or of its
    hub dataset's split."""
    if source.hub is not None:
        return _from_hub(source, source.hub)
    paths = [Path(f) for f in source.files]
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
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # a failure is this function's to report, in one line
    try:
        table = datasets.load_dataset(builder, data_files=[str(p) for p in paths], split="train", features=features)
    except Exception as exc:  # datasets and pyarrow raise many types; the user needs the line, or the first line
        for position, path in enumerate(paths):
            if (found := malformed_line(path)) is not None:
                raise ConfigError(f"{source.file(position)} line {found[0]}: {found[1]}") from exc
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"{source}: cannot read it as {builder} ({reason})") from exc
    finally:
        datasets.logging.set_verbosity(verbosity)
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


def _from_disk(path: Path, source: Source) -> datasets.Dataset:
    try:
        table = datasets.load_from_disk(str(path))
    except FileNotFoundError as exc:
        raise ConfigError(f"{source}: {path} is not a directory written by save_to_disk ({exc})") from exc
    if isinstance(table, datasets.DatasetDict):
        splits = ", ".join(table)
        raise ConfigError(f"{source}: {path} holds the splits {splits}; point it at one split's directory")
    return _nonempty(table, source)


def _from_hub(source: Source, ref: HubRef) -> datasets.Dataset:
    """The split of the hub dataset `ref`, read by `datasets` from its snapshot (fetched into the hub's cache now)."""
    snapshot = fetch(ref, "dataset", str(source))
    try:
        table = datasets.load_dataset(snapshot, name=ref.subset, split=ref.split)
    except Exception as exc:  # datasets raises many types (an unknown subset or split among them); the user needs why
        raise ConfigError(f"{source}: the hub dataset {ref} does not read ({exception_line(exc)})") from exc
    return _nonempty(table, source)


def _nonempty(table: datasets.Dataset, source: Source) -> datasets.Dataset:
    if len(table) == 0:
        raise ConfigError(f"{source}: it holds no problems")
    return table


def check_text_columns(table: datasets.Dataset, source: Source, columns: Collection[str]) -> None:
    """Each of the text `columns` (answers, responses) holds one type of value in every row, else a ConfigError
    naming the first row that differs: `datasets` reads a column of mixed types as JSON values, decoding the text
    that looks like JSON ("007" would become 7). Prompts and labels may mix types: each row is read on its own."""
    mixed = [c for c in columns if isinstance(table.features.get(c), datasets.Json)]
    if not mixed:
        return
    for position, path in enumerate(() if source.hub is not None else source.files):
        if (found := malformed_line(Path(path), mixed)) is not None:
            raise ConfigError(f"{source.file(position)} line {found[0]}: {found[1]}")
    raise ConfigError(f"{source}: column {mixed[0]!r} holds values of different types; give it one type")


def to_conversations(table: datasets.Dataset, data: DataArguments, source: Source) -> datasets.Dataset:
    """`table` mapped onto roll's columns through `data.prompt_key`, `data.answer_key` and `data.domain_key`."""
    columns = table.column_names

    def missing(key: str, setting: str) -> ConfigError:
        existing = ", ".join(repr(c) for c in columns)
        return ConfigError(f"{source}: no column {key!r} ({setting}); its columns are {existing}")

    if data.prompt_key not in columns:
        raise missing(data.prompt_key, "data.prompt_key")
    check_text_columns(table, source, [data.answer_key])
    prompt = table.features[data.prompt_key]
    conversational = _is_conversation(prompt)
    text = isinstance(prompt, datasets.Value) and prompt.dtype in ("string", "large_string")
    mixed = isinstance(prompt, datasets.Json)  # text in some rows, conversations in others: each row is read alone
    if not (conversational or text or mixed):
        raise ConfigError(
            f"{source}: column {data.prompt_key!r} (data.prompt_key) holds {prompt}, "
            "not text or a conversation (a list of {role, content})"
        )
    if data.answer_key not in columns and text:
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


@named_rows
def _normalize(row: dict[str, Any], prompt_key: str, answer_key: str, domain_key: str) -> dict[str, Any]:
    prompt = row[prompt_key]
    if isinstance(prompt, str):
        messages, demonstration = [{"role": "user", "content": prompt}], None
    else:
        messages, demonstration = split_conversation(prompt, f"data.prompt_key={prompt_key!r}")
    answer = row.get(answer_key)
    if answer is None:
        answer = demonstration
    if answer is None:
        raise RowError(f"no {answer_key!r} (data.answer_key) and no trailing assistant turn to use instead")
    domain = row.get(domain_key)
    return {
        "messages": messages,
        "answer": str(answer),
        "demonstration": str(answer) if demonstration is None else demonstration,
        "domain": DEFAULT_DOMAIN if domain is None else str(domain),
    }


def split_conversation(turns: Any, setting: str) -> tuple[list[dict[str, str]], str | None]:
    """(the prompt turns, ending with a user turn; the trailing assistant turn's content or None) of the
    conversation `turns` that `setting` names; RowError unless it is a list of {role, content} texts."""
    if not isinstance(turns, list) or not all(
        isinstance(turn, dict) and isinstance(turn.get("role"), str) and isinstance(turn.get("content"), str)
        for turn in turns
    ):
        raise RowError(f"{setting} holds {turns!r:.80}, not text or a conversation (a list of {{role, content}})")
    messages = [{"role": turn["role"], "content": turn["content"]} for turn in turns]
    for turn in messages:
        if turn["role"] not in ROLES:
            raise RowError(f"role {turn['role']!r} is not one of {', '.join(ROLES)}")
    demonstration = messages.pop()["content"] if messages and messages[-1]["role"] == "assistant" else None
    if not messages or messages[-1]["role"] != "user":
        raise RowError("a conversation must end with a user turn, optionally followed by the answer")
    return messages, demonstration
