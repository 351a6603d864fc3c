"""Chat calls of many agents batched into actor_infer generations.

The endpoint's handlers `submit` a call's prompt ids and sampling settings and wait for its samples; the thread
that runs the rollout `serve`s: it waits until every running agent has a call in, or until no call came for
`GATHER_S` (an agent running a tool, or hung), then generates the waiting calls, one `generate` per distinct
sampling settings, each call's `n` samples as rows of their own. Every generation happens in that thread, as the
multi-turn rollout's do.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from roll.configs.worker_config import GeneratingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.agentic.agent_session import Sample
from roll.pipeline.agentic.chat_api import ApiError
from roll.pipeline.base.rl_workers import WITH_ENGINE_LOG_PROBS

# generate(request, generating_args) -> a rollout batch (`responses`, `response_mask`, maybe `engine_log_probs`).
Generate = Callable[[DataProto, GeneratingArguments], DataProto]
# How long a wave waits for one more call once no running agent is left without one, or none arrives.
GATHER_S = 0.02


@dataclass
class _Job:
    prompt_ids: list[int]
    args: GeneratingArguments
    n: int
    future: Future


def left_padded(histories: Sequence[list[int]], pad_id: int, with_log_probs: bool) -> DataProto:
    """A generate request of token `histories`, left-padded, asking for the engine's log-probs or not."""
    width = max(len(h) for h in histories)
    ids = torch.tensor([[pad_id] * (width - len(h)) + h for h in histories])
    mask = torch.tensor([[0] * (width - len(h)) + [1] * len(h) for h in histories])
    request = DataProto.from_dict(tensors={"input_ids": ids, "attention_mask": mask})
    request.meta_info[WITH_ENGINE_LOG_PROBS] = with_log_probs
    return request


def sampled_rows(out: DataProto, with_log_probs: bool) -> list[tuple[list[int], list[float]]]:
    """Each row's sampled ids exactly as the engine returned them (its reported length) and their log-probs."""
    rows = []
    for row, length in enumerate(out.batch["response_mask"].sum(-1).tolist()):
        ids = out.batch["responses"][row, :length].tolist()
        log_probs = out.batch["engine_log_probs"][row, :length].float().tolist() if with_log_probs else []
        rows.append((ids, log_probs))
    return rows


class GenerationQueue:
    """Calls waiting for samples, and the loop that generates them in waves."""

    def __init__(self, pad_id: int, stop_ids: set[int], with_log_probs: bool) -> None:
        self.pad_id = pad_id
        self.stop_ids = stop_ids
        self.with_log_probs = with_log_probs
        self._jobs: list[_Job] = []
        self._changed = threading.Condition()
        self._closed = False

    def submit(self, prompt_ids: list[int], args: GeneratingArguments, n: int) -> Future:
        """A future of the `n` samples of `prompt_ids` under `args` (a list of `Sample`)."""
        future: Future = Future()
        with self._changed:
            if self._closed:
                future.set_exception(ApiError(404, "the rollout of this episode has ended", code="unknown_session"))
            else:
                self._jobs.append(_Job(prompt_ids, args, n, future))
                self._changed.notify_all()
        return future

    def serve(self, generate: Generate, finished: Callable[[], bool], waiting_for: Callable[[], int]) -> int:
        """Generate the submitted calls in waves until `finished()` and none is left; `waiting_for()` is how many
        agents are running (a wave waits for a call from each, up to `GATHER_S` without a new one). Returns the
        number of waves. Once it returns, later calls fail."""
        waves = 0
        while True:
            jobs = self._next_wave(finished, waiting_for)
            if jobs is None:
                return waves
            if jobs:
                self._generate(generate, jobs)
                waves += 1

    def _next_wave(self, finished: Callable[[], bool], waiting_for: Callable[[], int]) -> list[_Job] | None:
        with self._changed:
            if not self._jobs:
                if finished():
                    self._closed = True
                    return None
                self._changed.wait(GATHER_S)
                return []
            while len(self._jobs) < waiting_for():
                count, deadline = len(self._jobs), time.monotonic() + GATHER_S
                self._changed.wait(GATHER_S)
                if len(self._jobs) == count and time.monotonic() >= deadline:
                    break
            jobs, self._jobs = self._jobs, []
            return jobs

    def _generate(self, generate: Generate, jobs: list[_Job]) -> None:
        groups: dict[str, list[_Job]] = {}
        for job in jobs:
            groups.setdefault(repr(job.args), []).append(job)
        for group in groups.values():
            try:
                histories = [job.prompt_ids for job in group for _ in range(job.n)]
                out = generate(left_padded(histories, self.pad_id, self.with_log_probs), group[0].args)
                rows = iter(sampled_rows(out, self.with_log_probs))
            except BaseException as exc:  # the engine failed: every call of the wave is answered with it
                for job in group:
                    job.future.set_exception(exc)
                raise
            for job in group:
                samples = []
                for ids, log_probs in (next(rows) for _ in range(job.n)):
                    samples.append(Sample(ids, log_probs, stopped=bool(ids) and ids[-1] in self.stop_ids))
                job.future.set_result(samples)
