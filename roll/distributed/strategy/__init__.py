"""Strategy ABCs, the registry (name -> lazily imported class) and one module per backend.

May import: `roll.third_party` and every layer below it; never `roll.distributed.executor`.
"""
