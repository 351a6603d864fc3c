"""Per-rank memory of a role, estimated from its config and its model's config.json alone.

`estimate_rank` reads the role's strategy (`STRATEGY_KINDS`: train, infer or engine), builds what one
of its ranks holds (`backend_ranks`) and sets it against a budget: the device's memory on an
accelerator, the host's memory shared by the node's ranks on CPU. `RankEstimate` is the result and its
printed breakdown. Plain arithmetic: no torch, no Ray, no weights. docs/memory_estimate.md compares the
estimate with a real DeepSpeed run.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

from roll.configs.worker_config import WorkerConfig
from roll.pipeline.base.dry_run.backend_ranks import RankBreakdown, _engine_rank, _infer_rank, _Lengths, _train_rank
from roll.pipeline.base.dry_run.model_shape import ModelShape, model_shape
from roll.pipeline.base.dry_run.model_states import GiB, MemoryItem, Place

# What each backend holds; a test checks that every registered strategy is here.
STRATEGY_KINDS = {
    "deepspeed_train": "train",
    "deepspeed_infer": "infer",
    "fsdp2_train": "train",
    "fsdp2_infer": "infer",
    "hf_infer": "infer",
    "vllm": "engine",
    "sglang": "engine",
}


def host_memory_bytes() -> int:
    """This machine's physical memory."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


@dataclass(frozen=True)
class RankEstimate:
    """One rank of a role: what it holds throughout (`resident`) and what each phase adds at its peak.

    `places` are the memories `budget` covers: the device on accelerators, device and host on CPU
    (where a "device" is host memory too). `total` is the resident bytes plus the largest phase there.
    """

    role: str
    strategy: str
    ranks: int
    resident: tuple[MemoryItem, ...]
    phases: dict[str, tuple[MemoryItem, ...]]
    places: tuple[Place, ...]
    budget: int | None
    budget_source: str
    notes: tuple[str, ...] = field(default=())

    def bytes_of(self, items: tuple[MemoryItem, ...]) -> int:
        """Bytes of `items` in the memories the budget covers."""
        return sum(item.nbytes for item in items if item.place in self.places)

    @property
    def peak_phase(self) -> str | None:
        """The phase that adds the most, or None when the role has none."""
        return max(self.phases, key=lambda name: self.bytes_of(self.phases[name]), default=None)

    @property
    def total(self) -> int:
        """Estimated peak bytes of this rank in the budgeted memory."""
        peak = self.phases[self.peak_phase] if self.peak_phase else ()
        return self.bytes_of(self.resident) + self.bytes_of(peak)

    @property
    def elsewhere(self) -> int:
        """Resident bytes outside the budgeted memory (offloaded to host memory on accelerators, or to NVMe)."""
        return sum(item.nbytes for item in self.resident if item.place not in self.places)

    @property
    def over(self) -> bool:
        """Whether the estimate exceeds the budget (False when the budget is unknown)."""
        return self.budget is not None and self.total > self.budget

    def lines(self) -> list[str]:
        """A human-readable breakdown: headline, resident items, each phase, notes."""
        verdict = "unknown budget" if self.budget is None else ("OVER" if self.over else "fits")
        budget = f" of {self.budget / GiB:.2f} GiB ({self.budget_source})" if self.budget is not None else ""
        lines = [
            f"{self.role} ({self.strategy}, {self.ranks} rank{'s' if self.ranks > 1 else ''}): "
            f"~{self.total / GiB:.2f} GiB per rank{budget}: {verdict}"
        ]
        lines.append("  resident: " + _items_text(self.resident))
        for name, items in self.phases.items():
            marker = " (peak)" if name == self.peak_phase else ""
            lines.append(f"  {name}{marker}: +{self.bytes_of(items) / GiB:.2f} GiB: " + _items_text(items))
        if self.elsewhere:
            lines.append(f"  offloaded (outside the budget): {self.elsewhere / GiB:.2f} GiB")
        lines += [f"  note: {note}" for note in self.notes]
        return lines


def _items_text(items: tuple[MemoryItem, ...]) -> str:
    parts = [f"{i.name} {i.nbytes / GiB:.3f}" + (f" ({i.place})" if i.place != "device" else "") for i in items]
    return ", ".join(parts) or "nothing"


def estimate_rank(
    role: WorkerConfig,
    *,
    prompt_length: int,
    response_length: int,
    prompts: int | None = None,
    shape: ModelShape | None = None,
    kind: str = "causal_lm",
    platform: str = "cpu",
    device_memory: int | None = None,
    host_memory: int | None = None,
    ranks_on_node: int = 1,
    breakdown: RankBreakdown | None = None,
) -> RankEstimate | None:
    """Estimate the memory of one rank of `role` (resolved: name and world size set); None without a strategy.

    Sequences are `prompt_length` + `response_length` tokens, log-probs scored over the response;
    `prompts` is the batch a generation call spreads over the role's ranks (default: `infer_batch_size`
    per rank). The model's `shape` defaults to `model_shape(role.model_args.model_name_or_path)`; `kind`
    is what the worker loads (`causal_lm`, `value`, `reward`). The budget is `device_memory` bytes per
    device on an accelerator `platform` (unknown if None), or on "cpu" the host's memory (`host_memory`,
    default this machine's) divided by the `ranks_on_node` that share it.
    `breakdown` (what the pipeline's config computes for a model the decoder arithmetic cannot count, as a
    diffusion model) replaces the strategy's own resident items, phases and notes.
    """
    if role.strategy_args is None:
        return None
    strategy = role.strategy_args.strategy_name
    if strategy not in STRATEGY_KINDS:
        raise ValueError(f"no memory estimate for strategy {strategy!r}; known: {', '.join(STRATEGY_KINDS)}")
    shape = shape or (None if breakdown else model_shape(role.model_args.model_name_or_path))
    on_cpu = platform == "cpu"
    places: tuple[Place, ...] = ("device", "host") if on_cpu else ("device",)
    devices = role.num_devices_per_worker
    if on_cpu:
        host = host_memory or host_memory_bytes()
        budget, source = host // ranks_on_node, f"host {host / GiB:.1f} GiB / {ranks_on_node} ranks on the node"
    elif device_memory is None:
        budget, source = None, "device memory unknown"
    else:
        budget, source = device_memory * devices, f"{devices} x {device_memory / GiB:.1f} GiB device memory"
    lengths = _Lengths(prompt_length, response_length, prompts)
    if breakdown is not None:
        resident, phases, notes = breakdown
    elif STRATEGY_KINDS[strategy] == "train":
        resident, phases, notes = _train_rank(role, shape, kind, lengths, platform)
    elif STRATEGY_KINDS[strategy] == "infer":
        resident, phases, notes = _infer_rank(role, shape, kind, lengths)
    else:
        resident, phases, notes = _engine_rank(role, shape, kind, lengths, platform, budget)
    return RankEstimate(role.name, strategy, role.world_size or 1, resident, phases, places, budget, source, notes)
