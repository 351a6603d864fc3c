"""Clusters (a role = N Ray actors), the Worker base, StrategyWorker and the driver side of weight sync.

May import: `roll.distributed.strategy` and every layer below it.
"""
