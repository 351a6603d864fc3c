"""DPO, IPO, cDPO and KTO: preference optimisation against a frozen reference.

May import: `roll.pipeline.base` and below.
"""
