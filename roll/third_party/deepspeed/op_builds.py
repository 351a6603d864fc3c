"""Where DeepSpeed's just-in-time ops are looked for: the build directory of this Python environment.

`scripts/setup_env.sh` builds DeepSpeed's CPU ops (shared-memory collectives, CPU Adam, ...) into
`<venv>/torch_extensions` when it installs. A process started without that script's variables (an activated
venv running `roll-rlvr`, as the README shows) would look in torch's per-user default instead and build the
ops again there: 68 s for the shared-memory collectives on 2 cores, before the first step. Two environments
of one user share that default, so each rebuilt the ops the other had built last.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path


def use_environment_builds() -> None:
    """Point torch's JIT loader at `<sys.prefix>/torch_extensions` when it exists and `TORCH_EXTENSIONS_DIR` is
    unset (a directory the user chose is kept). Call before DeepSpeed loads an op; child processes inherit it."""
    built = Path(sys.prefix) / "torch_extensions"
    if "TORCH_EXTENSIONS_DIR" not in os.environ and built.is_dir():
        os.environ["TORCH_EXTENSIONS_DIR"] = str(built)
