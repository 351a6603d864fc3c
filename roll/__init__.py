"""roll: Ray-orchestrated reinforcement learning for post-training language models.

Importing roll is light: backends (DeepSpeed, vLLM, SGLang) are imported only by the worker that
uses them; backend modules register themselves and load their engine on first use
(`roll.distributed.strategy.registry`).
"""

__version__ = "0.1.0"

from roll.third_party.transformers.import_scans import install as _install_transformers_import_cache
from roll.utils.startup_gc import defer_collection as _defer_collection

_defer_collection()  # before the imports that follow this one in every roll process (roll/utils/startup_gc.py)
_install_transformers_import_cache()
