"""The shell commands README.md gives, and what the README test does with each.

Commands are the lines of its ```bash blocks (continuation lines joined, comments dropped) and the
inline code spans of its prose that start like a command (`bash ...`, `python ...`, `roll-...`).
Each has a verdict in VERDICTS: `Run` with the command the test runs (the README's own, or a cheap
form of it: fewer steps, `dry_run=true`, `--help`, `--collect-only`) or `Skip` with the reason it
cannot run on this machine. A pipeline command runs for real (a step or two) when a later command reads
what it writes, or when no integration test runs its YAML; otherwise its dry run checks the command,
config, models and data, and tests/integration/test_<pipeline>_pipeline.py runs that YAML end to end.
A command added to the README without a verdict fails
tests/unit/test_readme_commands.py; tests/integration/test_readme.py runs the `Run` ones in order,
in a fresh copy of the repository, the standalone ones in a second lane beside the others.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

FENCED_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE_SPAN = re.compile(r"`([^`\n]+)`")
# A prose code span is a command when it starts like one and has arguments (`ray` alone is a name).
COMMAND_START = re.compile(r"(bash|python|pip|ray|roll-[\w-]+|tensorboard|source|export|sbatch|kubectl|[A-Z_]+=\S*) ")
TRAILING_COMMENT = re.compile(r"\s+#\s.*$")


@dataclass(frozen=True)
class Run:
    """Run `command` (the README's, or a cheaper form doing the same thing) in the repository copy.

    A `standalone` command reads nothing that earlier commands write and writes nothing that later ones
    read (a dry run, `--help`, test collection, the cluster check), so the README test may run it beside
    the others.
    """

    command: str
    standalone: bool = False


@dataclass(frozen=True)
class Skip:
    """Not run on this machine, for `reason`."""

    reason: str


def readme_commands(text: str) -> list[str]:
    """The commands of a README's ```bash blocks and of its prose's code spans, in order, without repeats."""
    found: list[str] = []
    prose_parts, position = [], 0
    for block in FENCED_BLOCK.finditer(text):
        prose_parts.append(text[position : block.start()])
        position = block.end()
        if block.group(1) in ("bash", "sh", "shell"):
            found += _block_commands(block.group(2))
    prose_parts.append(text[position:])
    for span in INLINE_SPAN.findall(" ".join(prose_parts).replace("\n", " ")):
        if COMMAND_START.match(span):
            found.append(" ".join(span.replace("\\|", "|").split()))
    return list(dict.fromkeys(found))


def _block_commands(block: str) -> list[str]:
    commands, pending = [], ""
    for line in block.splitlines():
        pending += line.rstrip()
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        command = " ".join(TRAILING_COMMENT.sub("", pending).split())
        pending = ""
        if command and not command.startswith("#"):
            commands.append(command)
    return commands


def read_readme(repo_root: Path) -> list[str]:
    """The commands of `repo_root`/README.md."""
    return readme_commands((repo_root / "README.md").read_text())


CLUSTER = "needs a multi-machine Ray cluster; tests/integration/test_deployment.py runs the route on a local head"
GPU_INSTALL = "the CUDA install for GPU nodes: needs NVIDIA GPUs and download.pytorch.org, which this machine lacks"
QUICK_RUN = "sft.max_steps=2 sft.eval_steps=2 max_steps=1 eval_steps=1"  # the whole main job, a step or two each
VLLM_RUN = (
    "bash scripts/run.sh devices_per_node=3 actor_infer.device_mapping=2 actor_infer.strategy_args.strategy_name=vllm"
)
GPU_RECIPE_DRY_RUN = (
    "roll-rlvr --config-name rlvr_qwen2.5_0.5b_8gpu dry_run=true data.train_file= data.eval_file= "
    "'pretrain=\"tiny://qwen2?hidden_size=896&num_layers=24&num_heads=14&num_kv_heads=2&intermediate_size=4864"
    "&max_position_embeddings=32768\"'"
)
MESSAGES_DATA = (
    "data.prompt_key=messages data.train_file=data/gsm8k_format/train_messages.jsonl "
    "data.eval_file=data/gsm8k_format/test_messages.jsonl"
)
AUTOTP_DRY_RUN = (
    "roll-sft dry_run=true +actor_train.strategy_args.strategy_config.tensor_parallel.autotp_size=2 "
    "actor_train.training_args.gradient_accumulation_steps=2"
)
MESSAGES_SFT = f"roll-sft --config-name sft_gsm8k_format exp_name=sft_gsm8k_messages {MESSAGES_DATA}"
MESSAGES_RLVR = (
    "roll-rlvr --config-name rlvr_gsm8k_format exp_name=rlvr_gsm8k_messages pretrain=output/sft_gsm8k_messages/model "
    + MESSAGES_DATA
)
COLLECT = "--collect-only -q"  # lint, then collect the chosen tests: the command works and selects tests

RLVR_WITH_RM = (
    "roll-rlvr rewards.math.worker_cls=roll.pipeline.base.reward_model_worker.RewardModelWorker "
    "rewards.math.model_args.model_name_or_path=output/rm/model rewards.math.strategy_args.strategy_name=hf_infer "
    "rewards.math.model_args.dtype=fp32"
)

VERDICTS: dict[str, Run | Skip] = {
    "bash scripts/run.sh": Run(f"bash scripts/run.sh {QUICK_RUN}"),
    "bash scripts/test.sh": Run(f"bash scripts/test.sh {COLLECT}", standalone=True),
    "source .venv/bin/activate": Run("source .venv/bin/activate"),
    "roll-env": Run("roll-env", standalone=True),
    "tensorboard --logdir output/rlvr/logs/tensorboard": Run(
        "tensorboard --logdir output/rlvr/logs/tensorboard --inspect | grep actor/loss > /dev/null"
    ),
    "bash scripts/run.sh max_steps=300 algorithm.adv_estimator=rloo": Run(
        "bash scripts/run.sh max_steps=300 algorithm.adv_estimator=rloo dry_run=true", standalone=True
    ),
    "bash scripts/run.sh sft.max_steps=100 sft.skip_if_exported=false seed=7": Run(
        "bash scripts/run.sh sft.max_steps=100 sft.skip_if_exported=false seed=7 sft.dry_run=true dry_run=true",
        standalone=True,
    ),
    "roll-rlvr max_steps=50": Run("roll-rlvr max_steps=50 dry_run=true", standalone=True),
    "roll-rlvr -m seed=1,2 max_steps=50": Run("roll-rlvr -m seed=1,2 max_steps=50 dry_run=true", standalone=True),
    "bash scripts/test.sh tests/unit": Run(f"bash scripts/test.sh tests/unit {COLLECT}", standalone=True),
    "bash scripts/test.sh tests/integration": Run(f"bash scripts/test.sh tests/integration {COLLECT}", standalone=True),
    'bash scripts/test.sh -m "not slow"': Run(f'bash scripts/test.sh -m "not slow" {COLLECT}', standalone=True),
    "roll-cluster-check": Run("roll-cluster-check rounds=1", standalone=True),
    "roll-rlvr dry_run=true": Run("roll-rlvr dry_run=true", standalone=True),
    # The sweep above is a dry run here; tests/integration/test_entry_points.py reports on a real one.
    "roll-sweep-report output/rlvr": Run("roll-sweep-report output/rlvr --help", standalone=True),
    AUTOTP_DRY_RUN: Run(AUTOTP_DRY_RUN, standalone=True),
    "python scripts/make_gsm8k_format_data.py": Run("python scripts/make_gsm8k_format_data.py"),
    "roll-sft --config-name sft_gsm8k_format": Run("roll-sft --config-name sft_gsm8k_format max_steps=2 eval_steps=2"),
    "roll-rlvr --config-name rlvr_gsm8k_format": Run(
        "roll-rlvr --config-name rlvr_gsm8k_format max_steps=1 eval_steps=1"
    ),
    **{
        f"python scripts/make_agentic_sft_data.py {task}": Run(f"python scripts/make_agentic_sft_data.py {task}")
        for task in ("calculator", "frozen_lake", "guess_number")
    },
    # Each SFT run exports the warm start its agentic recipe reads; tests/integration/test_agentic_pipeline.py runs
    # the agentic YAMLs.
    "roll-sft --config-name sft_calculator": Run("roll-sft --config-name sft_calculator max_steps=2 eval_steps=2"),
    "roll-rlvr --config-name agentic_calculator": Run("roll-rlvr --config-name agentic_calculator dry_run=true"),
    "roll-sft --config-name sft_frozen_lake": Run("roll-sft --config-name sft_frozen_lake max_steps=2 eval_steps=2"),
    "roll-rlvr --config-name agentic_frozen_lake": Run("roll-rlvr --config-name agentic_frozen_lake dry_run=true"),
    "roll-sft --config-name sft_guess_number": Run("roll-sft --config-name sft_guess_number max_steps=2 eval_steps=2"),
    # Reads the SFT export above; tests/integration/test_agentic_pipeline.py runs its YAML.
    "roll-rlvr --config-name agentic_guess_number": Run("roll-rlvr --config-name agentic_guess_number dry_run=true"),
    MESSAGES_SFT: Run(f"{MESSAGES_SFT} max_steps=2 eval_steps=2"),
    # The messages file encodes to the prompt/answer file's ids (tests/unit/test_messages_dataset.py), which the
    # command above runs through RLVR.
    MESSAGES_RLVR: Run(f"{MESSAGES_RLVR} dry_run=true"),
    "pip install wandb": Skip("installs a tracker from the network; tests/unit/test_trackers.py covers the adapters"),
    GPU_RECIPE_DRY_RUN: Run(GPU_RECIPE_DRY_RUN, standalone=True),
    VLLM_RUN: Run(f"{VLLM_RUN} dry_run=true", standalone=True),
    "export RAY_AUTH_MODE=token": Run("export RAY_AUTH_MODE=token"),
    "RAY_ADDRESS=<head-ip>:6379 roll-rlvr num_nodes=2 devices_per_node=8": Skip(CLUSTER),
    "RAY_ADDRESS=<head-ip>:6379 roll-cluster-check num_nodes=2 devices_per_node=1 actor_train.device_mapping=0-1 "
    "actor_infer.device_mapping=1": Skip(CLUSTER),
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cu128": Skip(GPU_INSTALL),
    "pip install --no-build-isolation -r requirements_common.txt": Skip(GPU_INSTALL),
    "pip install -r requirements_gpu.txt": Skip(GPU_INSTALL),
    "pip install --no-deps -e .": Skip(
        f"{GPU_INSTALL}; run here it would point this environment's editable install at the test's copy"
    ),
    "source scripts/cpu_env.sh": Run("source scripts/cpu_env.sh"),
    "python benchmarks/zero_memory.py --help": Run("python benchmarks/zero_memory.py --help", standalone=True),
    "python examples/start_rlvr_pipeline.py": Run(
        "python examples/start_rlvr_pipeline.py dry_run=true", standalone=True
    ),
    "ray start --head": Skip(CLUSTER),
    "ray start --address=<head>:6379": Skip(CLUSTER),
    "ray job submit": Skip(CLUSTER),
    **{
        f"python benchmarks/{name}.py": Run(f"python benchmarks/{name}.py --help", standalone=True)
        for name in (
            "zero_memory",
            "memory_estimate",
            "offload_bandwidth",
            "generation_throughput",
            "weight_sync",
            "rlvr_step_breakdown",
            "scale_memory",
        )
    },
    # tests/integration/test_cpu_scale_recipe.py runs its YAML (at a narrower shape); the dry run checks the full one.
    "roll-rlvr --config-name rlvr_qwen2.5_0.5b_cpu dry_run=true": Run(
        "roll-rlvr --config-name rlvr_qwen2.5_0.5b_cpu dry_run=true", standalone=True
    ),
    "roll-rlvr --config-name rlvr_qwen2.5_0.5b_cpu": Run(
        "roll-rlvr --config-name rlvr_qwen2.5_0.5b_cpu dry_run=true", standalone=True
    ),
    "roll-rlvr --config-name rlvr_qwen2.5_0.5b_cpu pretrain=/models/Qwen2.5-0.5B-Instruct": Skip(
        "needs the real Qwen2.5-0.5B-Instruct checkpoint, which no model hub serves to this machine"
    ),
    "python benchmarks/compare_trl.py --model small|medium": Run(
        "python benchmarks/compare_trl.py --help", standalone=True
    ),
    # Installs TRL and runs 6 x 200 steps (18 min): the README test checks its options; its analysis has unit tests.
    "python benchmarks/compare_trl.py --to-accuracy": Run(
        "python benchmarks/compare_trl.py --to-accuracy --help", standalone=True
    ),
    "python benchmarks/compute_floor.py --model small|medium": Run(
        "python benchmarks/compute_floor.py --model small", standalone=True
    ),
    "python benchmarks/precision.py --model small|medium": Run(
        "python benchmarks/precision.py --model small --rows 2 --steps 1", standalone=True
    ),
    # The main job wrote the SFT export: roll-sft reuses it and roll-dpo starts from it (its dry runs check it exists).
    "roll-sft": Run("roll-sft max_steps=2 eval_steps=2"),
    "roll-dpo": Run("roll-dpo dry_run=true"),  # tests/integration/test_dpo_pipeline.py runs its YAML
    "roll-dpo loss.loss_type=ipo max_steps=100": Run(
        "roll-dpo loss.loss_type=ipo max_steps=100 dry_run=true", standalone=True
    ),
    "roll-dpo loss.loss_type=kto data.format=unpaired batch_size=64": Run(
        "roll-dpo loss.loss_type=kto data.format=unpaired batch_size=64 dry_run=true", standalone=True
    ),
    "roll-dpo 'actor_train.strategy_args.strategy_config=${deepspeed_zero3}'": Run(
        "roll-dpo 'actor_train.strategy_args.strategy_config=${deepspeed_zero3}' dry_run=true", standalone=True
    ),
    "roll-rm": Run("roll-rm max_steps=1 eval_steps=1 eval_batch_size=16"),
    # Reads roll-rm's export (and the SFT export the RLVR YAML starts from): not standalone.
    RLVR_WITH_RM: Run(f"{RLVR_WITH_RM} dry_run=true"),
    # The main job wrote the RLVR export, roll-distill's teacher (its dry runs check it exists: not standalone).
    "roll-distill": Run("roll-distill max_steps=1 eval_steps=1 eval_batch_size=16"),
    "roll-distill loss.kind=mixed loss.forward_weight=0.3 loss.nll_weight=0.5": Run(
        "roll-distill loss.kind=mixed loss.forward_weight=0.3 loss.nll_weight=0.5 dry_run=true"
    ),
    "roll-distill 'student.strategy_args.strategy_config=${deepspeed_zero3}'": Run(
        "roll-distill 'student.strategy_args.strategy_config=${deepspeed_zero3}' dry_run=true"
    ),
    # tests/integration/test_distill_pipeline.py runs a step with the vLLM teacher.
    "roll-distill teacher.strategy_args.strategy_name=vllm": Run(
        "roll-distill teacher.strategy_args.strategy_name=vllm dry_run=true"
    ),
    # Writes only its own outputs; a short warm start and two steps stand for the README's 600 and 40.
    "roll-reward-fl": Run("roll-reward-fl warm_start.steps=20 max_steps=2 eval_steps=2", standalone=True),
    "roll-reward-fl 'actor.strategy_args.strategy_config=${deepspeed_zero3}'": Run(
        "roll-reward-fl 'actor.strategy_args.strategy_config=${deepspeed_zero3}' dry_run=true", standalone=True
    ),
    # Reads roll-distill's export (the student) and the RLVR export (the teacher).
    "roll-rlvr --config-name distill_onpolicy_arithmetic": Run(
        "roll-rlvr --config-name distill_onpolicy_arithmetic dry_run=true"
    ),
    "roll-rm margin=1.0": Run("roll-rm margin=1.0 dry_run=true", standalone=True),
    # Starts from roll-rm's export, and rlvr_prm_arithmetic reads its own: a real step, not standalone.
    "roll-rm --config-name rm_prm_arithmetic": Run(
        "roll-rm --config-name rm_prm_arithmetic max_steps=1 eval_steps=1 eval_batch_size=16"
    ),
    # The two-step warm start rlvr_prm_arithmetic starts from.
    "roll-sft exp_name=sft_two_step data.task=two_step_arithmetic max_response_length=20": Run(
        "roll-sft exp_name=sft_two_step data.task=two_step_arithmetic max_response_length=20 max_steps=2 eval_steps=2"
    ),
    # Reads the PRM and the two-step SFT exports; no integration test runs this YAML (test_rm_pipeline.py takes an
    # RLVR step with a PRM from rlvr_arithmetic.yaml), so one real step.
    "roll-rlvr --config-name rlvr_prm_arithmetic": Run(
        "roll-rlvr --config-name rlvr_prm_arithmetic max_steps=1 eval_steps=1 eval_batch_size=8"
    ),
    "roll-rm 'reward_model.strategy_args.strategy_config=${deepspeed_zero3}'": Run(
        "roll-rm 'reward_model.strategy_args.strategy_config=${deepspeed_zero3}' dry_run=true", standalone=True
    ),
}
