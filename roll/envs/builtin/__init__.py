"""Built-in environments, registered by name when this package is imported (the registry imports it on first use).

Tiny-model friendly: short observations of digits, a few lowercase words and the map letters, all in
the character vocabulary of `roll.models.tiny`. It may import roll.envs, roll.utils and roll.rewards.
"""

from roll.envs.builtin import arithmetic, frozen_lake, guess_number

__all__ = ["arithmetic", "frozen_lake", "guess_number"]
