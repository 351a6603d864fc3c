"""TRL's GRPOTrainer against roll on one machine: the same model, task, batch and dtype; step times and their ratio.

Both train a randomly initialised char-level Qwen2 (`roll.models.tiny`) on `a+b=` (a, b in 0..49, roll's
arithmetic task) with 16 prompts x 8 samples per step, fp32, a k3 KL loss to the reference with coefficient
0.04 (TRL's `beta`; roll's `algorithm.kl_loss_coef` with `use_kl_loss=true`), one optimizer step per RL step,
clip 0.2 / 0.28, learning rate 5e-5, sampling at temperature 1, rewarded by roll's math reward
(math-verify). TRL runs in one process on all cores (`use_cpu=True`); roll runs its own entry
(`examples/start_rlvr_pipeline.py`) on 2 device slots of 1 core, every role colocated, actor_train on
DeepSpeed ZeRO-2, `hf_infer` generating and scoring the reference. Step times are medians after the warm-up
steps (roll's last step, which also evaluates, is left out).

    python benchmarks/compare_trl.py [--model small|medium] [--steps 6] [--warmup 2]
        [--ablate "OVERRIDE ..."] [--no-trl] [--write-docs] [roll overrides ...]

`--ablate algorithm.old_log_probs_pass=always` runs roll once more with that override, right after the
first roll run, for the ablation table; one `--ablate` may hold several overrides, split like a shell
command line (`--ablate "devices_per_node=1 cpus_per_device=2 ..."`), and the flag repeats for several
ablations. `--no-trl` runs only roll and its ablations (no comparison row). `--write-docs` rewrites this
model's rows of docs/performance.md.
TRL (requirements_bench.txt) is installed into this environment on first use, with every
installed package held at its version.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import doc_tables  # noqa: E402

REQUIREMENTS = REPO_ROOT / "requirements_bench.txt"
DOC = REPO_ROOT / "docs" / "performance.md"
PROMPTS, SAMPLES, BETA, LEARNING_RATE, SEED = 16, 8, 0.04, 5e-5, 42
# name -> (TinyModelSpec fields, max new tokens): the two shapes of issue 12.
MODELS: dict[str, tuple[dict[str, int], int]] = {
    "small": ({"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}, 32),
    "medium": (
        {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1408},
        64,
    ),
}
# The blocks of docs/performance.md this script owns (benchmarks/doc_tables.py); each row names its command.
TABLE, ABLATION = "compare_trl-table", "compare_trl-ablation"
BLOCKS = (TABLE, ABLATION)


# ---- the benchmark requirements ------------------------------------------------------------------------


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        requirement = line.split("#")[0].strip()
        if requirement:
            name, _, version = requirement.partition("==")
            pins[name.strip().lower()] = version.strip()
    return pins


def _installed() -> dict[str, str]:
    return {dist.metadata["Name"].lower(): dist.version for dist in metadata.distributions()}


def _pip(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    return subprocess.run(command, capture_output=True, text=True)


def ensure_requirements() -> None:
    """Install requirements_bench.txt into this environment unless present, changing nothing already installed.

    Every installed distribution becomes a pip constraint at its version, so pip either only adds
    packages or fails; afterwards every version must be unchanged and `pip check` must say nothing new.
    """
    installed = _installed()
    wanted = _pins(REQUIREMENTS)
    if all(installed.get(name) == version for name, version in wanted.items()):
        return
    print(f"installing {', '.join(f'{n}=={v}' for n, v in wanted.items())} (first use) ...", flush=True)
    problems_before = set(_pip("check").stdout.splitlines())
    frozen = _pip("freeze").stdout.splitlines()
    with tempfile.NamedTemporaryFile("w", suffix=".txt") as constraints:
        constraints.write("".join(f"{line}\n" for line in frozen if "==" in line))
        constraints.flush()
        result = _pip("install", "-q", "-r", str(REQUIREMENTS), "-c", constraints.name)
    if result.returncode:
        raise SystemExit(f"pip cannot add {REQUIREMENTS.name} without changing installed packages:\n{result.stderr}")
    after = _installed()
    changed = {name: f"{old} -> {after.get(name)}" for name, old in installed.items() if after.get(name) != old}
    new_problems = set(_pip("check").stdout.splitlines()) - problems_before
    if changed or new_problems:
        raise SystemExit(f"installing {REQUIREMENTS.name} changed {changed}; new `pip check` lines: {new_problems}")


# ---- inputs shared by both runs ------------------------------------------------------------------------


def build_inputs(model: str, root: Path) -> tuple[Path, Path, Path]:
    """The model directory, and train and held-out JSONL files of `a+b=` with a, b in 0..49."""
    from roll.datasets.arithmetic import arithmetic_problems
    from roll.models.tiny import TinyModelSpec, make_tiny_model

    model_dir = make_tiny_model(root / f"model-{model}", TinyModelSpec(**MODELS[model][0]), seed=0)
    paths = []
    for name, problems in zip(("train", "eval"), arithmetic_problems(max_operand=49, operations="+"), strict=True):
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in problems))
        paths.append(path)
    return model_dir, paths[0], paths[1]


def parameter_count(model_dir: Path) -> int:
    """Parameters stored in the model directory's safetensors file."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        return sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())  # noqa: SIM118


# ---- the two runs --------------------------------------------------------------------------------------


@dataclass
class Run:
    """One run: seconds of its measured steps, roll's per-step metrics, the 1-min load average before and after."""

    label: str
    seconds: list[float]
    rows: list[dict[str, float]]
    load: tuple[float, float]

    @property
    def median(self) -> float:
        """Median seconds per step."""
        return statistics.median(self.seconds)

    def phase_medians(self) -> dict[str, float]:
        """Median seconds of each `time/<phase>_s` roll logged, plus residency moves, compute and overhead."""
        phases = doc_tables.logged_phases(self.rows)
        logged = {k[5:].removesuffix("_s") for row in self.rows for k in row if k.startswith("time/")}
        order = phases + sorted(logged - set(phases) - {"step", "overhead_fraction"})
        medians = {p: statistics.median(row.get(f"time/{p}_s", 0.0) for row in self.rows) for p in order}
        residency = [sum(v for k, v in row.items() if k.endswith("/residency_s")) for row in self.rows]
        medians["offload/reload (all phases)"] = statistics.median(residency)
        return medians


def trl_step_seconds(
    model_dir: str, train_file: str, new_tokens: int, steps: int, threads: int, output_dir: str
) -> list[float]:
    """Train with TRL's GRPOTrainer for `steps` optimizer steps in this process; return each step's seconds."""
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from roll.rewards.functions import math_reward

    torch.set_num_threads(threads)
    records = [json.loads(line) for line in Path(train_file).read_text().splitlines()]

    def math_verify_reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [math_reward(p, c, a) for p, c, a in zip(prompts, completions, answer, strict=True)]

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.marks.append(time.perf_counter())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.marks.append(time.perf_counter())

    timer = StepTimer()
    config = GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": torch.float32},
        per_device_train_batch_size=PROMPTS * SAMPLES,
        gradient_accumulation_steps=1,
        num_generations=SAMPLES,
        max_completion_length=new_tokens,
        temperature=1.0,
        beta=BETA,
        epsilon=0.2,
        epsilon_high=0.28,
        learning_rate=LEARNING_RATE,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=SEED,
    )
    trainer = GRPOTrainer(
        model=model_dir,
        reward_funcs=math_verify_reward,
        args=config,
        train_dataset=Dataset.from_list(records),
        callbacks=[timer],
    )
    trainer.train()
    return [end - start for start, end in zip(timer.marks, timer.marks[1:], strict=False)]


def run_trl(
    model_dir: Path, train_file: Path, new_tokens: int, steps: int, warmup: int, threads: int, workdir: Path
) -> Run:
    """TRL in a child process with `threads` threads (scripts/cpu_env.sh caps the environment's at 1)."""
    env = os.environ | {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    job = {
        "model_dir": str(model_dir),
        "train_file": str(train_file),
        "new_tokens": new_tokens,
        "steps": warmup + steps,
        "threads": threads,
        "output_dir": str(workdir / "trl"),
    }
    result = workdir / "trl_seconds.json"
    load = os.getloadavg()[0]
    _run_logged([sys.executable, __file__, "--trl-job", json.dumps(job), str(result)], env, workdir / "trl.log")
    seconds = json.loads(result.read_text())
    return _done(Run(f"TRL {metadata.version('trl')} GRPOTrainer", seconds[warmup:], [], (load, os.getloadavg()[0])))


def roll_overrides(model_dir: Path, train_file: Path, eval_file: Path, new_tokens: int, max_steps: int) -> list[str]:
    """The command-line overrides of examples/start_rlvr_pipeline.py for the compared configuration."""
    train_rows = PROMPTS * SAMPLES // 2  # per rank of 2: the whole rollout is one optimizer step
    return [
        f"pretrain={model_dir}",
        f"max_steps={max_steps}",
        f"eval_steps={max_steps}",
        "eval_batch_size=16",
        "save_steps=0",
        "num_log_samples=0",
        f"seed={SEED}",
        f"data.train_file={train_file}",
        f"data.eval_file={eval_file}",
        "platform=cpu",
        "devices_per_node=2",
        "cpus_per_device=1",
        f"rollout_batch_size={PROMPTS}",
        f"actor_infer.generating_args.num_return_sequences={SAMPLES}",
        f"actor_infer.generating_args.max_new_tokens={new_tokens}",
        "actor_infer.generating_args.temperature=1.0",
        "actor_infer.generating_args.top_p=1.0",
        *(f"{role}.device_mapping=0-1" for role in ("actor_train", "actor_infer", "reference")),
        *(f"{role}.model_args.dtype=fp32" for role in ("actor_train", "actor_infer", "reference")),
        "actor_train.strategy_args.strategy_config=${deepspeed_zero2}",
        "actor_infer.strategy_args.strategy_name=hf_infer",
        "reference.strategy_args.strategy_name=hf_infer",
        f"actor_train.training_args.per_device_train_batch_size={train_rows}",
        "actor_train.training_args.gradient_accumulation_steps=1",
        f"actor_train.training_args.learning_rate={LEARNING_RATE}",
        "algorithm.ppo_epochs=1",
        "algorithm.clip_low=0.2",
        "algorithm.clip_high=0.28",
        "algorithm.use_kl_loss=true",
        f"algorithm.kl_loss_coef={BETA}",
        "algorithm.kl_loss_kind=k3",
        "algorithm.kl_penalty_coef=0",
        "rewards.math.reward_fn=roll.rewards.functions.math_reward",
    ]


def run_roll(label: str, overrides: list[str], warmup: int, output_dir: Path) -> Run:
    """examples/start_rlvr_pipeline.py with `overrides` in a child process writing to `output_dir`; its steps."""
    command = [sys.executable, str(REPO_ROOT / "examples" / "start_rlvr_pipeline.py"), *overrides]
    load = os.getloadavg()[0]
    _run_logged([*command, f"output_dir={output_dir}"], dict(os.environ), output_dir.with_suffix(".log"))
    metrics = output_dir / "rlvr" / "logs" / "metrics.jsonl"
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    # Step 0 is the first evaluation; the last step evaluates too.
    measured = [row for row in rows if row["step"] > 0 and "val/accuracy" not in row][warmup:]
    return _done(Run(label, [row["time/step_s"] for row in measured], measured, (load, os.getloadavg()[0])))


def _done(run: Run) -> Run:
    print(f"{run.label}: {run.median:.3f} s/step (median of {len(run.seconds)}), load {_load(run)}", flush=True)
    return run


def _run_logged(command: list[str], env: dict[str, str], log: Path) -> None:
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as out:
        code = subprocess.run(command, env=env, cwd=REPO_ROOT, stdout=out, stderr=subprocess.STDOUT).returncode
    if code:
        tail = "\n".join(log.read_text().splitlines()[-40:])
        raise SystemExit(f"{' '.join(command[:2])} exited with {code}; the end of {log}:\n{tail}")


# ---- reports -------------------------------------------------------------------------------------------


def machine() -> str:
    """This machine, the versions of both frameworks' libraries and the date (benchmarks/doc_tables.py)."""
    return doc_tables.machine(("torch", "deepspeed", "transformers", "trl"))


def phase_table(run: Run) -> str:
    """roll's median seconds per phase and their share of the median step, as a markdown table."""
    lines = ["| phase | median s | share of step |", "|---|---|---|"]
    for phase, seconds in run.phase_medians().items():
        lines.append(f"| {phase} | {seconds:.3f} | {seconds / run.median:.1%} |")
    lines.append(f"| **step** | **{run.median:.3f}** | 100% |")
    return "\n".join(lines)


def _load(run: Run) -> str:
    return f"{run.load[0]:.1f}-{run.load[1]:.1f}"


def _phases_inline(run: Run) -> str:
    """roll's phases in step order with their median seconds, those under 0.005 s left out."""
    medians = run.phase_medians()
    phases = doc_tables.logged_phases(run.rows)
    return ", ".join(f"{p} {medians[p]:.2f}" for p in phases if round(medians[p], 2) > 0)


def table_key(model: str, trl_threads: int) -> str:
    """The start of the comparison table's row of `model` with TRL on `trl_threads` threads."""
    return f"| {model}, TRL on {trl_threads} thread{'s' if trl_threads > 1 else ''}:"


def table_row(model: str, trl_threads: int, params: int, trl: Run, roll: Run, command: str) -> str:
    """The comparison table's row of `model` with TRL on `trl_threads` threads."""
    spec, new_tokens = MODELS[model]
    shape = f"hidden {spec['hidden_size']}, {spec['num_layers']} layers, {spec['num_heads']} heads, "
    shape += f"{spec['num_kv_heads']} kv, intermediate {spec['intermediate_size']}"
    return (
        f"{table_key(model, trl_threads)} {params / 1e6:.1f}M params ({shape}) | {new_tokens} | "
        f"{trl.median:.2f} | {roll.median:.2f} | {trl.median / roll.median:.2f} | {_phases_inline(roll)} | "
        f"{_load(trl)} / {_load(roll)} | {machine()} | `{command}` |"
    )


def ablation_overrides(ablation: str) -> list[str]:
    """The roll overrides of one `--ablate` value, split like a shell command line; raise on an empty one."""
    overrides = shlex.split(ablation)
    if not overrides:
        raise SystemExit(f"--ablate {ablation!r} holds no override")
    return overrides


def ablation_row(model: str, override: str, base: Run, ablated: Run, command: str) -> str:
    """The ablation table's row of `override` (one `--ablate` value: the optimisation turned off) on `model`."""
    return (
        f"| {model} | `{override}` | {base.median:.2f} | {ablated.median:.2f} | "
        f"{ablated.median / base.median - 1:+.0%} | {_phases_inline(base)} | {_phases_inline(ablated)} | "
        f"{_load(base)} / {_load(ablated)} | `{command}` |"
    )


def write_docs(rows: dict[str, list[tuple[str, str]]]) -> None:
    """In each block of docs/performance.md, replace the line starting with a row's key by that row (or add it).

    The rows name their own command and machine: one table gathers rows of several invocations.
    """
    for block, keyed_rows in rows.items():
        doc_tables.replace_block(DOC, block, doc_tables.upsert_rows(doc_tables.read_block(DOC, block), keyed_rows))


# ---- entry ---------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The options; anything else on the command line is a roll override."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), default="small")
    parser.add_argument("--steps", type=int, default=6, help="measured steps of each run, after the warm-up")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out before measuring")
    parser.add_argument("--trl-threads", type=int, default=os.cpu_count() or 1, help="default: every core")
    parser.add_argument(
        "--ablate",
        action="append",
        default=[],
        metavar='"OVERRIDE ..."',
        help="roll again with these overrides (split like a shell line); repeatable",
    )
    parser.add_argument("--no-trl", action="store_true", help="run only roll and its ablations")
    parser.add_argument("--write-docs", action="store_true", help="rewrite this model's rows of docs/performance.md")
    parser.add_argument("--trl-job", nargs=2, help=argparse.SUPPRESS)  # the TRL child: job JSON, result file
    return parser


def main() -> None:
    """Parse arguments; install the requirements if needed; run TRL, roll and the ablations; print and write."""
    args, extra = build_parser().parse_known_args()
    if args.trl_job:
        job, result = json.loads(args.trl_job[0]), Path(args.trl_job[1])
        result.write_text(json.dumps(trl_step_seconds(**job)))
        return
    if not args.no_trl:
        ensure_requirements()
    command = doc_tables.command_line(__file__, sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="compare_trl-") as tmp:
        workdir = Path(tmp)
        model_dir, train_file, eval_file = build_inputs(args.model, workdir)
        new_tokens = MODELS[args.model][1]
        base = roll_overrides(model_dir, train_file, eval_file, new_tokens, args.warmup + args.steps + 1)
        ablate = [(a, ablation_overrides(a)) for a in args.ablate]  # a malformed value stops before any run
        trl = None
        if not args.no_trl:
            trl = run_trl(model_dir, train_file, new_tokens, args.steps, args.warmup, args.trl_threads, workdir)
        roll = run_roll("roll", [*base, *extra], args.warmup, workdir / "roll")
        ablations = [
            (a, run_roll(f"roll {a}", [*base, *extra, *o], args.warmup, workdir / f"roll-ablation-{i}"))
            for i, (a, o) in enumerate(ablate)
        ]
        params = parameter_count(model_dir)
    print(f"\n{args.model}: {params / 1e6:.1f}M parameters, {new_tokens} new tokens; {machine()}")
    print("| run | s/step (median) | steps | load 1-min (before-after) |\n|---|---|---|---|")
    for run in ([trl] if trl else []) + [roll, *(ablated for _, ablated in ablations)]:
        print(f"| {run.label} | {run.median:.3f} | {len(run.seconds)} | {_load(run)} |")
    if trl:
        print(f"\nTRL / roll = {trl.median / roll.median:.2f}")
    print(f"\nroll's phases:\n{phase_table(roll)}")
    for override, ablated in ablations:
        print(f"\nroll with {override}: {ablated.median / roll.median - 1:+.1%} s/step\n{phase_table(ablated)}")
    if args.write_docs:
        compared = [table_row(args.model, args.trl_threads, params, trl, roll, command)] if trl else []
        write_docs(
            {
                TABLE: [(table_key(args.model, args.trl_threads), row) for row in compared],
                ABLATION: [
                    (f"| {args.model} | `{o}` |", ablation_row(args.model, o, roll, a, command)) for o, a in ablations
                ],
            }
        )
        print(f"\nwrote {DOC.relative_to(REPO_ROOT)}")


if __name__ == "__main__":
    main()
