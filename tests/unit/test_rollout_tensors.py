"""Rollout tensors from generations, and forward passes that never run with dropout."""

from __future__ import annotations

import math
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from roll.configs.worker_config import GeneratingArguments
from roll.datasets.responses import response_texts
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.hf_compute import forward_in_micro_batches
from roll.distributed.strategy.response_scores import LOG_PROB_TEMPERATURE
from roll.distributed.strategy.strategy import Generation, InferenceStrategy
from roll.models.model_providers import load_tokenizer
from roll.models.tiny import build_char_tokenizer
from roll.pipeline.base.evaluation import answer_scorer
from roll.pipeline.base.rl_workers import ActorWorker, split_generation
from tests.unit.test_hf_sampled_log_probs import prompts, strategy
from tests.unit.test_token_budget_equivalence import load, model_dir  # noqa: F401 (the fixture)

EOS = PAD = 0
MAX_NEW = 8
# Generation configs laid out as real models' are, their ids named by where they occur in the free-running greedy
# samples (row, step), so that samples end at different steps and some reach max_new_tokens: the EOS ids (an int
# when one), the pad id ("eos": the last EOS; None: no pad, padding is the first EOS) and stop-string tokens.
LAYOUTS = {
    "eos list, no pad (Llama-3-Instruct)": ([(0, 0), (1, 2)], None, []),
    "eos list, pad = second eos (Qwen2.5-Instruct)": ([(0, 0), (1, 2)], "eos", []),
    "pad = eos (Qwen2.5 base)": ([(1, 2)], "eos", []),
    "stop string, pad = eos": ([(4, 0)], "eos", [(2, 2)]),
}


def test_prompt_mask_is_carried_not_rebuilt_from_the_pad_id() -> None:
    # Left-padded prompt [PAD, 5, EOS, 6]: its EOS (a chat template's turn end, pad = eos) is attended.
    prompt_mask = torch.tensor([[0, 1, 1, 1]])
    output = torch.tensor([[PAD, 5, EOS, 6, 7, EOS, PAD]])
    tensors = split_generation(Generation(output, torch.tensor([2]), torch.tensor([False])), prompt_mask)
    assert tensors["attention_mask"].tolist() == [[0, 1, 1, 1, 1, 1, 0]]
    assert tensors["response_mask"].tolist() == [[1, 1, 0]]
    assert tensors["input_ids"].tolist() == output.tolist()


@pytest.mark.parametrize("layout", LAYOUTS)
def test_response_masks_and_stop_reasons_come_from_what_was_sampled(model_dir: Path, layout: str) -> None:  # noqa: F811
    """The mask is 1 exactly on the sampled tokens (final EOS or stop token included), whatever the EOS and pad ids."""
    hf = strategy(load(model_dir), model_dir)
    batch = prompts(hf.model.config.vocab_size)
    config = hf.model.generation_config
    config.eos_token_id, config.pad_token_id = None, 0
    free = hf.generate(batch, GeneratingArguments(max_new_tokens=MAX_NEW, do_sample=False)).output_ids[:, 5:]
    eos_at, pad, stop_at = LAYOUTS[layout]
    eos_ids = [int(free[row, step]) for row, step in eos_at]
    stop_ids = [int(free[row, step]) for row, step in stop_at]
    config.eos_token_id = eos_ids if len(eos_ids) > 1 else eos_ids[0]
    config.pad_token_id = eos_ids[-1] if pad == "eos" else None
    stop_strings = [load_tokenizer(str(model_dir)).decode([i]) for i in stop_ids]
    args = GeneratingArguments(max_new_tokens=MAX_NEW, do_sample=False, stop_strings=stop_strings)

    ends = torch.isin(free, torch.tensor(eos_ids + stop_ids))
    truncated = ~ends.any(-1)
    lengths = torch.where(truncated, MAX_NEW, ends.int().argmax(-1) + 1)
    assert truncated.any() and not truncated.all() and len(set(lengths.tolist())) > 2
    rollout = ActorWorker.to_rollout(SimpleNamespace(), batch, hf.generate(batch, args), args).batch
    mask = torch.arange(MAX_NEW) < lengths[:, None]
    assert rollout["response_mask"].tolist() == mask.long().tolist()
    assert rollout["truncated"].tolist() == truncated.tolist()
    assert torch.equal(rollout["attention_mask"][:, 5:], rollout["response_mask"])
    assert torch.equal(rollout["responses"][mask], free[mask])
    assert (rollout["responses"][~mask] == (eos_ids[0] if pad is None else eos_ids[-1])).all()
    recorded = hf.generate_with_log_probs(batch, args)
    assert torch.equal(recorded.response_lengths, lengths) and torch.equal(recorded.truncated, truncated)
    assert (recorded.log_probs[mask] < 0).all() and (recorded.log_probs[~mask] == 0).all()


def test_responses_are_decoded_up_to_their_mask_not_a_pad_id() -> None:
    """Held-out scoring (and the reward workers) read each response through its mask: the engine's padding may be
    any id (here an ordinary token, "3"), not this tokenizer's pad."""
    tokenizer = build_char_tokenizer()
    sampled = tokenizer("= 12", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    pad = tokenizer.convert_tokens_to_ids("3")
    responses = torch.tensor([sampled + [pad] * 3])
    mask = torch.tensor([[1] * len(sampled) + [0] * 3])
    batch = DataProto.from_dict(
        tensors={"responses": responses, "response_mask": mask}, non_tensors={"answer": np.array(["12"], dtype=object)}
    )
    assert response_texts(tokenizer, batch) == ["= 12"]
    assert answer_scorer(tokenizer)(batch).tolist() == [1.0]


class DropoutLM(torch.nn.Module):
    """Logits through a dropout layer: different on every call in train mode."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(8, 8)
        self.dropout = torch.nn.Dropout(0.5)

    def forward(self, input_ids: torch.Tensor, **_: object) -> SimpleNamespace:
        return SimpleNamespace(logits=self.dropout(self.embed(input_ids)))


def test_forward_passes_run_in_eval_mode_after_training() -> None:
    model = DropoutLM().train()  # as a training strategy leaves it after an update
    batch = DataProto.from_dict(
        tensors={"input_ids": torch.arange(8).reshape(2, 4), "attention_mask": torch.ones(2, 4)}
    )

    def logits(micro_batch: DataProto, output: SimpleNamespace) -> tuple[None, dict[str, torch.Tensor]]:
        return None, {"logits": output.logits}

    first = forward_in_micro_batches(model, batch, logits, 1, "cpu")["logits"]
    second = forward_in_micro_batches(model, batch, logits, 2, "cpu")["logits"]
    assert torch.equal(first, second)
    assert torch.equal(first, model.embed(batch.batch["input_ids"]).detach())


class _FixedLogitsStrategy:
    """Runs the worker's forward function on fixed logits: token 1 three times as likely as token 0."""

    response_log_probs = InferenceStrategy.response_log_probs

    def forward_step(self, batch: DataProto, forward_func: Any) -> dict[str, torch.Tensor]:
        logits = torch.tensor([0.0, math.log(3.0)]).expand(*batch.batch["input_ids"].shape, 2)
        return forward_func(batch, SimpleNamespace(logits=logits))[1]


@pytest.mark.parametrize(("temperature", "p_token1"), [(1.0, 0.75), (2.0, math.sqrt(3) / (1 + math.sqrt(3)))])
def test_log_probs_are_taken_at_the_batch_log_prob_temperature(temperature: float, p_token1: float) -> None:
    batch = DataProto.from_dict(
        tensors={"input_ids": torch.tensor([[0, 1, 1]]), "responses": torch.tensor([[1, 1]])},
        meta_info={LOG_PROB_TEMPERATURE: temperature},
    )
    worker = SimpleNamespace(strategy=_FixedLogitsStrategy(), compute_seconds=0.0)
    log_probs = ActorWorker.compute_log_probs(worker, batch).batch["log_probs"]
    torch.testing.assert_close(log_probs, torch.full((1, 2), math.log(p_token1)))


def test_held_out_answers_that_are_not_mathematics_score_by_exact_match() -> None:
    tokenizer = build_char_tokenizer()
    texts, answers = ["D", "<calc 12*34>", "L", " 408"], ["D", "<calc 12*34>", "R", "408"]
    rows = [tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] for text in texts]
    width = max(map(len, rows))
    responses = torch.tensor([row + [0] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    batch = DataProto.from_dict(
        tensors={"responses": responses, "response_mask": mask}, non_tensors={"answer": np.array(answers, dtype=object)}
    )
    assert answer_scorer(tokenizer)(batch).tolist() == [1.0, 1.0, 0.0, 1.0]


def test_sampling_seeds_continue_across_data_parallel_workers() -> None:
    """Two dp ranks given identical prompts must not sample identical tokens: each rank's rows are seeded from
    where the previous rank's rows end (vLLM seeds prompt i with seed + i * n), and rank 0 keeps the seed."""
    seen: dict[int, GeneratingArguments] = {}

    def worker(dp_rank: int) -> SimpleNamespace:
        def generate(batch: DataProto, args: GeneratingArguments) -> Generation:
            seen[dp_rank] = args
            rows = len(batch) * args.num_return_sequences
            return Generation(torch.zeros(rows, 4, dtype=torch.long), torch.ones(rows, dtype=torch.long), None)

        fake = SimpleNamespace(rank_info=SimpleNamespace(dp_rank=dp_rank), strategy=SimpleNamespace(generate=generate))
        fake.to_rollout = lambda batch, generation, args: batch
        return fake

    shard = DataProto.from_dict(
        tensors={"input_ids": torch.ones(3, 2, dtype=torch.long), "attention_mask": torch.ones(3, 2, dtype=torch.long)}
    )
    args = GeneratingArguments(num_return_sequences=2, seed=7)
    for dp_rank in (0, 1):
        ActorWorker.generate.__wrapped__(worker(dp_rank), shard, args)  # type: ignore[attr-defined]
    assert (seen[0].seed, seen[1].seed) == (7, 7 + 3 * 2)
    unseeded = GeneratingArguments(seed=None)
    ActorWorker.generate.__wrapped__(worker(1), shard, unseeded)  # type: ignore[attr-defined]
    assert seen[1].seed is None
