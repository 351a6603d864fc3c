"""A finished SFT export is reused before any Ray or worker starts (`skip_if_exported`)."""

from __future__ import annotations

import json
from pathlib import Path

from roll.pipeline.sft.sft_config import SFTConfig
from roll.pipeline.sft.sft_pipeline import EXPORT_MARKER, SFTPipeline


def test_a_finished_export_is_the_result_without_training(tmp_path: Path, capsys) -> None:
    config = SFTConfig(export_dir=str(tmp_path), skip_if_exported=True)
    assert SFTPipeline.finished_result(config) is None, "no export yet: train"
    (tmp_path / EXPORT_MARKER).write_text(json.dumps({"val_accuracy": 0.75}))
    assert SFTPipeline.finished_result(config) == 0.75
    assert "already exported" in capsys.readouterr().out
    config.skip_if_exported = False
    assert SFTPipeline.finished_result(config) is None, "retraining was asked for"
