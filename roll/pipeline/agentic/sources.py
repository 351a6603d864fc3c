"""Several environments in one run (`env.sources`): each source's environment (or agent) and weight, the seeded draw
of an episode's source, and the per-source metric keys (`rollout/<source>/...`, `val/<source>/...`).

An episode's source is drawn from its seed, so the members of a GRPO group (which share their seed) play the same
source, a resumed or repeated run draws the same sources, and held-out seeds always meet the same environments.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from roll.configs.schema import DOTTED_PATH, ConfigError, any_value, check, field_rule

T = TypeVar("T")

# The draw's own random stream: an environment seeds its task with `random.Random(seed)`, and a draw from that
# same stream would tie which source an episode gets to which task it would have been given.
SOURCE_STREAM = 0x50_0C_E5


@dataclass
class EnvSource:
    """One environment of a mixed run: its name in the metrics, the environment with its kwargs, its weight."""

    name: str = field(
        default="",
        metadata=check(pattern=r"[A-Za-z0-9_-]+", expect="a name of letters, digits, _ or - (metric keys hold it)"),
    )
    # As env.name: a registered name, a dotted path or `gem:<env_id>`.
    env: str = field(default="", metadata=check(nonempty=True, hint="e.g. calculator_arithmetic or package.module.Env"))
    kwargs: dict[str, Any] = field(
        default_factory=dict, metadata=any_value("the environment's constructor arguments, checked by building one")
    )
    # Relative: a source's share of the episodes is its weight over the sum of the weights.
    weight: float = field(default=1.0, metadata=check(gt=0))
    # A user's agent `package.module.function(task, client)` that plays this source's episodes through the endpoint,
    # as env.agent does (`env` then gives its tasks and scores its final answers); None: the policy plays `env`.
    agent: str | None = field(default=None, metadata=check(DOTTED_PATH))

    def check_fields(self, path: str) -> None:
        """Every field's rule, the omitted ones included (the schema checks only the keys a YAML gives)."""
        for f in dataclasses.fields(self):
            rule = field_rule(f)
            if rule is not None:
                rule.check(getattr(self, f.name), f"{path}.{f.name}")


def check_sources(sources: Sequence[EnvSource]) -> None:
    """Each source's fields, and names that are unique; ConfigError naming the field."""
    seen: dict[str, int] = {}
    for i, source in enumerate(sources):
        source.check_fields(f"env.sources[{i}]")
        if source.name in seen:
            raise ConfigError(
                f"env.sources[{i}].name={source.name!r} repeats env.sources[{seen[source.name]}].name; "
                "each source needs its own name (it keys the source's metrics)"
            )
        seen[source.name] = i


def draw_sources(seeds: Sequence[int], sources: Sequence[EnvSource]) -> list[str]:
    """The source of each seed's episode, drawn by weight from a random stream of that seed alone."""
    weights = np.array([source.weight for source in sources], dtype=np.float64)
    bounds = np.cumsum(weights) / weights.sum()
    names = []
    for seed in seeds:
        u = np.random.default_rng([SOURCE_STREAM, int(seed)]).random()
        index = min(int(np.searchsorted(bounds, u, side="right")), len(sources) - 1)
        names.append(sources[index].name)
    return names


def group_by_source(names: Sequence[str]) -> dict[str, list[int]]:
    """The positions of each source's items, sources in order of first appearance."""
    groups: dict[str, list[int]] = {}
    for i, name in enumerate(names):
        groups.setdefault(name, []).append(i)
    return groups


def per_source_metrics(
    items: Sequence[T], names: Sequence[str], metrics_of: Callable[[list[T]], dict[str, float]]
) -> dict[str, float]:
    """`metrics_of` each source's items, each key `<kind>/<rest>` renamed `<kind>/<source>/<rest>`."""
    metrics: dict[str, float] = {}
    for name, positions in group_by_source(names).items():
        for key, value in metrics_of([items[i] for i in positions]).items():
            kind, _, rest = key.partition("/")
            metrics[f"{kind}/{name}/{rest}"] = value
    return metrics
