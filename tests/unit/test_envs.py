"""The built-in environments on the protocol, the registry and the GEM adapter (with the real gem-llm package)."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from roll.envs import Env, make_env, register_env, registered_envs
from roll.envs.builtin.arithmetic import MultiplicationEnv
from roll.envs.builtin.frozen_lake import FrozenLakeEnv
from roll.envs.builtin.guess_number import GuessNumberEnv
from roll.envs.gem_adapter import GemEnv
from roll.envs.manager import EnvManager
from roll.envs.protocol import InvalidEnvOutput, checked_reset, checked_step
from roll.envs.registry import env_factory


class CountdownEnv:
    """A test environment: says the number, the action decrements it; done at 0."""

    def __init__(self, start: int = 2) -> None:
        self.start = start
        self.left = start

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        self.left = self.start
        return str(self.left), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.left -= 1
        return str(self.left), float(self.left == 0), self.left == 0, False, {}


def not_an_env() -> int:
    return 3


def bisect(env: Env, low: int, high: int, seed: int, wrap: str = "{}") -> list[tuple[int, str, float, bool]]:
    """Play bisection on [low, high]; the (guess, observation, reward, terminated) of each turn."""
    env.reset(seed)
    turns = []
    while True:
        guess = (low + high) // 2
        observation, reward, terminated, truncated, _ = env.step(wrap.format(guess))
        turns.append((guess, observation, reward, terminated))
        if terminated or truncated:
            return turns
        if "higher" in observation:
            low = guess + 1
        else:
            high = guess - 1


# guess_number


def test_bisection_finds_the_secret_of_seed_1_in_four_turns() -> None:
    # Random(1).randint(1, 100) = 18: 50 lower, 25 lower, 12 higher, (13+24)//2 = 18.
    turns = bisect(GuessNumberEnv(n=100), 1, 100, seed=1)
    assert turns == [
        (50, "lower", 0.0, False),
        (25, "lower", 0.0, False),
        (12, "higher", 0.0, False),
        (18, "correct", 1.0, True),
    ]


def test_bisection_wins_within_the_default_turn_limit_on_every_seed() -> None:
    env = GuessNumberEnv(n=100)
    assert env.max_turns == 8  # ceil(log2 100) + 1
    # Seed 2's secret 8 takes 7 guesses: 50 25 12 6 9 7 8.
    assert [guess for guess, *_ in bisect(env, 1, 100, seed=2)] == [50, 25, 12, 6, 9, 7, 8]
    for seed in range(300):
        assert bisect(env, 1, 100, seed)[-1][1:] == ("correct", 1.0, True)


def test_guess_number_invalid_actions_and_running_out_of_turns() -> None:
    env = GuessNumberEnv(n=10, max_turns=3)
    assert env.reset(seed=1) == ("guess 1-10", {})  # the secret is Random(1).randint(1, 10) = 3
    assert env.step("banana") == ("invalid", 0.0, False, False, {"invalid_action": 1})
    assert env.step("11") == ("invalid", 0.0, False, False, {"invalid_action": 1})
    assert env.step("I guess 2") == ("higher", 0.0, False, True, {"invalid_action": 0, "success": 0.0})


def test_the_same_seed_gives_the_same_secret() -> None:
    first, second = GuessNumberEnv(), GuessNumberEnv()
    first.reset(seed=7)
    second.reset(seed=7)
    assert first.secret == second.secret


# calculator_arithmetic


def test_multiplication_scores_the_right_answer_1_and_a_wrong_one_0() -> None:
    env = MultiplicationEnv(min_digits=2, max_digits=3)
    observation, _ = env.reset(seed=3)
    a, b = map(int, observation.removesuffix("=?").split("*"))
    assert 10 <= a <= 999 and 10 <= b <= 999
    assert env.step(f"{a * b}") == ("correct", 1.0, True, False, {"invalid_action": 0, "success": 1.0})
    env.reset(seed=3)
    assert env.step(f"{a * b + 1}") == ("wrong", 0.0, True, False, {"invalid_action": 0, "success": 0.0})
    env.reset(seed=3)
    assert env.step("no idea")[:4] == ("invalid", 0.0, False, False)
    assert env.step("?")[:4] == ("invalid", 0.0, False, True)  # max_turns=2 answers


def test_calculator_arithmetic_solves_with_the_bracket_tool_call_tiny_models_can_write() -> None:
    env = make_env("calculator_arithmetic")
    observation, _ = env.reset(seed=3)
    assert observation == "57*87=?"
    assert env.step("<calc 57*87>") == (
        "4959",
        0.0,
        False,
        False,
        {"tool_calls": 1, "tool_successes": 1, "observation_role": "tool"},
    )
    observation, reward, terminated, _, info = env.step("4959")
    assert (observation, reward, terminated, info["success"], info["tool_calls"]) == ("correct", 1.0, True, 1.0, 0)


# frozen_lake


def test_frozen_lake_known_path_reaches_the_goal() -> None:
    env = FrozenLakeEnv()
    assert env.reset(seed=0) == ("PFFF\nFHFH\nFFFH\nHFFG", {})
    results = [env.step(action) for action in ["D", "down", "R", "right", "d", "R"]]
    assert [r[1] for r in results] == [0.0] * 5 + [1.0]  # gymnasium's schedule by default
    assert results[2][0] == "SFFF\nFHFH\nFPFH\nHFFG"
    assert results[-1] == ("SFFF\nFHFH\nFFFH\nHFFP", 1.0, True, False, {"invalid_action": 0, "success": 1.0})


def test_frozen_lake_hole_invalid_action_and_turn_limit() -> None:
    env = FrozenLakeEnv(max_turns=3, hole_reward=-1.0, step_reward=-0.01)  # shaped
    env.reset(seed=0)
    assert env.step("R")[1:3] == (-0.01, False)
    assert env.step("D") == ("SFFF\nFPFH\nFFFH\nHFFG", -1.0, True, False, {"invalid_action": 0, "success": 0.0})
    env.reset(seed=0)
    assert env.step("jump") == ("invalid\nPFFF\nFHFH\nFFFH\nHFFG", -0.01, False, False, {"invalid_action": 1})
    env.step("U")  # into the wall: stays
    assert env.step("L") == ("PFFF\nFHFH\nFFFH\nHFFG", -0.01, False, True, {"invalid_action": 0, "success": 0.0})


def test_frozen_lake_random_maps_follow_the_seed() -> None:
    env = FrozenLakeEnv(random_map=True)
    maps = {seed: env.reset(seed)[0] for seed in range(5)}
    assert maps[3] == env.reset(3)[0] == "PFHF\nFFFF\nFFFF\nFFFG"  # gymnasium's generate_random_map(4, seed=3)
    assert len(set(maps.values())) > 1


def test_frozen_lake_slippery_moves_follow_the_seed() -> None:
    def walk(seed: int) -> list[str]:
        env = FrozenLakeEnv(is_slippery=True, max_turns=8)
        env.reset(seed)
        return [env.step("R")[0] for _ in range(3)]

    assert walk(5) == walk(5)


# registry


def test_registry_builds_by_name_with_kwargs() -> None:
    assert {"guess_number", "calculator_arithmetic", "frozen_lake"} <= set(registered_envs())
    env = make_env("guess_number", {"n": 10})
    assert isinstance(env, GuessNumberEnv) and env.n == 10 and env.max_turns == 5


def test_registry_builds_by_dotted_path_and_registered_decorator() -> None:
    env = make_env("tests.unit.test_envs.CountdownEnv", {"start": 1})
    assert env.reset(0) == ("1", {}) and env.step("x")[:3] == ("0", 1.0, True)
    register_env("test_countdown")(CountdownEnv)
    assert isinstance(make_env("test_countdown"), CountdownEnv)
    with pytest.raises(ValueError, match="already registered"):
        register_env("test_countdown")(GuessNumberEnv)


def test_registry_errors_name_what_is_wrong() -> None:
    with pytest.raises(
        ValueError, match=r"env 'guess_nmber' is not a registered environment \(registered: .*guess_number"
    ):
        make_env("guess_nmber")
    with pytest.raises(ValueError, match=r"env\.name 'nowhere\.module\.Env' cannot be imported"):
        env_factory("nowhere.module.Env", field="env.name")
    with pytest.raises(ValueError, match=r"does not take the kwargs \['size'\]"):
        make_env("guess_number", {"size": 3})
    with pytest.raises(ValueError, match="built a int, which has no reset"):
        make_env("tests.unit.test_envs.not_an_env")


# protocol checks


def test_protocol_checks_convert_numpy_and_refuse_garbage() -> None:
    assert checked_step(["o", np.float32(0.5), np.bool_(True), False, {}]) == ("o", 0.5, True, False, {})
    assert type(checked_step(("o", np.int64(1), False, False, {}))[1]) is float
    assert checked_reset(("o", {"a": 1})) == ("o", {"a": 1})
    for garbage in [
        ("o", 1.0, False, False),
        ("o", True, False, False, {}),
        ("o", float("nan"), False, False, {}),
        (1, 0.0, False, False, {}),
        ("o", 0.0, 1, False, {}),
        ("o", 0.0, False, False, None),
        None,
    ]:
        with pytest.raises(InvalidEnvOutput):
            checked_step(garbage)
    with pytest.raises(InvalidEnvOutput, match="reset must return"):
        checked_reset("o")


# GEM, through the real gem-llm package


def test_gem_guess_the_number_through_the_adapter() -> None:
    env = make_env("gem:game:GuessTheNumber-v0-easy")
    observation, info = env.reset(seed=1)
    assert "Guess The Number" in observation and isinstance(info, dict)
    # gem seeds the global random with 1, then randint(1, 10) = 3: 5 lower, 2 higher, 3.
    turns = bisect(env, 1, 10, seed=1, wrap="\\boxed{{{}}}")
    assert [(guess, reward, terminated) for guess, _, reward, terminated in turns] == [
        (5, 0.0, False),
        (2, 0.0, False),
        (3, 1.0, True),
    ]
    assert "lower" in turns[0][1] and "higher" in turns[1][1] and "Congratulations" in turns[2][1]


def test_gem_unknown_id_is_a_value_error_with_the_closest_ids() -> None:
    with pytest.raises(ValueError, match="'gem:game:GuessTheNumber-v0-eazy' is not a GEM environment id; did you mean"):
        env_factory("gem:game:GuessTheNumber-v0-eazy")


class _GemStandIn:
    """A stand-in for a `gem.Env` behind the adapter: its reset hangs until `release` is set, when asked to."""

    def __init__(self, hang: bool, release: threading.Event) -> None:
        self.hang, self.release = hang, release

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        if self.hang:
            self.release.wait(30)
        return f"start {seed}", {}


def _gem_env(inner: _GemStandIn) -> GemEnv:
    env = GemEnv.__new__(GemEnv)  # the adapter around a stand-in: no gem.make
    env.env_id, env.env = "stand-in", inner
    return env


def test_a_gem_reset_abandoned_at_its_timeout_does_not_block_later_resets() -> None:
    release = threading.Event()
    built = iter([_GemStandIn(hang=True, release=release), _GemStandIn(hang=False, release=release)])
    manager = EnvManager(lambda: _gem_env(next(built)), num_envs=1, timeout_s=0.5)
    try:
        assert manager.reset([1])[0].info["env_error"] == 1  # abandoned in GEM's reset, under the reset lock
        started = time.monotonic()
        assert manager.reset([2])[0].observation == "start 2"  # a fresh environment resets in time
        assert time.monotonic() - started < 0.5
    finally:
        release.set()


def test_bisection_sft_rows_cover_the_bisection_tree() -> None:
    from roll.envs.builtin.guess_number import bisection_rows

    rows = bisection_rows(16, "<eos>")
    # One row per turn of each of the 16 games (5 turns at most); one distinct prompt per node of the bisection tree.
    assert len(rows) == 54 and len({row["prompt"]: row["answer"] for row in rows}) == 16
    assert len({(row["prompt"], row["answer"]) for row in rows}) == 16
    # Secret 11: 8 higher, 12 lower, 10 higher, 11 correct.
    game = [row for row in rows if row["prompt"].startswith("guess 1-16\n8<eos>higher\n12<eos>lower\n10<eos>higher")]
    assert [row["answer"] for row in game] == ["11"]


def _transcript_rows(task: str, eos: str) -> list[dict[str, str]]:
    from roll.envs.builtin.arithmetic import tool_use_rows
    from roll.envs.builtin.frozen_lake import noisy_expert_rows
    from roll.envs.builtin.guess_number import bisection_rows

    if task == "guess_number":
        return bisection_rows(16, eos)
    if task == "calculator":
        return tool_use_rows(range(20), 0.5, eos)
    return noisy_expert_rows(range(20), 0.5, eos)


@pytest.mark.parametrize("task", ["guess_number", "calculator", "frozen_lake"])
def test_sft_transcript_rows_tokenise_as_the_rollout_history(task: str) -> None:
    """Each row's prompt is, id for id, what the multi-turn rollout holds before that turn: the first observation,
    then per turn the sampled action with its EOS and the next observation, each encoded on its own."""
    from roll.models.tiny import build_char_tokenizer
    from roll.pipeline.agentic.observations import ObservationEncoder

    tokenizer = build_char_tokenizer()
    encoder = ObservationEncoder(tokenizer, chat_template=False)
    rows = _transcript_rows(task, tokenizer.eos_token)
    assert any(tokenizer.eos_token in row["prompt"] for row in rows)  # some rows hold earlier turns
    for row in rows:
        # obs0 \n a1 <eos> obs1 \n a2 <eos> ... obsN \n: actions hold no newline, observations may.
        *turns, last = row["prompt"].split(tokenizer.eos_token)
        history: list[int] = []
        for index, part in enumerate(turns):
            observation, action = part.rsplit("\n", 1)
            history += encoder.first(observation) if index == 0 else encoder.next(observation)
            history += tokenizer(action, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        history += encoder.first(last[:-1]) if not turns else encoder.next(last[:-1])
        assert tokenizer(row["prompt"], add_special_tokens=False)["input_ids"] == history


def test_calculator_rows_call_the_tool_on_their_share_of_problems() -> None:
    from roll.envs.builtin.arithmetic import calculator_arithmetic, tool_use_rows

    rows = tool_use_rows(range(10), 0.3, "<eos>")
    calls = [row for row in rows if row["answer"].startswith("<calc ")]
    assert len(calls) == 3 and len(rows) == 13  # 3 problems in two turns, 7 answered directly
    env = calculator_arithmetic()
    env.reset(0)
    observation, *_ = env.step(calls[0]["answer"])  # the transcript's tool answer is the tool's
    assert rows[1]["prompt"].endswith(f"<eos>{observation}\n") and rows[1]["answer"] == observation


def test_the_frozen_lake_expert_walks_a_shortest_path() -> None:
    from roll.envs.builtin.frozen_lake import FrozenLakeEnv, noisy_expert_rows, shortest_path_move

    # From the start of gymnasium's 4x4 map the only way down passes (1,0), (2,0), then right along row 2.
    rows = ["SFFF", "FHFH", "FFFH", "HFFG"]
    assert shortest_path_move(rows, 0) == "D" and shortest_path_move(rows, 8) in "DR"
    assert shortest_path_move(["SHFF", "HFFF", "FFFF", "FFFG"], 0) == ""  # walled in
    env = FrozenLakeEnv(random_map=True)
    for seed in range(50):
        moves = [row["answer"] for row in noisy_expert_rows([seed], 0.0, "<eos>")]
        env.reset(seed)
        results = [env.step(move) for move in moves]
        assert results[-1][4]["success"] == 1.0 and len(moves) <= 6  # every 4x4 random map: 6 moves at most
