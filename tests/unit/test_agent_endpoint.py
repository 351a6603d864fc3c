"""The agent endpoint without Ray: request checks and OpenAI-style errors, tool calls in responses, and episodes of
agents (`tests/agents.py`) played over HTTP against a scripted engine: ids as sampled, segments, failures."""

from __future__ import annotations

import json
import re
import time
from typing import Any

import httpx
import pytest
import torch

from examples.agents.calculator_agent import SYSTEM
from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.data_config import DataArguments
from roll.configs.schema import ConfigError
from roll.configs.worker_config import GeneratingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.models.model_providers import load_tokenizer
from roll.pipeline.agentic.agent_rollout import AgentRollout
from roll.pipeline.agentic.agent_tasks import DataTasks
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.chat_api import ApiError, assistant_message, parse_chat_request
from roll.pipeline.agentic.chat_server import ChatServer
from roll.pipeline.agentic.generation_queue import GenerationQueue
from roll.pipeline.agentic.observations import ObservationEncoder
from roll.pipeline.rlvr.rollout import compute_advantages, pad_rows, rollout_groups
from tests import agents
from tests.unit.test_hydra_configs import load_config
from tests.unit.test_multi_turn import ScriptedEngine

CALC = {"type": "function", "function": {"name": "calc", "parameters": {"properties": {"expression": {}}}}}


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    return load_tokenizer("tiny://qwen2")


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ([], None),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0]"),
        ({"messages": [{"role": "user", "content": "hi"}], "logit_bias": {}}, "logit_bias"),
        ({"messages": [{"role": "user", "content": "hi"}], "stream": True}, "stream"),
        ({"messages": [{"role": "user", "content": "hi"}], "n": 0}, "n"),
        ({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}, "temperature"),
        ({"messages": [{"role": "user", "content": "hi"}], "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "user", "content": "hi"}], "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_a_malformed_request_is_a_400_naming_the_field(body: Any, param: str | None) -> None:
    with pytest.raises(ApiError) as error:
        parse_chat_request(body)
    assert error.value.status == 400 and error.value.param == param
    assert error.value.body()["error"]["type"] == "invalid_request_error"


def test_a_request_is_normalised_for_the_chat_template() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": '{"expression": "2*3"}'}}
    request = parse_chat_request(
        {
            "model": "any",
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "c1", "content": "6"},
            ],
            "stop": "\n",
            "max_completion_tokens": 5,
            "seed": 3,
        }
    )
    assert request.messages[0] == {"role": "system", "content": "be brief"}
    assert request.messages[1]["tool_calls"][0]["function"]["arguments"] == {"expression": "2*3"}
    assert request.stop == ("\n",) and request.max_tokens == 5 and request.seed == 3


def test_tool_calls_in_the_sampled_text_become_openai_tool_calls() -> None:
    request = parse_chat_request({"messages": [{"role": "user", "content": "2*3"}], "tools": [CALC]})
    hermes = assistant_message(
        'ok <tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>', request, None
    )
    assert hermes["content"] == "ok"
    (call,) = hermes["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "calc" and json.loads(call["function"]["arguments"]) == {"expression": "2*3"}
    bracket = assistant_message("<calc 2*3>", request, ("<", ">"))
    assert bracket["content"] is None
    assert json.loads(bracket["tool_calls"][0]["function"]["arguments"]) == {"expression": "2*3"}
    # Without brackets, a malformed call, an unknown tool or tool_choice none: the text stays the content.
    assert assistant_message("<calc 2*3>", request, None) == {"role": "assistant", "content": "<calc 2*3>"}
    broken = '<tool_call>{"name": "calc"'
    assert assistant_message(broken, request, None)["content"] == broken
    unknown = '<tool_call>{"name": "search", "arguments": {}}</tool_call>'
    assert "tool_calls" not in assistant_message(unknown, request, None)
    no_tools = parse_chat_request(
        {"messages": [{"role": "user", "content": "x"}], "tools": [CALC], "tool_choice": "none"}
    )
    assert "tool_calls" not in assistant_message("<calc 2*3>", no_tools, ("<", ">"))


def _rollout(tokenizer: Any, agent: str, **env: Any) -> tuple[AgentRollout, ScriptedEngine, ChatServer]:
    fields = {"max_trajectory_tokens": 24, "max_observation_tokens": 16, "max_turns": 3, "agent_timeout_s": 10.0}
    args = EnvArguments(name="tests.agents.EchoTask", agent=agent, **(fields | env))
    server = ChatServer()
    return AgentRollout(args, tokenizer, pad_id=0, server=server), ScriptedEngine(tokenizer), server


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_calls_that_extend_each_other_train_the_ids_as_sampled(tokenizer: Any) -> None:
    rollout, engine, server = _rollout(tokenizer, "tests.agents.extending_agent")
    try:
        batch, metrics = rollout.run(engine.generate, [5, 5], GeneratingArguments(max_new_tokens=4), base_seed=1)
    finally:
        server.close()
    xy_eos = engine.sampled
    prompt, again = _ids(tokenizer, "task 5\n"), _ids(tokenizer, "again\n")
    # Each second call's prompt is the first call's prompt, its sampled ids and the new user turn: no
    # re-tokenisation. (How the four calls group into waves depends on timing: a loaded machine splits them.)
    seen = sorted(row for rows, _, _ in engine.calls for row in rows)
    assert seen == [prompt] * 2 + [prompt + xy_eos + again] * 2
    assert batch.batch["prompts"][0].tolist() == prompt
    response = xy_eos + again + xy_eos
    assert batch.batch["responses"][0, : len(response)].tolist() == response
    assert batch.batch["response_mask"][0, : len(response)].tolist() == [1] * 3 + [0] * len(again) + [1] * 3
    # "xy" has an even length: reward 0 on the last sampled token; no episode failed.
    assert batch.batch["scores"].tolist() == [0.0, 0.0] and batch.batch["reward_failed"].tolist() == [0.0, 0.0]
    assert metrics["rollout/agent_calls_per_episode"] == 2 and metrics["rollout/agent_new_segments"] == 0
    for session in rollout.sessions:
        assert [call.new_segment for call in session.calls] == [True, False]


def test_a_rewritten_history_starts_a_new_segment_and_a_hang_or_raise_ends_only_its_episode(tokenizer: Any) -> None:
    agents.reset()
    # Long enough for the other agents' calls on a loaded machine: they must not time out too.
    timeout_s = 5.0
    rollout, engine, server = _rollout(tokenizer, "tests.agents.scripted_agent", agent_timeout_s=timeout_s)
    failing, _, failing_server = _rollout(tokenizer, "tests.agents.raising_agent")
    try:
        started = time.monotonic()
        batch, metrics = rollout.run(engine.generate, [0] * 3, GeneratingArguments(max_new_tokens=4), base_seed=1)
        elapsed = time.monotonic() - started
        raised, raised_metrics = failing.run(engine.generate, [1], GeneratingArguments(max_new_tokens=4), base_seed=1)
    finally:
        server.close()
        failing_server.close()
    assert elapsed < timeout_s + 3.0  # the hung agent was abandoned at its timeout
    sessions = rollout.sessions
    (hung,) = [s for s in sessions if not s.calls]
    (rewrote,) = [s for s in sessions if len(s.segments) == 2]
    (extended,) = [s for s in sessions if len(s.segments) == 1]
    assert [c.new_segment for c in rewrote.calls] == [True, True]
    assert [c.new_segment for c in extended.calls] == [True, False]
    # A row per segment: the rewritten episode has two, the hung one a row of its own that failed.
    episode_of = batch.batch["episode_index"].tolist()
    rows = {id(s): [r for r, e in enumerate(episode_of) if e == sessions.index(s)] for s in sessions}
    assert len(batch) == 4 and [len(rows[id(s)]) for s in (hung, rewrote, extended)] == [1, 2, 1]
    failed = batch.batch["reward_failed"].tolist()
    assert [failed[r] for r in rows[id(hung)]] == [1.0] and sum(failed) == 1.0
    assert metrics["rollout/agent_timeouts"] == 1 and metrics["rollout/agent_new_segments"] == 1
    # The rewritten episode's second row is its second segment: the summary's prompt and the one call after it.
    row = rows[id(rewrote)][1]
    assert batch.batch["prompts"][row].tolist()[-len(rewrote.calls[1].prompt_ids) :] == rewrote.calls[1].prompt_ids
    assert "timeout" in batch.non_tensor_batch["env_error"][rows[id(hung)][0]]
    assert raised.batch["reward_failed"].tolist() == [1.0] and raised_metrics["rollout/agent_errors"] == 1
    assert "the agent's own bug" in raised.non_tensor_batch["env_error"][0]


def test_every_segment_trains_with_its_episodes_advantage(tokenizer: Any) -> None:
    """A group of two: an episode of two segments (reward 1) and one of a single segment (reward 0) give three rows,
    padded to four; GRPO's statistics take one score per episode, and each segment's row gets its episode's
    advantage on exactly its sampled ids."""
    agents.reset()
    rollout, engine, server = _rollout(tokenizer, "tests.agents.segment_agent")
    try:
        batch, metrics = rollout.run(engine.generate, [0, 0], GeneratingArguments(max_new_tokens=4), base_seed=1)
    finally:
        server.close()
    (rewrote,) = [s for s in rollout.sessions if len(s.segments) == 2]
    first = rollout.sessions.index(rewrote)
    episode_of = batch.batch["episode_index"].tolist()
    assert len(batch) == 3 and sorted(episode_of) == [first, first, 1 - first]
    assert metrics["rollout/agent_new_segments"] == 1 and batch.batch["scores"].tolist() == [
        float(e == first) for e in episode_of
    ]
    # Each segment's row: its first call's prompt, then the ids sampled (mask 1) and the turns appended (mask 0).
    xy_eos, task, again = engine.sampled, _ids(tokenizer, "task 0\n"), _ids(tokenizer, "again\n")
    expected = {
        first: [(task, xy_eos, [1] * 3), (again, xy_eos, [1] * 3)],
        1 - first: [(task, xy_eos + again + xy_eos, [1] * 3 + [0] * len(again) + [1] * 3)],
    }
    data, trained = batch.batch, {first: [], 1 - first: []}
    for row, episode in enumerate(episode_of):
        prompt = data["prompts"][row][data["prompts"][row] != 0].tolist()
        length = int(data["attention_mask"][row, data["prompts"].shape[1] :].sum())
        response, mask = data["responses"][row, :length].tolist(), data["response_mask"][row].tolist()
        assert mask[length:] == [0] * (len(mask) - length)
        trained[episode].append((prompt, response, mask[:length]))
    assert trained == expected

    groups = rollout_groups(batch, group_size=2)
    assert groups.tolist() == [0, 0, 0]
    padded, groups = pad_rows(batch, groups, row_multiple=4)
    pad = padded.batch["reward_failed"].bool()
    assert len(padded) == 4 and int(pad.sum()) == 1 and padded.batch["response_mask"][pad].sum() == 0
    assert groups[~pad].tolist() == [0, 0, 0] and groups[pad].tolist() == [1]
    out, _ = compute_advantages(padded, groups, AlgorithmArguments(adv_estimator="grpo"), 0.0, pad)
    # Per episode: scores 1 and 0, mean 0.5, unbiased std sqrt(0.5): +-0.5 / (0.7071 + 1e-6). Per row (1, 1, 0) it
    # would have been +0.577 and -1.155.
    advantage = 0.5 / (0.5**0.5 + 1e-6)
    real = torch.nonzero(~pad).flatten().tolist()
    assert padded.batch["episode_index"][real].tolist() == episode_of  # the rows in their order, padding between
    for row, episode in zip(real, episode_of, strict=True):
        mask = out.batch["response_mask"][row].bool()
        expected_row = torch.full((int(mask.sum()),), advantage if episode == first else -advantage)
        torch.testing.assert_close(out.batch["advantages"][row][mask], expected_row)
        assert out.batch["advantages"][row][~mask].abs().sum() == 0
    assert out.batch["advantages"][pad].abs().sum() == 0


def test_an_async_agent_returns_its_reward(tokenizer: Any) -> None:
    rollout, engine, server = _rollout(tokenizer, "tests.agents.async_agent")
    try:
        batch, _ = rollout.run(engine.generate, [2], GeneratingArguments(max_new_tokens=4), base_seed=1)
    finally:
        server.close()
    assert batch.batch["scores"].tolist() == [0.0] and batch.batch["reward_failed"].tolist() == [0.0]


def test_requests_beyond_the_budgets_or_without_a_key_get_json_errors(tokenizer: Any) -> None:
    rollout, _, server = _rollout(tokenizer, "tests.agents.extending_agent", max_observation_tokens=8)
    args = GeneratingArguments(max_new_tokens=4)
    session = rollout._session(0, args)
    server.start()
    server.open(session, GenerationQueue(0, set(), False))
    url = f"{server.base_url(session.session_id)}/chat/completions"
    headers = {"Authorization": f"Bearer {server.api_key}"}
    too_long = {"messages": [{"role": "user", "content": "a much too long task"}]}
    try:
        answers = {
            "key": httpx.post(url, json=too_long, headers={"Authorization": "Bearer wrong"}),
            "json": httpx.post(url, content=b"{not json", headers=headers),
            "long": httpx.post(url, json=too_long, headers=headers),
            "session": httpx.post(url.replace(session.session_id, "nope"), json=too_long, headers=headers),
            "path": httpx.post(
                f"http://{server.host}:{server.port}/v1/chat/completions", json=too_long, headers=headers
            ),
        }
    finally:
        server.close()
    codes = {name: (answer.status_code, answer.json()["error"]["code"]) for name, answer in answers.items()}
    assert codes["key"] == (401, "invalid_api_key")
    assert codes["json"][0] == 400 and codes["long"] == (400, "context_length_exceeded")
    assert codes["session"] == (404, "unknown_session") and codes["path"][0] == 404
    assert session.rejected == 2  # the malformed body and the long one; the others named no open session


def test_env_agent_is_checked_at_config_time() -> None:
    with pytest.raises(ConfigError, match=r"env.agent 'tests.agents.missing' cannot be imported"):
        EnvArguments(name="tests.agents.EchoTask", agent="tests.agents.missing").validate(4)
    with pytest.raises(ConfigError, match=r"env.agent=tests.agents.no_client_argument must take \(task, client\)"):
        EnvArguments(name="tests.agents.EchoTask", agent="tests.agents.no_client_argument").validate(4)
    in_workers = EnvArguments(name="tests.agents.EchoTask", agent="tests.agents.extending_agent", num_env_workers=1)
    in_workers.validate(4)  # agents may run in env workers; the dry run says so, and where the endpoint listens
    assert any("in the env-worker actors" in line and "node's address" in line for line in in_workers.describe(4, 8))


def test_the_agent_warm_start_holds_the_ids_the_endpoint_gives_the_calculator_agent(tokenizer: Any) -> None:
    """`make_agentic_sft_data.py calculator --system` rows encode to the endpoint's ids of the example agent's calls
    without a chat template: its system prompt and task, then the call, its EOS and the tool's answer."""
    from examples.agents.calculator_agent import CALC, SYSTEM
    from roll.envs.builtin.arithmetic import tool_use_rows
    from roll.pipeline.agentic.observations import ObservationEncoder

    call, answer = tool_use_rows([0], 1.0, tokenizer.eos_token, 2, 2, system=SYSTEM)
    encoder = ObservationEncoder(tokenizer, chat_template=False, tools=[CALC])
    first = encoder.conversation([{"role": "system", "content": SYSTEM}, {"role": "user", "content": "15*43=?"}])
    assert _ids(tokenizer, call["prompt"]) == first
    sampled = [*_ids(tokenizer, call["answer"]), tokenizer.eos_token_id]
    tool_turn = encoder.next_messages([{"role": "tool", "content": "645"}], action_end=tokenizer.eos_token)
    assert _ids(tokenizer, answer["prompt"]) == first + sampled + tool_turn


class LogProbEngine(ScriptedEngine):
    """`ScriptedEngine` that also reports an engine log-prob of -0.5 for every sampled token."""

    def generate(self, request: DataProto, args: GeneratingArguments) -> DataProto:
        out = super().generate(request, args)
        out.batch["engine_log_probs"] = torch.full(out.batch["responses"].shape, -0.5)
        return out


def test_the_engines_log_probs_of_each_call_are_kept_on_its_sampled_ids(tokenizer: Any) -> None:
    args = EnvArguments(name="tests.agents.EchoTask", agent="tests.agents.extending_agent", max_trajectory_tokens=24)
    server = ChatServer()
    rollout = AgentRollout(args, tokenizer, pad_id=0, server=server, with_engine_log_probs=True)
    engine = LogProbEngine(tokenizer)
    try:
        batch, _ = rollout.run(engine.generate, [5], GeneratingArguments(max_new_tokens=4), base_seed=1)
    finally:
        server.close()
    mask, log_probs = batch.batch["response_mask"][0], batch.batch["engine_log_probs"][0]
    assert (
        mask.sum() == 6 and bool((log_probs[mask.bool()] == -0.5).all()) and bool((log_probs[~mask.bool()] == 0).all())
    )


class SolvingEngine(ScriptedEngine):
    """Answers the last `a+b=` or `a-b=` of each prompt: its value when `a` is even, one more when it is odd."""

    def __init__(self, tokenizer: Any) -> None:
        super().__init__(tokenizer)
        self.tokenizer = tokenizer

    def generate(self, request: DataProto, args: GeneratingArguments) -> DataProto:
        ids, mask = request.batch["input_ids"], request.batch["attention_mask"].bool()
        answers = []
        for row, keep in zip(ids, mask, strict=True):
            a, op, b = re.findall(r"(\d+)([+-])(\d+)=", self.tokenizer.decode(row[keep].tolist()))[-1]
            value = int(a) + int(b) if op == "+" else int(a) - int(b)
            answers.append([*_ids(self.tokenizer, str(value + int(a) % 2)), self.tokenizer.eos_token_id])
        width = max(map(len, answers))
        responses = torch.tensor([answer + [0] * (width - len(answer)) for answer in answers])
        response_mask = torch.tensor([[1] * len(answer) + [0] * (width - len(answer)) for answer in answers])
        return DataProto.from_dict(tensors={"responses": responses, "response_mask": response_mask})


DATA_AGENT = {
    "agent": "examples.agents.calculator_agent.calculator_agent",
    "agent_task": "data",
    "max_observation_tokens": 24,
    "max_trajectory_tokens": 24,
    "eval_episodes": 4,
    "agent_timeout_s": 10.0,
}


def test_an_agent_plays_data_rows_scored_by_the_reward_function(tokenizer: Any) -> None:
    """The calculator agent on the built-in arithmetic rows: each seed's row is its task, and math_reward scores its
    final answer against the row's answer."""
    env = EnvArguments(**DATA_AGENT)
    tasks = DataTasks.load(DataArguments(), env)
    # Held-out seeds are the held-out rows in order; a pass of training seeds visits every training row once.
    assert [tasks.row(env.eval_seed_offset + i) for i in range(2)] == tasks.held_out[:2]
    assert sorted(tasks.row(seed).prompt for seed in range(len(tasks.train))) == sorted(r.prompt for r in tasks.train)
    seeds = [0, 0, 1, 1, 2, env.eval_seed_offset]
    rows = [tasks.row(seed) for seed in seeds]
    server = ChatServer()
    rollout = AgentRollout(env, tokenizer, pad_id=0, server=server, tasks=tasks.task)
    engine = SolvingEngine(tokenizer)
    try:
        batch, metrics = rollout.run(engine.generate, seeds, GeneratingArguments(max_new_tokens=4), base_seed=1)
    finally:
        server.close()
    # Each task is the row's prompt (`a+b=`), behind the agent's system prompt; an even `a` is answered right.
    assert list(batch.non_tensor_batch["prompt"]) == [row.prompt for row in rows]
    expected = [float(int(re.match(r"\d+", row.prompt)[0]) % 2 == 0) for row in rows]
    assert batch.batch["scores"].tolist() == expected and 0 < sum(expected) < len(expected)
    assert metrics["rollout/success"] == pytest.approx(sum(expected) / len(expected))
    first_call = ObservationEncoder(tokenizer, chat_template=False).conversation(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": rows[0].prompt}]
    )
    assert rollout.sessions[0].calls[0].prompt_ids == first_call
    assert tasks.task(0).score("no number") == (0.0, 0.0)
    # Batches whose every episode failed stop the run, naming the agent on the data rows.
    from roll.pipeline.agentic.env_rollout import ALL_FAILED_BATCHES_LIMIT, EnvRollouts

    rollouts = EnvRollouts(env, tokenizer, 0, GeneratingArguments(max_new_tokens=4), False, data=DataArguments())
    batch.batch["reward_failed"][:] = 1.0
    batch.non_tensor_batch["env_error"][:] = "the agent raised ValueError: x"
    with pytest.raises(RuntimeError, match=r"the agent env.agent=examples.* on the data rows.*ValueError: x"):
        for _ in range(ALL_FAILED_BATCHES_LIMIT):
            rollouts._check_not_all_failed(batch)
    rollouts.close()


def test_data_rows_as_an_agents_tasks_are_checked_before_ray(tmp_path: Any) -> None:
    with pytest.raises(ConfigError, match=r"env.agent_task=data .* set env.agent"):
        EnvArguments(agent_task="data").validate(4)
    with pytest.raises(ConfigError, match=r"remove env.name=calculator_arithmetic"):
        EnvArguments(**DATA_AGENT, name="calculator_arithmetic").validate(4)
    with pytest.raises(ConfigError, match=r"env.reward_fn"):
        EnvArguments(**DATA_AGENT, reward_fn="tests.agents.no_such_reward").validate(4)
    with pytest.raises(ConfigError, match=r"env.eval_episodes=100000 .* has 160"):
        DataTasks.load(DataArguments(), EnvArguments(**(DATA_AGENT | {"eval_episodes": 100_000})))
    # The recipe's YAML with its tasks from data files that do not exist: refused when the config loads.
    recipe = [
        "devices_per_node=2",
        "pretrain=tiny://qwen2",
        f"env.agent={DATA_AGENT['agent']}",
        "env.agent_task=data",
        "~env.name",
        "~env.kwargs",
    ]
    missing = tmp_path / "missing.jsonl"
    with pytest.raises(ConfigError, match=r"data\.train_file"):
        load_config("agentic_calculator_agent", [*recipe, f"data.train_file={missing}", f"data.eval_file={missing}"])
    config = load_config("agentic_calculator_agent", recipe)
    assert any("data rows" in line and "math_reward" in line for line in config.env.describe(128, 13))


def test_a_source_played_by_an_agent_mixes_with_an_environment_source(tokenizer: Any) -> None:
    """env.sources with an agent source (`tests.agents.extending_agent` on EchoTask) beside an environment source
    (TwoTurns): one batch in the episodes' order, each group of one source, each played its own way; metrics per
    source, the overall ones over all episodes."""
    from roll.pipeline.agentic.env_rollout import EnvRollouts
    from roll.pipeline.agentic.mixed_rollout import MixedRollout
    from roll.pipeline.agentic.sources import EnvSource, draw_sources

    sources = [
        EnvSource(name="echo", env="tests.agents.EchoTask", agent="tests.agents.extending_agent"),
        EnvSource(name="game", env="test_two_turns"),
    ]
    env = EnvArguments(sources=sources, max_trajectory_tokens=24, max_observation_tokens=16, agent_timeout_s=10.0)
    env.validate(max_new_tokens=4)
    assert any("played by the agent tests.agents.extending_agent" in line for line in env.describe(8, 4))
    seeds = [seed for seed in range(4) for _ in range(2)]
    names = draw_sources(seeds, sources)
    assert set(names) == {"echo", "game"}  # seeds 0-3 draw both
    server = ChatServer()
    rollout = MixedRollout(env, tokenizer, pad_id=0, server=server)
    engine = ScriptedEngine(tokenizer)
    try:
        batch, metrics = rollout.run(engine.generate, seeds, GeneratingArguments(max_new_tokens=4), base_seed=1)
    finally:
        server.close()
        rollout.close()
    # One row per episode here (no history was rewritten), in the seeds' order, each tagged with its source.
    assert batch.batch["episode_index"].tolist() == list(range(8))
    assert list(batch.non_tensor_batch["env_source"]) == names
    xy_eos, again, ok = engine.sampled, _ids(tokenizer, "again\n"), _ids(tokenizer, "ok\n")
    for row, name in enumerate(names):
        response = batch.batch["responses"][row].tolist()
        observation = again if name == "echo" else ok  # the agent's user turn, or the environment's observation
        assert response[: 2 * len(xy_eos) + len(observation)] == xy_eos + observation + xy_eos
    # The agent's final answer "xy" scores 0 (even length); TwoTurns pays 0.5 + 1 over its two turns.
    assert batch.batch["scores"].tolist() == [0.0 if name == "echo" else 1.5 for name in names]
    echo = names.count("echo")
    assert metrics["rollout/echo/agent_calls_per_episode"] == 2 and metrics["rollout/echo/success"] == 0
    assert metrics["rollout/game/success"] == 1 and metrics["rollout/agent_rows"] == echo
    assert metrics["rollout/success"] == pytest.approx((len(names) - echo) / len(names))
    assert metrics["rollout/turns_mean"] == pytest.approx((echo * 1 + (len(names) - echo) * 2) / len(names))
    rollouts = EnvRollouts(env, tokenizer, 0, GeneratingArguments(max_new_tokens=4), False)
    assert isinstance(rollouts.rollout, MixedRollout) and rollouts.server is not None
    rollouts.close()
