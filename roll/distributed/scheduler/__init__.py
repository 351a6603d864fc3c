"""DataProto, dispatch modes (`@register`), rank layout, placement, the ResourceManager and Ray start.

May import: `roll.configs`, `roll.platforms`, `roll.utils`.
"""
