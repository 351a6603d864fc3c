"""Diffusion pipelines: Reward FL (reward feedback learning) of a text-to-image diffusion model against a
differentiable image reward, its denoising loop with truncated gradients, the shapes demonstration data and
its warm start.

May import: `roll.pipeline.base` and below.
"""
