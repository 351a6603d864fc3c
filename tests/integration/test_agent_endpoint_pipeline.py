"""Agents through the OpenAI-compatible endpoint with real Ray and a real engine (hf_infer, a tiny policy): one
RLVR step of `tests.agents.scripted_agent` episodes, then more batches played by the same pipeline's actor_infer
with every engine call recorded, which the tests below read: the scripted agent's again, the calculator agent on
arithmetic data rows, an agent source beside an environment source, and the scripted agent in an env worker."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any

import pytest
import ray
import torch
from transformers import AutoTokenizer

from roll.configs.data_config import DataArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.agentic.agent_rollout import AgentRollout
from roll.pipeline.agentic.agent_session import AgentSession
from roll.pipeline.agentic.agent_tasks import DataRow, DataTasks
from roll.pipeline.agentic.agent_workers import endpoint_host
from roll.pipeline.agentic.agentic_config import DEFAULT_ENV
from roll.pipeline.agentic.chat_server import ChatServer
from roll.pipeline.agentic.endpoint_template import plain_chat_template
from roll.pipeline.agentic.env_rollout import cluster_generate
from roll.pipeline.agentic.mixed_rollout import MixedRollout
from roll.pipeline.agentic.observations import ObservationEncoder
from roll.pipeline.agentic.sources import EnvSource
from roll.pipeline.rlvr import phases
from roll.pipeline.rlvr.rlvr_pipeline import RLVRPipeline
from roll.pipeline.rlvr.rollout import compute_advantages, rollout_groups
from roll.rewards.functions import math_reward
from tests import agents
from tests.pipeline_runs import logged_metrics
from tests.rlvr_runs import small_policy_config

pytestmark = pytest.mark.slow

TIMEOUT_S = 4.0
GROUP = 4
CALCULATOR_AGENT = "examples.agents.calculator_agent.calculator_agent"


@dataclass
class DataRun:
    """Episodes of the calculator agent on arithmetic rows: the batch, its sessions, each episode's row."""

    batch: DataProto
    sessions: list[AgentSession]
    rows: list[DataRow]
    tokenizer: Any


@dataclass
class AgentRun:
    """The metrics rows of the step, and the recorded batch: its sessions, the engine's (prompt, sampled) rows."""

    rows: list[dict]
    batch: DataProto
    metrics: dict[str, float]
    sessions: list[AgentSession]
    engine_rows: list[tuple[list[int], list[int]]]
    elapsed_s: float
    algorithm: Any
    data: DataRun
    mixed: tuple[DataProto, dict[str, float], list[AgentSession]]  # the batch, metrics and the agent's sessions
    export_dir: str  # the policy the run exported
    in_worker: WorkerRuns


@dataclass
class WorkerRuns:
    """Two batches of one task's episodes played by the scripted agent in an env-worker actor."""

    batches: list[DataProto]
    metrics: list[dict[str, float]]
    sessions: list[list[AgentSession]]
    base_url: str
    started_in_driver: int  # episodes the driver's copy of tests.agents saw start


@pytest.fixture(scope="module")
def agent_run(ray_session: None, tmp_path_factory: pytest.TempPathFactory) -> AgentRun:
    output = tmp_path_factory.mktemp("agent_endpoint")
    config = small_policy_config(
        "agentic_calculator_agent",
        output,
        "max_steps=1",
        "eval_steps=1",
        "env.eval_episodes=4",
        "env.name=tests.agents.EchoTask",
        "~env.kwargs",
        "env.agent=tests.agents.scripted_agent",
        f"env.agent_timeout_s={TIMEOUT_S}",
        "env.max_observation_tokens=16",
        "env.max_trajectory_tokens=24",
        "actor_infer.generating_args.max_new_tokens=4",
    )
    agents.reset()
    pipeline = RLVRPipeline(config)
    try:
        pipeline.run()
        pipeline.sync_weights()
        pipeline.residency.enter(phases.GENERATE)
        generate, engine_rows = cluster_generate(pipeline.clusters["actor_infer"]), []

        def recording(request: DataProto, args: Any) -> DataProto:
            out = generate(request, args)
            for row, mask, response, length in zip(
                request.batch["input_ids"],
                request.batch["attention_mask"].bool(),
                out.batch["responses"],
                out.batch["response_mask"].sum(-1),
                strict=True,
            ):
                engine_rows.append((row[mask].tolist(), response[: int(length)].tolist()))
            return out

        agents.reset()
        rollout = pipeline.env_rollouts.rollout
        started = time.monotonic()
        batch, metrics = rollout.run(recording, [0] * GROUP + [1] * GROUP, config.actor_infer.generating_args, 9)
        elapsed = time.monotonic() - started
        # The same engine and endpoint: the calculator agent on arithmetic rows, then an agent source beside an
        # environment source.
        server, args = pipeline.env_rollouts.server, config.actor_infer.generating_args
        data_env = replace(
            config.env, name=DEFAULT_ENV, agent=CALCULATOR_AGENT, agent_task="data", max_observation_tokens=24
        )
        tasks = DataTasks.load(DataArguments(), data_env)
        data_rollout = AgentRollout(data_env, pipeline.tokenizer, pipeline.pad_id, server, tasks=tasks.task)
        data_batch, _ = data_rollout.run(recording, [0, 0, 1, 1], args, 10)
        sources = [
            EnvSource(name="calc", env="tests.agents.EchoTask", agent=CALCULATOR_AGENT),
            EnvSource(name="echo", env="tests.agents.EchoTask"),
        ]
        mixed_env = replace(config.env, name=DEFAULT_ENV, agent=None, sources=sources, max_observation_tokens=24)
        mixed = MixedRollout(mixed_env, pipeline.tokenizer, pipeline.pad_id, server)
        mixed_batch, mixed_metrics = mixed.run(recording, [s for s in range(4) for _ in range(2)], args, 11)
        mixed.close()
        # A longer deadline than the driver-thread runs: each call also makes a Ray round trip to the worker.
        worker_env = replace(config.env, num_env_workers=1, agent_timeout_s=TIMEOUT_S + 2)
        in_worker = _runs_in_a_worker(worker_env, pipeline, recording, args)
    finally:
        pipeline.shutdown()
    return AgentRun(
        logged_metrics(config.run_dir),
        batch,
        metrics,
        rollout.sessions,
        engine_rows,
        elapsed,
        config.algorithm,
        DataRun(data_batch, data_rollout.sessions, [tasks.row(seed) for seed in [0, 0, 1, 1]], pipeline.tokenizer),
        (mixed_batch, mixed_metrics, mixed.agents["calc"].sessions),
        config.model_export_dir,
        in_worker,
    )


def _runs_in_a_worker(env: Any, pipeline: RLVRPipeline, generate: Any, args: Any) -> WorkerRuns:
    """Two batches of task 2's episodes, the agents in one env worker and the endpoint on the node's address. Per
    process, the first episode of a task to start hangs: the second batch hangs again only if the worker that held
    the first batch's hung episode was replaced."""
    server = ChatServer(endpoint_host(env))
    rollout = AgentRollout(env, pipeline.tokenizer, pipeline.pad_id, server)
    agents.reset()
    runs = []
    try:
        for base_seed in (12, 13):
            batch, metrics = rollout.run(generate, [2] * GROUP, args, base_seed)
            runs.append((batch, metrics, rollout.sessions))
        base_url = server.base_url("s")
    finally:
        rollout.close()
        server.close()
    return WorkerRuns(
        [batch for batch, _, _ in runs],
        [metrics for _, metrics, _ in runs],
        [sessions for _, _, sessions in runs],
        base_url,
        sum(agents.started_episodes().values()),
    )


def test_a_step_of_agent_episodes_trains_every_segment(agent_run: AgentRun) -> None:
    step = agent_run.rows[1]
    assert step["step"] == 1 and "actor/loss" in step
    # Per task (4 of 4 episodes), one episode hung and one rewrote its history; the others made two calls each. Each
    # segment is a row: 16 episodes, 4 of them of two segments, 20 rows (padded to whole optimizer steps of 16).
    assert step["rollout/agent_timeouts"] == 4 and step["rollout/reward_failed"] == 4
    assert step["rollout/agent_new_segments"] == 4 and step["rollout/agent_rejected_calls"] == 0
    assert step["rollout/agent_rows"] == 20
    assert 0 <= agent_run.rows[-1]["val/accuracy"] <= 1


def _rows_of(batch: DataProto, episode: int) -> list[int]:
    return [row for row, e in enumerate(batch.batch["episode_index"].tolist()) if e == episode]


def test_the_ids_trained_are_the_ids_the_engine_sampled_call_by_call(agent_run: AgentRun) -> None:
    batch = agent_run.batch.batch
    trained = 0
    for episode, session in enumerate(agent_run.sessions):
        if not session.calls:
            continue
        for call in session.calls:
            assert (call.prompt_ids, call.choices[0].sample.ids) in agent_run.engine_rows
        starts = [i for i, call in enumerate(session.calls) if call.new_segment]
        segments = [session.calls[a:b] for a, b in zip(starts, [*starts[1:], len(session.calls)], strict=True)]
        rows = _rows_of(agent_run.batch, episode)
        assert len(rows) == len(segments)  # every segment trained, as a row of its own
        for row, calls in zip(rows, segments, strict=True):
            prompt_width = batch["prompts"].shape[1]
            prompt = batch["prompts"][row][batch["attention_mask"][row, :prompt_width].bool()].tolist()
            width = batch["responses"].shape[1]
            response_mask = batch["response_mask"][row].tolist()
            response = batch["responses"][row, : sum(batch["attention_mask"][row, -width:].tolist())].tolist()
            ids = prompt + response
            for call in calls:
                start = len(call.prompt_ids)
                sampled = call.choices[0].sample.ids
                assert ids[:start] == call.prompt_ids  # the engine was given the trained ids before it
                assert ids[start : start + len(sampled)] == sampled
                offset = start - len(prompt)
                assert response_mask[offset : offset + len(sampled)] == [1] * len(sampled)
            assert sum(response_mask) == sum(len(call.choices[0].sample.ids) for call in calls)
            trained += 1
    # 2 x (GROUP - 1) episodes that finished, two of them of two segments.
    assert trained == 2 * (GROUP - 1) + 2 == len(agent_run.batch) - 2


def test_a_rewritten_history_starts_a_new_segment(agent_run: AgentRun) -> None:
    rewritten = [s for s in agent_run.sessions if len(s.segments) == 2]
    assert len(rewritten) == 2 and agent_run.metrics["rollout/agent_new_segments"] == 2
    for session in rewritten:
        first, second = session.calls
        assert second.new_segment and second.prompt_ids[: len(first.prompt_ids)] != first.prompt_ids


def test_a_hanging_agent_ends_only_its_episode_within_its_timeout(agent_run: AgentRun) -> None:
    failed = agent_run.batch.batch["reward_failed"].tolist()
    hung = [_rows_of(agent_run.batch, e) for e, session in enumerate(agent_run.sessions) if not session.calls]
    assert [[row] for row, f in enumerate(failed) if f] == hung and len(hung) == 2  # one row each
    assert agent_run.metrics["rollout/agent_timeouts"] == 2
    assert agent_run.elapsed_s < TIMEOUT_S + 10  # the engine's waves meanwhile took the rest


def test_a_failed_episode_changes_no_other_group_members_advantage(agent_run: AgentRun) -> None:
    batch, failed = agent_run.batch, agent_run.batch.batch["reward_failed"].bool()
    group_index = rollout_groups(batch, GROUP)
    assert group_index.tolist() == [0] * (len(batch) // 2) + [1] * (len(batch) // 2)
    every_row = torch.arange(len(batch))  # indexing copies: compute_advantages zeroes a failed row's mask in place
    with_failed, _ = compute_advantages(batch[every_row], group_index, agent_run.algorithm, 0.0, failed)
    kept = torch.nonzero(~failed).flatten()
    without, _ = compute_advantages(batch[kept], group_index[kept], agent_run.algorithm, 0.0)
    assert torch.allclose(with_failed.batch["advantages"][kept], without.batch["advantages"])
    assert with_failed.batch["advantages"][failed].abs().sum() == 0


def _final_answer(session: AgentSession) -> str:
    """What the calculator agent returned: its last call's content, "" when that call asked for a tool."""
    message = session.calls[-1].choices[0].message
    return "" if message.get("tool_calls") else message.get("content") or ""


def test_an_agent_on_data_rows_is_scored_by_the_reward_function(agent_run: AgentRun) -> None:
    from examples.agents.calculator_agent import SYSTEM

    data = agent_run.data
    encoder = ObservationEncoder(data.tokenizer, chat_template=False)
    failed = data.batch.batch["reward_failed"].tolist()
    scores = data.batch.batch["scores"].tolist()
    for episode, (session, row) in enumerate(zip(data.sessions, data.rows, strict=True)):
        # The task is the row's prompt behind the agent's system line; every call's ids are the engine's.
        first = encoder.conversation([{"role": "system", "content": SYSTEM}, {"role": "user", "content": row.prompt}])
        assert session.calls[0].prompt_ids == first
        for call in session.calls:
            assert (call.prompt_ids, call.choices[0].sample.ids) in agent_run.engine_rows
        assert scores[episode] == math_reward(row.prompt, _final_answer(session), row.answer)
    assert failed == [0.0] * len(data.rows)  # one short call each, within every budget
    assert list(data.batch.non_tensor_batch["prompt"]) == [row.prompt for row in data.rows]
    assert data.rows[0] == data.rows[1] and data.rows[0] != data.rows[2]  # a group shares its row


def test_an_agent_source_and_an_environment_source_in_one_batch(agent_run: AgentRun) -> None:
    batch, metrics, sessions = agent_run.mixed
    names = list(batch.non_tensor_batch["env_source"])
    assert set(names) == {"calc", "echo"} and batch.batch["episode_index"].tolist() == sorted(
        batch.batch["episode_index"].tolist()
    )
    # The agent source's calls and the environment source's turns went to the same engine, the ids as sampled.
    for session in sessions:
        for call in session.calls:
            assert (call.prompt_ids, call.choices[0].sample.ids) in agent_run.engine_rows
    width = batch.batch["prompts"].shape[1]
    for row, name in enumerate(names):
        if name == "echo":
            prompt = batch.batch["prompts"][row][batch.batch["attention_mask"][row, :width].bool()].tolist()
            sampled = int(batch.batch["response_mask"][row].sum())
            assert (prompt, batch.batch["responses"][row, :sampled].tolist()) in agent_run.engine_rows
    assert metrics["rollout/calc/agent_calls_per_episode"] >= 1 and "rollout/echo/success" in metrics


def test_the_export_carries_the_chat_template_the_endpoint_rendered(agent_run: AgentRun) -> None:
    # The run trains in the plain layout with bracket calls: a server of the export renders it
    # (tests/unit/test_endpoint_template.py checks that rendering against the trained ids).
    exported = AutoTokenizer.from_pretrained(agent_run.export_dir)
    assert exported.chat_template == plain_chat_template(("<", ">"))
    first_call = [{"role": "system", "content": "Multiply."}, {"role": "user", "content": "37*48=?"}]
    rendered = exported.apply_chat_template(first_call, tokenize=False, add_generation_prompt=True)
    assert rendered == "Multiply.\n37*48=?\n"


def test_agents_in_an_env_worker_end_only_their_own_episode_and_a_hung_worker_is_replaced(agent_run: AgentRun) -> None:
    runs = agent_run.in_worker
    assert runs.started_in_driver == 0  # every agent ran in the worker's process
    assert runs.base_url.startswith(f"http://{ray.util.get_node_ip_address()}:")
    for batch, metrics, sessions in zip(runs.batches, runs.metrics, runs.sessions, strict=True):
        # Per batch: one episode hung (the worker's first of the task), one rewrote its history, two extended.
        assert metrics["rollout/agent_timeouts"] == 1 and metrics["rollout/agent_errors"] == 0
        assert metrics["rollout/agent_new_segments"] == 1 and int(batch.batch["reward_failed"].sum()) == 1
        for session in sessions:
            for call in session.calls:
                assert (call.prompt_ids, call.choices[0].sample.ids) in agent_run.engine_rows
        assert sum(1 for session in sessions if len(session.calls) == 2) == GROUP - 1
