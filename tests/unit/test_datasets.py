"""Data files through Hugging Face `datasets`: formats, column mapping, conversations, chat templates, lengths.

No Ray and no model: the tokenizer is the tiny char-level one, built in memory (it has a chat template).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import datasets
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from roll.configs.data_config import DataArguments, PreferenceDataArguments
from roll.configs.loader import load_pipeline_config
from roll.configs.schema import ConfigError
from roll.datasets.arithmetic import Problem
from roll.datasets.chat_format import format_prompt, use_chat_template
from roll.datasets.gsm8k_format import gsm8k_record, write_gsm8k_format
from roll.datasets.preference_formats import load_format_splits
from roll.datasets.prompt_dataset import encode_demonstrations, encode_prompts, load_splits, pad_token_id
from roll.datasets.sources import Source, read_table, to_conversations
from roll.models.tiny import build_char_tokenizer
from roll.pipeline.rlvr.rlvr_config import RLVRConfig
from roll.pipeline.sft.sft_config import SFTConfig
from tests.unit.test_config_validation import BLOCKS, ON_THIS_MACHINE
from tests.unit.test_hydra_configs import compose_config

ROWS = [{"question": f"{i}+1=", "solution": str(i + 1), "source": "math" if i % 2 else "logic"} for i in range(6)]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


@pytest.fixture(scope="module")
def gsm8k_files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The GSM8K-format parquet and messages JSONL splits written by the repo's data script."""
    return write_gsm8k_format(tmp_path_factory.mktemp("gsm8k"), max_operand=9)


def write_formats(root: Path) -> dict[str, str | list[str]]:
    """ROWS as every accepted input: .jsonl, .json, .parquet, .csv, a save_to_disk directory, two files."""
    table = datasets.Dataset.from_list(ROWS)
    (root / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS))
    (root / "rows.json").write_text(json.dumps(ROWS))
    table.to_parquet(str(root / "rows.parquet"))
    table.to_csv(str(root / "rows.csv"), index=False)
    table.save_to_disk(str(root / "saved"))
    (root / "a.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS[:2]))
    (root / "b.jsonl").write_text("".join(json.dumps(row) + "\n" for row in ROWS[2:]))
    return {
        "jsonl": str(root / "rows.jsonl"),
        "json": str(root / "rows.json"),
        "parquet": str(root / "rows.parquet"),
        "csv": str(root / "rows.csv"),
        "save_to_disk": str(root / "saved"),
        "two files": [str(root / "a.jsonl"), str(root / "b.jsonl")],
    }


MAPPED = DataArguments(prompt_key="question", answer_key="solution", domain_key="source")


def test_every_format_reads_the_same_rows_through_the_column_keys(tmp_path: Path) -> None:
    for name, files in write_formats(tmp_path).items():
        source = Source.of(name, files)
        rows = to_conversations(read_table(source), MAPPED, source).to_list()
        assert [r["messages"] for r in rows] == [[{"role": "user", "content": row["question"]}] for row in ROWS], name
        assert [(r["answer"], r["demonstration"], r["domain"]) for r in rows] == [
            (row["solution"], row["solution"], row["source"]) for row in ROWS
        ], name


def test_a_missing_column_names_the_file_the_column_and_the_columns_there(tmp_path: Path) -> None:
    files = write_formats(tmp_path)
    source = Source.of("data.train_file", files["parquet"])
    table = read_table(source)
    for data, setting in [
        (DataArguments(answer_key="solution"), "data.prompt_key"),
        (DataArguments(prompt_key="question"), "data.answer_key"),
        (DataArguments(prompt_key="question", answer_key="solution", domain_key="topic"), "data.domain_key"),
    ]:
        missing = getattr(data, setting.split(".")[1])
        with pytest.raises(ConfigError) as error:
            to_conversations(table, data, source)
        assert str(error.value) == (
            f"data.train_file={files['parquet']!r}: no column {missing!r} ({setting}); "
            "its columns are 'question', 'solution', 'source'"
        )
    # Without a domain column at the default key, every row is math.
    plain = datasets.Dataset.from_list([{"prompt": "1+1=", "answer": "2"}])
    assert to_conversations(plain, DataArguments(), Source("x"))[0]["domain"] == "math"


@pytest.mark.parametrize(
    ("files", "message"),
    [
        ("/no/such/train.jsonl", r"^data.train_file='/no/such/train.jsonl': no such file or directory \(/no/such/"),
        ("{tmp}/rows.txt", r"cannot read .txt; give .jsonl, .json, .parquet or .csv files"),
        (["{tmp}/rows.jsonl", "{tmp}/rows.csv"], r"the files mix formats \(.csv, .jsonl\)"),
        ("{tmp}/broken.jsonl", r"^data.train_file='.*broken.jsonl' line 1: not valid JSON \("),
        ("{tmp}/empty.jsonl", r"^data.train_file='.*empty.jsonl': it holds no problems$"),
        ("{tmp}/dict", r"holds the splits train, test; point it at one split's directory"),
    ],
)
def test_unreadable_inputs_are_one_line_errors(tmp_path: Path, files: str | list[str], message: str) -> None:
    write_formats(tmp_path)
    (tmp_path / "rows.txt").write_text("1+1=")
    (tmp_path / "broken.jsonl").write_text('{"prompt": \n')
    (tmp_path / "empty.jsonl").write_text("")
    table = datasets.Dataset.from_list(ROWS)
    datasets.DatasetDict({"train": table, "test": table}).save_to_disk(str(tmp_path / "dict"))
    given = [f.format(tmp=tmp_path) for f in files] if isinstance(files, list) else files.format(tmp=tmp_path)
    with pytest.raises(ConfigError, match=message) as error:
        read_table(Source.of("data.train_file", given))
    assert "\n" not in str(error.value)


def test_a_messages_column_is_a_conversation_whose_last_assistant_turn_is_the_demonstration() -> None:
    conversation = [
        {"role": "system", "content": "Answer with a number."},
        {"role": "user", "content": "2+2="},
        {"role": "assistant", "content": "4"},
    ]
    table = datasets.Dataset.from_list([{"messages": conversation}])
    (row,) = to_conversations(table, DataArguments(prompt_key="messages"), Source("x")).to_list()
    assert row["messages"] == conversation[:2]
    assert (row["answer"], row["demonstration"]) == ("4", "4")
    # An answer column wins for the reward; the assistant turn stays the demonstration.
    with_answer = datasets.Dataset.from_list([{"messages": conversation, "answer": "four"}])
    (row,) = to_conversations(with_answer, DataArguments(prompt_key="messages"), Source("x")).to_list()
    assert (row["answer"], row["demonstration"]) == ("four", "4")
    unanswered = datasets.Dataset.from_list([{"messages": conversation[:2]}])
    with pytest.raises(ConfigError, match=r"^x row 0: no 'answer' \(data.answer_key\) and no trailing assistant"):
        to_conversations(unanswered, DataArguments(prompt_key="messages"), Source("x"))
    bad_role = datasets.Dataset.from_list([{"messages": [{"role": "tool", "content": "x"}], "answer": "1"}])
    with pytest.raises(ConfigError, match=r"^x row 0: role 'tool' is not one of system, user, assistant$"):
        to_conversations(bad_role, DataArguments(prompt_key="messages"), Source("x"))


def test_the_chat_template_setting(tokenizer: PreTrainedTokenizerFast) -> None:
    assert use_chat_template(None, tokenizer) and use_chat_template(True, tokenizer)
    assert not use_chat_template(False, tokenizer)
    plain = build_char_tokenizer()
    plain.chat_template = None
    assert not use_chat_template(None, plain)
    with pytest.raises(ConfigError, match=r"^data.apply_chat_template=true but the tokenizer of .* has no chat"):
        use_chat_template(True, plain)


def test_prompts_are_formatted_with_the_template_system_prompt_and_generation_prompt(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    user = [{"role": "user", "content": "2+2="}]
    assert format_prompt(user, tokenizer, chat_template=False) == "2+2="
    assert format_prompt(user, tokenizer, chat_template=True) == "<user>: 2+2=\n<assistant>: "
    assert format_prompt(user, tokenizer, True, system_prompt="Be brief.") == (
        "<system>: Be brief.\n<user>: 2+2=\n<assistant>: "
    )
    own_system = [{"role": "system", "content": "Mine."}, *user]
    assert format_prompt(own_system, tokenizer, True, "Be brief.") == "<system>: Mine.\n<user>: 2+2=\n<assistant>: "


def test_the_built_in_task_without_the_template_is_tokenised_as_before(tokenizer: PreTrainedTokenizerFast) -> None:
    train, held_out = load_splits(DataArguments(apply_chat_template=False), tokenizer)
    assert (len(train), len(held_out)) == (640, 160)
    assert all(e.prompt.endswith("=") and "<" not in e.prompt for e in train)
    batch = encode_prompts(train[:8], pad_token_id(tokenizer))
    before = tokenizer([e.prompt for e in train[:8]], padding=True, return_tensors="pt", add_special_tokens=False)
    assert torch.equal(batch.batch["input_ids"], before["input_ids"])
    assert torch.equal(batch.batch["attention_mask"], before["attention_mask"])


def test_the_built_in_tasks_operands_widen_with_task_max_operand(tokenizer: PreTrainedTokenizerFast) -> None:
    train, held_out = load_splits(DataArguments(apply_chat_template=False, task_max_operand=49), tokenizer)
    assert (len(train), len(held_out)) == (4000, 1000)
    operands = {int(n) for e in train + held_out for n in e.prompt.rstrip("=").replace("-", "+").split("+")}
    assert operands == set(range(50))
    assert {e.prompt for e in held_out}.isdisjoint(e.prompt for e in train)


def test_sft_trains_only_on_the_assistant_turn_of_the_templated_conversation(
    tokenizer: PreTrainedTokenizerFast,
) -> None:
    data = DataArguments(max_prompt_length=64, system_prompt="Be brief.")
    train, _ = load_splits(data, tokenizer, max_response_length=6)
    example = train[0]
    full = tokenizer.apply_chat_template(
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": example.prompt.split("<user>: ")[1].split("\n")[0]},
            {"role": "assistant", "content": example.answer},
        ],
        tokenize=False,
    )
    # The prompt and response are the conversation as the template writes it, up to the end of the turn.
    assert full.startswith(tokenizer.decode(example.prompt_ids + example.response_ids))
    batch = encode_demonstrations(train[:4], pad_token_id(tokenizer))
    masked = batch.batch["responses"][0][batch.batch["response_mask"][0].bool()].tolist()
    assert masked == example.response_ids and masked[-1] == tokenizer.eos_token_id
    assert batch.batch["attention_mask"][0].sum() == len(example.prompt_ids) + len(example.response_ids)


def test_too_long_rows_are_dropped_with_a_count_or_refused(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "rows.jsonl"
    lengths = [3, 10, 3, 10]
    path.write_text("".join(json.dumps({"prompt": "1" * n, "answer": "1"}) + "\n" for n in lengths))
    data = DataArguments(train_file=str(path), eval_file=str(path), max_prompt_length=5, apply_chat_template=False)
    with caplog.at_level(logging.WARNING, logger="roll.datasets.prompt_dataset"):
        train, _ = load_splits(data, tokenizer)
    assert [len(e.prompt_ids) for e in train] == [3, 3]
    assert f"data.train_file={str(path)!r}: dropped 2 of 4 rows with prompts longer than" in caplog.text
    data.too_long = "error"
    with pytest.raises(
        ConfigError, match=r"2 of 4 rows have prompts longer than data.max_prompt_length=5 tokens, e\.g"
    ):
        load_splits(data, tokenizer)
    data.too_long, data.max_prompt_length = "drop", 2
    with pytest.raises(ConfigError, match=r"4 of 4 rows have .*; raise the limit$"):
        load_splits(data, tokenizer)


def test_tokenising_a_file_is_cached(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(20)))
    data = DataArguments(train_file=str(path), eval_file=str(path), max_prompt_length=32)
    first = load_splits(data, tokenizer)
    table = read_table(Source.of("x", str(path)))
    cache_dir = Path(table.cache_files[0]["filename"]).parent
    cached = {p: p.stat().st_mtime_ns for p in cache_dir.glob("cache-*.arrow")}
    assert cached, "the maps wrote no cache files"
    assert load_splits(data, tokenizer) == first
    assert {p: p.stat().st_mtime_ns for p in cache_dir.glob("cache-*.arrow")} == cached  # read back, not rewritten


def test_the_gsm8k_format_files_load_as_parquet_and_as_messages(
    gsm8k_files: dict[str, Path], tokenizer: PreTrainedTokenizerFast
) -> None:
    assert gsm8k_record(Problem("3+4=", "7")) == {
        "question": "What is 3 plus 4?",
        "answer": "3 + 4 = 7\n#### 7",
    }
    parquet = DataArguments(
        train_file=str(gsm8k_files["train.parquet"]),
        eval_file=str(gsm8k_files["test.parquet"]),
        prompt_key="question",
        max_prompt_length=48,
    )
    messages = DataArguments(
        train_file=str(gsm8k_files["train_messages.jsonl"]),
        eval_file=str(gsm8k_files["test_messages.jsonl"]),
        prompt_key="messages",
        max_prompt_length=48,
    )
    from_parquet, from_messages = load_splits(parquet, tokenizer, 24), load_splits(messages, tokenizer, 24)
    assert from_parquet == from_messages  # the same problems, prompts, answers and tokens either way
    train, held_out = from_parquet
    assert (len(train), len(held_out)) == (160, 40)
    assert train[0].prompt.startswith("<user>: What is ") and train[0].prompt.endswith("?\n<assistant>: ")
    assert train[0].answer.split("\n#### ")[1] == train[0].answer.split(" = ")[1].split("\n")[0]


GSM8K_OVERRIDES = ["data.apply_chat_template=null", "data.max_prompt_length=48"]


GSM8K_INPUTS = [("{split}.parquet", "question"), ("{split}_messages.jsonl", "messages")]


@pytest.mark.parametrize(("files", "prompt_key"), GSM8K_INPUTS)
def test_sft_and_rlvr_configs_on_the_gsm8k_format_files_validate(
    gsm8k_files: dict[str, Path], files: str, prompt_key: str, tmp_path: Path
) -> None:
    data = [
        f"data.train_file={gsm8k_files[files.format(split='train')]}",
        f"data.eval_file={gsm8k_files[files.format(split='test')]}",
        f"data.prompt_key={prompt_key}",
        *GSM8K_OVERRIDES,
    ]
    common = [*ON_THIS_MACHINE, f"output_dir={tmp_path}", *data]
    sft = load_pipeline_config(compose_config("sft_arithmetic", [*common, "max_response_length=24"]), SFTConfig, BLOCKS)
    assert sft.data.prompt_key == prompt_key
    rlvr_overrides = [*common, "pretrain=tiny://qwen2", "actor_infer.generating_args.max_new_tokens=24"]
    rlvr = load_pipeline_config(compose_config("rlvr_arithmetic", rlvr_overrides), RLVRConfig, BLOCKS)
    assert rlvr.data.train_file.endswith(files.format(split="train"))
    too_short = compose_config("sft_arithmetic", [*common, "max_response_length=4"])
    with pytest.raises(ConfigError, match=r"^data.train_file=.*: 160 of 160 rows have .* demonstrations longer than"):
        load_pipeline_config(too_short, SFTConfig, BLOCKS)


def write_rows(path: Path, rows: list[object]) -> str:
    """`rows` as a data file of `path`'s format: JSON lines (a row may be raw text: a malformed line), a JSON array,
    CSV (rows as lists of fields, the first the header) or parquet."""
    if path.suffix == ".jsonl":
        path.write_text("".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows))
    elif path.suffix == ".json":
        path.write_text("[\n" + ",\n".join(row if isinstance(row, str) else json.dumps(row) for row in rows) + "\n]\n")
    elif path.suffix == ".csv":
        path.write_text("".join(",".join(fields) + "\n" for fields in rows))
    else:
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    return str(path)


def data_of(data_format: str, train: str | list[str], held_out: str, **keys: str) -> DataArguments:
    """Arguments reading `train` and `held_out` in `data_format` (prompts, pairs, unpaired, steps) as plain text."""
    common = {"train_file": train, "eval_file": held_out, "apply_chat_template": False, **keys}
    if data_format == "prompts":
        return DataArguments(**common)
    return PreferenceDataArguments(format=data_format, **common)


def load(data: DataArguments, tokenizer: PreTrainedTokenizerFast) -> tuple[list, list]:
    """The splits of `data` as the pipeline reading its format loads them."""
    if isinstance(data, PreferenceDataArguments):
        return load_format_splits(data, tokenizer, 8)
    return load_splits(data, tokenizer, 8)


GOOD = {
    "prompts": {"prompt": "1+1=", "answer": "2"},
    "pairs": {"prompt": "1+1=", "chosen": "2", "rejected": "3"},
    "unpaired": {"prompt": "1+1=", "completion": "2", "label": 1},
    "steps": {"prompt": "1+1=", "completions": ["1+1=2"], "labels": [1]},
}
BAD_ROWS = [
    # (format, file, rows, error): the first bad row is the third row of the data
    ("prompts", "p.jsonl", [GOOD["prompts"], "", '{"prompt": "2+2=", "answer": }'], r"p.jsonl' line 3: not valid JSON"),
    ("prompts", "p.jsonl", [GOOD["prompts"], [1, 2]], r"p.jsonl' line 2: a list, not an object of columns"),
    ("prompts", "p.jsonl", [GOOD["prompts"], {"prompt": "2+2=", "answer": 4}], r"p.jsonl' line 2: column 'answer'"),
    ("prompts", "p.json", [GOOD["prompts"], "{", GOOD["prompts"]], r"p.json' line 3: not valid JSON"),
    ("prompts", "p.csv", [["prompt", "answer"], ["1+1=", "2"], ["2+2=", "4", "5"]], r"p.csv' line 3: 3 fields where"),
    ("prompts", "p.csv", [["prompt", "answer"], ["1+1=", "2"], [], ["2+2=", ""]], r"p.csv' line 4: no 'answer'"),
    (
        "prompts",
        "p.jsonl",
        [{"prompt": [{"role": "user", "content": "x"}], "answer": "1"}] * 2
        + [{"prompt": [{"role": "bot", "content": "x"}], "answer": "1"}],
        r"p.jsonl' line 3: role 'bot' is not one of system, user, assistant",
    ),
    ("prompts", "p.jsonl", [GOOD["prompts"], {"answer": "2"}], r"p.jsonl' line 2: data.prompt_key='prompt' holds None"),
    ("pairs", "p.jsonl", [GOOD["pairs"], {**GOOD["pairs"], "rejected": 3}], r"p.jsonl' line 2: column 'rejected'"),
    ("pairs", "p.parquet", [GOOD["pairs"], {**GOOD["pairs"], "chosen": None}], r"p.parquet' row 1: data.chosen_key="),
    ("unpaired", "u.jsonl", [GOOD["unpaired"], {**GOOD["unpaired"], "label": "yes"}], r"u.jsonl' line 2: column 'la"),
    ("steps", "s.jsonl", [GOOD["steps"], {**GOOD["steps"], "labels": [1, 0]}], r"s.jsonl' line 2: data.step_labels_k"),
]


@pytest.mark.parametrize(("data_format", "name", "rows", "message"), BAD_ROWS)
def test_a_malformed_row_names_its_file_and_line_in_every_format(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, data_format: str, name: str, rows: list, message: str
) -> None:
    held_out = write_rows(tmp_path / f"held_out{Path(name).suffix}", [GOOD[data_format]] * 2)
    if name.endswith(".csv"):
        held_out = write_rows(tmp_path / "held_out.csv", [["prompt", "answer"], ["1+1=", "2"]])
    data = data_of(data_format, write_rows(tmp_path / name, rows), held_out)
    with pytest.raises(ConfigError, match=rf"^data.train_file='{tmp_path}/{message}") as error:
        load(data, tokenizer)
    assert "\n" not in str(error.value)


def test_a_row_of_a_list_of_files_is_named_by_its_file_there(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    turn = {"prompt": [{"role": "user", "content": "1+1="}], "answer": "2"}
    first = write_rows(tmp_path / "a.jsonl", [turn] * 3)
    second = write_rows(tmp_path / "b.jsonl", [turn, {**turn, "prompt": [{"role": "bot", "content": "1+1="}]}])
    with pytest.raises(ConfigError, match=rf"^data.train_file\[1\]='{second}' line 2: role 'bot' is not one of"):
        load(data_of("prompts", [first, second], first), tokenizer)


DEGENERATE = [
    ("prompts", {"prompt": "2+2=", "answer": ""}, "an empty demonstration"),
    ("pairs", {"prompt": "2+2=", "chosen": "4", "rejected": "4"}, "the same chosen response and rejected response"),
    ("pairs", {"prompt": "2+2=", "chosen": "4", "rejected": ""}, "an empty chosen response or rejected response"),
    ("pairs", {"prompt": "2+2=", "chosen": " \n ", "rejected": "5"}, "an empty chosen response or rejected response"),
    ("prompts", {"prompt": "2+2=", "answer": "  "}, "an empty demonstration"),
    ("unpaired", {"prompt": "2+2=", "completion": "", "label": 0}, "an empty completion"),
    ("steps", {"prompt": "2+2=", "completions": [""], "labels": [1]}, "an empty response"),
]


@pytest.mark.parametrize(("data_format", "row", "what"), DEGENERATE)
def test_a_degenerate_row_is_dropped_with_a_warning_naming_it(
    tokenizer: PreTrainedTokenizerFast,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    data_format: str,
    row: dict,
    what: str,
) -> None:
    path = write_rows(tmp_path / "rows.jsonl", [GOOD[data_format], row, GOOD[data_format]])
    with caplog.at_level(logging.WARNING, logger="roll.datasets.prompt_dataset"):
        train, _ = load(data_of(data_format, path, path), tokenizer)
    assert len(train) == 2
    assert f"data.train_file={path!r}: dropped 1 of 3 rows with {what}: data.train_file={path!r} line 2" in caplog.text
    only_degenerate = write_rows(tmp_path / "bad.jsonl", [row])
    with pytest.raises(ConfigError, match=rf"1 of 1 rows have {what}, e.g. .*bad.jsonl' line 1 .*; fix the rows$"):
        load(data_of(data_format, only_degenerate, path), tokenizer)


def test_a_prompt_over_the_budget_is_named_by_its_line(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = write_rows(tmp_path / "rows.jsonl", [{"prompt": "1" * n, "answer": "1"} for n in (3, 3, 10, 3, 12)])
    data = data_of("prompts", path, path, max_prompt_length=5)
    with caplog.at_level(logging.WARNING, logger="roll.datasets.prompt_dataset"):
        load(data, tokenizer)
    assert "dropped 2 of 5 rows with prompts longer than data.max_prompt_length=5 tokens" in caplog.text
    assert f": data.train_file={path!r} line 3, data.train_file={path!r} line 5\n" in caplog.text
    data.too_long = "error"
    with pytest.raises(ConfigError, match=rf"2 of 5 rows have prompts .*, e.g. data.train_file='{path}' line 3 "):
        load(data, tokenizer)
