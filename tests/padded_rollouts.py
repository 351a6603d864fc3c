"""Rollout batches of given real lengths in roll's layout, for the token-budget tests."""

from __future__ import annotations

import torch


def padded_rollout(
    prompt_lengths: list[int], response_lengths: list[int], widths: tuple[int, int], vocab: int, seed: int
) -> tuple[dict[str, torch.Tensor], torch.Generator]:
    """Left-padded prompts and right-padded responses (`widths`) of these real lengths, random ids in [4, vocab).

    Returns the tensors and the generator, which the caller draws its targets (advantages, ...) from.
    """
    generator = torch.Generator().manual_seed(seed)
    (prompt_width, response_width), rows = widths, len(prompt_lengths)
    prompt_mask = (torch.arange(prompt_width) >= prompt_width - torch.tensor(prompt_lengths)[:, None]).long()
    response_mask = (torch.arange(response_width) < torch.tensor(response_lengths)[:, None]).long()
    prompts = torch.randint(4, vocab, (rows, prompt_width), generator=generator) * prompt_mask
    responses = torch.randint(4, vocab, (rows, response_width), generator=generator) * response_mask
    tensors = {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "input_ids": torch.cat([prompts, responses], 1),
        "attention_mask": torch.cat([prompt_mask, response_mask], 1),
    }
    return tensors, generator
