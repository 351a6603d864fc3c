"""benchmarks/rlvr_step_breakdown.py without Ray: the table of a synchronous run and of one with k >= 1."""

from __future__ import annotations

from benchmarks import compare_trl, rlvr_step_breakdown

PHASES = {"time/sync_weights_s": 0.1, "time/generate_s": 0.2, "time/actor_update_s": 0.5, "time/step_s": 1.0}


def test_a_run_without_worker_compute_still_gets_its_phases_and_says_why_no_overhead() -> None:
    row = {"step": 2, **PHASES, "phase/generate/residency_s": 0.05, "rollout/staleness_mean": 1.0}
    lines = rlvr_step_breakdown.table([row, row]).splitlines()
    assert "| generate | 0.200 | 20.0% |" in lines and "| **step** | **1.000** | 100% |" in lines
    assert "| offload/reload (all phases) | 0.050 | 5.0% |" in lines
    assert not any("compute" in line or "overhead" in line for line in lines if line.startswith("|"))
    assert lines[-1] == rlvr_step_breakdown.NO_OVERHEAD and "async_generation_ratio=0" in lines[-1]


def test_a_synchronous_run_reports_the_overhead_share() -> None:
    row = {"step": 1, **PHASES, "time/worker_compute_s": 0.9, "time/overhead_fraction": 0.1}
    lines = rlvr_step_breakdown.table([row]).splitlines()
    assert lines[-2:] == ["| worker compute | 0.900 | 90.0% |", "| **framework overhead** | 0.100 | **10.0%** |"]


def test_models_are_the_default_runs_and_compare_trls_medium_shape_each_with_its_block() -> None:
    small, medium = rlvr_step_breakdown.MODELS["small"], rlvr_step_breakdown.MODELS["medium"]
    assert small[0] == "tiny://qwen2"
    spec = compare_trl.MODELS["medium"][0]
    assert medium[0].startswith("tiny://qwen2?")
    assert sorted(medium[0].split("?")[1].split("&")) == sorted(f"{k}={v}" for k, v in spec.items())
    assert (small[1], medium[1]) == rlvr_step_breakdown.BLOCKS and small[1] != medium[1]
    args, overrides = rlvr_step_breakdown.build_parser().parse_known_args(["--model", "medium", "x=1"])
    assert args.model == "medium" and overrides == ["x=1"]
