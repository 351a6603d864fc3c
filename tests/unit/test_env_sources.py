"""Several environments in one run (`env.sources`): the config checks, the seeded weighted draw, episodes played
by their source's environment in GRPO groups of one source, and the per-source metrics."""

from __future__ import annotations

import copy
from collections import Counter
from typing import Any

import pytest

from roll.configs.schema import ConfigError, from_dict
from roll.configs.worker_config import GeneratingArguments
from roll.envs.protocol import SUCCESS
from roll.envs.registry import register_env
from roll.models.model_providers import load_tokenizer
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.env_rollout import ALL_FAILED_BATCHES_LIMIT, EnvRollouts, held_out_metrics
from roll.pipeline.agentic.multi_turn import MultiTurnRollout
from roll.pipeline.agentic.sources import EnvSource, draw_sources
from tests.unit.test_multi_turn import ScriptedEngine

BUILT: list[str] = []  # the greeting of every OneTurn made, in order


@register_env("test_one_turn")
class OneTurn:
    """Observation `greeting`; the first action ends the episode with reward and success `reward`."""

    def __init__(self, greeting: str = "hi", reward: float = 1.0) -> None:
        self.greeting, self.reward = greeting, reward
        BUILT.append(greeting)

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        return self.greeting, {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        return "done", self.reward, True, False, {SUCCESS: self.reward}


def _sources(**overrides: Any) -> list[dict[str, Any]]:
    """Two sources of OneTurn: `win` (greeting "hi", reward 1, weight 3) and `lose` ("yo", reward 0, weight 1)."""
    win = {"name": "win", "env": "test_one_turn", "kwargs": {"greeting": "hi", "reward": 1.0}, "weight": 3.0}
    lose = {"name": "lose", "env": "test_one_turn", "kwargs": {"greeting": "yo", "reward": 0.0}, "weight": 1.0}
    return [win | overrides, lose]


def _env(sources: list[dict[str, Any]], **fields: Any) -> EnvArguments:
    return from_dict(EnvArguments, {"sources": sources, "max_trajectory_tokens": 16, **fields}, "env")


@pytest.mark.parametrize(
    ("overrides", "error"),
    [
        ({"env": "no_such_env"}, r"env\.sources\[0\]\.env"),
        (
            {"env": "tests.unit.test_multi_turn.RaisingEnv", "kwargs": {}},
            r"env\.sources\[0\]\.env=.*RaisingEnv .*FileNotFoundError",
        ),
        ({"kwargs": {"size": 3}}, r"does not take the kwargs \['size'\].*env\.sources\[0\]\.kwargs="),
        ({"name": "lose"}, r"env\.sources\[1\]\.name='lose' repeats env\.sources\[0\]\.name"),
        ({"name": "a/b"}, r"env\.sources\[0\]\.name='a/b' is not a name of letters"),
        ({"weight": 1e-9}, r"env\.sources\[0\] \(win, weight 1e-09\) draws none of the env\.eval_episodes=8"),
    ],
)
def test_a_bad_source_is_a_config_error_naming_its_field(overrides: dict[str, Any], error: str) -> None:
    with pytest.raises(ConfigError, match=error):
        _env(_sources(**overrides), eval_episodes=8 if "weight" in overrides else 64).validate(max_new_tokens=4)


def test_the_schema_and_the_check_name_weights_and_omitted_fields() -> None:
    with pytest.raises(ConfigError, match=r"env\.sources\[0\]\.weight=0.0 is out of range: it must be > 0"):
        _env(_sources(weight=0))
    with pytest.raises(ConfigError, match=r"env\.sources\[0\]\.weight=-1.0 is out of range"):
        _env(_sources(weight=-1))
    with pytest.raises(ConfigError, match=r"unknown config key 'env\.sources\[0\]\.env_name'"):
        _env(_sources(env_name="x"))
    nameless = [{"env": "test_one_turn"}, {"name": "b", "env": "test_one_turn"}]
    with pytest.raises(ConfigError, match=r"env\.sources\[0\]\.name='' is not a name"):
        _env(nameless).validate(max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"env\.sources\[1\]\.env is empty"):
        _env([{"name": "a", "env": "test_one_turn"}, {"name": "b"}]).validate(max_new_tokens=4)


def test_sources_replace_name_kwargs_and_agent() -> None:
    with pytest.raises(ConfigError, match=r"remove env\.name=calculator_arithmetic and env\.kwargs=\{\}"):
        _env(_sources(), name="calculator_arithmetic").validate(max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"env\.kwargs=\{'n': 4\}"):
        _env(_sources(), kwargs={"n": 4}).validate(max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"env\.agent=pkg\.agent plays one environment's tasks"):
        _env(_sources(), agent="pkg.agent").validate(max_new_tokens=4)


def test_the_config_check_builds_every_source() -> None:
    BUILT.clear()
    _env(_sources()).validate(max_new_tokens=4)
    assert BUILT == ["hi", "yo"]


def test_the_draw_follows_the_weights_and_depends_on_the_seed_alone() -> None:
    sources = [EnvSource("a", "test_one_turn", weight=3.0), EnvSource("b", "test_one_turn", weight=1.0)]
    seeds = list(range(4000))
    names = draw_sources(seeds, sources)
    assert Counter(names)["a"] / len(seeds) == pytest.approx(0.75, abs=0.03)
    assert draw_sources(seeds[::-1], sources) == names[::-1]  # the same seed draws the same source, in any batch
    # Independent of the environments' own `random.Random(seed)`: the draw is no function of the task's first number.
    assert draw_sources(seeds, sources) != ["a" if s % 4 else "b" for s in seeds]


def test_episodes_play_their_sources_environment_in_groups_of_one_source() -> None:
    tokenizer = load_tokenizer("tiny://qwen2")
    env = _env(_sources())
    rollout = MultiTurnRollout(env, tokenizer, pad_id=0)
    seeds = [seed for seed in range(12) for _ in range(4)]  # 12 GRPO groups of 4
    engine = ScriptedEngine(tokenizer)
    batch, metrics = rollout.run(engine.generate, seeds, GeneratingArguments(max_new_tokens=4), base_seed=1)
    drawn = draw_sources(list(range(12)), env.sources)
    assert len(set(drawn)) == 2  # both sources in the batch, so the check below means something
    prompts = list(batch.non_tensor_batch["prompt"])
    assert prompts == [{"win": "hi", "lose": "yo"}[name] for name in drawn for _ in range(4)]
    assert len(engine.calls) == 1 and len(engine.calls[0][0]) == 48  # one generation serves both sources
    wins = drawn.count("win") * 4
    assert batch.batch["scores"].tolist() == [1.0 if name == "win" else 0.0 for name in drawn for _ in range(4)]
    assert metrics["rollout/success"] == pytest.approx(wins / 48)
    assert metrics["rollout/win/success"] == 1.0 and metrics["rollout/lose/success"] == 0.0
    assert metrics["rollout/win/turns_mean"] == metrics["rollout/lose/turns_mean"] == 1.0
    rollout.close()


def test_a_single_environment_has_no_per_source_metrics() -> None:
    tokenizer = load_tokenizer("tiny://qwen2")
    rollout = MultiTurnRollout(EnvArguments(name="test_one_turn", max_trajectory_tokens=16), tokenizer, pad_id=0)
    _, metrics = rollout.run(ScriptedEngine(tokenizer).generate, [1, 2], GeneratingArguments(max_new_tokens=4), 1)
    assert all(key.count("/") == 1 for key in metrics), metrics


def test_held_out_metrics_per_source() -> None:
    greedy = {"rollout/success": 0.5, "rollout/a/success": 1.0, "rollout/b/success": 0.0}
    sampled = {"rollout/success": 0.25, "rollout/a/success": 0.5, "rollout/b/success": 0.0}
    assert held_out_metrics(greedy, sampled, ["a", "b", "c"]) == {
        "val/accuracy": 0.5,
        "val/sampled_success": 0.25,
        "val/a/accuracy": 1.0,
        "val/a/sampled_success": 0.5,
        "val/b/accuracy": 0.0,
        "val/b/sampled_success": 0.0,
    }


def test_the_dry_run_plans_each_source() -> None:
    lines = _env(_sources(), eval_episodes=64).describe(episodes=32, max_new_tokens=4)
    held_out = Counter(draw_sources(list(range(1_000_000_000, 1_000_000_064)), _env(_sources()).sources))
    win = "env source win: test_one_turn with {'greeting': 'hi', 'reward': 1.0}, weight 3 (75%): about 24.0 of 32 "
    assert f"{win}episodes per step (whole groups), {held_out['win']} of 64 held-out seeds" in lines
    assert any(line.startswith("env source lose: test_one_turn") for line in lines)
    assert lines[0].startswith("env win, lose: 32 episodes per step")


def test_a_source_whose_episodes_all_fail_stops_the_run_naming_it() -> None:
    tokenizer = load_tokenizer("tiny://qwen2")
    broken = {"name": "broken", "env": "tests.unit.test_multi_turn.TwoTurns", "kwargs": {"fail": "raise"}}
    rollouts = EnvRollouts(_env([_sources()[0], broken]), tokenizer, 0, GeneratingArguments(max_new_tokens=4), False)
    engine = ScriptedEngine(tokenizer)

    def batch(index: int) -> dict[str, float]:
        seeds = list(range(8 * index, 8 * index + 8))
        return rollouts.train_batch(engine, seeds, group_size=2, base_seed=index)[1]  # type: ignore[arg-type]

    assert ALL_FAILED_BATCHES_LIMIT == 3
    for index in range(2):  # `broken` drawn, every episode of it failed: the run goes on on `win`
        metrics = batch(index)
        assert metrics["rollout/win/success"] == 1.0 and metrics["rollout/broken/env_errors"] > 0
    assert "rollout/broken/success" not in batch(2)  # seeds 16-23 draw no `broken`: no evidence either way
    with pytest.raises(
        RuntimeError, match=r"env\.sources\[1\] broken \(tests\.unit\.test_multi_turn\.TwoTurns .*broken"
    ):
        batch(3)


def test_each_source_has_its_own_tools_in_the_prompt_and_its_own_template_check() -> None:
    tokenizer = load_tokenizer("tiny://qwen2")
    calc = {"name": "calc", "env": "calculator_arithmetic"}
    env = _env([{"name": "guess", "env": "guess_number"}, calc], apply_chat_template=True, max_observation_tokens=512)
    env.check_chat_template(tokenizer, "tiny")
    rollout = MultiTurnRollout(env, tokenizer, pad_id=0)
    assert rollout.encoders["guess"].tools == [] and [t["function"]["name"] for t in rollout.encoders["calc"].tools]
    no_tool_turns = copy.deepcopy(tokenizer)
    no_tool_turns.chat_template = (
        "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool turns') }}{% endif %}"
        "{{ m['content'] }}\n{% endfor %}"
    )
    with pytest.raises(ConfigError, match=r"env\.sources\[1\]\.env=calculator_arithmetic answers tool calls"):
        env.check_chat_template(no_tool_turns, "no-tools")
