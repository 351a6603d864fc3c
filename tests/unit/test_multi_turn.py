"""The multi-turn rollout with a stand-in engine: masks, reward positions, token consistency, groups, failures."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.schema import ConfigError
from roll.configs.worker_config import GeneratingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.envs.protocol import SUCCESS
from roll.envs.registry import register_env
from roll.models.model_providers import load_tokenizer
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.env_rollout import EnvRollouts
from roll.pipeline.agentic.multi_turn import MultiTurnRollout
from roll.pipeline.rlvr.rollout import compute_advantages

RESETS: list[int | None] = []
BUILT: list[Any] = []  # every TwoTurns made, in order


@register_env("test_two_turns")
class TwoTurns:
    """Observation "go", then "ok" with reward 0.5 after the first action; reward 1 and success on the second."""

    def __init__(self, fail: str = "") -> None:
        self.fail, self.turns, self.closed = fail, 0, False
        BUILT.append(self)

    def close(self) -> None:
        self.closed = True

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        RESETS.append(seed)
        self.turns = 0
        return "go", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        self.turns += 1
        if self.fail == "raise":
            raise RuntimeError("broken")
        if self.fail == "hang":
            time.sleep(30)
        if self.turns == 2:
            return "done", 1.0, True, False, {SUCCESS: 1.0}
        return "ok", 0.5, False, False, {}


class ScriptedEngine:
    """Answers every row with the same sampled ids `xy<eos>` and records what each call saw and returned."""

    world_size = 1

    def __init__(self, tokenizer: Any) -> None:
        self.sampled = [*tokenizer("xy", add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
        self.calls: list[tuple[list[list[int]], list[int], GeneratingArguments]] = []

    def generate(self, request: DataProto, args: GeneratingArguments) -> DataProto:
        ids, mask = request.batch["input_ids"], request.batch["attention_mask"].bool()
        seen = [row[keep].tolist() for row, keep in zip(ids, mask, strict=True)]
        self.calls.append((seen, self.sampled, args))
        rows, width = len(request), len(self.sampled) + 2
        responses = torch.zeros((rows, width), dtype=torch.long)
        responses[:, : len(self.sampled)] = torch.tensor(self.sampled)
        response_mask = (torch.arange(width) < len(self.sampled)).long().expand(rows, width)
        return DataProto.from_dict(tensors={"responses": responses, "response_mask": response_mask})


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("tiny://qwen2")


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _play(tokenizer: Any, seeds: list[int], **env: Any) -> tuple[DataProto, dict[str, float], ScriptedEngine]:
    args = EnvArguments(name="test_two_turns", max_trajectory_tokens=16, **env)
    engine = ScriptedEngine(tokenizer)
    rollout = MultiTurnRollout(args, tokenizer, pad_id=0)
    batch, metrics = rollout.run(engine.generate, seeds, GeneratingArguments(max_new_tokens=4), base_seed=7)
    return batch, metrics, engine


def test_masks_rewards_and_ids_of_a_two_turn_episode(tokenizer: Any) -> None:
    batch, metrics, engine = _play(tokenizer, [3])
    xy_eos, ok = engine.sampled, _ids(tokenizer, "ok\n")
    assert len(xy_eos) == 3 and len(ok) == 3
    data = batch.batch
    assert data["prompts"][0].tolist() == _ids(tokenizer, "go\n")
    # Actions, then the observation, then the second action; the final observation "done" is not appended.
    assert data["responses"][0, :9].tolist() == xy_eos + ok + xy_eos
    assert data["responses"].shape[1] == 16
    assert data["response_mask"][0].tolist() == [1, 1, 1, 0, 0, 0, 1, 1, 1] + [0] * 7  # loss on sampled ids only
    assert data["attention_mask"][0].tolist() == [1] * 3 + [1] * 9 + [0] * 7  # env tokens attended
    expected_rewards = [0.0] * 16
    expected_rewards[2], expected_rewards[8] = 0.5, 1.0  # each on its turn's last sampled token (the EOS)
    assert data["turn_rewards"][0].tolist() == expected_rewards
    assert data["turn_discounts"][0].tolist() == [1.0] * 16  # env.turn_gamma defaults to 1
    assert data["scores"].tolist() == [1.5]  # sum
    assert data["truncated"].tolist() == [False]
    assert metrics["rollout/success"] == 1.0 and metrics["rollout/turns_mean"] == 2.0
    # Token in, token out: each call saw the previous call's ids plus the observation, and the trained row is
    # the last call's input followed by what it returned.
    (first_seen, _, first_args), (second_seen, _, second_args) = engine.calls
    assert second_seen[0] == first_seen[0] + xy_eos + ok
    row = data["input_ids"][0][data["attention_mask"][0].bool()].tolist()
    assert row == second_seen[0] + xy_eos
    assert first_args.num_return_sequences == 1 and first_args.seed != second_args.seed


def test_environments_are_kept_across_batches_and_closed_at_the_end(tokenizer: Any) -> None:
    rollout = MultiTurnRollout(EnvArguments(name="test_two_turns", max_trajectory_tokens=16), tokenizer, pad_id=0)
    engine, args = ScriptedEngine(tokenizer), GeneratingArguments(max_new_tokens=4)
    BUILT.clear()
    for step in range(3):
        rollout.run(engine.generate, [1, 2], args, base_seed=step)
    assert len(BUILT) == 2 and not any(env.closed for env in BUILT)  # built for the first batch, then reset
    rollout.run(engine.generate, [1, 2, 3], args, base_seed=3)  # another batch size gets its own
    assert len(BUILT) == 5
    rollout.close()
    assert all(env.closed for env in BUILT)


def test_template_drift_counts_episodes_whose_ids_the_template_would_not_give(tokenizer: Any) -> None:
    args = EnvArguments(name="test_two_turns", max_trajectory_tokens=64, apply_chat_template=True)
    engine = ScriptedEngine(tokenizer)
    _, metrics = MultiTurnRollout(args, tokenizer, pad_id=0).run(engine.generate, [1, 2], GeneratingArguments(), 0)
    assert metrics["rollout/template_drift"] == 0.0  # a character tokenizer: decoding and re-encoding round-trip
    # A special token sampled inside an action is dropped by decoding: the re-rendered conversation lacks it.
    engine.sampled = [engine.sampled[0], tokenizer.bos_token_id, *engine.sampled[1:]]
    _, metrics = MultiTurnRollout(args, tokenizer, pad_id=0).run(engine.generate, [1, 2], GeneratingArguments(), 0)
    assert metrics["rollout/template_drift"] == 1.0
    plain = EnvArguments(name="test_two_turns", max_trajectory_tokens=64)
    _, metrics = MultiTurnRollout(plain, tokenizer, pad_id=0).run(engine.generate, [1], GeneratingArguments(), 0)
    assert "rollout/template_drift" not in metrics  # without a template there is nothing to re-render


def test_turn_gamma_sits_on_each_turns_last_sampled_token(tokenizer: Any) -> None:
    batch, _, _ = _play(tokenizer, [3], turn_gamma=0.5)
    expected = [1.0] * 16
    expected[2] = expected[8] = 0.5
    assert batch.batch["turn_discounts"][0].tolist() == expected


def test_last_turn_score(tokenizer: Any) -> None:
    batch, _, _ = _play(tokenizer, [3], trajectory_score="last")
    assert batch.batch["scores"].tolist() == [1.0]
    assert batch.batch["turn_rewards"].sum().item() == 1.5


def test_a_turn_that_would_not_fit_truncates_the_episode(tokenizer: Any) -> None:
    args = EnvArguments(name="test_two_turns", max_trajectory_tokens=8)  # 3 + 3 + 4 > 8
    engine = ScriptedEngine(tokenizer)
    batch, metrics = MultiTurnRollout(args, tokenizer, 0).run(
        engine.generate, [1], GeneratingArguments(max_new_tokens=4), 0
    )
    assert len(engine.calls) == 1
    assert batch.batch["response_mask"][0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert batch.batch["attention_mask"][0, -8:].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]
    assert batch.batch["truncated"].tolist() == [True] and metrics["rollout/truncated_fraction"] == 1.0


def test_max_turns_truncates(tokenizer: Any) -> None:
    batch, _, engine = _play(tokenizer, [1], max_turns=1)
    assert len(engine.calls) == 1 and batch.batch["truncated"].tolist() == [True]
    assert batch.batch["scores"].tolist() == [0.5]


def test_a_grpo_group_shares_its_seed(tokenizer: Any) -> None:
    RESETS.clear()
    args = EnvArguments(name="test_two_turns", max_trajectory_tokens=16)
    rollouts = EnvRollouts(args, tokenizer, 0, GeneratingArguments(max_new_tokens=4), False)
    batch, _ = rollouts.train_batch(ScriptedEngine(tokenizer), [5, 9], group_size=3, base_seed=1)  # type: ignore[arg-type]
    assert batch.non_tensor_batch["env_seed"].tolist() == [5, 5, 5, 9, 9, 9]
    assert RESETS == [5, 5, 5, 9, 9, 9]


@pytest.mark.parametrize("fail", ["raise", "hang"])
def test_a_failing_env_truncates_its_own_episode_within_the_timeout(tokenizer: Any, fail: str) -> None:
    args = EnvArguments(name="test_two_turns", kwargs={"fail": fail}, max_trajectory_tokens=16, timeout_s=0.5)
    started = time.monotonic()
    batch, metrics = MultiTurnRollout(args, tokenizer, 0).run(
        ScriptedEngine(tokenizer).generate, [1, 2], GeneratingArguments(max_new_tokens=4), 0
    )
    assert time.monotonic() - started < 5
    assert batch.batch["truncated"].tolist() == [True, True]
    assert metrics["rollout/env_errors"] == 2.0
    assert batch.batch["response_mask"][:, :3].sum().item() == 6  # the ids as played ...
    assert batch.batch["reward_failed"].tolist() == [1.0, 1.0]  # ... but the pipeline leaves the rows out


def _turn_batch(values: list[float] | None = None, turn_gamma: float = 1.0) -> DataProto:
    tensors = {
        "response_mask": torch.tensor([[1, 1, 0, 1]]),
        "turn_rewards": torch.tensor([[0.0, 0.5, 0.0, 1.0]]),
        "turn_discounts": torch.tensor([[1.0, turn_gamma, 1.0, turn_gamma]]),
        "scores": torch.tensor([1.5]),
    }
    if values is not None:
        tensors["values"] = torch.tensor([values])
    return DataProto.from_dict(tensors=tensors)


def test_reinforce_plus_plus_reads_turn_rewards_and_skips_env_tokens() -> None:
    algorithm = AlgorithmArguments(adv_estimator="reinforce_plus_plus", gamma=1.0)
    batch, _ = compute_advantages(_turn_batch(), torch.tensor([0]), algorithm, 0.0)
    assert batch.batch["token_rewards"].tolist() == [[0.0, 0.5, 0.0, 1.0]]
    assert batch.batch["returns"].tolist() == [[1.5, 1.5, 0.0, 1.0]]  # G_t over sampled tokens only


def test_reinforce_plus_plus_discounts_between_turns_not_within_them() -> None:
    algorithm = AlgorithmArguments(adv_estimator="reinforce_plus_plus", gamma=1.0)
    batch, _ = compute_advantages(_turn_batch(turn_gamma=0.5), torch.tensor([0]), algorithm, 0.0)
    # t1 ends turn 1: 0.5 + 0.5 * G3; t0 is inside turn 1: G1 undiscounted.
    assert batch.batch["returns"].tolist() == [[1.0, 1.0, 0.0, 1.0]]
    per_token = AlgorithmArguments(adv_estimator="reinforce_plus_plus", gamma=0.5)
    batch, _ = compute_advantages(_turn_batch(turn_gamma=0.5), torch.tensor([0]), per_token, 0.0)
    assert batch.batch["returns"].tolist() == [[0.375, 0.75, 0.0, 1.0]]  # both: 0.5 * 0.5 across, 0.5 within


def test_gae_discounts_between_turns() -> None:
    algorithm = AlgorithmArguments(adv_estimator="gae", gamma=1.0, lam=1.0, whiten_advantages=False)
    batch, _ = compute_advantages(_turn_batch([0.1, 0.2, 9.0, 0.3], turn_gamma=0.5), torch.tensor([0]), algorithm, 0.0)
    # t3: 1 - 0.3 = 0.7; t1: 0.5 + 0.5 * 0.3 - 0.2 + 0.5 * 0.7 = 0.8; t0: 0 + 0.2 - 0.1 + 0.8 = 0.9.
    assert batch.batch["advantages"][0].tolist() == pytest.approx([0.9, 0.8, 0.0, 0.7])


def test_gae_skips_env_tokens() -> None:
    algorithm = AlgorithmArguments(adv_estimator="gae", gamma=1.0, lam=1.0, whiten_advantages=False)
    batch, _ = compute_advantages(_turn_batch([0.1, 0.2, 9.0, 0.3]), torch.tensor([0]), algorithm, 0.0)
    # t3: 1 - 0.3; t1: 0.5 + V3 - V1 + A3 = 0.6 + 0.7; t0: 0 + V1 - V0 + A1 = 0.1 + 1.3; the env token's value unused.
    assert batch.batch["advantages"][0].tolist() == pytest.approx([1.4, 1.3, 0.0, 0.7])


def test_grpo_uses_the_trajectory_score() -> None:
    algorithm = AlgorithmArguments(adv_estimator="grpo")
    batch, _ = compute_advantages(_turn_batch(), torch.tensor([0]), algorithm, 0.0)
    assert batch.batch["token_rewards"].tolist() == [[0.0, 0.0, 0.0, 1.5]]  # score on the last sampled token


def test_env_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match=r"env\.name"):
        EnvArguments(name="no_such_env").validate(max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"env\.max_trajectory_tokens=3"):
        EnvArguments(max_trajectory_tokens=3).validate(max_new_tokens=4)


class RaisingEnv:
    """An environment whose constructor raises, as one missing its data would."""

    def __init__(self, path: str = "data.jsonl") -> None:
        raise FileNotFoundError(f"no such file: {path}")

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        return "", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        return "", 0.0, True, False, {}


def test_the_config_check_builds_one_environment_and_closes_it() -> None:
    with pytest.raises(ConfigError, match=r"env\.name=tests\.unit\.test_multi_turn\.RaisingEnv .*FileNotFoundError"):
        EnvArguments(name="tests.unit.test_multi_turn.RaisingEnv").validate(max_new_tokens=4)
    with pytest.raises(ConfigError, match=r"does not take the kwargs \['size'\].*env\.kwargs="):
        EnvArguments(name="tests.unit.test_multi_turn.TwoTurns", kwargs={"size": 3}).validate(max_new_tokens=4)
    BUILT.clear()
    EnvArguments(name="tests.unit.test_multi_turn.TwoTurns").validate(max_new_tokens=4)
    assert len(BUILT) == 1 and BUILT[0].closed


def test_a_chat_template_that_cannot_render_a_tool_turn_is_a_config_error(tokenizer: Any) -> None:
    import copy

    strict = copy.deepcopy(tokenizer)
    strict.chat_template = (
        "{% for m in messages %}{% if m['role'] not in ['user', 'assistant'] %}"
        "{{ raise_exception('roles must be user or assistant') }}{% endif %}"
        "{{ m['role'] + ': ' + m['content'] }}{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    games = EnvArguments(name="guess_number", apply_chat_template=True)
    games.check_chat_template(strict, "strict-model")  # no tools: user turns render
    tools = EnvArguments(name="calculator_arithmetic", apply_chat_template=True, max_observation_tokens=512)
    with pytest.raises(ConfigError, match=r"env\.name=calculator_arithmetic .* 'tool'"):
        tools.check_chat_template(strict, "strict-model")
    tools.check_chat_template(tokenizer, "tiny")  # the tiny template renders any role
    strict.chat_template = None
    with pytest.raises(ConfigError, match=r"env\.apply_chat_template=true, but the chat template of strict-model"):
        games.check_chat_template(strict, "strict-model")


def test_a_failed_episode_is_flagged_as_reward_failed(tokenizer: Any) -> None:
    args = EnvArguments(name="test_two_turns", kwargs={"fail": "raise"}, max_trajectory_tokens=16, timeout_s=5)
    batch, _ = MultiTurnRollout(args, tokenizer, 0).run(
        ScriptedEngine(tokenizer).generate, [1], GeneratingArguments(max_new_tokens=4), 0
    )
    assert batch.batch["reward_failed"].tolist() == [1.0]  # not a real zero reward
    healthy, _, _ = _play(tokenizer, [1])
    assert healthy.batch["reward_failed"].tolist() == [0.0]


@pytest.mark.parametrize("estimator", ["grpo", "rloo", "reinforce_plus_plus"])
@pytest.mark.parametrize("reward_norm", ["none", "group", "batch"])
def test_failed_rows_change_no_other_rows_advantage_and_get_no_loss(estimator: str, reward_norm: str) -> None:
    def batch(scores: list[float]) -> DataProto:
        rows = len(scores)
        turn_rewards = torch.zeros(rows, 3)
        turn_rewards[:, 2] = torch.tensor(scores)
        return DataProto.from_dict(
            tensors={
                "response_mask": torch.ones(rows, 3, dtype=torch.long),
                "scores": torch.tensor(scores),
                "turn_rewards": turn_rewards,
                "turn_discounts": torch.ones(rows, 3),
            }
        )

    algorithm = AlgorithmArguments(adv_estimator=estimator, reward_norm=reward_norm)
    # Group 0: two real episodes and one that failed (its 0 is no reward); group 1: three real episodes.
    with_failure = batch([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    failed = torch.tensor([False, False, True, False, False, False])
    out, _ = compute_advantages(with_failure, torch.tensor([0, 0, 0, 1, 1, 1]), algorithm, 0.0, excluded=failed)
    alone, _ = compute_advantages(batch([1.0, 0.0, 1.0, 1.0, 0.0]), torch.tensor([0, 0, 1, 1, 1]), algorithm, 0.0)
    keep = torch.tensor([0, 1, 3, 4, 5])
    torch.testing.assert_close(out.batch["advantages"][keep], alone.batch["advantages"])
    assert out.batch["response_mask"][2].sum().item() == 0  # no loss on the failed episode
    assert out.batch["advantages"][2].abs().sum().item() == 0


def test_dynamic_sampling_refills_an_env_batch_with_episodes_of_new_seeds(tokenizer: Any) -> None:
    from types import SimpleNamespace

    from roll.pipeline.agentic.env_rollout import EpisodeSeeds
    from roll.pipeline.base.residency import Residency
    from roll.pipeline.rlvr.rlvr_pipeline import RLVRPipeline

    env = EnvArguments(name="test_two_turns", max_trajectory_tokens=16)
    generating_args = GeneratingArguments(max_new_tokens=4, num_return_sequences=2)
    algorithm = AlgorithmArguments(dynamic_sampling=True, dynamic_sampling_max_rounds=3)
    pipeline = RLVRPipeline.__new__(RLVRPipeline)
    pipeline.config = SimpleNamespace(
        seed=0,
        max_steps=5,
        async_generation_ratio=0,
        algorithm=algorithm,
        env=env,
        actor_infer=SimpleNamespace(generating_args=generating_args),
    )
    pipeline.clusters = {"actor_infer": ScriptedEngine(tokenizer)}
    pipeline.residency = Residency(pipeline.clusters, {})
    pipeline.sampler = EpisodeSeeds(batch_size=2, limit=10**9)
    pipeline.env_rollouts = EnvRollouts(env, tokenizer, 0, generating_args, False)
    pipeline.trainer_roles, pipeline.pad_id, pipeline.log_prob_temperature = {}, 0, 1.0
    pipeline.weights_stale, pipeline.answer_check, pipeline.tracker = False, None, SimpleNamespace(log_samples=print)
    pipeline.config.num_log_samples = 0
    metrics: dict[str, float] = {}
    batch = pipeline.play_episodes(1, metrics, {})
    RESETS.clear()
    # Every episode of the stand-in scores 1.5: no group is informative, so each round plays two more seeds.
    kept, _ = pipeline.filter_groups(batch, 1, metrics, {})
    assert RESETS == [2, 2, 3, 3, 4, 4, 5, 5] and pipeline.sampler.position == 6
    assert metrics["rollout/generation_rounds"] == 3.0 and len(kept) == 0


GEMMA_STYLE_TEMPLATE = (
    "{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)


def test_a_turn_ended_by_any_stop_id_of_the_generation_config_is_closed_once() -> None:
    """Gemma: EOS is `<eos>`, but a turn ends on `<end_of_turn>`, the generation config's other EOS id; the template's
    closing `<end_of_turn>` the policy sampled is not appended a second time."""
    from roll.models.tiny import DEFAULT_ALPHABET, build_char_tokenizer

    gemma = build_char_tokenizer(DEFAULT_ALPHABET)
    gemma.add_special_tokens({"eos_token": "<eos>", "additional_special_tokens": ["<start_of_turn>", "<end_of_turn>"]})
    gemma.chat_template = GEMMA_STYLE_TEMPLATE
    end_of_turn = gemma.convert_tokens_to_ids("<end_of_turn>")
    engine = ScriptedEngine(gemma)
    engine.sampled = [*_ids(gemma, "xy"), end_of_turn]
    args = EnvArguments(name="test_two_turns", max_trajectory_tokens=64, apply_chat_template=True)
    rollout = MultiTurnRollout(args, gemma, pad_id=0, stop_ids=[gemma.eos_token_id, end_of_turn])
    batch, metrics = rollout.run(engine.generate, [1], GeneratingArguments(max_new_tokens=4), 0)
    row = batch.batch["responses"][0][batch.batch["attention_mask"][0, -64:].bool()].tolist()
    turns = ["xy<end_of_turn>\n", "<start_of_turn>user\nok<end_of_turn>\n", "<start_of_turn>model\nxy<end_of_turn>"]
    assert gemma.decode(row) == "".join(turns)
    assert metrics["rollout/template_drift"] == 0.0


def test_an_env_workers_start_up_does_not_count_inside_the_first_resets_timeout(monkeypatch: Any) -> None:
    """Env workers with stand-in Ray actors that take 0.6 s to start, longer than a reset's 0.3 s timeout plus
    the actor grace: the first reset still answers, its timeout counted from when the actor is up."""
    import concurrent.futures
    from types import SimpleNamespace

    from ray.exceptions import GetTimeoutError

    from roll.pipeline.agentic import env_workers

    pool = concurrent.futures.ThreadPoolExecutor(4)

    class StandInActor:
        def __init__(self, env: EnvArguments, num_envs: int) -> None:
            self.up_at = time.monotonic() + 0.6
            self.actor = env_workers.EnvActor(env, num_envs)

        def __getattr__(self, method: str) -> Any:
            def call(*args: Any) -> concurrent.futures.Future:
                def run() -> Any:
                    time.sleep(max(0.0, self.up_at - time.monotonic()))  # the actor's process starting
                    return getattr(self.actor, method)(*args)

                return pool.submit(run)

            return SimpleNamespace(remote=call)

    def get(refs: Any, timeout: float) -> Any:
        try:
            return [r.result(timeout) for r in refs] if isinstance(refs, list) else refs.result(timeout)
        except concurrent.futures.TimeoutError as exc:
            raise GetTimeoutError("timed out") from exc

    monkeypatch.setattr(env_workers, "_REMOTE_ENV_ACTOR", SimpleNamespace(remote=StandInActor))
    monkeypatch.setattr(env_workers, "ray", SimpleNamespace(get=get, kill=lambda actor: None))
    monkeypatch.setattr(env_workers, "ACTOR_GRACE_S", 0.1)
    args = EnvArguments(name="test_two_turns", num_env_workers=2, timeout_s=0.3)
    workers = env_workers.EnvWorkers(args, num_envs=2)
    try:
        results = workers.reset([1, 2])
        assert [r.observation for r in results] == ["go", "go"]
        assert [r.observation for r in workers.step(["a", "b"])] == ["ok", "ok"]
    finally:
        pool.shutdown(wait=False)


def test_a_run_whose_episodes_all_fail_for_several_batches_stops_naming_the_error(tokenizer: Any) -> None:
    from roll.pipeline.agentic.env_rollout import ALL_FAILED_BATCHES_LIMIT

    args = EnvArguments(name="test_two_turns", kwargs={"fail": "raise"}, max_trajectory_tokens=16, timeout_s=5)
    rollouts = EnvRollouts(args, tokenizer, 0, GeneratingArguments(max_new_tokens=4), False)
    engine = ScriptedEngine(tokenizer)
    for step in range(ALL_FAILED_BATCHES_LIMIT - 1):
        batch, _ = rollouts.train_batch(engine, [step], group_size=2, base_seed=step)  # type: ignore[arg-type]
        assert batch.non_tensor_batch["env_error"][0].startswith("step raised RuntimeError: broken")
    with pytest.raises(RuntimeError, match=r"env\.name=test_two_turns.*step raised RuntimeError: broken"):
        rollouts.train_batch(engine, [9], group_size=2, base_seed=9)  # type: ignore[arg-type]
    plain = EnvArguments(name="test_two_turns", max_trajectory_tokens=16)
    healthy = EnvRollouts(plain, tokenizer, 0, GeneratingArguments(max_new_tokens=4), False)
    for step in range(ALL_FAILED_BATCHES_LIMIT + 1):
        healthy.train_batch(engine, [step], group_size=2, base_seed=step)  # type: ignore[arg-type]


@pytest.mark.parametrize("estimator", ["reinforce_plus_plus", "gae"])
def test_token_level_estimators_read_reward_norm_and_the_overlong_penalty(tokenizer: Any, estimator: str) -> None:
    from types import SimpleNamespace

    from roll.pipeline.rlvr.rlvr_pipeline import RLVRPipeline

    def returns(batch: DataProto, **algorithm: Any) -> list[float]:
        args = AlgorithmArguments(adv_estimator=estimator, gamma=1.0, lam=1.0, whiten_advantages=False, **algorithm)
        values = {"values": torch.zeros(batch.batch["response_mask"].shape)} if estimator == "gae" else {}
        batch = batch.union(DataProto.from_dict(tensors=values)) if values else batch
        out, _ = compute_advantages(batch, torch.zeros(len(batch), dtype=torch.long), args, 0.0)
        return out.batch["returns"][:, 0].tolist()  # the first sampled token's return: the episode's whole reward

    # Two episodes of one group: both turns (1.5), and the first turn only (0.5).
    both, _, _ = _play(tokenizer, [1])
    one, _, _ = _play(tokenizer, [1], max_turns=1)
    group = DataProto.concat([both, one])
    assert returns(group) == pytest.approx([1.5, 0.5])
    assert returns(group, reward_norm="group") == pytest.approx([0.5**0.5, -(0.5**0.5)], rel=1e-4)  # ±0.5 / 0.7071

    # The overlong penalty counts the whole trajectory (9 tokens: 6 sampled, 3 of the observation) against
    # env.max_trajectory_tokens=11 with a buffer of 4: -(9 - 7) / 4 on the episode, and on its last sampled token.
    pipeline = RLVRPipeline.__new__(RLVRPipeline)
    algorithm = AlgorithmArguments(adv_estimator=estimator, overlong_buffer_len=4, overlong_penalty_factor=1.0)
    pipeline.config = SimpleNamespace(env=EnvArguments(max_trajectory_tokens=11), algorithm=algorithm)
    metrics: dict[str, float] = {}
    penalised = pipeline._scored_episodes(both, metrics)
    assert metrics["rollout/overlong_penalty_mean"] == pytest.approx(-0.5)
    assert returns(penalised) == pytest.approx([1.0])


def test_dynamic_sampling_judges_a_group_without_its_failed_episodes() -> None:
    from roll.pipeline.rlvr.rollout import informative_rows, keep_informative_groups

    # Group 0: 1, 1 and a failed episode (its 0 is no score): no spread. Group 1: 1, 0 and a failed one.
    batch = DataProto.from_dict(tensors={"scores": torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0])})
    group_index = torch.tensor([0, 0, 0, 1, 1, 1])
    failed = torch.tensor([False, False, True, False, False, True])
    assert informative_rows(batch, group_index, excluded=failed) == 3
    _, kept_index, _ = keep_informative_groups(batch, group_index, 1, excluded=failed)
    assert kept_index.tolist() == [1, 1, 1]
    all_failed = torch.tensor([True, True, True, False, False, False])
    assert informative_rows(batch, group_index, excluded=all_failed) == 3  # group 1: 1, 0, 0
