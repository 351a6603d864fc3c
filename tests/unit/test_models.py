"""Tiny-model factory and model providers: tokenizer, local checkpoints, model kinds, dtypes and LoRA."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from roll.configs.worker_config import ModelArguments
from roll.models.model_providers import dtype_from_name, load_model, load_tokenizer
from roll.models.reward_pooling import classification_head
from roll.models.tiny import DEFAULT_ALPHABET, TinyModelSpec, build_char_tokenizer, make_tiny_model

MIXED = "Hello, World!  12+3*(4-5)/6=7?\n  x_y: 'a' \"b\" #1 <2> 50%; ok.\n"
BATCH, LENGTH = 2, 5


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One default tiny qwen2 checkpoint shared by the module."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2")


def _inputs() -> dict[str, torch.Tensor]:
    input_ids = torch.randint(4, 20, (BATCH, LENGTH))
    attention_mask = torch.ones_like(input_ids)
    input_ids[0, :2], attention_mask[0, :2] = 0, 0
    return {"input_ids": input_ids, "attention_mask": attention_mask}


def test_char_tokenizer_round_trips_one_token_per_character() -> None:
    tokenizer = build_char_tokenizer()
    ids = tokenizer(MIXED)["input_ids"]
    assert len(ids) == len(MIXED)
    assert tokenizer.decode(ids) == MIXED
    assert tokenizer.decode(tokenizer(DEFAULT_ALPHABET)["input_ids"]) == DEFAULT_ALPHABET
    assert tokenizer.pad_token_id == 0
    assert {tokenizer.bos_token, tokenizer.eos_token, tokenizer.unk_token} == {"<bos>", "<eos>", "<unk>"}


def test_char_tokenizer_pads_on_the_left() -> None:
    batch = build_char_tokenizer()(["ab", "abcd"], padding=True)
    assert batch["input_ids"][0][:2] == [0, 0]
    assert batch["attention_mask"] == [[0, 0, 1, 1], [1, 1, 1, 1]]


def test_chat_template() -> None:
    tokenizer = build_char_tokenizer()
    messages = [{"role": "user", "content": "1+1?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<user>: 1+1?\n<assistant>: "
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert tokenizer.decode(ids) == text
    answered = [*messages, {"role": "assistant", "content": "2"}]
    assert tokenizer.apply_chat_template(answered, tokenize=False) == "<user>: 1+1?\n<assistant>: 2<eos>\n"


def test_tiny_model_loads_offline(model_dir: Path) -> None:
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert type(model).__name__ == "Qwen2ForCausalLM"
    assert model.dtype == torch.float32
    assert model.model.layers[0].self_attn.head_dim == 32
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    assert model.config.vocab_size == len(tokenizer) == len(build_char_tokenizer())
    assert tokenizer(MIXED)["input_ids"] == build_char_tokenizer()(MIXED)["input_ids"]
    assert tokenizer.decode(tokenizer(MIXED)["input_ids"]) == MIXED
    assert tokenizer.padding_side == "left"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False) == "<user>: hi\n"


def test_tiny_model_is_deterministic_in_its_seed(tmp_path: Path) -> None:
    def weights(seed: int, name: str) -> dict[str, torch.Tensor]:
        return load_file(make_tiny_model(tmp_path / name, seed=seed) / "model.safetensors")

    first, again, other = weights(0, "a"), weights(0, "b"), weights(1, "c")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert not all(torch.equal(first[k], other[k]) for k in first)


def test_tiny_model_is_idempotent(model_dir: Path) -> None:
    mtimes = {f: f.stat().st_mtime_ns for f in model_dir.iterdir()}
    assert make_tiny_model(model_dir) == model_dir
    assert {f: f.stat().st_mtime_ns for f in model_dir.iterdir()} == mtimes


def test_tiny_model_rebuilds_for_another_seed(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "m", seed=0)
    before = load_file(path / "model.safetensors")
    after = load_file(make_tiny_model(path, seed=1) / "model.safetensors")
    assert not all(torch.equal(before[k], after[k]) for k in before)


def test_tiny_llama(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "llama", TinyModelSpec(arch="llama", tie_word_embeddings=True))
    model = AutoModelForCausalLM.from_pretrained(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.model.layers[0].self_attn.head_dim == 32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert tokenizer.decode(tokenizer(MIXED)["input_ids"]) == MIXED


def test_spec_rejects_uneven_heads() -> None:
    with pytest.raises(ValueError, match="multiple of num_heads"):
        TinyModelSpec(hidden_size=100, num_heads=3)


def test_load_tokenizer(model_dir: Path, tmp_path: Path) -> None:
    tokenizer = load_tokenizer(str(model_dir))
    assert tokenizer.padding_side == "left"
    assert tokenizer.pad_token_id == 0
    without_pad = build_char_tokenizer()
    without_pad.pad_token = None
    without_pad.save_pretrained(tmp_path)
    assert load_tokenizer(str(tmp_path)).pad_token == "<eos>"


@pytest.mark.parametrize("dtype_name", ["fp32", "bf16"])
@pytest.mark.parametrize(
    ("kind", "class_name", "shape"),
    [
        ("causal_lm", "Qwen2ForCausalLM", (BATCH, LENGTH, None)),
        ("value", "Qwen2ForTokenClassification", (BATCH, LENGTH, 1)),
        ("reward", "Qwen2ForSequenceClassification", (BATCH, 1)),
    ],
)
def test_load_model_kinds(
    model_dir: Path, kind: str, class_name: str, shape: tuple[int | None, ...], dtype_name: str
) -> None:
    model = load_model(ModelArguments(model_name_or_path=str(model_dir), dtype=dtype_name), kind)
    assert type(model).__name__ == class_name
    assert model.dtype == dtype_from_name(dtype_name)
    with torch.no_grad():
        logits = model(**_inputs()).logits
    vocab = model.config.vocab_size
    assert tuple(logits.shape) == tuple(vocab if size is None else size for size in shape)
    assert logits.dtype == dtype_from_name(dtype_name)


def test_dtype_argument_overrides_model_args(model_dir: Path) -> None:
    model = load_model(ModelArguments(model_name_or_path=str(model_dir), dtype="bf16"), dtype=torch.float32)
    assert model.dtype == torch.float32


def test_trainable_turns_the_cache_off(model_dir: Path) -> None:
    args = ModelArguments(model_name_or_path=str(model_dir))
    assert load_model(args).config.use_cache
    assert not load_model(args, trainable=True).config.use_cache


@pytest.mark.parametrize("kind", ["causal_lm", "value", "reward"])
def test_lora_trains_adapters_and_head_only(model_dir: Path, kind: str) -> None:
    args = ModelArguments(model_name_or_path=str(model_dir), dtype="fp32", lora_rank=4)
    model = load_model(args, kind, trainable=True)
    trainable = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
    total = sum(p.numel() for p in model.parameters())
    assert trainable
    assert all("lora_" in name or ".score." in name for name in trainable)
    assert any(".score." in name for name in trainable) == (kind != "causal_lm")
    assert sum(trainable.values()) < total / 10
    model(**_inputs()).logits.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


def test_missing_model_dir_names_the_field(tmp_path: Path) -> None:
    for path in (tmp_path / "absent", tmp_path):
        with pytest.raises(FileNotFoundError, match=r"model_args\.model_name_or_path") as error:
            load_model(ModelArguments(model_name_or_path=str(path)))
        assert str(path) in str(error.value)


def test_dtype_from_name_rejects_unknown_names() -> None:
    assert dtype_from_name("bf16") == torch.bfloat16
    with pytest.raises(ValueError, match="fp32"):
        dtype_from_name("float64")


def test_lora_merge_honours_fan_in_fan_out() -> None:
    # GPT-2's Conv1D layers store their weight as [in, out], so peft's delta B @ A ([out, in]) is added transposed.
    # The attention output projection c_proj is square (8 x 8): a missing transpose would keep the shape but be wrong.
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    from roll.models.hf_weights import hf_named_weights

    torch.manual_seed(0)
    config = GPT2Config(n_embd=8, n_layer=1, n_head=2, n_positions=16, vocab_size=32)
    lora = LoraConfig(r=2, lora_alpha=4, target_modules=["attn.c_proj"], fan_in_fan_out=True)
    model = get_peft_model(GPT2LMHeadModel(config), lora)
    layer = model.base_model.model.transformer.h[0].attn.c_proj
    torch.nn.init.normal_(layer.lora_B["default"].weight)
    base = layer.base_layer.weight.detach().clone()
    a, b = layer.lora_A["default"].weight.detach(), layer.lora_B["default"].weight.detach()
    merged = {name: tensor.clone() for name, tensor in hf_named_weights(model)}
    # scaling = lora_alpha / r = 2.
    expected = base + 2.0 * (b @ a).T
    assert not torch.allclose(expected, base + 2.0 * (b @ a), atol=1e-3)
    torch.testing.assert_close(merged["transformer.h.0.attn.c_proj.weight"], expected)
    reference = model.merge_and_unload().state_dict()
    for name, tensor in merged.items():
        torch.testing.assert_close(tensor, reference[name], msg=name)


@pytest.mark.parametrize("lora_rank", [0, 4])
def test_reward_score_is_read_at_the_last_attended_token_whatever_pads_the_row(model_dir: Path, lora_rank: int) -> None:
    # pad == eos (Qwen2.5 base): the row ends in a sampled EOS followed by EOS padding. transformers would read the
    # token before the final EOS; the score must be the head's output at the EOS itself.
    model = load_model(ModelArguments(model_name_or_path=str(model_dir), dtype="fp32", lora_rank=lora_rank), "reward")
    eos = model.config.eos_token_id
    model.config.pad_token_id = eos
    input_ids = torch.tensor([[5, 6, 7, eos, eos, eos], [5, 6, 7, 8, 9, eos]])
    attention_mask = torch.tensor([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]])
    rows = zip(input_ids, (4, 6), strict=True)
    with torch.no_grad():
        scores = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0]
        hidden = [model(input_ids=row[None, :n], output_hidden_states=True).hidden_states[-1][0, -1] for row, n in rows]
        expected = [classification_head(model)(h)[0] for h in hidden]
    assert scores.tolist() == pytest.approx([e.item() for e in expected], abs=1e-5)
