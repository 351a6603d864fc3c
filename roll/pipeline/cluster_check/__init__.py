"""The cluster check: collectives and every dispatch mode on two colocated roles, before a real run.

May import: `roll.pipeline.base` and below.
"""
