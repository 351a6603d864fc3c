"""Atomic, resumable DeepSpeed checkpoints, including resume at a different data-parallel size.

Layout of a checkpoint `save_dir/<tag>` (staged and marked by `roll.utils.staged_checkpoint`, which also keeps
`latest`, the marker and each rank's RNG states):

    <tag>/state/               DeepSpeed's own files (model, per-rank ZeRO optimizer shards)
    <tag>/state_universal/     made on first resume at another data-parallel size

Under AutoTP (tensor_parallel.autotp_size > 1) DeepSpeed writes one model-states file per tensor-parallel
rank; the marker records the tensor-parallel size, and a resume must use the same one.
"""

from __future__ import annotations

import argparse
import os
import shutil
from pathlib import Path
from typing import Any

import torch.distributed as dist

from roll.utils.staged_checkpoint import (
    MARKER,
    check_checkpoint_backend,
    checkpoint_meta,
    resolve_checkpoint,
    restore_rng,
    staged_checkpoint,
)

__all__ = ["MARKER", "load", "save"]

ENGINE_TAG = "state"
UNIVERSAL_TAG = "state_universal"


def _rank_and_world() -> tuple[int, int]:
    return dist.get_rank(), dist.get_world_size()


def _tensor_parallel_size(engine: Any) -> int:
    return max(1, int(engine.autotp_size()))


def save(engine: Any, save_dir: str, tag: str, client_state: dict[str, Any]) -> str:
    """Write checkpoint `save_dir/tag` from every rank; it becomes visible (and `latest`) only when complete."""
    tp_size = _tensor_parallel_size(engine)
    meta = {
        "dp_size": _rank_and_world()[1] // tp_size,
        "tp_size": tp_size,
        "zero_stage": engine.zero_optimization_stage(),
    }
    with staged_checkpoint(save_dir, tag, meta) as staging:
        engine.save_checkpoint(str(staging), tag=ENGINE_TAG, client_state=client_state, save_latest=False)
    return str(Path(save_dir) / tag)


def load(engine: Any, load_dir: str, tag: str | None = None) -> tuple[str, dict[str, Any]]:
    """Restore engine, optimizer, scheduler and RNG from a checkpoint; return its path and client state.

    When the checkpoint was written by a different number of data-parallel ranks and its optimizer
    states are partitioned, it is converted once to DeepSpeed's universal format and loaded from there.
    A checkpoint of another tensor-parallel size is refused (ValueError naming both sizes).
    """
    rank, world = _rank_and_world()
    path = resolve_checkpoint(load_dir, tag)
    check_checkpoint_backend(path, "deepspeed_train")
    meta = checkpoint_meta(path)
    tp_size = _tensor_parallel_size(engine)
    saved_tp = meta.get("tp_size", 1)
    if saved_tp != tp_size:
        raise ValueError(
            f"{path} was written with tensor_parallel.autotp_size={saved_tp} and this role runs {tp_size}; "
            f"resume with autotp_size={saved_tp} (the data-parallel size may differ)"
        )
    partitioned = any((path / ENGINE_TAG).glob("*zero_pp_rank_*"))
    engine_tag = ENGINE_TAG
    if meta["dp_size"] != world // tp_size and partitioned:
        if rank == 0 and not (path / UNIVERSAL_TAG).is_dir():
            _convert_to_universal(path / ENGINE_TAG, path / UNIVERSAL_TAG)
        dist.barrier()
        engine._config.load_universal_checkpoint = True  # private: the engine reads it during load
        engine_tag = UNIVERSAL_TAG
    try:
        loaded_path, client_state = engine.load_checkpoint(str(path), tag=engine_tag)
    finally:
        engine._config.load_universal_checkpoint = False
    if loaded_path is None:
        raise RuntimeError(f"DeepSpeed could not load {path / engine_tag}")
    restore_rng(path, rank)
    return str(path), client_state


def _convert_to_universal(source: Path, target: Path) -> None:
    from deepspeed.checkpoint import ds_to_universal

    staging = target.with_name(f".{target.name}.incomplete")
    shutil.rmtree(staging, ignore_errors=True)
    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(staging),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    ds_to_universal.main(args)
    # The engine reads its module weights from the model-states file beside the universal shards.
    for model_file in source.glob("*model_states.pt"):
        if not (staging / model_file.name).exists():
            shutil.copy2(model_file, staging / model_file.name)
    os.replace(staging, target)
