"""A `messages` data file end to end through what the pipelines call: `load_splits` (SFT and RLVR), then
`encode_demonstrations` (SFT's batches) and `encode_prompts` (RLVR's prompts). No Ray and no model.

The expected token ids are built by hand from the tiny char tokenizer's template, written out literally:
`<role>: content` lines, `<eos>` after an assistant turn, and `<assistant>: ` as the generation prompt.
"""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from transformers import PreTrainedTokenizerFast

from roll.configs.data_config import DataArguments
from roll.datasets.prompt_dataset import Example, encode_demonstrations, encode_prompts, load_splits, pad_token_id
from roll.datasets.sources import Source, read_table
from roll.models.tiny import build_char_tokenizer

CONVERSATIONS = [
    [
        {"role": "system", "content": "Reply with a number."},
        {"role": "user", "content": "2+3="},
        {"role": "assistant", "content": "5"},
    ],
    [  # earlier turns are part of the prompt; only the last assistant turn is trained on and checked
        {"role": "user", "content": "1+1="},
        {"role": "assistant", "content": "2"},
        {"role": "user", "content": "and 20+4="},
        {"role": "assistant", "content": "24"},
    ],
    [{"role": "user", "content": "7-4="}, {"role": "assistant", "content": "3"}],
]
# The prompts as the template writes them, and the answers (the last assistant turns).
PROMPTS = [
    "<system>: Reply with a number.\n<user>: 2+3=\n<assistant>: ",
    "<user>: 1+1=\n<assistant>: 2<eos>\n<user>: and 20+4=\n<assistant>: ",
    "<user>: 7-4=\n<assistant>: ",
]
ANSWERS = ["5", "24", "3"]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    return build_char_tokenizer()


def char_ids(text: str, tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """`text`'s ids one character at a time (the char tokenizer has no merges); `<eos>` is its special token."""
    head, eos, tail = text.partition("<eos>")
    ids = [tokenizer.convert_tokens_to_ids(tokenizer.tokenize(char)[0]) for char in head]
    return [*ids, tokenizer.eos_token_id, *char_ids(tail, tokenizer)] if eos else ids


def expected(tokenizer: PreTrainedTokenizerFast) -> list[Example]:
    return [
        Example(
            prompt=prompt,
            answer=answer,
            domain="math",
            prompt_ids=char_ids(prompt, tokenizer),
            response_ids=[*char_ids(answer, tokenizer), tokenizer.eos_token_id],
        )
        for prompt, answer in zip(PROMPTS, ANSWERS, strict=True)
    ]


def write_messages(root: Path) -> dict[str, str]:
    """CONVERSATIONS as a `messages` column in every format that holds a list of {role, content}."""
    rows = [{"messages": conversation} for conversation in CONVERSATIONS]
    table = datasets.Dataset.from_list(rows)
    (root / "m.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (root / "m.json").write_text(json.dumps(rows))
    table.to_parquet(str(root / "m.parquet"))
    # polars (and pyarrow with large types) write 64-bit offsets, which `datasets` reads as LargeList.
    turn = pa.struct([("role", pa.large_string()), ("content", pa.large_string())])
    pq.write_table(pa.table({"messages": pa.array(CONVERSATIONS, pa.large_list(turn))}), root / "large.parquet")
    table.save_to_disk(str(root / "m_saved"))
    paths = {"jsonl": "m.jsonl", "json": "m.json", "parquet": "m.parquet", "large_list parquet": "large.parquet"}
    return {name: str(root / path) for name, path in {**paths, "save_to_disk": "m_saved"}.items()}


def write_prompt_answer(root: Path) -> dict[str, str]:
    """The same problems as already-templated `prompt` text with an `answer`, in every format."""
    rows = [{"prompt": prompt, "answer": answer} for prompt, answer in zip(PROMPTS, ANSWERS, strict=True)]
    table = datasets.Dataset.from_list(rows)
    (root / "p.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    table.to_parquet(str(root / "p.parquet"))
    table.to_csv(str(root / "p.csv"), index=False)
    table.save_to_disk(str(root / "p_saved"))
    paths = {name: str(root / f"p.{name}") for name in ("jsonl", "parquet", "csv")}
    return {**paths, "save_to_disk": str(root / "p_saved")}


def splits(files: str, tokenizer: PreTrainedTokenizerFast, **data: object) -> list[Example]:
    train, held_out = load_splits(
        DataArguments(train_file=files, eval_file=files, max_prompt_length=64, **data), tokenizer, 8
    )
    assert train == held_out
    return train


def test_a_messages_file_in_every_format_gives_the_hand_built_prompts_answers_and_ids(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    want = expected(tokenizer)
    for name, files in write_messages(tmp_path).items():
        assert splits(files, tokenizer, prompt_key="messages") == want, name
    # The template itself agrees: the prompt is the whole conversation's text up to the last answer.
    for conversation, example in zip(CONVERSATIONS, want, strict=True):
        full = tokenizer.apply_chat_template(conversation, tokenize=False)
        assert full == example.prompt + example.answer + "<eos>\n"


def test_a_messages_file_equals_the_templated_prompt_answer_file_in_every_format(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    messages = splits(write_messages(tmp_path)["jsonl"], tokenizer, prompt_key="messages")
    for name, files in write_prompt_answer(tmp_path).items():
        assert splits(files, tokenizer, apply_chat_template=False) == messages, name


def test_csv_columns_stay_text(tokenizer: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    path = tmp_path / "rows.csv"
    path.write_text('prompt,answer\n"What is 1/2?\nIn decimals.",0.50\n007,007\n')
    assert read_table(Source.of("x", str(path))).to_list() == [
        {"prompt": "What is 1/2?\nIn decimals.", "answer": "0.50"},  # not 0.5
        {"prompt": "007", "answer": "007"},  # not 7
    ]


def test_sft_batches_carry_the_loss_on_the_last_assistant_turn_only(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    examples = splits(write_messages(tmp_path)["jsonl"], tokenizer, prompt_key="messages")
    pad = pad_token_id(tokenizer)
    batch = encode_demonstrations(examples, pad).batch
    prompt_width = max(len(char_ids(p, tokenizer)) for p in PROMPTS)  # `<eos>` is one token
    assert batch["prompts"].shape[1] == prompt_width
    for row, (prompt, answer) in enumerate(zip(PROMPTS, ANSWERS, strict=True)):
        sequence = [*char_ids(prompt + answer, tokenizer), tokenizer.eos_token_id]
        assert batch["input_ids"][row][batch["attention_mask"][row].bool()].tolist() == sequence
        # The loss mask over the whole sequence: 0 on padding and the prompt (earlier answers included),
        # 1 on the answer and its EOS, 0 on the right padding.
        loss_mask = [0] * prompt_width + batch["response_mask"][row].tolist()
        width = len(answer) + 1
        assert loss_mask == [0] * prompt_width + [1] * width + [0] * (len(loss_mask) - prompt_width - width)
        trained = batch["input_ids"][row][torch.tensor(loss_mask).bool()].tolist()
        assert trained == [*char_ids(answer, tokenizer), tokenizer.eos_token_id]
        left = prompt_width - len(char_ids(prompt, tokenizer))
        assert batch["input_ids"][row][:left].tolist() == [pad] * left


def test_rlvr_prompts_are_the_templated_conversations_and_the_answers_their_last_turns(
    tokenizer: PreTrainedTokenizerFast, tmp_path: Path
) -> None:
    examples = splits(write_messages(tmp_path)["jsonl"], tokenizer, prompt_key="messages")
    prompts = encode_prompts(examples, pad_token_id(tokenizer))
    assert list(prompts.non_tensor_batch["prompt"]) == PROMPTS
    assert list(prompts.non_tensor_batch["answer"]) == ANSWERS
    for row, prompt in enumerate(PROMPTS):
        kept = prompts.batch["input_ids"][row][prompts.batch["attention_mask"][row].bool()]
        assert kept.tolist() == char_ids(prompt, tokenizer)
        assert tokenizer.decode(kept) == prompt  # what the engine is given, ending in the generation prompt
