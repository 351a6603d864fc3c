"""Diffusion models: loading a diffusers directory into its parts, and the local `tiny-diffusion://` factory.

May import: `roll.configs`, `roll.platforms`, `roll.utils`, `roll.models`.
"""
