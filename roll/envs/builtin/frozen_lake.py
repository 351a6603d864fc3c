"""frozen_lake: gymnasium's FrozenLake-v1 on a 4x4 map, rendered as text, moved with `L D R U`.

The observation is the map, one row a line, the player's square shown as `P`: `S` start, `F` frozen,
`H` hole, `G` goal. An action's last word `L D R U` or `left down right up` (any case) moves; any
other action is answered `invalid` above the map, counted in `invalid_action`, and spends the turn.

Rewards: gymnasium's schedule by default, 1 at the goal and 0 elsewhere; a turn discount
(`env.turn_gamma` under GAE) makes shorter paths worth more. `hole_reward` and `step_reward` shape
it. Measured with the agentic_frozen_lake recipe (docs/agentic.md): with a hole at -1 and a step at
-0.01, a weak warm start learned to wander until the turn limit rather than risk a hole (sampled
success 0.09 -> 0.02 in 8 steps at lr 5e-4); with gymnasium's schedule it rose.

`random_map=True` draws each episode's map from its seed (gymnasium's `generate_random_map`), so
held-out seeds are maps not seen in training; by default the map is gymnasium's fixed 4x4 one.
`is_slippery=True` makes moves slip sideways with probability 2/3, drawn from the seed.
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from typing import Any

from roll.envs.protocol import INVALID_ACTION, SUCCESS, ResetResult, StepResult
from roll.envs.registry import register_env

_MOVES = {"l": 0, "left": 0, "d": 1, "down": 1, "r": 2, "right": 2, "u": 3, "up": 3}  # gymnasium's action ids
_MOVE = re.compile(r"\b(left|down|right|up|l|d|r|u)\b", re.IGNORECASE)
SIZE = 4


@register_env("frozen_lake")
class FrozenLakeEnv:
    """FrozenLake-v1 4x4 as text; `max_turns` turns at most (truncated after)."""

    def __init__(
        self,
        is_slippery: bool = False,
        random_map: bool = False,
        max_turns: int = 10,
        goal_reward: float = 1.0,
        hole_reward: float = 0.0,
        step_reward: float = 0.0,
    ) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns ({max_turns}) must be at least 1")
        self.is_slippery = is_slippery
        self.random_map = random_map
        self.max_turns = max_turns
        self.rewards = {"G": goal_reward, "H": hole_reward}
        self.step_reward = step_reward
        self.turns = 0
        self._gym: Any = None if random_map else self._make(None)

    def reset(self, seed: int | None = None) -> ResetResult:
        """A new episode; with `random_map`, on the map drawn from `seed`."""
        if self.random_map:
            from gymnasium.envs.toy_text.frozen_lake import generate_random_map

            self._gym = self._make(generate_random_map(size=SIZE, seed=seed))
        self._gym.reset(seed=seed)
        self.turns = 0
        return self.render(), {}

    def step(self, action: str) -> StepResult:
        """Move by the action's last move word."""
        self.turns += 1
        moves = _MOVE.findall(action)
        if moves:
            _, _, terminated, _, _ = self._gym.step(_MOVES[moves[-1].lower()])
            tile = self.tile()
            observation, reward = self.render(), self.rewards.get(tile, self.step_reward)
        else:
            terminated, tile = False, self.tile()
            observation, reward = f"invalid\n{self.render()}", self.step_reward
        truncated = not terminated and self.turns >= self.max_turns
        info: dict[str, Any] = {INVALID_ACTION: int(not moves)}
        if terminated or truncated:
            info[SUCCESS] = float(tile == "G")
        return observation, reward, terminated, truncated, info

    def tile(self) -> str:
        """The letter of the player's square."""
        row, col = divmod(int(self._gym.unwrapped.s), SIZE)
        return self._gym.unwrapped.desc[row][col].decode()

    def render(self) -> str:
        """The map, one row a line, with the player's square as `P`."""
        grid = [list(row) for row in self.rows()]
        row, col = divmod(int(self._gym.unwrapped.s), SIZE)
        grid[row][col] = "P"
        return "\n".join("".join(row) for row in grid)

    def rows(self) -> list[str]:
        """The map's rows as letters, without the player."""
        return [b"".join(row).decode() for row in self._gym.unwrapped.desc]

    def best_move(self) -> str:
        """The first move of a shortest path from the player's square to the goal avoiding holes; "" if none."""
        return shortest_path_move(self.rows(), int(self._gym.unwrapped.s))

    def _make(self, desc: list[str] | None) -> Any:
        import gymnasium

        # Our own max_turns ends episodes; gymnasium's TimeLimit (100 steps) never comes into play.
        return gymnasium.make("FrozenLake-v1", desc=desc, map_name=f"{SIZE}x{SIZE}", is_slippery=self.is_slippery)


def shortest_path_move(desc: list[str], position: int) -> str:
    """The first move (`L D R U`) of a shortest path from `position` to the goal that avoids holes; "" if none."""
    goal = next(i for i in range(SIZE * SIZE) if desc[i // SIZE][i % SIZE] == "G")
    first: dict[int, str] = {position: ""}
    frontier = [position]
    while frontier and goal not in first:
        following = []
        for square in frontier:
            row, col = divmod(square, SIZE)
            for move, (dr, dc) in zip("LDRU", ((0, -1), (1, 0), (0, 1), (-1, 0)), strict=True):
                r, c = row + dr, col + dc
                nxt = r * SIZE + c
                if 0 <= r < SIZE and 0 <= c < SIZE and nxt not in first and desc[r][c] != "H":
                    first[nxt] = first[square] or move
                    following.append(nxt)
        frontier = following
    return first.get(goal, "")


def noisy_expert_rows(seeds: Sequence[int], epsilon: float, eos: str, max_turns: int = 10) -> list[dict[str, str]]:
    """SFT rows of non-slippery random-map episodes played by a noisy expert, as the rollout tokenises them
    without a chat template (each map and a newline; each earlier move followed by `eos` as text).

    Each turn the expert takes a shortest path's move, or with probability `epsilon` a uniformly random one; the
    row's answer is the move taken, so the warm start imitates the noise too and leaves RL room to improve.
    """
    rows = []
    env = FrozenLakeEnv(random_map=True, max_turns=max_turns)
    for seed in seeds:
        rng = random.Random(seed)
        observation, _ = env.reset(seed)
        prompt = observation + "\n"
        for _ in range(max_turns):
            best = env.best_move()
            move = rng.choice("LDRU") if rng.random() < epsilon or not best else best
            rows.append({"prompt": prompt, "answer": move})
            observation, _, terminated, truncated, _ = env.step(move)
            if terminated or truncated:
                break
            prompt += f"{move}{eos}{observation}\n"
    return rows
