"""DeepSpeed's Muon module imported without compiling its kernels, which then compile on their first call.

Every ZeRO engine imports `deepspeed.runtime.zero.muon` (to ask whether the optimizer is Muon), and that module
wraps three functions in `torch.compile` as it is imported. The wrapping imports TorchInductor: about a CPU-second
in each training process, spent even where no Muon optimizer exists. roll imports the module first with the
wrapping deferred to the functions' first call, so an engine that never runs Muon never pays it.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def compile_on_first_call(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function`, handed to `torch.compile` (with its defaults) when it is first called rather than now."""
    compiled: Callable[..., Any] | None = None

    @functools.wraps(function)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal compiled
        if compiled is None:
            compiled = torch.compile(function)
        return compiled(*args, **kwargs)

    return call


def import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon module with `compile_on_first_call` standing in for `torch.compile`; does nothing
    once it is imported, or in a DeepSpeed without it."""
    if MUON_MODULE in sys.modules:
        return
    from deepspeed.runtime import compiler

    original = compiler.compile
    compiler.compile = lambda: compile_on_first_call
    try:
        __import__(MUON_MODULE)
    except ImportError:
        pass  # a DeepSpeed release without Muon: nothing imports it
    finally:
        compiler.compile = original
