"""Read back what wandb, swanlab and mlflow stored for a finished run and compare it with roll's own logs.

For re-checking the trackers against the real packages (docs/trackers.md); not part of the test suite:

    roll-rlvr ... tracker=[tensorboard,wandb,swanlab,mlflow] output_dir=/tmp/trk   # WANDB_MODE=offline etc.
    python scripts/check_tracker_runs.py /tmp/trk/rlvr/logs

Each tracker whose files are under the logs directory is read with its package's own format: the
offline `.wandb` record log, SwanLab's `.swanlab` data store, MLflow's SQLite store. Exits 1 when a
step's metrics or a sample table differ from `metrics.jsonl` / `samples.jsonl`.
"""

from __future__ import annotations

import argparse
import json
import math
import struct
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

Steps = dict[int, dict[str, float]]
Samples = dict[int, list[dict[str, Any]]]


def roll_logs(logs: Path) -> tuple[Steps, Samples]:
    """The finite metrics per step of `metrics.jsonl` and the rows per step of `samples.jsonl`."""
    metrics: Steps = {}
    for line in (logs / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        step = int(row.pop("step"))
        metrics.setdefault(step, {}).update({k: v for k, v in row.items() if math.isfinite(v)})
    samples: Samples = {}
    for line in (logs / "samples.jsonl").read_text().splitlines():
        row = json.loads(line)
        samples.setdefault(int(row.pop("step")), []).append(row)
    return metrics, samples


def _leveldb_records(path: Path) -> Iterator[bytes]:
    """The records of a W&B LevelDB-style log: a 7-byte header, then 32 KiB blocks of 7-byte-headed chunks."""
    raw, block = path.read_bytes(), 32768
    if raw[:4] != b":W&B":
        raise ValueError(f"{path} is not a W&B run file")
    position, pending = 7, b""
    while position + 7 <= len(raw):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", raw[position : position + 7])
        if left < 7 or (kind == 0 and length == 0):
            position += left
            continue
        data, position = raw[position + 7 : position + 7 + length], position + 7 + length
        if kind == 1:  # a whole record; 2, 3, 4: its first, middle and last chunks
            yield data
        elif kind in (2, 3):
            pending = data if kind == 2 else pending + data
        elif kind == 4:
            yield pending + data


def read_wandb(logs: Path) -> tuple[Steps, Samples, dict[str, Any]]:
    """Metrics, sample tables and config of the latest offline wandb run under `logs`."""
    from wandb.proto import wandb_internal_pb2

    run_dir = logs / "wandb" / "latest-run"
    metrics: Steps = {}
    samples: Samples = {}
    config: dict[str, Any] = {}
    for data in _leveldb_records(next(run_dir.glob("run-*.wandb"))):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(data)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            updates = record.run.config.update
            config = {item.key: json.loads(item.value_json) for item in updates if item.key != "_wandb"}
        elif kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            step = record.history.step.num
            metrics[step] = {k: v for k, v in items.items() if not k.startswith(("_", "samples"))}
            if "samples/path" in items:
                table = json.loads((run_dir / "files" / items["samples/path"]).read_text())
                samples[step] = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
    return metrics, samples, config


def read_swanlab(logs: Path) -> tuple[Steps, Samples, dict[str, Any]]:
    """Metrics, sample texts and config of the SwanLab run under `logs`."""
    import yaml
    from google.protobuf.json_format import MessageToDict
    from swanlab.proto.swanlab.record.v1.record_pb2 import Record
    from swanlab.sdk.internal.core_python.store import DataStoreReader

    run_dir = max(logs.glob("run-*"))
    reader = DataStoreReader()
    reader.open(next(run_dir.glob("run-*.swanlab")))
    metrics: Steps = {}
    samples: Samples = {}
    for data in reader:
        record = Record()
        record.ParseFromString(data)
        fields = MessageToDict(record)  # leaves out zeros: step 0, a value of 0.0
        if "scalar" in fields:
            scalar = fields["scalar"]
            metrics.setdefault(int(scalar.get("step", 0)), {})[scalar["key"]] = scalar["value"].get("number", 0.0)
        elif "media" in fields and fields["media"]["key"] == "samples":
            items = fields["media"]["value"]["items"]
            texts = [(run_dir / "media" / "text" / item["filename"]).read_text() for item in items]
            samples[int(fields["media"].get("step", 0))] = [json.loads(text) for text in texts]
    reader.close()
    config = {k: v["value"] for k, v in yaml.safe_load((run_dir / "files" / "config.yaml").read_text()).items()}
    return metrics, samples, config


def read_mlflow(logs: Path) -> tuple[Steps, Samples, dict[str, Any]]:
    """Metrics, sample tables and config.json of the (single) MLflow run in `logs/mlflow.db`."""
    import mlflow

    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{(logs / 'mlflow.db').resolve()}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    metrics: Steps = {}
    for key in run.data.metrics:
        for point in client.get_metric_history(run.info.run_id, key):
            metrics.setdefault(point.step, {})[key] = point.value
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    samples: Samples = {}
    for path in sorted((artifacts / "samples").glob("step_*.json")):
        table = json.loads(path.read_text())
        samples[int(path.stem.split("_")[1])] = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]
    return metrics, samples, json.loads((artifacts / "config.json").read_text())


READERS = {"wandb": read_wandb, "swanlab": read_swanlab, "mlflow": read_mlflow}
FOUND = {"wandb": "wandb/latest-run", "swanlab": "run-*", "mlflow": "mlflow.db"}


def main() -> int:
    """Compare every tracker found under the logs directory with roll's logs; print one line each."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("logs", type=Path, help="a run's logs directory, <run_dir>/logs")
    logs = parser.parse_args().logs
    want_metrics, want_samples = roll_logs(logs)
    failed = False
    for name, reader in READERS.items():
        if not any(logs.glob(FOUND[name])):
            continue
        metrics, samples, config = reader(logs)
        per_step = ", ".join(f"step {s}: {len(m)}" for s, m in sorted(metrics.items()))
        ok = metrics == want_metrics and samples == want_samples
        failed |= not ok
        print(
            f"{name}: {'same as' if ok else 'DIFFERENT from'} metrics.jsonl/samples.jsonl; metrics {per_step}; "
            f"sample rows {sum(map(len, samples.values()))}; config fields {len(config)}"
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
