"""The log-prob of each token `model.generate` sampled, as vLLM reports it: before any logits processing.

`SampledLogProbs` stands in for the model in `generate_in_micro_batches`; each of its `generate`
calls also asks transformers for the raw logits of every step (`output_logits`, taken before
temperature, top-k, top-p and every other logits processor) and keeps the log-softmax of the
sampled token. That is the distribution of the model itself, vLLM's default `raw_logprobs` and what
a forward pass at `log_prob_temperature: one` scores, whatever the sampling temperature.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from roll.utils.functionals import length_mask


class SampledLogProbs:
    """`model` for generation, recording the log-prob of every sampled token per `generate` call."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.calls: list[torch.Tensor] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)

    def generate(self, input_ids: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        """`model.generate`'s sequences; the sampled tokens' log-probs `[rows, generated]` are kept in `calls`."""
        output = self.model.generate(input_ids=input_ids, output_logits=True, return_dict_in_generate=True, **kwargs)
        sampled = output.sequences[:, input_ids.shape[1] :]
        per_step = [
            torch.log_softmax(logits.float(), dim=-1).gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
            for logits, tokens in zip(output.logits, sampled.T, strict=True)
        ]
        self.calls.append(torch.stack(per_step, dim=1).cpu())
        return output.sequences

    def log_probs(self, lengths: torch.Tensor, width: int) -> torch.Tensor:
        """Every call's log-probs in order, `[rows, width]` (max_new_tokens); 0 after each row's length, as engines
        report them (a row that ended early kept stepping on pad tokens while others ran)."""
        log_probs = torch.cat([F.pad(lp, (0, width - lp.shape[1])) for lp in self.calls])
        return log_probs * length_mask(lengths, width)
