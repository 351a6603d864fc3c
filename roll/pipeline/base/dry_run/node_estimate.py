"""The host memory of each node of a CPU run: every process the run starts there, at the step's peak.

On CPU every rank's "device" is the host's memory, so what must fit is the sum over the node's
processes: the driver and Ray's own processes (node 0), each worker's runtime (the interpreter and
its libraries), each rank's resident states (`estimate_rank`), and on top the largest phase. A
synchronous step runs its phases one role at a time (generation, then log-probs, then training), so
the peak adds one role's phase at a time, with all of that role's ranks on the node at once; with
`async_generation_ratio` >= 1 generation overlaps the rest, and the generating role's phase is added
as well. The runtimes are measured (benchmarks/scale_memory.py, docs/memory_estimate.md).

A frozen `hf_infer` role that never receives weights (the reference, a teacher), loading a checkpoint
stored in its own dtype, holds its weights as the checkpoint file's pages: transformers maps
safetensors without copying them. Those pages are page cache, shared by every process mapping the
file and reclaimable (evicted, they are read again), so they are counted once per file, apart from
the used memory that Ray's memory monitor compares with its threshold.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass

from roll.configs.schema import ConfigError
from roll.configs.worker_config import WorkerConfig
from roll.distributed.executor.cluster import resolve_worker_cls
from roll.distributed.executor.strategy_worker import StrategyWorker
from roll.distributed.executor.worker_host import process_groups
from roll.distributed.scheduler.placement import PlacementPlan, plan_placement
from roll.pipeline.base.dry_run.model_shape import model_shape
from roll.pipeline.base.dry_run.model_states import GiB
from roll.pipeline.base.dry_run.rank_estimate import STRATEGY_KINDS, RankEstimate, estimate_rank, host_memory_bytes
from roll.pipeline.base.pipeline_config import PipelineConfig

logger = logging.getLogger(__name__)
MiB = 2**20
# Used memory (what Ray's memory monitor counts: shared libraries' pages are page cache) of each process beside its
# model, fitted to benchmarks/scale_memory.py's run at 24M parameters, where the model is negligible: a worker with
# torch, transformers and DeepSpeed imported (a training one also with its process group and engine), a reward or
# environment worker, and the driver with Ray's own processes (GCS, raylet, dashboard, agents, log monitor). The
# vLLM figure (its worker and the engine's own process) is an allowance, not yet measured against a run.
RUNTIME_BYTES = {"train": 400 * MiB, "infer": 300 * MiB, "engine": 1100 * MiB, "plain": 250 * MiB}
DRIVER_AND_RAY_BYTES = 1000 * MiB
# Ray's memory monitor kills workers once the node's used memory passes this share of its total.
RAY_KILL_FRACTION = 0.95
# The role whose generation overlaps training when generation runs ahead (async_generation_ratio >= 1).
GENERATING_ROLE = "actor_infer"
# What each role's worker loads, for the parameter count of its model.
MODEL_KINDS = {"critic": "value"}
# Roles whose weights are overwritten by weight syncs: their parameters' pages are copied on the first write.
SYNCED_ROLES = ("actor_infer",)


@dataclass(frozen=True)
class ProcessEstimate:
    """One rank of a role in a worker process: `label` is `role/rank`; `process` is the `role/rank` owning the OS
    process (its own label unless it shares one); `rank` is None for a role without a model (reward, env)."""

    label: str
    role: str
    process: str
    runtime: int
    rank: RankEstimate | None
    mapped: int = 0  # weights held as pages of the checkpoint file (see the module's docstring)
    model: str = ""

    @property
    def resident(self) -> int:
        """Bytes of used memory held throughout: the model states (on CPU, "offloaded" to host is still here)."""
        return self.rank.bytes_of(self.rank.resident) - self.mapped if self.rank else 0

    @property
    def phase_peak(self) -> int:
        """What the largest phase adds."""
        return self.rank.total - self.rank.bytes_of(self.rank.resident) if self.rank else 0

    @property
    def peak(self) -> int:
        """The process's own peak."""
        return self.runtime + self.resident + self.phase_peak


@dataclass(frozen=True)
class NodeEstimate:
    """The estimated peak of one node's host memory, against what Ray lets the node's processes use."""

    node: int
    processes: tuple[ProcessEstimate, ...]
    base: int  # the driver and Ray's processes on node 0; Ray's raylet and agents elsewhere
    budget: int
    budget_source: str
    overlapping: tuple[str, ...]  # roles whose phases overlap at the peak

    def _phase_by_role(self) -> dict[str, int]:
        added: dict[str, int] = defaultdict(int)
        for process in self.processes:
            added[process.role] += process.phase_peak
        return added

    @property
    def peak_roles(self) -> tuple[str, ...]:
        """The roles whose phases make the peak: the largest one, plus the overlapping ones."""
        added = self._phase_by_role()
        largest = max(added, key=added.__getitem__, default=None)
        return tuple(dict.fromkeys([*(r for r in self.overlapping if r in added), *([largest] if largest else [])]))

    @property
    def page_cache(self) -> int:
        """Bytes of checkpoint files mapped as weights, once per file."""
        files = {p.model: p.mapped for p in self.processes if p.mapped}
        return sum(files.values())

    @property
    def total(self) -> int:
        """Estimated peak bytes of the node's used memory (the mapped checkpoint pages apart)."""
        added = self._phase_by_role()
        steady = sum(p.runtime + p.resident for p in self.processes)
        return self.base + steady + sum(added[role] for role in self.peak_roles)

    def process_peaks(self) -> dict[str, int]:
        """Each worker process's own peak, keyed by its ranks' labels joined with ` + `: roles sharing a process take
        turns on it, so their runtimes and resident states add up and only the largest of their phases does."""
        members: dict[str, list[ProcessEstimate]] = defaultdict(list)
        for process in self.processes:
            members[process.process].append(process)
        return {
            " + ".join(sorted(p.label for p in group)): sum(p.runtime + p.resident for p in group)
            + max(p.phase_peak for p in group)
            for group in members.values()
        }

    @property
    def over(self) -> bool:
        """Whether the estimate exceeds the budget."""
        return self.total > self.budget

    def terms(self) -> dict[str, int]:
        """The estimate's terms, summed over the node's ranks: runtimes, each role's resident states and peak phase."""
        terms: dict[str, int] = defaultdict(int)
        terms["driver and Ray"] = self.base
        peak_roles = self.peak_roles
        for process in self.processes:
            terms["worker runtimes"] += process.runtime
            if process.rank is None:
                continue
            for item in process.rank.resident:
                if item.place in process.rank.places and not (process.mapped and item.name == "params"):
                    terms[f"{process.role} {item.name}"] += item.nbytes
            if process.role in peak_roles and process.rank.peak_phase:
                for item in process.rank.phases[process.rank.peak_phase]:
                    if item.place in process.rank.places:
                        terms[f"{process.role} {process.rank.peak_phase}: {item.name}"] += item.nbytes
        return dict(terms)

    @property
    def largest_term(self) -> str:
        """The biggest term and its size, e.g. `actor_train Adam m+v 3.68 GiB`."""
        name, size = max(self.terms().items(), key=lambda item: item[1])
        return f"{name} {size / GiB:.2f} GiB"

    def lines(self) -> list[str]:
        """The node's headline and its processes, for the dry run."""
        verdict = "OVER" if self.over else "fits"
        lines = [
            f"node {self.node}: ~{self.total / GiB:.2f} GiB at the step's peak of {self.budget / GiB:.2f} GiB "
            f"({self.budget_source}): {verdict}; largest term: {self.largest_term}",
            f"  driver and Ray: {self.base / GiB:.2f} GiB",
        ]
        if self.page_cache:
            lines.append(
                f"  checkpoint pages mapped as frozen weights (page cache, shared, not in the total): "
                f"{self.page_cache / GiB:.2f} GiB"
            )
        for process in self.processes:
            shared = f" (in {process.process}'s process)" if process.process != process.label else ""
            lines.append(
                f"  {process.label}{shared}: runtime {process.runtime / GiB:.2f} + resident "
                f"{process.resident / GiB:.2f} + peak phase {process.phase_peak / GiB:.2f} GiB"
            )
        lines.append(f"  the peak adds the phases of: {', '.join(self.peak_roles) or 'no role'}")
        return lines


def _runtime(role: WorkerConfig) -> int:
    if role.strategy_args is None or not issubclass(resolve_worker_cls(role.worker_cls), StrategyWorker):
        return RUNTIME_BYTES["plain"]
    return RUNTIME_BYTES[STRATEGY_KINDS.get(role.strategy_args.strategy_name, "train")]


def _mapped_weights(name: str, role: WorkerConfig, rank: RankEstimate | None) -> int:
    """The bytes of `role`'s weights that stay pages of its checkpoint file (0 when they are copied)."""
    if rank is None or name in SYNCED_ROLES or role.strategy_args.strategy_name != "hf_infer":
        return 0
    if role.model_args.lora_rank > 0 or model_shape(role.model_args.model_name_or_path).stored_dtype != (
        role.model_args.dtype
    ):
        return 0
    return sum(item.nbytes for item in rank.resident if item.name == "params")


def estimate_nodes(
    config: PipelineConfig, plan: PlacementPlan | None = None, host_memory: int | None = None
) -> list[NodeEstimate]:
    """Each planned node's peak host memory for a CPU run of `config` (every node assumed to have `host_memory`)."""
    plan = plan or plan_placement(config.cluster_shape(), config.roles())
    host = host_memory or host_memory_bytes()
    prompt_length, response_length, prompts = config.sequence_lengths()
    overlapping = (GENERATING_ROLE,) if getattr(config, "async_generation_ratio", 0) else ()
    processes: dict[int, list[ProcessEstimate]] = defaultdict(list)
    roles = config.roles()
    # Roles sharing a process per device (share_worker_processes) pay one runtime there: the largest of theirs.
    owners = {}
    for group in process_groups(roles) if config.share_worker_processes else []:
        owner = max(group, key=lambda member: _runtime(roles[member]))
        owners.update(dict.fromkeys(group, owner))
    for name, role in roles.items():
        placements = plan.roles.get(name, ())
        rank_estimate = None
        if role.strategy_args is not None and issubclass(resolve_worker_cls(role.worker_cls), StrategyWorker):
            rank_estimate = estimate_rank(
                role,
                prompt_length=prompt_length,
                response_length=response_length,
                prompts=prompts,
                kind=MODEL_KINDS.get(name, "causal_lm"),
                platform="cpu",
                host_memory=host,
                breakdown=config.rank_breakdown(name, role, "cpu"),
            )
        mapped = _mapped_weights(name, role, rank_estimate)
        owner = owners.get(name, name)
        for placement in placements:
            processes[placement.node].append(
                ProcessEstimate(
                    f"{name}/{placement.rank}",
                    name,
                    f"{owner}/{placement.rank}",
                    _runtime(role) if owner == name else 0,
                    rank_estimate,
                    mapped,
                    role.model_args.model_name_or_path if mapped else "",
                )
            )
    budget = int(host * RAY_KILL_FRACTION)
    source = f"{RAY_KILL_FRACTION:.0%} of the host's {host / GiB:.1f} GiB, where Ray's memory monitor kills workers"
    return [
        NodeEstimate(
            node.index,
            tuple(processes.get(node.index, ())),
            DRIVER_AND_RAY_BYTES if node.index == 0 else DRIVER_AND_RAY_BYTES // 2,
            budget,
            source,
            overlapping,
        )
        for node in plan.nodes
    ]


def cpu_node_estimates(config: PipelineConfig, plan: PlacementPlan | None = None) -> list[NodeEstimate]:
    """`estimate_nodes` for a CPU run; [] on other platforms (their host memory holds only what is offloaded) and
    for a run whose memory cannot be estimated (logged)."""
    if config.platform != "cpu":
        return []
    try:
        return estimate_nodes(config, plan)
    except ConfigError:  # the estimate found the config wrong: that is the run's error, not a missing estimate
        raise
    except (ValueError, OSError) as exc:  # a model it cannot count (MoE), a backend it does not know
        logger.warning("the node memory estimate is skipped: %s", exc)
        return []


def check_node_memory(config: PipelineConfig, plan: PlacementPlan | None = None) -> list[NodeEstimate]:
    """`cpu_node_estimates`; ConfigError, naming the largest term, when a node exceeds its budget (unless
    `memory_check=false`)."""
    nodes = cpu_node_estimates(config, plan)
    over = [node for node in nodes if node.over]
    if over and config.memory_check:
        node = over[0]
        raise ConfigError(
            f"the run will not fit in host memory: node {node.node} needs ~{node.total / GiB:.1f} GiB at the step's "
            f"peak, over {node.budget / GiB:.1f} GiB ({node.budget_source}); the largest term is {node.largest_term}. "
            "Give roles fewer ranks (each rank holds its own copy of the weights), a ZeRO stage or dtype that holds "
            "less, or smaller batches; `dry_run=true` prints every term, and memory_check=false runs it anyway"
        )
    return nodes
