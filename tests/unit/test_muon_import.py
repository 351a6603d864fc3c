"""DeepSpeed's Muon module imported without compiling (roll/third_party/deepspeed/muon_import.py): nothing is
compiled on import, the kernels compile once on their first call, and DeepSpeed's compile hook is put back."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch

from roll.third_party.deepspeed.muon_import import MUON_MODULE, compile_on_first_call, import_muon_uncompiled


@pytest.fixture
def compiled(monkeypatch: pytest.MonkeyPatch) -> list[Callable[..., Any]]:
    """The functions handed to `torch.compile`, which returns them as they are; DeepSpeed's Muon modules unloaded
    for the test and restored after it."""
    handed: list[Callable[..., Any]] = []
    monkeypatch.setattr(torch, "compile", lambda function: handed.append(function) or function)
    for name in [name for name in sys.modules if name.startswith("deepspeed.runtime.zero.muon")]:
        monkeypatch.delitem(sys.modules, name)
    return handed


def test_importing_muon_compiles_nothing_and_restores_deepspeeds_hook(compiled: list[Callable[..., Any]]) -> None:
    from deepspeed.runtime import compiler

    hook = compiler.compile
    import_muon_uncompiled()
    assert MUON_MODULE in sys.modules and compiled == []
    assert compiler.compile is hook
    from deepspeed.runtime.zero.muon import original_muon

    assert original_muon.muon_update.__wrapped__.__name__ == "muon_update"


def test_a_kernel_compiles_on_its_first_call_only(compiled: list[Callable[..., Any]]) -> None:
    def double(x: torch.Tensor) -> torch.Tensor:
        return 2 * x

    lazy = compile_on_first_call(double)
    assert compiled == [] and lazy.__name__ == "double"
    assert lazy(torch.ones(2)).tolist() == [2.0, 2.0] and lazy(torch.ones(1)).tolist() == [2.0]
    assert compiled == [double]
