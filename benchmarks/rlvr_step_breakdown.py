"""Step time of the RLVR pipeline by phase, and the framework's overhead as a share of the step.

Runs the embedded default (`examples/config/rlvr_arithmetic.yaml`) for a few steps on an embedded Ray
and averages the per-step metrics the pipeline logs: wall time of each phase, worker compute time
(the slowest rank of each role, summed over roles, which run one after another) and the overhead
fraction `1 - worker compute / step time` (Ray dispatch, data transport, the driver's own work).

    python benchmarks/rlvr_step_breakdown.py [--model small|medium] [--steps 20] [--skip 3] [--write-docs]
        [hydra overrides ...]

`--model small` is the default run's `tiny://qwen2` (0.3M parameters); `--model medium` the same work on
the 23.7M-parameter shape of benchmarks/compare_trl.py (hidden 512, 8 layers), as `tiny://` options.
The phases are the ones the pipeline logged (`time/<phase>_s` for every phase roll/pipeline/rlvr names), in the
order it ran them. With `async_generation_ratio` >= 1 the pipeline logs no worker compute (its roles
overlap), so the table then gives the phases and says why the overhead is missing. `--write-docs` rewrites
this model's table in docs/rlvr.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import compare_trl, doc_tables  # noqa: E402

DOC = REPO_ROOT / "docs" / "rlvr.md"
# --model -> the pretrain reference (roll.models.tiny builds it on first use) and its block of docs/rlvr.md.
MODELS: dict[str, tuple[str, str]] = {
    "small": ("tiny://qwen2", "rlvr_step_breakdown"),
    "medium": (
        "tiny://qwen2?" + "&".join(f"{k}={v}" for k, v in compare_trl.MODELS["medium"][0].items()),
        "rlvr_step_breakdown-medium",
    ),
}
BLOCKS = tuple(block for _, block in MODELS.values())
NO_OVERHEAD = (
    "Worker compute and framework overhead: not logged by this run. The pipeline logs them only with "
    "`async_generation_ratio=0`: with k >= 1 actor_infer generates the next batch while the other roles work, "
    "so step time minus summed worker compute is no overhead (and asking actor_infer would wait for its batch)."
)
PACKAGES = ("torch", "deepspeed", "transformers", "ray")


def run(steps: int, overrides: list[str], output_dir: str, pretrain: str = MODELS["small"][0]) -> list[dict]:
    """Run the pipeline for `steps` steps without evaluation on `pretrain` unless overridden; its per-step metrics."""
    from roll.configs.hydra_defaults import register_schema_defaults
    from roll.configs.loader import load_pipeline_config, yaml_names
    from roll.pipeline.rlvr.rlvr_config import RLVRConfig
    from roll.pipeline.rlvr.rlvr_pipeline import RLVRPipeline

    config_dir = REPO_ROOT / "examples" / "config"
    register_schema_defaults("rlvr", RLVRConfig)
    fixed = [f"max_steps={steps}", f"eval_steps={steps + 1}", "eval_batch_size=2", f"output_dir={output_dir}"]
    if not any(o.startswith("pretrain=") for o in overrides):
        fixed.append(f"pretrain='{pretrain}'")  # the same work as the default run, no SFT export needed
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose("rlvr_arithmetic", overrides=[*fixed, *overrides])
    config = load_pipeline_config(cfg, RLVRConfig, yaml_names([config_dir]))
    pipeline = RLVRPipeline(config)
    try:
        pipeline.run()
    finally:
        pipeline.shutdown()
    metrics_file = Path(output_dir) / config.exp_name / "logs" / "metrics.jsonl"
    return [row for row in map(json.loads, metrics_file.read_text().splitlines()) if row["step"] > 0]


def table(rows: list[dict]) -> str:
    """Mean seconds per phase and the overhead share (or why it is absent), as a markdown table."""
    step_time = statistics.mean(r["time/step_s"] for r in rows)
    lines = ["| phase | mean s | share of step |", "|---|---|---|"]
    for phase in doc_tables.logged_phases(rows):
        seconds = statistics.mean(r.get(f"time/{phase}_s", 0.0) for r in rows)
        lines.append(f"| {phase} | {seconds:.3f} | {seconds / step_time:.1%} |")
    residency = statistics.mean(sum(v for k, v in r.items() if k.endswith("/residency_s")) for r in rows)
    lines += [
        f"| offload/reload (all phases) | {residency:.3f} | {residency / step_time:.1%} |",
        f"| **step** | **{step_time:.3f}** | 100% |",
    ]
    if not all("time/overhead_fraction" in r for r in rows):
        return "\n".join([*lines, "", NO_OVERHEAD])
    compute = statistics.mean(r["time/worker_compute_s"] for r in rows)
    overhead = statistics.mean(r["time/overhead_fraction"] for r in rows)
    lines += [
        f"| worker compute | {compute:.3f} | {compute / step_time:.1%} |",
        f"| **framework overhead** | {step_time - compute:.3f} | **{overhead:.1%}** |",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The options; anything else on the command line is a Hydra override of the run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small", help="small: 0.3M, medium: 23.7M params")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the averages")
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite this model's table in {DOC.name}")
    return parser


def main() -> None:
    """Parse arguments, run, print the table (and write it)."""
    args, overrides = build_parser().parse_known_args()
    with tempfile.TemporaryDirectory() as output_dir:
        load = os.getloadavg()[0]
        rows = run(args.steps, overrides, output_dir, MODELS[args.model][0])
    loads = f"{load:.1f} / {os.getloadavg()[0]:.1f}"
    result = f"{table(rows[args.skip :])}\n\n1-minute load average before / after the run: {loads}."
    command = doc_tables.command_line(__file__, sys.argv[1:])
    print(f"{doc_tables.provenance(command, PACKAGES)}\n\n{result}")
    if args.write_docs:
        doc_tables.write_block(DOC, MODELS[args.model][1], command, result, PACKAGES)


if __name__ == "__main__":
    main()
