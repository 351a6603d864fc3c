"""Step time of the RLVR pipeline by phase, and the framework's overhead as a share of the step.

Runs the embedded default (`examples/config/rlvr_arithmetic.yaml`) for a few steps on an embedded Ray
and averages the per-step metrics the pipeline logs: wall time of each phase, worker compute time
(the slowest rank of each role, summed over roles, which run one after another) and the overhead
fraction `1 - worker compute / step time` (Ray dispatch, data transport, the driver's own work).

    python benchmarks/rlvr_step_breakdown.py [--steps 20] [--skip 3] [--write-docs] [hydra overrides ...]

The phases are the ones the pipeline logged (`time/<phase>_s` for every phase roll/pipeline/rlvr names), in the
order it ran them. `--write-docs` rewrites the table in docs/rlvr.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from hydra import compose, initialize_config_dir

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import doc_tables  # noqa: E402

DOC = REPO_ROOT / "docs" / "rlvr.md"
BLOCKS = ("rlvr_step_breakdown",)
PACKAGES = ("torch", "deepspeed", "transformers", "ray")


def run(steps: int, overrides: list[str], output_dir: str) -> list[dict]:
    """Run the pipeline for `steps` steps without evaluation; return its per-step metrics."""
    from roll.configs.hydra_defaults import register_schema_defaults
    from roll.configs.loader import load_pipeline_config, yaml_names
    from roll.pipeline.rlvr.rlvr_config import RLVRConfig
    from roll.pipeline.rlvr.rlvr_pipeline import RLVRPipeline

    config_dir = REPO_ROOT / "examples" / "config"
    register_schema_defaults("rlvr", RLVRConfig)
    fixed = [f"max_steps={steps}", f"eval_steps={steps + 1}", "eval_batch_size=2", f"output_dir={output_dir}"]
    if not any(o.startswith("pretrain=") for o in overrides):
        fixed.append("pretrain=tiny://qwen2")  # the same work as the default run, no SFT export needed
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
    """Mean seconds per phase and the overhead share, as a markdown table."""
    step_time = statistics.mean(r["time/step_s"] for r in rows)
    lines = ["| phase | mean s | share of step |", "|---|---|---|"]
    for phase in doc_tables.logged_phases(rows):
        seconds = statistics.mean(r.get(f"time/{phase}_s", 0.0) for r in rows)
        lines.append(f"| {phase} | {seconds:.3f} | {seconds / step_time:.1%} |")
    residency = statistics.mean(sum(v for k, v in r.items() if k.endswith("/residency_s")) for r in rows)
    compute = statistics.mean(r["time/worker_compute_s"] for r in rows)
    overhead = statistics.mean(r["time/overhead_fraction"] for r in rows)
    lines += [
        f"| offload/reload (all phases) | {residency:.3f} | {residency / step_time:.1%} |",
        f"| **step** | **{step_time:.3f}** | 100% |",
        f"| worker compute | {compute:.3f} | {compute / step_time:.1%} |",
        f"| **framework overhead** | {step_time - compute:.3f} | **{overhead:.1%}** |",
    ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """The options; anything else on the command line is a Hydra override of the run."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--skip", type=int, default=3, help="warm-up steps left out of the averages")
    parser.add_argument("--write-docs", action="store_true", help=f"rewrite the table in {DOC.name}")
    return parser


def main() -> None:
    """Parse arguments, run, print the table (and write it)."""
    args, overrides = build_parser().parse_known_args()
    with tempfile.TemporaryDirectory() as output_dir:
        rows = run(args.steps, overrides, output_dir)
    result = table(rows[args.skip :])
    command = doc_tables.command_line(__file__, sys.argv[1:])
    print(f"{doc_tables.provenance(command, PACKAGES)}\n\n{result}")
    if args.write_docs:
        doc_tables.write_block(DOC, BLOCKS[0], command, result, PACKAGES)


if __name__ == "__main__":
    main()
