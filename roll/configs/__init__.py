"""Config schemas as dataclasses (roles, algorithm, data), strict conversion from YAML, Hydra defaults.

Schemas never know the backends: the pipeline base asks the strategy registry to check a strategy
block. May import: `roll.platforms`, `roll.utils`.
"""
