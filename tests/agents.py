"""Agents and a task for the agent-endpoint tests, named by dotted path as a user's are (`env.agent`).

`EchoTask` gives `task <seed>` and scores a final answer by its length's parity (a reward that varies among an
untrained model's samples). `scripted_agent` makes two calls, the second extending the first; per task, its
first episode hangs and its second rewrites the history before the second call (`BEHAVIOUR` says which by the
order the episodes of a task start in; `reset()` forgets it); on held-out seeds (`HELD_OUT_FROM` on) it extends.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

from roll.envs.protocol import SUCCESS

HANG_S = 3600.0
_started: Counter = Counter()
_lock = threading.Lock()
BEHAVIOUR = {0: "hang", 1: "rewrite"}  # by the order an episode of a task starts in; the others extend
HELD_OUT_FROM = 10**6


def reset() -> None:
    """Forget which tasks' episodes started."""
    with _lock:
        _started.clear()


def started_episodes() -> dict[str, int]:
    """How many episodes of each task started in this process since `reset`."""
    with _lock:
        return dict(_started)


class EchoTask:
    """`task <seed>`; a final answer scores 1 when its length is odd."""

    def reset(self, seed: int | None = None) -> tuple[str, dict]:
        return f"task {seed}", {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        reward = float(len(action) % 2)
        return "done", reward, True, False, {SUCCESS: reward}


def _ask(client: Any, messages: list[dict]) -> Any:
    return client.chat.completions.create(model="roll-policy", messages=messages, max_tokens=4).choices[0].message


def two_calls(task: str, client: Any, rewrite: bool = False) -> str:
    """Ask, then ask again after the answer and a user turn (or, with `rewrite`, with the history cut to that turn)."""
    first = [{"role": "user", "content": task}]
    answer = _ask(client, first)
    if rewrite:
        second = [{"role": "user", "content": "again"}]
    else:
        second = [*first, answer.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
    return _ask(client, second).content or ""


def scripted_agent(task: str, client: Any) -> str:
    """`two_calls`, or per `BEHAVIOUR` a hang or a rewritten history."""
    with _lock:
        order = _started[task]
        _started[task] += 1
    held_out = int(task.split()[-1]) >= HELD_OUT_FROM
    behaviour = "extend" if held_out else BEHAVIOUR.get(order, "extend")
    if behaviour == "hang":
        time.sleep(HANG_S)
    return two_calls(task, client, rewrite=behaviour == "rewrite")


def segment_agent(task: str, client: Any) -> float:
    """Per task, the first episode to start rewrites its history (two segments) and returns reward 1, the others
    extend it (one segment) and return 0."""
    with _lock:
        order = _started[task]
        _started[task] += 1
    two_calls(task, client, rewrite=order == 0)
    return float(order == 0)


def extending_agent(task: str, client: Any) -> str:
    """`two_calls`, the second extending the first."""
    return two_calls(task, client)


def raising_agent(task: str, client: Any) -> str:
    """Fails after one call."""
    _ask(client, [{"role": "user", "content": task}])
    raise RuntimeError("the agent's own bug")


async def async_agent(task: str, client: Any) -> float:
    """An async agent: one call with the async client, its reward returned directly."""
    reply = await client.chat.completions.create(
        model="roll-policy", messages=[{"role": "user", "content": task}], max_tokens=4
    )
    return float(len(reply.choices[0].message.content or "") % 2)


def no_client_argument(task: str) -> str:
    """Takes no client: env.agent rejects it at config time."""
    return task
