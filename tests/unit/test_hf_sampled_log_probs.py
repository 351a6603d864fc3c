"""hf_infer returns the log-prob of each token it sampled, as a forward pass scores it (vLLM's raw log-probs)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from roll.configs.worker_config import GeneratingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.hf_compute import model_inputs
from roll.distributed.strategy.hf_strategy import HfInferStrategy
from roll.pipeline.base.rl_workers import split_generation
from roll.utils.functionals import response_log_probs
from tests.unit.test_token_budget_equivalence import load, model_dir  # noqa: F401 (the fixture)

MAX_NEW = 6


def strategy(model: torch.nn.Module, model_path: Path) -> HfInferStrategy:
    """An hf_infer strategy around `model`, micro-batches of 3 prompts (so the log-probs of two calls join)."""
    hf = HfInferStrategy.__new__(HfInferStrategy)
    hf.model, hf.device = model.eval(), torch.device("cpu")
    hf.worker_config = SimpleNamespace(
        infer_batch_size=3, model_args=SimpleNamespace(model_name_or_path=str(model_path))
    )
    return hf


def prompts(vocab: int) -> DataProto:
    """Five left-padded prompts of 2 to 5 tokens."""
    generator = torch.Generator().manual_seed(3)
    ids = torch.randint(3, vocab, (5, 5), generator=generator)
    mask = torch.ones(5, 5, dtype=torch.long)
    for row, length in enumerate((5, 2, 4, 3, 5)):
        mask[row, : 5 - length] = 0
    return DataProto.from_dict(tensors={"input_ids": ids * mask, "attention_mask": mask})


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 0.9)])
def test_hf_infer_log_probs_equal_a_forward_pass(model_dir: Path, temperature: float, top_p: float) -> None:  # noqa: F811
    """Sampled at any temperature and top-p, the returned log-probs are the model's own (temperature 1, no top-p)."""
    model = load(model_dir)
    batch = prompts(model.config.vocab_size)
    args = GeneratingArguments(
        max_new_tokens=MAX_NEW, temperature=temperature, top_p=top_p, num_return_sequences=2, seed=0
    )
    generation = strategy(model, model_dir).generate_with_log_probs(batch, args)
    log_probs = generation.log_probs
    assert generation.output_ids.shape == (10, 5 + MAX_NEW) and log_probs.shape == (10, MAX_NEW)
    rollout = split_generation(generation, batch.batch["attention_mask"].repeat_interleave(2, 0))
    with torch.no_grad():
        logits = model(**model_inputs(DataProto.from_dict(tensors=rollout), "cpu")).logits
    expected = response_log_probs(logits, rollout["input_ids"], MAX_NEW)
    mask = rollout["response_mask"].bool()
    assert mask.sum() > 10
    torch.testing.assert_close(log_probs[mask], expected[mask], atol=1e-5, rtol=1e-5)
    assert (log_probs[mask] < 0).all() and (log_probs[~mask] == 0).all()


def test_hf_infer_generates_the_same_tokens_with_and_without_log_probs(model_dir: Path) -> None:  # noqa: F811
    """Recording the log-probs does not change what is sampled under the same seed."""
    hf = strategy(load(model_dir), model_dir)
    batch = prompts(hf.model.config.vocab_size)
    args = GeneratingArguments(max_new_tokens=MAX_NEW, num_return_sequences=2, seed=1)
    plain, recorded = hf.generate(batch, args), hf.generate_with_log_probs(batch, args)
    assert torch.equal(plain.output_ids, recorded.output_ids)
    assert torch.equal(plain.response_lengths, recorded.response_lengths)
