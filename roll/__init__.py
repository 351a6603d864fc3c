"""roll: Ray-orchestrated reinforcement learning for post-training language models.

Importing roll is light: backends (DeepSpeed, vLLM, SGLang) are imported only by the worker that
uses them, through `roll.distributed.strategy.factory`.
"""

__version__ = "0.1.0"
