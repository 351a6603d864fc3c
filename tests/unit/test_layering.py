"""Layering: no module of roll imports a layer above its own (docs/architecture.md draws the layers)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.conftest import REPO_ROOT

# Lowest first. A module may import its own layer and the layers below it, never one above.
LAYERS: list[tuple[str, ...]] = [
    ("roll.utils",),
    ("roll.algorithms",),  # pure torch math: advantages, losses, KL, reward shaping
    ("roll.platforms",),
    ("roll.configs",),
    ("roll.distributed.scheduler",),  # DataProto, dispatch modes, rank layout, Ray start
    ("roll.distributed.weight_sync",),  # transports: plan, buckets, broadcast group, colocated hand-over
    ("roll.models", "roll.datasets", "roll.rewards", "roll.envs"),
    ("roll.third_party",),
    ("roll.distributed.strategy",),
    ("roll.distributed.executor",),
    ("roll.pipeline",),
    ("roll.system_report", "roll.cli"),  # top-level tools (system report, console entry points) that nothing imports
]


def layer_of(module: str) -> int | None:
    """Index of the layer `module` belongs to (None for roll's top package)."""
    for index, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return index
    return None


def roll_modules() -> dict[str, Path]:
    """Every module of the roll package by dotted name."""
    root = REPO_ROOT / "roll"
    return {
        ".".join(path.relative_to(REPO_ROOT).with_suffix("").parts).removesuffix(".__init__"): path
        for path in root.rglob("*.py")
    }


def imported_roll_modules(path: Path) -> list[tuple[str, int]]:
    """The roll modules a file imports anywhere in it (lazy imports inside functions too), with line numbers."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("roll"):
            found.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names if alias.name.startswith("roll")]
    return found


def test_every_module_has_a_layer() -> None:
    unplaced = [name for name in roll_modules() if name not in ("roll", "roll.distributed") and layer_of(name) is None]
    assert not unplaced, f"add these modules' packages to LAYERS: {unplaced}"


@pytest.mark.parametrize("module", sorted(roll_modules()))
def test_no_import_of_a_higher_layer(module: str) -> None:
    own = layer_of(module)
    if own is None:
        return
    upward = [
        f"line {line}: {target} ({LAYERS[layer_of(target)][0]} is above {LAYERS[own][0]})"
        for target, line in imported_roll_modules(roll_modules()[module])
        if (layer_of(target) or 0) > own
    ]
    assert not upward, f"{module} imports a higher layer: {upward}"


# Families one may import: RLVR's driver runs agentic RL's multi-turn rollout when its config has an `env:` block.
FAMILY_IMPORTS = {"rlvr": {"agentic"}}


def pipeline_family(module: str) -> str | None:
    """The pipeline family (`rlvr`, `dpo`, ...) a module belongs to; None outside the families (`base` is none)."""
    parts = module.split(".")
    if len(parts) > 2 and parts[:2] == ["roll", "pipeline"] and parts[2] != "base":
        return parts[2]
    return None


@pytest.mark.parametrize("module", sorted(m for m in roll_modules() if pipeline_family(m)))
def test_no_pipeline_family_imports_another(module: str) -> None:
    own = pipeline_family(module)
    crossing = [
        f"line {line}: {target}"
        for target, line in imported_roll_modules(roll_modules()[module])
        if pipeline_family(target) not in (None, own, *FAMILY_IMPORTS.get(own, ()))
    ]
    assert not crossing, (
        f"{module} imports another pipeline family (move what they share to roll.pipeline.base): {crossing}"
    )


def test_agentic_rl_has_its_own_family_which_imports_no_other() -> None:
    agentic = [m for m in roll_modules() if pipeline_family(m) == "agentic"]
    assert {"roll.pipeline.agentic.multi_turn", "roll.pipeline.agentic.env_rollout"} <= set(agentic)
    assert not [m for m in roll_modules() if m.startswith("roll.pipeline.rlvr.") and "env" in m.rsplit(".", 1)[1]]
    assert "agentic" not in FAMILY_IMPORTS  # the reverse import would be a cycle: rlvr imports agentic


def test_every_package_says_what_it_is_for() -> None:
    silent = [
        name
        for name, path in roll_modules().items()
        if path.name == "__init__.py" and not ast.get_docstring(ast.parse(path.read_text()))
    ]
    assert not silent, f"give these packages a docstring (what they hold, what they may import): {silent}"


def test_the_check_catches_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from roll.pipeline.base.pipeline import BasePipeline\n")
    assert [(m, layer_of(m)) for m, _ in imported_roll_modules(bad)] == [("roll.pipeline.base.pipeline", 10)]
    assert layer_of("roll.configs.schema") < layer_of("roll.pipeline.base.pipeline")
