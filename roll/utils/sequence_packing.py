"""Sequence packing: the attended tokens of padded rows concatenated into one row, and model outputs mapped back.

The packed row carries each sequence's own position ids (restarting at 0), which is what keeps attention
inside each sequence: transformers builds a block-diagonal causal mask from position ids that restart
when no attention mask is given (sdpa, eager), and flash-attention's varlen kernel takes `cu_seqlens`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PackedRows:
    """Rows of a padded batch `[n, W]` packed into one row `[1, L]`, L = attended tokens in all rows."""

    input_ids: torch.Tensor  # [1, L]
    position_ids: torch.Tensor  # [1, L]
    index: torch.Tensor  # [n, W]: packed position of each padded position (0 where not attended)
    attended: torch.Tensor  # [n, W] bool
    cu_seqlens: torch.Tensor  # [n + 1] int32: where each sequence starts in the packed row, then L
    max_length: int  # the longest sequence

    def flash_attention_kwargs(self) -> dict[str, torch.Tensor | int]:
        """The varlen keyword arguments transformers passes on to flash-attention (GPU)."""
        return {
            "cu_seq_lens_q": self.cu_seqlens,
            "cu_seq_lens_k": self.cu_seqlens,
            "max_length_q": self.max_length,
            "max_length_k": self.max_length,
        }


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor) -> PackedRows:
    """Concatenate the attended tokens of each row, in row order, with their position ids."""
    attended = attention_mask.bool()
    lengths = attended.sum(-1)
    index = (attended.flatten().long().cumsum(0) - 1).view_as(attended).clamp(min=0).masked_fill(~attended, 0)
    cu_seqlens = torch.zeros(len(lengths) + 1, dtype=torch.int32, device=input_ids.device)
    cu_seqlens[1:] = lengths.cumsum(0)
    return PackedRows(
        input_ids=input_ids[attended].unsqueeze(0),
        position_ids=position_ids[attended].unsqueeze(0),
        index=index,
        attended=attended,
        cu_seqlens=cu_seqlens,
        max_length=int(lengths.max()) if len(lengths) else 0,
    )


def unpack_rows(packed: torch.Tensor, packing: PackedRows) -> torch.Tensor:
    """A packed output `[1, L, ...]` back in the padded layout `[n, W, ...]`, zeros where nothing was attended.

    A gather, so gradients flow back to the packed positions.
    """
    values = packed[0][packing.index]
    attended = packing.attended.view(*packing.attended.shape, *([1] * (values.dim() - 2)))
    return values.masked_fill(~attended, 0)
