"""guess_number: find a secret integer in [1, n]; each guess is answered `higher`, `lower` or `correct`.

Bisection wins within ceil(log2 n) + 1 guesses, the default turn limit. The secret comes from the
reset's seed. Reward 1 on the correct guess (terminated), 0 otherwise; running out of turns truncates.
An action without a number in [1, n] (its last number counts) is answered `invalid`, counted in
`invalid_action`, and spends the turn.
"""

from __future__ import annotations

import math
import random

from roll.envs.builtin.text import last_integer
from roll.envs.protocol import INVALID_ACTION, SUCCESS, ResetResult, StepResult
from roll.envs.registry import register_env


@register_env("guess_number")
class GuessNumberEnv:
    """Guess the secret in [1, n] within `max_turns` (default ceil(log2 n) + 1)."""

    def __init__(self, n: int = 100, max_turns: int | None = None) -> None:
        if n < 1 or (max_turns is not None and max_turns < 1):
            raise ValueError(f"n ({n}) and max_turns ({max_turns}) must be at least 1")
        self.n = n
        self.max_turns = max_turns or math.ceil(math.log2(n)) + 1
        self.secret = 0
        self.turns = 0

    def reset(self, seed: int | None = None) -> ResetResult:
        """A new secret from `seed`; the observation states the range."""
        self.secret = random.Random(seed).randint(1, self.n)
        self.turns = 0
        return f"guess 1-{self.n}", {}

    def step(self, action: str) -> StepResult:
        """Answer the action's guess."""
        self.turns += 1
        guess = last_integer(action)
        if guess == self.secret:
            return "correct", 1.0, True, False, {INVALID_ACTION: 0, SUCCESS: 1.0}
        invalid = guess is None or not 1 <= guess <= self.n
        observation = "invalid" if invalid else "higher" if guess < self.secret else "lower"
        truncated = self.turns >= self.max_turns
        info = {INVALID_ACTION: int(invalid), **({SUCCESS: 0.0} if truncated else {})}
        return observation, 0.0, False, truncated, info


def bisection_rows(n: int, eos: str) -> list[dict[str, str]]:
    """SFT rows of bisection games against every secret in 1..n: one per turn, `prompt` the episode so far as
    the multi-turn rollout tokenises it without a chat template (`guess 1-n` and a newline, then per earlier
    turn the guess, `eos` as text, the answer and a newline) and `answer` the next guess."""
    rows = []
    env = GuessNumberEnv(n=n)
    for secret in range(1, n + 1):
        observation, _ = env.reset()
        env.secret = secret
        prompt, low, high = observation + "\n", 1, n
        while True:
            guess = (low + high) // 2
            rows.append({"prompt": prompt, "answer": str(guess)})
            observation, _, terminated, truncated, _ = env.step(str(guess))
            if terminated or truncated:
                break
            low, high = (guess + 1, high) if observation == "higher" else (low, guess - 1)
            prompt += f"{guess}{eos}{observation}\n"
    return rows
