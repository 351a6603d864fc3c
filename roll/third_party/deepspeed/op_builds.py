"""Where DeepSpeed's just-in-time ops are looked for: the build directory of this Python environment.

`scripts/setup_env.sh` builds DeepSpeed's CPU ops (shared-memory collectives, CPU Adam, ...) into
`<venv>/torch_extensions` when it installs. A process started without that script's variables (an activated
venv running `roll-rlvr`, as the README shows) would look in torch's per-user default instead and build the
ops again there: 68 s for the shared-memory collectives on 2 cores, before the first step. Two environments
of one user share that default, so each rebuilt the ops the other had built last.

The ninja that checks a build must be the one that made it: the environment's ninja (1.13, a dependency of
DeepSpeed) and a system one (1.11 on these machines) record different command hashes, so a run found by the
system's `PATH` (`.venv/bin/python examples/start_rlvr_pipeline.py`, without activating) rebuilt the
shared-memory op (25-35 s, and about 1.4 GiB per compiler process), and the next activated run rebuilt it back.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def use_environment_builds() -> None:
    """Point torch's JIT loader at `<sys.prefix>/torch_extensions` when it exists and `TORCH_EXTENSIONS_DIR` is
    unset (a directory the user chose is kept), and put the environment's `bin` (its ninja) first on `PATH`. Call
    before DeepSpeed loads an op; child processes inherit both."""
    built = Path(sys.prefix) / "torch_extensions"
    if "TORCH_EXTENSIONS_DIR" not in os.environ and built.is_dir():
        os.environ["TORCH_EXTENSIONS_DIR"] = str(built)
    environment_bin = Path(sys.prefix) / "bin"
    if (environment_bin / "ninja").exists():
        path = [entry for entry in os.environ.get("PATH", "").split(os.pathsep) if entry]
        if not path or path[0] != str(environment_bin):
            os.environ["PATH"] = os.pathsep.join([str(environment_bin), *path])
