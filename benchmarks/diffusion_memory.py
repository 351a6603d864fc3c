"""A Reward FL step on CPU at about 100M parameters: the actor process's peak memory against the dry run's estimate.

    python benchmarks/diffusion_memory.py [--model unet|flow] [--steps N] [--malloc-threshold] [--write-docs] [OVERRIDE]

It runs `roll-reward-fl` (the shapes YAML, without its warm start) on a `tiny-diffusion://` UNet of 97M parameters
(32x32 pixels, channels 320 and 640, a text encoder of width 256), or with `--model flow` on a tiny SD3 flow
transformer of about 100M (5 joint blocks of 12 x 64, 32x32 pixels, the flow shapes YAML: Euler steps), with the
identity reward on a small locally built CLIP vision tower, for `--steps` optimizer steps (default 1) of 4 prompts
(8 denoising steps, guidance 3, the gradient through the last 2, ZeRO-2 on one rank, fp32) and two held-out images
before and after. The actor's process is
sampled five times a second (RSS and PSS, and the method it runs), and compared with what the dry run estimates for
it: its runtime, resident states and largest phase (`node_estimate`, with the actor's breakdown from
`roll/pipeline/diffusion/memory_estimate.py`). `--malloc-threshold` gives the actor `MALLOC_MMAP_THRESHOLD_=131072`
(as the 0.5B LLM recipe does), so freed tensors leave its heap. OVERRIDEs go to the run and the estimate alike.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import doc_tables  # noqa: E402
from benchmarks.scale_memory import SAMPLE_S, _worker_pids, sample  # noqa: E402

GiB = 2**30
DOC = REPO_ROOT / "docs" / "memory_estimate.md"
BLOCK = "diffusion_memory"
# docs/memory_estimate.md's tables: glibc's default, MALLOC_MMAP_THRESHOLD_, and several steps with it.
BLOCKS = (BLOCK, f"{BLOCK}_malloc", f"{BLOCK}_steps")
FLOW_BLOCK = f"{BLOCK}_flow"
# Each model's YAML and reference.
MODELS = {
    "unet": ("reward_fl_shapes", "tiny-diffusion://unet?image_size=32&base_channels=320&text_hidden_size=256"),
    "flow": (
        "reward_fl_flow_shapes",
        "tiny-diffusion://sd3?image_size=32&layers=5&heads=12&head_dim=64&text_hidden_size=64&max_prompt_tokens=16",
    ),
}
RUN = (
    "platform=cpu",
    "warm_start.base_model=''",
    "warm_start.output_dir=''",
    "eval_steps=1",
    "batch_size=4",
    "actor.training_args.per_device_train_batch_size=4",
    "data.held_out_prompts=2",
    "data.eval_images_per_prompt=1",
    "reward.name=identity",
)


def reward_files(root: Path) -> list[str]:
    """The identity reward's encoder (a 4-layer CLIP vision tower of width 256 at 32x32) and reference image, built
    in `root`; the overrides naming them."""
    import torch
    from PIL import Image

    from roll.models.tiny_image_encoder import make_tiny_image_encoder

    encoder = make_tiny_image_encoder(root / "encoder", image_size=32, hidden_size=256, num_layers=4)
    pixels = torch.zeros(32, 32, 3, dtype=torch.uint8)
    pixels[8:24, 8:24, 0] = 220
    Image.fromarray(pixels.numpy()).save(root / "reference.png")
    return [f"+reward.kwargs={{encoder:'{encoder}',reference_image:'{root / 'reference.png'}'}}"]


def estimate(config_name: str, overrides: list[str]) -> tuple[int, list[str]]:
    """The dry run's estimate of the actor's process (bytes) and its printed lines."""
    from hydra import compose, initialize_config_dir

    from roll.configs.hydra_defaults import register_schema_defaults
    from roll.configs.loader import load_pipeline_config, yaml_names
    from roll.pipeline.base.dry_run.node_estimate import estimate_nodes
    from roll.pipeline.diffusion.reward_fl_config import RewardFLConfig

    config_dir = REPO_ROOT / "examples" / "config"
    register_schema_defaults("reward_fl", RewardFLConfig)
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        cfg = compose(config_name, overrides=overrides)
    config = load_pipeline_config(cfg, RewardFLConfig, yaml_names([config_dir]))
    node = estimate_nodes(config)[0]
    ranks = [line for process in node.processes if process.rank for line in process.rank.lines()]
    return node.process_peaks()["actor/0"], [*node.lines(), *ranks]


def run(config_name: str, overrides: list[str], output_dir: Path) -> tuple[dict[str, int], float]:
    """Run Reward FL with `overrides`; the actor's peaks (`rss`, `pss`, and `pss <method>` per method it ran) and
    the wall time."""
    pid_dir = output_dir / "pids"
    pid_dir.mkdir()
    script = str(REPO_ROOT / "examples" / "start_reward_fl_pipeline.py")
    command = [sys.executable, script, "--config-name", config_name, *overrides]
    env = {**os.environ, "ROLL_PID_DIR": str(pid_dir)}
    memory = psutil.virtual_memory()
    started = time.monotonic()
    rss: list[int] = [0]
    with tempfile.TemporaryFile("w+") as stderr:
        process = subprocess.Popen(command, cwd=REPO_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=stderr, text=True)
        sampled: list = []
        threads = [
            threading.Thread(target=lambda: sampled.append(sample(process, memory.total - memory.available, pid_dir))),
            threading.Thread(target=lambda: _sample_rss(process, pid_dir, rss)),
        ]
        for thread in threads:
            thread.start()
        process.wait()
        for thread in threads:
            thread.join()
        stderr.seek(0)
        tail = stderr.read()[-3000:]
    if process.returncode != 0:
        raise SystemExit(f"the run failed (exit {process.returncode}):\n{tail}")
    peaks = {"rss": rss[0], "pss": sampled[0].process_peak["actor/0"]}
    peaks |= {f"pss {method}": pss for (role, method), pss in sampled[0].method_peak.items() if role == "actor"}
    return peaks, time.monotonic() - started


def _sample_rss(process: subprocess.Popen, pid_dir: Path, peak: list[int]) -> None:
    """Keep the largest RSS of the actor's process in `peak[0]` until `process` exits."""
    while process.poll() is None:
        for pid, label in _worker_pids(pid_dir).items():
            if label == "actor/0":
                with contextlib.suppress(psutil.Error):
                    peak[0] = max(peak[0], psutil.Process(pid).memory_info().rss)
        time.sleep(SAMPLE_S)


def build_parser() -> argparse.ArgumentParser:
    """The options; anything else on the command line is a Hydra override of the run and the estimate."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(MODELS), default="unet", help="a UNet or a flow transformer")
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps (Adam's moments exist from the first)")
    parser.add_argument("--malloc-threshold", action="store_true", help="MALLOC_MMAP_THRESHOLD_=131072 in the actor")
    parser.add_argument(doc_tables.WRITE_DOCS, action="store_true", dest="write_docs")
    return parser


def main() -> None:
    """Estimate, run, print the comparison (and write it into its block)."""
    args, extra = build_parser().parse_known_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config_name, model = MODELS[args.model]
        overrides = [*RUN, f"pretrain='{model}'", f"max_steps={args.steps}", *reward_files(root)]
        overrides += [f"output_dir={root / 'out'}", *extra]
        if args.malloc_threshold:
            overrides.append("+actor.env_vars.MALLOC_MMAP_THRESHOLD_='131072'")
        estimated, lines = estimate(config_name, overrides)
        peaks, seconds = run(config_name, overrides, root)
    print("\n".join(lines))
    rows = [
        f"| {name} | {value / GiB:.2f} | {estimated / GiB:.2f} | {value / estimated:.2f} |"
        for name, value in sorted(peaks.items())
    ]
    malloc = "MALLOC_MMAP_THRESHOLD_=131072" if args.malloc_threshold else "glibc's default"
    text = "\n".join(
        [
            f"Actor process ({args.model}), {malloc}, {args.steps} step(s); the run took {seconds:.0f} s.",
            "",
            "| actor peak | measured (GiB) | estimate (GiB) | measured / estimate |",
            "|---|---:|---:|---:|",
            *rows,
            "",
            "The dry run's lines for the node:",
            "",
            "```",
            *lines,
            "```",
        ]
    )
    print(text)
    if args.write_docs:
        block = BLOCKS[2] if args.steps > 1 else BLOCKS[1] if args.malloc_threshold else BLOCKS[0]
        block = FLOW_BLOCK if args.model == "flow" else block
        doc_tables.write_block(DOC, block, doc_tables.command_line(__file__, sys.argv[1:]), text)


if __name__ == "__main__":
    main()
