"""Diffusion pipelines: Reward FL (reward feedback learning) of a text-to-image diffusion model against a
differentiable image reward, its denoising loop with truncated gradients, the policy-gradient variant for
rewards without a gradient, the prompts, and the shapes demonstration's data and warm start.

May import: `roll.pipeline.base` and below.
"""
