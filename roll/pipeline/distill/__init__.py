"""Offline distillation: a student trained on a teacher's top-k distribution.

May import: `roll.pipeline.base` and below.
"""
