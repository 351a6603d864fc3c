"""Models and datasets named by hub id, fetched by the driver into the hub's own cache before any worker starts.

A model setting (`pretrain`, `<role>.model_args.model_name_or_path`, `warm_start.base_model`) may name a hub
repository as `org/name` or `org/name@revision` (a branch, a tag or a commit hash); a data-file setting
(`data.train_file`, `data.eval_file`) a dataset repository, optionally followed by `?subset=<name>&split=<name>`
(the split defaults to train). A value that exists on the local disk is a local path, and `tiny://` and
`tiny-diffusion://` references are never ids.

Hugging Face is the hub unless `ROLL_MODEL_HUB=modelscope`. `huggingface_hub.snapshot_download` puts the snapshot in
the cache `HF_HOME` (or `HF_HUB_CACHE`) names and, with `HF_HUB_OFFLINE=1`, only looks there.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from huggingface_hub import constants, snapshot_download
from huggingface_hub.errors import LocalEntryNotFoundError, RepositoryNotFoundError, RevisionNotFoundError

from roll.configs.schema import ConfigError
from roll.utils.imports import exception_line

HUB_ENV = "ROLL_MODEL_HUB"
HUBS = ("huggingface", "modelscope")
RepoKind = Literal["model", "dataset"]

_ID = re.compile(r"(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(?:@(?P<revision>[^?\s]+))?(?:\?(?P<query>\S*))?")
# A missing `data/train.jsonl` is a missing file, not a dataset repository.
_DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
_DATASET_OPTIONS = ("subset", "split")
# Weights in formats roll never loads (TensorFlow, Flax, ONNX, GGUF) and the second copy of the weights some
# repositories keep under original/: fetching them would only cost disk and time.
_NEVER_LOADED = ["*.h5", "*.msgpack", "*.onnx", "*.gguf", "*.tflite", "original/*"]


@dataclass(frozen=True)
class HubRef:
    """A repository on the hub, at `revision` (None: its default branch); a dataset's subset and split too."""

    repo_id: str
    revision: str | None = None
    subset: str | None = None
    split: str = "train"

    def __str__(self) -> str:
        return f"{self.repo_id}@{self.revision}" if self.revision else self.repo_id


def parse_hub_ref(value: str, kind: RepoKind = "model") -> HubRef | None:
    """The hub repository `value` names, or None when it is a local path (one that exists, or a data file's name)
    or a scheme reference such as tiny://. ValueError for a dataset option other than subset and split."""
    match = _ID.fullmatch(value)
    if match is None or Path(value).expanduser().exists():
        return None
    repo, query = match["repo"], match["query"]
    if (kind == "model" and query is not None) or (kind == "dataset" and repo.lower().endswith(_DATA_SUFFIXES)):
        return None
    options: dict[str, str] = {}
    for item in filter(None, (query or "").split("&")):
        key, _, option = item.partition("=")
        if key not in _DATASET_OPTIONS or not option:
            raise ValueError(f"{item!r} is not subset=<name> or split=<name>")
        options[key] = option
    return HubRef(repo, match["revision"], options.get("subset"), options.get("split", "train"))


def resolve_model_id(value: str, setting: str) -> str:
    """`value` with a model hub id replaced by its local snapshot directory (fetched now); other values as given."""
    ref = parse_hub_ref(value)
    return value if ref is None else fetch(ref, "model", f"{setting}={value!r}")


def fetch(ref: HubRef, kind: RepoKind, where: str) -> str:
    """The local snapshot directory of `ref`, downloaded into the hub's cache unless it is there already.

    A ConfigError starting with `where` (the setting and its value) names the id and the fix when it cannot be had.
    """
    hub = _selected_hub(where)
    try:
        if hub == "modelscope":
            return _modelscope_snapshot(ref, kind)
        ignored = _NEVER_LOADED if kind == "model" else None
        return snapshot_download(ref.repo_id, repo_type=kind, revision=ref.revision, ignore_patterns=ignored)
    except Exception as exc:  # the hubs raise many types (HTTP, cache, id checks); the user needs the reason and fix
        raise ConfigError(f"{where}: no local path of that name, and {_why(exc, ref, kind, hub)}") from exc


def _selected_hub(where: str) -> str:
    """The hub ids are fetched from: `ROLL_MODEL_HUB` (default huggingface); a ConfigError for another value, or
    for modelscope while its package is missing."""
    hub = os.environ.get(HUB_ENV, "huggingface").strip().lower() or "huggingface"
    if hub not in HUBS:
        raise ConfigError(f"{where}: {HUB_ENV}={hub!r} is not one of {', '.join(HUBS)}; set it to one or unset it")
    if hub == "modelscope" and importlib.util.find_spec("modelscope") is None:
        raise ConfigError(
            f"{where}: {HUB_ENV}=modelscope needs the modelscope package, which is not installed: pip install "
            f"modelscope (or unset {HUB_ENV} to use the Hugging Face hub)"
        )
    return hub


def _modelscope_snapshot(ref: HubRef, kind: RepoKind) -> str:
    import modelscope

    download = modelscope.snapshot_download if kind == "model" else modelscope.dataset_snapshot_download
    return download(ref.repo_id, **({"revision": ref.revision} if ref.revision else {}))


def _download_command(ref: HubRef, kind: RepoKind, hub: str) -> str:
    revision = f" --revision {ref.revision}" if ref.revision else ""
    if hub == "modelscope":
        return f"modelscope download --{kind} {ref.repo_id}{revision}"
    return f"hf download {ref.repo_id}{revision}" + (" --repo-type dataset" if kind == "dataset" else "")


def _why(exc: Exception, ref: HubRef, kind: RepoKind, hub: str) -> str:
    command = _download_command(ref, kind, hub)
    if isinstance(exc, LocalEntryNotFoundError) and constants.is_offline_mode():
        return (
            f"the Hugging Face {kind} {ref} is not in the cache ({constants.HF_HUB_CACHE}) while HF_HUB_OFFLINE is "
            f"set: download it with `{command}` on a machine with network and copy its HF_HOME here, or unset "
            "HF_HUB_OFFLINE"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"the hub has no revision {ref.revision!r} of the {kind} {ref.repo_id}; give a branch, tag or commit"
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"the hub has no {kind} {ref.repo_id} that you can read (no such repository, or a private or gated one: "
            "log in with `hf auth login`); fix the id, or give a local directory"
        )
    return f"the {kind} {ref} cannot be fetched from {hub} ({exception_line(exc)}); check the network, or `{command}`"
