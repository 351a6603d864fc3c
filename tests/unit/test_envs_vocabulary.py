"""What the built-in environments say, and the bracket calls tiny models make, fit the tiny tokenizer's characters."""

from __future__ import annotations

from roll.envs import make_env
from roll.models.tiny import DEFAULT_ALPHABET


def observations() -> set[str]:
    """Every kind of observation the built-ins and the calculator tool produce, over a few seeds and actions."""
    seen: set[str] = set()
    actions = {
        "guess_number": ["50", "25", "x", "0", "75", "12", "60", "90"],
        "calculator_arithmetic": ["<calc 12*34>", "<calc 1/0>", "<calc 9**999>", "<sum 1>", "oops", "408"],
        "frozen_lake": ["R", "D", "left", "jump", "U", "D", "R"],
    }
    kwargs = {"frozen_lake": [{}, {"random_map": True, "is_slippery": True}]}
    for name, steps in actions.items():
        for config in kwargs.get(name, [{}]):
            env = make_env(name, config)
            for seed in range(5):
                seen.add(env.reset(seed)[0])
                for action in steps:
                    observation, _, terminated, truncated, _ = env.step(action)
                    seen.add(observation)
                    if terminated or truncated:
                        break
    return seen


def test_built_in_observations_use_only_tiny_model_characters() -> None:
    missing = {char for observation in observations() for char in observation} - set(DEFAULT_ALPHABET)
    assert not missing, f"characters outside roll.models.tiny.DEFAULT_ALPHABET: {sorted(missing)}"


def test_bracket_tool_calls_use_only_tiny_model_characters() -> None:
    missing = set("<calc 123*45>") - set(DEFAULT_ALPHABET)
    assert not missing, f"calculator_arithmetic's default bracket calls need {sorted(missing)}"
