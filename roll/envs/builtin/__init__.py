"""Built-in environments, registered by name when this package is imported (the registry imports it on first use).

Tiny-model friendly: short observations of digits, a few lowercase words and the map letters, all in
the character vocabulary of `roll.models.tiny` (`framed_colour` shows pictures too, for a vision-language policy).
It may import roll.envs, roll.utils, roll.rewards and roll.datasets (its synthetic pictures).
"""

from roll.envs.builtin import arithmetic, framed_colour, frozen_lake, guess_number

__all__ = ["arithmetic", "framed_colour", "frozen_lake", "guess_number"]
