"""`dry_run=true`: what a validated run would do, printed without starting any actor.

The plan has three parts: where every rank goes (roles -> nodes -> devices -> ranks, from the same
placement plan the run reserves), how a step's batch divides over the roles, and an estimate of each
rank's memory against the device's (GPU) or the host's (CPU). Without an address nothing of Ray
starts; with one, the driver connects only to read the alive nodes and checks the plan against them.
"""

from __future__ import annotations

import os

from roll.configs.schema import ConfigError
from roll.configs.worker_config import WorkerConfig
from roll.distributed.executor.cluster import resolve_worker_cls
from roll.distributed.executor.strategy_worker import StrategyWorker
from roll.distributed.scheduler.placement import NodeResources, PlacementPlan, plan_placement
from roll.pipeline.base.dry_run.node_estimate import MODEL_KINDS, cpu_node_estimates
from roll.pipeline.base.dry_run.rank_estimate import RankEstimate, estimate_rank
from roll.pipeline.base.pipeline_config import PipelineConfig


def cluster_nodes(config: PipelineConfig) -> list[NodeResources] | None:
    """The alive nodes of the cluster the run would use, or None when it would start its own Ray."""
    address = config.ray_address or os.environ.get("RAY_ADDRESS")
    if not address or address == "local":
        return None
    import ray

    ray.init(address=address, namespace=config.ray_namespace, logging_level="ERROR")
    try:
        return NodeResources.from_ray(ray.nodes())
    finally:
        ray.shutdown()


def dry_run_report(config: PipelineConfig, nodes: list[NodeResources] | None = None) -> list[str]:
    """The plan of a validated run as text lines: placement, batch arithmetic, memory per rank."""
    plan = plan_placement(config.cluster_shape(), config.roles(), nodes)
    where = "checked against the cluster's alive nodes" if nodes is not None else "on the configured device grid"
    lines = [
        f"dry run of {config.exp_name}: nothing was started",
        f"== placement ({config.num_nodes} node(s) x {config.devices_per_node} device(s), "
        f"platform {config.platform}; {where})",
        *plan.format(),
        *_model_parallel_lines(config),
        "== batches",
        *(config.batch_plan() or ["(this pipeline has no batch arithmetic)"]),
        "== memory per rank (an estimate; docs/memory_estimate.md compares it with measured runs)",
    ]
    over = []
    for name, role in config.roles().items():
        if not issubclass(resolve_worker_cls(role.worker_cls), StrategyWorker):
            continue  # e.g. reward workers: no model of their own
        try:
            estimate = _estimate(config, plan, name, role)
        except ConfigError:  # the estimate found the config wrong: that is the run's error, not a missing estimate
            raise
        except (ValueError, OSError) as exc:  # a model it cannot count (MoE), as for the nodes
            lines.append(f"{name}: no memory estimate ({exc})")
            continue
        if estimate is None:
            continue
        lines += estimate.lines()
        if estimate.over:
            over.append(name)
    if over:
        lines.append(f"warning: the estimate of {', '.join(over)} exceeds its memory; see the breakdown above")
    if config.platform == "cpu":
        lines.append("== memory per node (every process of the run in the host's memory, at the step's peak)")
        for node in cpu_node_estimates(config, plan):
            lines += node.lines()
            if node.over:
                then = "the run is refused before Ray starts" if config.memory_check else "memory_check=false runs it"
                lines.append(f"node {node.node} will not fit: {then}")
    return lines


def _model_parallel_lines(config: PipelineConfig) -> list[str]:
    """How the ranks of each role that shards its model across workers (AutoTP) form data-parallel groups."""
    return [
        f"{name}: {role.world_size} ranks = {role.dp_size} data-parallel group(s) x {role.model_parallel_size} "
        f"tensor-parallel ranks (consecutive ranks, one batch shard per group; the batch lines count groups)"
        for name, role in config.roles().items()
        if role.model_parallel_size > 1
    ]


def _estimate(config: PipelineConfig, plan: PlacementPlan, name: str, role: WorkerConfig) -> RankEstimate | None:
    prompt_length, response_length, prompts = config.sequence_lengths()
    ranks_on_node = max((rank.local_world_size for rank in plan.roles.get(name, ())), default=1)
    return estimate_rank(
        role,
        prompt_length=prompt_length,
        response_length=response_length,
        prompts=prompts,
        kind=MODEL_KINDS.get(name, "causal_lm"),
        platform=config.platform,
        ranks_on_node=ranks_on_node,
        breakdown=config.rank_breakdown(name, role, config.platform),
    )
