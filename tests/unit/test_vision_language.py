"""Vision-language models in process: the tiny Qwen2.5-VL, image rows and their limits, images reaching every pass
(generation, log-prob passes, training) with the engine's and the trainer's log-probs agreeing, and episodes whose
observations show pictures."""

from __future__ import annotations

import io
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from roll.configs.data_config import DataArguments
from roll.configs.schema import ConfigError
from roll.configs.worker_config import GeneratingArguments, ModelArguments, StrategyArguments, WorkerConfig
from roll.datasets.image_prompts import encode_image_rows
from roll.datasets.prompt_dataset import encode_demonstrations, encode_prompts, load_splits
from roll.datasets.sources import Source
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.hf_compute import forward_in_micro_batches, optimizer_step_losses
from roll.distributed.strategy.hf_strategy import HfInferStrategy
from roll.distributed.strategy.registry import strategy_class
from roll.distributed.strategy.response_scores import log_probs_forward
from roll.models.hf_weights import hf_named_weights
from roll.models.model_providers import load_model
from roll.models.processors import is_vision_language, load_processor
from roll.models.tiny_vlm import make_tiny_vlm
from roll.models.vision_inputs import IMAGE_GRID_THW, PIXEL_VALUES
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.multi_turn import MultiTurnRollout
from roll.pipeline.base.dry_run.backend_ranks import _model_params
from roll.pipeline.base.dry_run.model_shape import model_shape
from roll.pipeline.base.rl_workers import split_generation
from roll.pipeline.rlvr.rlvr_config import RLVRConfig
from roll.utils.functionals import masked_mean, response_log_probs

MAX_NEW = 4


@pytest.fixture(scope="module")
def vlm_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny Qwen2.5-VL built once for the module."""
    return make_tiny_vlm(tmp_path_factory.mktemp("tiny_vlm") / "qwen2_5_vl")


@pytest.fixture(scope="module")
def splits(vlm_dir: Path) -> tuple[list, list]:
    """The built-in visual_count task processed for the tiny VLM."""
    data = DataArguments(task="visual_count", max_prompt_length=64)
    return load_splits(data, load_processor(str(vlm_dir)), processor=load_processor(str(vlm_dir)))


def hf_infer(model: torch.nn.Module, model_path: Path) -> HfInferStrategy:
    """An hf_infer strategy around `model`, micro-batches of 2 prompts."""
    strategy = HfInferStrategy.__new__(HfInferStrategy)
    strategy.model, strategy.device = model.eval(), torch.device("cpu")
    strategy.worker_config = SimpleNamespace(
        name="actor_infer", infer_batch_size=2, model_args=SimpleNamespace(model_name_or_path=str(model_path))
    )
    return strategy


def test_tiny_vlm_is_a_qwen2_5_vl_with_a_vision_tower(vlm_dir: Path) -> None:
    """The directory loads as transformers' Qwen2.5-VL, through the processor path real checkpoints take."""
    model = load_model(ModelArguments(model_name_or_path=str(vlm_dir), dtype="fp32"))
    assert type(model).__name__ == "Qwen2_5_VLForConditionalGeneration"
    assert sum(p.numel() for p in model.model.visual.parameters()) > 10_000
    assert is_vision_language(str(vlm_dir)) and is_vision_language("tiny://qwen2_5_vl")
    assert not is_vision_language("tiny://qwen2")
    processor = load_processor(str(vlm_dir))
    assert processor.image_token_id == model.config.image_token_id
    # The dry run counts every parameter, the vision tower's included, from the reference and from the directory.
    total, visual = sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.model.visual.parameters())
    assert model_shape("tiny://qwen2_5_vl").param_count() == model_shape(str(vlm_dir)).param_count() == total
    assert model_shape(str(vlm_dir)).vision_params == visual
    # A frozen tower has no optimizer states: the memory estimate trains the rest only.
    role = WorkerConfig(model_args=ModelArguments(model_name_or_path=str(vlm_dir)))
    assert _model_params(role, model_shape(str(vlm_dir)), "causal_lm") == (total, total - visual)
    role.model_args.freeze_vision_tower = False
    assert _model_params(role, model_shape(str(vlm_dir)), "causal_lm") == (total, total)


def test_visual_task_rows_carry_their_images(splits: tuple[list, list]) -> None:
    """Each example holds its prompt's image tokens and the pixels and grid that fill them; splits differ."""
    train, held_out = splits
    assert len(train) == 512 and len(held_out) == 128
    example = train[0]
    grid = example.image_grid_thw
    assert grid.shape == (1, 3) and example.pixel_values.shape[0] == int(grid.prod())
    batch = encode_prompts(train[:3], pad_id=0)
    assert list(batch.non_tensor_batch) == ["prompt", "answer", "domain", PIXEL_VALUES, IMAGE_GRID_THW]
    assert {e.answer for e in train} == {"1", "2", "3", "4"}
    train_pixels = {e.pixel_values.tobytes() for e in train}
    assert not any(e.pixel_values.tobytes() in train_pixels for e in held_out)


def test_a_corrupt_or_oversized_image_is_refused_naming_its_row(vlm_dir: Path, tmp_path: Path) -> None:
    """Checked as the data is read: a file that is no image, and one above data.max_image_pixels, each by row."""
    processor = load_processor(str(vlm_dir))
    data = DataArguments(max_image_pixels=100 * 100)
    good = io.BytesIO()
    Image.new("RGB", (40, 40), "red").save(good, format="PNG")
    corrupt = tmp_path / "corrupt.png"
    corrupt.write_bytes(b"not a png at all")
    big = tmp_path / "big.png"
    Image.new("RGB", (200, 120), "blue").save(big)

    def row(image: object) -> dict:
        content = [{"type": "image"}, {"type": "text", "text": "colour?"}]
        return {"messages": [{"role": "user", "content": content}], "images": [image], "answer": "red"}

    source = Source("data.train_file='rows.jsonl'")
    encoded = encode_image_rows([row(good.getvalue())], processor, data, source)
    assert encoded[0]["image_grid_thw"].shape == (1, 3)
    with pytest.raises(ConfigError, match=r"row 1: its image 0 cannot be read"):
        encode_image_rows([row(good.getvalue()), row(str(corrupt))], processor, data, source)
    with pytest.raises(ConfigError, match=r"row 2: its image 0 is 200x120 = 24000 pixels, more than data.max_image"):
        encode_image_rows([row(good.getvalue()), row(good.getvalue()), row(str(big))], processor, data, source)
    two = row(str(big))
    two["messages"][0]["content"].insert(0, {"type": "image", "image": str(big)})
    with pytest.raises(
        ConfigError, match=r"rows.jsonl' row 0: it has 2 images, more than data.max_images_per_prompt=1"
    ):
        encode_image_rows([two], processor, DataArguments(max_images_per_prompt=1), source)


def test_engine_and_trainer_log_probs_agree_on_image_prompts(vlm_dir: Path, splits: tuple[list, list]) -> None:
    """hf_infer samples from image prompts (images repeated per sample); the log-probs it reports are those a
    forward pass over [prompt | response] with the same pixels and Qwen's multimodal positions gives."""
    model = load_model(ModelArguments(model_name_or_path=str(vlm_dir), dtype="fp32"))
    prompts = encode_prompts(splits[0][:3], pad_id=0)
    args = GeneratingArguments(max_new_tokens=MAX_NEW, num_return_sequences=2, seed=0)
    generation = hf_infer(model, vlm_dir).generate_with_log_probs(prompts, args)
    assert generation.output_ids.shape[0] == 6
    repeated = prompts.repeat(2, interleave=True)
    rollout = DataProto.from_dict(
        tensors=split_generation(generation, repeated.batch["attention_mask"]),
        non_tensors=repeated.non_tensor_batch,
    )
    trainer = forward_in_micro_batches(model, rollout, log_probs_forward, 4, "cpu")["log_probs"]
    mask = rollout.batch["response_mask"].bool()
    assert mask.sum() >= 6
    torch.testing.assert_close(generation.log_probs[mask], trainer[mask], atol=1e-4, rtol=1e-4)
    # Other pixels under the same ids score differently: the images reach the pass.
    blank = rollout.non_tensor_batch[PIXEL_VALUES].copy()
    for i in range(len(blank)):
        blank[i] = np.zeros_like(blank[i])
    other = DataProto.from_dict(
        tensors=dict(rollout.batch), non_tensors={**rollout.non_tensor_batch, PIXEL_VALUES: blank}
    )
    changed = forward_in_micro_batches(model, other, log_probs_forward, 4, "cpu")["log_probs"]
    assert not torch.allclose(changed[mask], trainer[mask], atol=1e-4)


def test_training_with_images_freezes_or_trains_the_vision_tower(vlm_dir: Path, splits: tuple[list, list]) -> None:
    """An SFT loss on image rows back-propagates into the decoder always and into the vision tower only when
    model_args.freeze_vision_tower=false."""
    batch = encode_demonstrations(splits[0][:2], pad_id=0)
    for frozen in (True, False):
        args = ModelArguments(model_name_or_path=str(vlm_dir), dtype="fp32", freeze_vision_tower=frozen)
        model = load_model(args, trainable=True).train()

        def loss_func(micro_batch: DataProto, output: object) -> tuple[torch.Tensor, dict]:
            width = micro_batch.batch["responses"].shape[1]
            log_probs = response_log_probs(output.logits, micro_batch.batch["input_ids"], width)
            return -masked_mean(log_probs, micro_batch.batch["response_mask"]), {}

        for loss, _, _ in optimizer_step_losses(model, batch, loss_func, 2, "cpu"):
            loss.backward()
        visual = [p for p in model.model.visual.parameters()]
        assert all(p.requires_grad != frozen for p in visual)
        assert (all(p.grad is None for p in visual)) == frozen
        assert model.lm_head.weight.grad is not None and model.lm_head.weight.grad.abs().sum() > 0


def test_generation_engines_refuse_a_vision_language_model(vlm_dir: Path) -> None:
    """vLLM takes token ids alone in roll: a vision-language role on it is a config error naming the field (SGLang,
    the other engine, is refused on CPU before this check could be reached)."""
    for name in ("vllm",):
        role = WorkerConfig(
            model_args=ModelArguments(model_name_or_path=str(vlm_dir)),
            strategy_args=StrategyArguments(strategy_name=name),
        )
        role.name = "actor_infer"
        with pytest.raises(ConfigError, match=rf"actor_infer.strategy_args.strategy_name={name}: .* vision-language"):
            strategy_class(name).check_config(role)


def test_image_observations_are_appended_without_loss(vlm_dir: Path) -> None:
    """Episodes of framed_colour played by the tiny VLM (hf_infer): each picture's tokens are in the trajectory
    with loss mask 0, the row carries every picture's pixels in order, and a forward pass over the episode batch
    with them gives the log-probs the engine reported for the sampled tokens."""
    model = load_model(ModelArguments(model_name_or_path=str(vlm_dir), dtype="fp32"))
    processor = load_processor(str(vlm_dir))
    strategy = hf_infer(model, vlm_dir)
    env = EnvArguments(
        name="framed_colour", max_turns=2, max_trajectory_tokens=96, max_observation_tokens=80, apply_chat_template=True
    )

    turns = []

    def generate(request: DataProto, args: GeneratingArguments) -> DataProto:
        turns.append([len(grid) for grid in request.non_tensor_batch[IMAGE_GRID_THW]])  # the pictures so far
        generation = strategy.generate_with_log_probs(request, args)
        tensors = split_generation(generation, request.batch["attention_mask"])
        return DataProto.from_dict(tensors={**tensors, "engine_log_probs": generation.log_probs})

    rollout = MultiTurnRollout(env, processor.tokenizer, 0, with_engine_log_probs=True, processor=processor)
    args = GeneratingArguments(max_new_tokens=4, seed=0)
    batch, _ = rollout.run(generate, [0, 1, 2], args, base_seed=0)
    assert turns[0] == [1, 1, 1] and turns[1] == [2] * len(turns[1])
    image_token = processor.image_token_id
    responses, mask = batch.batch["responses"], batch.batch["response_mask"]
    grids = batch.non_tensor_batch[IMAGE_GRID_THW]
    second_pictures = 0
    for row in range(len(batch)):
        in_response = responses[row] == image_token
        assert not (mask[row].bool() & in_response).any()  # no loss on an observation's image tokens
        second_pictures += int(in_response.any())
        assert len(grids[row]) == 1 + int(in_response.any())  # the prompt's picture, and the second one's
        assert (batch.batch["prompts"][row] == image_token).sum() == 9
    assert second_pictures >= 1
    trainer = forward_in_micro_batches(model, batch, log_probs_forward, 4, "cpu")["log_probs"]
    sampled = mask.bool()
    torch.testing.assert_close(batch.batch["engine_log_probs"][sampled], trainer[sampled], atol=1e-4, rtol=1e-4)


def test_a_vision_language_critic_is_a_config_error(vlm_dir: Path) -> None:
    """roll builds no value head on a vision-language model: such a critic is refused naming the field."""
    config = SimpleNamespace(critic=WorkerConfig(model_args=ModelArguments(model_name_or_path=str(vlm_dir))))
    with pytest.raises(ConfigError, match=r"critic.model_args.model_name_or_path=.* vision-language model"):
        RLVRConfig._check_vision_language_critic(config)
    config.critic = WorkerConfig(model_args=ModelArguments(model_name_or_path="tiny://qwen2"))
    RLVRConfig._check_vision_language_critic(config)


def test_the_weight_sync_carries_the_vision_tower(vlm_dir: Path) -> None:
    """What a trainer streams (`hf_named_weights`) loads into hf_infer by name, the vision tower's weights included."""
    trainer = load_model(ModelArguments(model_name_or_path=str(vlm_dir), dtype="fp32", freeze_vision_tower=False))
    with torch.no_grad():
        for param in trainer.parameters():
            param.add_(0.01)
    model = load_model(ModelArguments(model_name_or_path=str(vlm_dir), dtype="fp32"))
    engine = hf_infer(model, vlm_dir)
    engine.weight_shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    weights = list(hf_named_weights(trainer))
    assert any(".visual." in name for name, _ in weights)
    engine.load_weights(weights)
    for (name, synced), (_, sent) in zip(model.named_parameters(), trainer.named_parameters(), strict=True):
        assert torch.equal(synced, sent), name


def test_data_files_with_images_load_as_the_pipelines_read_them(vlm_dir: Path, tmp_path: Path) -> None:
    """A JSONL of chat messages with image paths, and a `datasets` table whose `images` column is an Image feature
    (as a hub dataset's) under a text prompt with an `<image>` marker, become examples with pixels."""
    import datasets

    picture = tmp_path / "red.png"
    Image.new("RGB", (56, 56), "red").save(picture)
    content = [{"type": "image", "image": str(picture)}, {"type": "text", "text": "colour?"}]
    rows = [{"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "red"}]}] * 2
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    processor = load_processor(str(vlm_dir))
    jsonl = DataArguments(train_file=str(tmp_path / "rows.jsonl"), eval_file=str(tmp_path / "rows.jsonl"))
    jsonl.prompt_key, jsonl.max_prompt_length = "messages", 64
    train, _ = load_splits(jsonl, processor.tokenizer, processor=processor)
    assert train[0].answer == "red" and train[0].image_grid_thw.tolist() == [[1, 4, 4]]

    features = datasets.Features(
        {"problem": datasets.Value("string"), "images": [datasets.Image()], "answer": datasets.Value("string")}
    )
    table = datasets.Dataset.from_dict(
        {"problem": ["<image>What colour?"] * 2, "images": [[str(picture)]] * 2, "answer": ["red"] * 2},
        features=features,
    )
    table.save_to_disk(tmp_path / "table")
    hub_like = DataArguments(
        train_file=str(tmp_path / "table"), eval_file=str(tmp_path / "table"), prompt_key="problem"
    )
    hub_like.max_prompt_length = 64
    train, _ = load_splits(hub_like, processor.tokenizer, processor=processor)
    assert "<image>" not in train[0].prompt and train[0].pixel_values.shape == (16, 1176)
