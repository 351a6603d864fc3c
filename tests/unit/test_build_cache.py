"""Built directories are vouched for file by file, and cache entries appear whole or not at all."""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from pathlib import Path

import pytest

from roll.configs.output_dirs import check_writable
from roll.configs.schema import ConfigError
from roll.models.build_cache import build_in_cache, read_marker, write_marker
from roll.models.diffusion.tiny_diffusion import resolve_diffusion_path
from roll.models.tiny import SPEC_MARKER, resolve_model_path

MARKER = "marker.json"


BUILT = (MARKER, {"width": 2})


@dataclass(frozen=True)
class Spec:
    width: int = 2


def _build(directory: Path, calls: list[Path] | None = None) -> Path:
    directory.mkdir(parents=True)
    (directory / "part").mkdir()
    (directory / "part" / "weights.bin").write_bytes(b"x" * 100)
    write_marker(directory, MARKER, {"width": 2})
    if calls is not None:
        calls.append(directory)
    return directory


def test_a_marker_vouches_only_while_every_file_is_whole(tmp_path: Path) -> None:
    built = _build(tmp_path / "m")
    assert read_marker(built, MARKER) == {"width": 2}
    (built / "part" / "weights.bin").write_bytes(b"x" * 10)  # truncated by a concurrent writer
    assert read_marker(built, MARKER) is None
    (built / "part" / "weights.bin").unlink()
    assert read_marker(built, MARKER) is None
    (built / MARKER).write_text('{"version": 1}')  # a marker of the old format lists no files: rebuilt
    assert read_marker(built, MARKER) is None


def test_a_cache_entryBUILT_once_then_reused(tmp_path: Path) -> None:
    calls: list[Path] = []
    first = build_in_cache("kind", Spec(), 0, lambda d: _build(d, calls), BUILT, str(tmp_path))
    again = build_in_cache("kind", Spec(), 0, lambda d: _build(d, calls), BUILT, str(tmp_path))
    assert first == again and len(calls) == 1
    assert calls[0] != Path(first), "the build writes a staging directory, renamed into place"
    assert sorted(p.name for p in (tmp_path / "kind").iterdir()) == [".width2-seed0.lock", "width2-seed0"]


def test_an_entry_emptied_after_its_build_is_rebuilt(tmp_path: Path) -> None:
    entry = Path(build_in_cache("kind", Spec(), 0, _build, BUILT, str(tmp_path)))
    (entry / "part" / "weights.bin").write_bytes(b"")
    calls: list[Path] = []
    rebuilt = Path(build_in_cache("kind", Spec(), 0, lambda d: _build(d, calls), BUILT, str(tmp_path)))
    assert rebuilt == entry and len(calls) == 1
    assert (entry / "part" / "weights.bin").stat().st_size == 100


def test_a_failed_build_leaves_no_entry(tmp_path: Path) -> None:
    def failing(directory: Path) -> Path:
        directory.mkdir()
        (directory / "half").write_text("half")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError, match="mid-build"):
        build_in_cache("kind", Spec(), 0, failing, BUILT, str(tmp_path))
    assert not (tmp_path / "kind" / "width2-seed0").exists()
    assert Path(build_in_cache("kind", Spec(), 0, _build, BUILT, str(tmp_path))).is_dir()


def _resolve_in(cache_dir: str, reference: str) -> str:
    resolver = resolve_diffusion_path if reference.startswith("tiny-diffusion://") else resolve_model_path
    return resolver(reference, cache_dir)


@pytest.mark.parametrize(
    "reference", ["tiny://qwen2?hidden_size=32&num_heads=1&num_kv_heads=1", "tiny-diffusion://unet?image_size=8"]
)
def test_concurrent_processes_share_one_whole_entry(tmp_path: Path, reference: str) -> None:
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        paths = pool.starmap(_resolve_in, [(str(tmp_path), reference)] * 2)
    assert paths[0] == paths[1]
    marker = SPEC_MARKER if reference.startswith("tiny://") else "roll_tiny_diffusion_spec.json"
    assert read_marker(Path(paths[0]), marker) is not None
    assert not [p for p in Path(paths[0]).parent.iterdir() if ".building-" in p.name or ".stale-" in p.name]


def test_no_run_writes_into_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ROLL_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ConfigError, match=r"output_dir=.*inside roll's model cache"):
        check_writable("output_dir", str(tmp_path / "cache" / "tiny" / "entry"))
    check_writable("output_dir", str(tmp_path / "runs"))


TINY_UNET = "tiny-diffusion://unet?image_size=8"


def test_a_rank_other_than_0_builds_whole_entries(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Workers build cache entries after their process group formed, and any rank may win the build lock; transformers
    # writes a model's files only on rank 0, so rank 1's entries had every file but the weights.
    import torch
    from transformers import AutoModelForCausalLM, CLIPTextModel

    reference = AutoModelForCausalLM.from_pretrained(resolve_model_path("tiny://qwen2", str(tmp_path / "rank0")))
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda group=None: 1)
    llm = Path(resolve_model_path("tiny://qwen2", str(tmp_path / "rank1")))
    diffusion = Path(resolve_diffusion_path(TINY_UNET, str(tmp_path / "rank1")))
    monkeypatch.undo()
    model = AutoModelForCausalLM.from_pretrained(llm)
    assert model.config.tie_word_embeddings == reference.config.tie_word_embeddings
    for (name, weight), (_, expected) in zip(model.state_dict().items(), reference.state_dict().items(), strict=True):
        assert torch.equal(weight, expected), name
    assert (model.generation_config.eos_token_id, model.generation_config.pad_token_id) == (
        reference.generation_config.eos_token_id,
        reference.generation_config.pad_token_id,
    )
    expected_encoder = CLIPTextModel.from_pretrained(
        Path(resolve_diffusion_path(TINY_UNET, str(tmp_path / "rank0"))) / "text_encoder"
    )
    encoder = CLIPTextModel.from_pretrained(diffusion / "text_encoder")
    for (name, weight), (_, expected) in zip(
        encoder.state_dict().items(), expected_encoder.state_dict().items(), strict=True
    ):
        assert torch.equal(weight, expected), name
