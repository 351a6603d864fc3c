"""Data: built-in tasks, data files read with `datasets`, chat templates, prompt/preference/step encodings.

May import: `roll.configs`, `roll.models` (tokenizers), `roll.distributed.scheduler` (DataProto), `roll.utils`.
"""
