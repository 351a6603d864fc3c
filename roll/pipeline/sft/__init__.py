"""SFT: supervised fine-tuning on demonstrations (the warm start of the RL recipes).

May import: `roll.pipeline.base` and below.
"""
