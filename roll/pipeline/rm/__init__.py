"""Reward modelling: a Bradley-Terry outcome reward model and a process reward model (PRM).

May import: `roll.pipeline.base` and below.
"""
