"""Batches whose episodes take a variable number of rows: an agent episode whose history was rewritten trains one row
per segment, each with the episode's reward.

Such a batch carries `episode_index` (long `[B]`): the rows of one episode are adjacent and share it, and episode
`e` belongs to GRPO group `e // n`. Statistics over episodes (group means and stds, reward normalisation) take one
value per episode, so an episode of many segments weighs no more than one of a single segment; `EpisodeRows` maps
between rows and episodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

EPISODE_INDEX = "episode_index"


@dataclass(frozen=True)
class EpisodeRows:
    """The episodes of a batch's rows: `row_episode` (long `[B]`, each row's episode in 0..E-1) and `last` (long
    `[E]`, each episode's last row)."""

    row_episode: torch.Tensor
    last: torch.Tensor

    @classmethod
    def of(cls, episode_index: torch.Tensor) -> EpisodeRows:
        """The episodes of `episode_index` (adjacent rows of one episode share their index)."""
        _, row_episode = torch.unique_consecutive(episode_index, return_inverse=True)
        episodes = int(row_episode.max()) + 1 if row_episode.numel() else 0
        rows = torch.arange(len(row_episode))
        last = torch.zeros(episodes, dtype=torch.long).scatter_reduce(0, row_episode, rows, "amax")
        return cls(row_episode, last)

    def is_last(self) -> torch.Tensor:
        """Bool `[B]`: the rows that are their episode's last."""
        flags = torch.zeros(len(self.row_episode), dtype=torch.bool)
        flags[self.last] = True
        return flags

    def per_episode(self, values: torch.Tensor) -> torch.Tensor:
        """`values[B]` (equal over an episode's rows) as one value per episode: its last row's."""
        return values[self.last]

    def to_rows(self, values: torch.Tensor) -> torch.Tensor:
        """One value per episode `[E]` given to each of its rows `[B]`."""
        return values[self.row_episode]

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        """`values[B]` summed over each episode's rows `[E]`."""
        return torch.zeros(len(self.last), dtype=values.dtype).index_add(0, self.row_episode, values)


def episode_groups(episode_index: torch.Tensor, group_size: int) -> torch.Tensor:
    """Each row's GRPO group: its episode's, the episodes of a group being `group_size` consecutive ones."""
    return torch.div(episode_index, group_size, rounding_mode="floor")
