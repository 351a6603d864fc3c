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

    python benchmarks/compare_trl.py --to-accuracy [--seeds 42 7 1] [--eval-every 10] [--pretrain DIR]
        [--write-docs] [roll overrides ...]

`--to-accuracy` compares time to a result instead: both start from the README's SFT export (`--pretrain`, else
`examples/start_sft_pipeline.py` writes one) and train with the learning settings of roll's default RLVR job
(examples/config/rlvr_arithmetic.yaml) on its built-in task, one run per seed each, evaluating greedy held-out
accuracy every `--eval-every` steps. The target is TRL's final accuracy (the mean over its seeds of each run's
last 3 evaluations); each side's time is when the mean of its seeds' curves, smoothed over 3 evaluations,
reaches it: wall seconds from the command and seconds in training steps, evaluations left out of both. roll
overrides may change only systems settings there.

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
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import TYPE_CHECKING, Any

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

if TYPE_CHECKING:
    from roll.datasets.arithmetic import Problem

from benchmarks import doc_tables  # noqa: E402
from benchmarks.accuracy_curves import (  # noqa: E402
    Point,
    final_accuracy,
    first_reaching,
    load_points,
    mean_curve,
    roll_points,
    save_points,
    standard_error,
)

REQUIREMENTS = REPO_ROOT / "requirements_bench.txt"
DOC = REPO_ROOT / "docs" / "performance.md"
PROMPTS, SAMPLES, BETA, LEARNING_RATE, SEED = 16, 8, 0.04, 5e-5, 42
PROMPT_TOKENS = 16  # `a+b=` prompts are far shorter; roll's data.max_prompt_length, the longest it keeps
# name -> (TinyModelSpec fields, max new tokens): the two shapes of issue 12.
MODELS: dict[str, tuple[dict[str, int], int]] = {
    "small": ({"hidden_size": 128, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "intermediate_size": 256}, 32),
    "medium": (
        {"hidden_size": 512, "num_layers": 8, "num_heads": 8, "num_kv_heads": 4, "intermediate_size": 1408},
        64,
    ),
}
# The blocks of docs/performance.md this script owns (benchmarks/doc_tables.py); each row names its command.
TABLE, ABLATION, TO_ACCURACY = "compare_trl-table", "compare_trl-ablation", "compare_trl-to-accuracy"
TO_ACCURACY_ABLATION = "compare_trl-to-accuracy-ablation"  # --to-accuracy --no-trl: roll against its ablations
TO_ACCURACY_LARGER = "compare_trl-to-accuracy-larger"  # --to-accuracy --sft ...: from another SFT export's model
BLOCKS = (TABLE, ABLATION, TO_ACCURACY, TO_ACCURACY_ABLATION, TO_ACCURACY_LARGER)
DEFAULT_JOB = "rlvr_arithmetic"  # examples/config/: the README's main job, whose learning settings both sides share
SMOOTHING = 3  # evaluations averaged for the target and the crossing


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
    train_file, eval_file = write_splits(arithmetic_problems(max_operand=49, operations="+"), root)
    return model_dir, train_file, eval_file


def write_splits(splits: tuple[Sequence[Problem], Sequence[Problem]], root: Path) -> tuple[Path, Path]:
    """A train and a held-out split of problems as `root`/train.jsonl and `root`/held_out.jsonl (prompt, answer)."""
    paths = (root / "train.jsonl", root / "held_out.jsonl")
    for path, problems in zip(paths, splits, strict=True):
        path.write_text("".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in problems))
    return paths


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


def grpo_trainer(model_dir: str, train_file: str, output_dir: str, callback: Any, **settings: Any) -> Any:
    """TRL's GRPOTrainer on `train_file`'s prompts with math-verify rewards (roll's reward function), on CPU in fp32,
    saving and reporting nothing, with `callback`; `settings` are the GRPOConfig fields each comparison sets."""
    import torch
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    from roll.rewards.functions import math_reward

    records = [json.loads(line) for line in Path(train_file).read_text().splitlines()]

    def math_verify_reward(prompts: list[str], completions: list[str], answer: list[str], **_: Any) -> list[float]:
        return [math_reward(p, c, a) for p, c, a in zip(prompts, completions, answer, strict=True)]

    config = GRPOConfig(
        output_dir=output_dir,
        use_cpu=True,
        bf16=False,
        model_init_kwargs={"dtype": torch.float32},
        gradient_accumulation_steps=1,
        temperature=1.0,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        **settings,
    )
    return GRPOTrainer(
        model=model_dir,
        reward_funcs=math_verify_reward,
        args=config,
        train_dataset=Dataset.from_list(records),
        callbacks=[callback],
    )


def trl_step_seconds(
    model_dir: str, train_file: str, new_tokens: int, steps: int, threads: int, output_dir: str
) -> list[float]:
    """Train with TRL's GRPOTrainer for `steps` optimizer steps in this process; return each step's seconds."""
    import torch
    from transformers import TrainerCallback

    torch.set_num_threads(threads)

    class StepTimer(TrainerCallback):
        def __init__(self) -> None:
            self.marks: list[float] = []

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.marks.append(time.perf_counter())

        def on_step_end(self, *args: Any, **kwargs: Any) -> None:
            self.marks.append(time.perf_counter())

    timer = StepTimer()
    settings = {"num_generations": SAMPLES, "max_completion_length": new_tokens, "beta": BETA, "epsilon": 0.2}
    settings |= {"epsilon_high": 0.28, "learning_rate": LEARNING_RATE, "max_steps": steps, "logging_steps": 1}
    grpo_trainer(
        model_dir, train_file, output_dir, timer, per_device_train_batch_size=PROMPTS * SAMPLES, seed=SEED, **settings
    ).train()
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
    # A rank's rows of a step in one pass, trimmed to the longest: the default job's budget is sized to its 6 new
    # tokens and would split these longer rows into two passes (9% slower at --model small).
    budget = train_rows * (PROMPT_TOKENS + new_tokens)
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
        f"data.max_prompt_length={PROMPT_TOKENS}",
        *(f"{role}.max_tokens_per_microbatch={budget}" for role in ("actor_train", "reference")),
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


# ---- time to accuracy ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class SharedSettings:
    """The learning settings of roll's default RLVR job, which TRL takes in `--to-accuracy`."""

    prompts: int
    samples: int
    new_tokens: int
    learning_rate: float
    kl_coef: float
    clip_low: float
    clip_high: float
    rows_per_update: int
    max_steps: int

    @property
    def updates_per_step(self) -> int:
        """Optimizer steps per RL step (each RL step's samples are split into updates of `rows_per_update`)."""
        return self.prompts * self.samples // self.rows_per_update


def default_job(pretrain: Path, overrides: list[str]) -> Any:
    """roll's default RLVR job (examples/config/rlvr_arithmetic.yaml) from `pretrain` with `overrides`, validated."""
    from hydra import compose, initialize_config_dir

    from roll.configs.hydra_defaults import register_schema_defaults
    from roll.configs.loader import load_pipeline_config, yaml_names
    from roll.pipeline.rlvr.rlvr_config import RLVRConfig

    config_dir = REPO_ROOT / "examples" / "config"
    register_schema_defaults("rlvr", RLVRConfig)
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose(DEFAULT_JOB, overrides=[f"pretrain={pretrain}", *overrides])
    return load_pipeline_config(cfg, RLVRConfig, yaml_names([config_dir]))


def shared_settings(config: Any) -> SharedSettings:
    """What TRL is given of roll's job `config`; stops if the job uses a setting TRL is not configured for here."""
    algorithm, generating = config.algorithm, config.actor_infer.generating_args
    training = config.actor_train.training_args
    expected = {
        "algorithm.adv_estimator": (algorithm.adv_estimator, "grpo"),
        "algorithm.ppo_epochs": (algorithm.ppo_epochs, 1),
        "algorithm.use_kl_loss": (algorithm.use_kl_loss, True),
        "algorithm.kl_loss_kind": (algorithm.kl_loss_kind, "k3"),
        "algorithm.kl_penalty_coef": (algorithm.kl_penalty_coef, 0),
        "algorithm.loss_agg_mode": (algorithm.loss_agg_mode, "token-mean"),
        "actor_train.training_args.lr_scheduler_type": (training.lr_scheduler_type, "constant"),
        "actor_train.training_args.warmup_steps": (training.warmup_steps, 0),
        "actor_infer.generating_args.temperature": (generating.temperature, 1.0),
        "actor_infer.generating_args.top_p": (generating.top_p, 1.0),
    }
    for name, (value, wanted) in expected.items():
        if value != wanted:
            raise SystemExit(f"--to-accuracy configures TRL for {name}={wanted!r}; the job has {value!r}")
    return SharedSettings(
        prompts=config.rollout_batch_size,
        samples=generating.num_return_sequences,
        new_tokens=generating.max_new_tokens,
        learning_rate=training.learning_rate,
        kl_coef=algorithm.kl_loss_coef,
        clip_low=algorithm.clip_low,
        clip_high=algorithm.clip_high,
        rows_per_update=training.per_device_train_batch_size
        * training.gradient_accumulation_steps
        * len(config.actor_train.devices),
        max_steps=config.max_steps,
    )


def write_task(data: Any, root: Path) -> tuple[Path, Path]:
    """The job's built-in task (`a op b=`, roll.datasets.arithmetic, with its `data.task_seed` and
    `data.task_max_operand`) as train and held-out JSONL files."""
    from roll.datasets.arithmetic import arithmetic_problems

    return write_splits(arithmetic_problems(max_operand=data.task_max_operand, seed=data.task_seed), root)


def trl_accuracy_points(
    model_dir: str,
    train_file: str,
    eval_file: str,
    settings: dict[str, Any],
    seed: int,
    eval_every: int,
    threads: int,
    output_dir: str,
) -> list[Point]:
    """Train with TRL's GRPOTrainer on roll's shared settings in this process, evaluating greedy held-out accuracy
    (math-verify, as roll's reward worker scores) every `eval_every` RL steps; the evaluations."""
    import psutil
    import torch
    from transformers import AutoTokenizer, TrainerCallback

    from roll.rewards.functions import math_reward

    torch.set_num_threads(threads)
    shared = SharedSettings(**settings)
    held_out = [json.loads(line) for line in Path(eval_file).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    command_started = psutil.Process().create_time()

    def accuracy(model: Any) -> float:
        model.eval()
        correct = 0
        with torch.no_grad():
            for start in range(0, len(held_out), 64):
                rows = held_out[start : start + 64]
                inputs = tokenizer(
                    [r["prompt"] for r in rows],
                    return_tensors="pt",
                    padding=True,
                    padding_side="left",
                    add_special_tokens=False,
                )
                out = model.generate(
                    **inputs, max_new_tokens=shared.new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
                )
                texts = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
                correct += sum(math_reward(r["prompt"], t, r["answer"]) >= 1 for r, t in zip(rows, texts, strict=True))
        model.train()
        return correct / len(held_out)

    class Evaluator(TrainerCallback):
        def __init__(self) -> None:
            self.points: list[Point] = []
            self.eval_s = 0.0
            self.train_started = 0.0

        def evaluate(self, model: Any, step: int) -> None:
            began = time.time()
            wall_s, train_s = began - command_started - self.eval_s, began - self.train_started - self.eval_s
            self.points.append(Point(step, accuracy(model), wall_s, train_s))
            self.eval_s += time.time() - began

        def on_train_begin(self, *args: Any, **kwargs: Any) -> None:
            self.train_started = time.time()
            self.evaluate(kwargs["model"], 0)

        def on_step_end(self, args: Any, state: Any, *rest: Any, **kwargs: Any) -> None:
            if state.global_step % (eval_every * shared.updates_per_step) == 0:
                self.evaluate(kwargs["model"], state.global_step // shared.updates_per_step)

    evaluator = Evaluator()
    trainer = grpo_trainer(
        model_dir,
        train_file,
        output_dir,
        evaluator,
        per_device_train_batch_size=shared.rows_per_update,
        steps_per_generation=shared.updates_per_step,
        num_generations=shared.samples,
        max_completion_length=shared.new_tokens,
        top_p=1.0,
        beta=shared.kl_coef,
        epsilon=shared.clip_low,
        epsilon_high=shared.clip_high,
        learning_rate=shared.learning_rate,
        lr_scheduler_type="constant",
        max_steps=shared.max_steps * shared.updates_per_step,
        logging_steps=10,
        seed=seed,
    )
    trainer.train()
    return evaluator.points


def sft_export(workdir: Path, overrides: list[str]) -> Path:
    """The README's first command, `examples/start_sft_pipeline.py` with `overrides`, into `workdir`; the export."""
    output = workdir / "sft-run"
    command = [
        sys.executable,
        str(REPO_ROOT / "examples" / "start_sft_pipeline.py"),
        *overrides,
        f"output_dir={output}",
    ]
    _run_logged(command, dict(os.environ), workdir / "sft.log")
    return output / "sft" / "model"


def trl_curve(
    pretrain: Path,
    task: tuple[Path, Path],
    settings: SharedSettings,
    seed: int,
    args: argparse.Namespace,
    workdir: Path,
) -> list[Point]:
    """One TRL run of `--to-accuracy` in a child process with `--trl-threads` threads."""
    threads = str(args.trl_threads)
    env = os.environ | {"OMP_NUM_THREADS": threads, "MKL_NUM_THREADS": threads, "HF_HUB_OFFLINE": "1"}
    job = {
        "model_dir": str(pretrain),
        "train_file": str(task[0]),
        "eval_file": str(task[1]),
        "settings": asdict(settings),
        "seed": seed,
        "eval_every": args.eval_every,
        "threads": args.trl_threads,
        "output_dir": str(workdir / f"trl-{seed}"),
    }
    result = workdir / f"trl-{seed}.json"
    command = [sys.executable, __file__, "--trl-accuracy-job", json.dumps(job), str(result)]
    _run_logged(command, env, workdir / f"trl-{seed}.log")
    return _reported(f"TRL seed {seed}", load_points(result))


def roll_curve(
    pretrain: Path, seed: int, args: argparse.Namespace, overrides: list[str], workdir: Path, tag: str = "roll"
) -> list[Point]:
    """One roll run of `--to-accuracy`: examples/start_rlvr_pipeline.py, the default job with `overrides`."""
    output = workdir / f"{tag}-{seed}"
    overrides = [f"pretrain={pretrain}", f"seed={seed}", f"eval_steps={args.eval_every}", *overrides]
    command = [sys.executable, str(REPO_ROOT / "examples" / "start_rlvr_pipeline.py"), *overrides]
    _run_logged([*command, f"output_dir={output}"], dict(os.environ), workdir / f"{tag}-{seed}.log")
    [metrics] = output.glob("*/logs/metrics.jsonl")
    return _reported(f"{tag} seed {seed}", roll_points([json.loads(line) for line in metrics.read_text().splitlines()]))


def _reported(label: str, points: list[Point]) -> list[Point]:
    last = points[-1]
    print(
        f"{label}: {points[0].accuracy:.3f} -> {last.accuracy:.3f} held-out in {last.step} steps, "
        f"{last.train_s:.0f} s training, {last.wall_s:.0f} s wall without evaluations",
        flush=True,
    )
    return points


def to_accuracy_report(
    sides: list[tuple[str, list[list[Point]]]], seeds: list[int], held_out: int, settings: SharedSettings
) -> str:
    """The `--to-accuracy` result as markdown: the target (the first side's final accuracy), each side's time to it,
    the first side's time over each other's, and the curves."""
    reference, reference_curves = sides[0]
    finals = [final_accuracy(curve, SMOOTHING) for curve in reference_curves]
    target = statistics.fmean(finals)
    spread = statistics.stdev(finals) if len(finals) > 1 else float("nan")
    lines = [
        f"Target: {target:.3f}, {reference}'s final held-out accuracy (the mean over seeds {', '.join(map(str, seeds))}"
        f" of each run's last {SMOOTHING} evaluations; their standard deviation {spread:.3f}). One evaluation is "
        f"greedy on the {held_out} held-out problems: standard error {standard_error(target, held_out):.3f} at the "
        f"target. All: {settings.max_steps} steps of {settings.prompts} prompts x {settings.samples} samples, "
        f"{settings.updates_per_step} optimizer step(s) of {settings.rows_per_update} rows each, learning rate "
        f"{settings.learning_rate:g} (constant), KL loss {settings.kl_coef:g} (k3), clip {settings.clip_low:g} / "
        f"{settings.clip_high:g}, {settings.new_tokens} new tokens.",
        "",
        "| side | final accuracy per seed | training s/step | reaches the target at step | wall s to it (from the "
        "command) | training s to it |",
        "|---|---|---|---|---|---|",
    ]
    reached = {}
    for name, curves in sides:
        per_seed = ", ".join(f"{final_accuracy(c, SMOOTHING):.3f}" for c in curves)
        per_step = statistics.fmean(c[-1].train_s / c[-1].step for c in curves)
        point = reached[name] = first_reaching(curves, target, SMOOTHING)
        where = f"{point.step} | {point.wall_s:.0f} | {point.train_s:.0f}" if point else "not reached | - | -"
        lines.append(f"| {name} | {per_seed} | {per_step:.2f} | {where} |")
    ratios = [
        f"{reference} / {name}: {reached[reference].wall_s / point.wall_s:.2f} in wall time from the command, "
        f"{reached[reference].train_s / point.train_s:.2f} in training time."
        for name, point in list(reached.items())[1:]
        if reached[reference] and point and point.train_s > 0
    ]
    lines += ["", *ratios] if ratios else []
    means = [{p.step: p for p in mean_curve(curves)} for _, curves in sides]
    lines += ["", "| step | " + " | ".join(f"{name}: mean (seeds)" for name, _ in sides) + " |"]
    lines.append("|---" * (len(sides) + 1) + "|")
    for step in sorted(set.intersection(*(set(m) for m in means))):
        cells = [
            f"{mean[step].accuracy:.3f} ({', '.join(f'{p.accuracy:.2f}' for c in curves for p in c if p.step == step)})"
            for mean, (_, curves) in zip(means, sides, strict=True)
        ]
        lines.append(f"| {step} | {' | '.join(cells)} |")
    return "\n".join(lines)


def to_accuracy(args: argparse.Namespace, extra: list[str]) -> None:
    """`--to-accuracy`: per seed a TRL run and a roll run from the same SFT export; print (and write) the report."""
    command = doc_tables.command_line(__file__, sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="compare_trl-accuracy-") as tmp:
        workdir = Path(tmp)
        sft_overrides = split_overrides(args.sft, "--sft") if args.sft else []
        pretrain = Path(args.pretrain).resolve() if args.pretrain else sft_export(workdir, sft_overrides)
        config = default_job(pretrain, extra)  # a bad override stops here, before any run
        settings = shared_settings(config)
        task = write_task(config.data, workdir)
        held_out = len(task[1].read_text().splitlines())
        ablations = [(a, split_overrides(a)) for a in args.ablate]
        for ablation, overrides in ablations:  # systems settings only: what TRL is given must not change
            if shared_settings(default_job(pretrain, [*extra, *overrides])) != settings:
                raise SystemExit(f"--ablate {ablation!r} changes a learning setting; --to-accuracy compares systems")
        sides: list[tuple[str, list[list[Point]]]] = [] if args.no_trl else [("TRL", [])]
        sides += [("roll", [])] + [(f"roll `{a}`", []) for a, _ in ablations]
        for seed in args.seeds:
            if not args.no_trl:
                sides[0][1].append(trl_curve(pretrain, task, settings, seed, args, workdir))
            runs = [("roll", extra)] + [(f"ablation-{i}", [*extra, *o]) for i, (_, o) in enumerate(ablations)]
            for (_, curves), (tag, overrides) in zip(sides[-len(runs) :], runs, strict=True):
                curves.append(roll_curve(pretrain, seed, args, overrides, workdir, tag))
        params = parameter_count(pretrain)
    report = f"Model: {params / 1e6:.2f}M parameters. " + to_accuracy_report(sides, args.seeds, held_out, settings)
    print(f"\n{machine()}\n\n{report}")
    if args.write_docs:
        block = TO_ACCURACY_ABLATION if args.no_trl else TO_ACCURACY_LARGER if args.sft else TO_ACCURACY
        doc_tables.write_block(DOC, block, command, report, ("torch", "deepspeed", "transformers", "trl"))


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


def split_overrides(value: str, option: str = "--ablate") -> list[str]:
    """The overrides of one `option` value, split like a shell command line; raise on an empty one."""
    overrides = shlex.split(value)
    if not overrides:
        raise SystemExit(f"{option} {value!r} holds no override")
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
    parser.add_argument("--to-accuracy", action="store_true", help="time to TRL's final accuracy, several seeds")
    parser.add_argument("--seeds", type=int, nargs="+", default=[42, 7, 1], help="--to-accuracy: one run each")
    parser.add_argument("--eval-every", type=int, default=10, help="--to-accuracy: RL steps between evaluations")
    start = parser.add_mutually_exclusive_group()  # --sft makes the export --pretrain names
    start.add_argument("--pretrain", help="--to-accuracy: the SFT export both start from (default: train one)")
    start.add_argument(
        "--sft",
        metavar='"OVERRIDE ..."',
        help="--to-accuracy: overrides of the SFT run that makes the export (another model, task); --write-docs "
        "then writes the larger-model block",
    )
    parser.add_argument("--trl-job", nargs=2, help=argparse.SUPPRESS)  # the TRL child: job JSON, result file
    parser.add_argument("--trl-accuracy-job", nargs=2, help=argparse.SUPPRESS)
    return parser


def main() -> None:
    """Parse arguments; install the requirements if needed; run TRL, roll and the ablations; print and write."""
    args, extra = build_parser().parse_known_args()
    if args.trl_job:
        job, result = json.loads(args.trl_job[0]), Path(args.trl_job[1])
        result.write_text(json.dumps(trl_step_seconds(**job)))
        return
    if args.trl_accuracy_job:
        job, result = json.loads(args.trl_accuracy_job[0]), Path(args.trl_accuracy_job[1])
        save_points(trl_accuracy_points(**job), result)
        return
    if not args.no_trl:
        ensure_requirements()
    if args.to_accuracy:
        to_accuracy(args, extra)
        return
    command = doc_tables.command_line(__file__, sys.argv[1:])
    with tempfile.TemporaryDirectory(prefix="compare_trl-") as tmp:
        workdir = Path(tmp)
        model_dir, train_file, eval_file = build_inputs(args.model, workdir)
        new_tokens = MODELS[args.model][1]
        base = roll_overrides(model_dir, train_file, eval_file, new_tokens, args.warmup + args.steps + 1)
        ablate = [(a, split_overrides(a)) for a in args.ablate]  # a malformed value stops before any run
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
