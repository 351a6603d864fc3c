"""Agentic RL: multi-turn episodes of an environment (`roll.envs`) as the RLVR pipeline's rollout.

`agentic_config` is the `env:` block of the schema (`EnvArguments`), `multi_turn` plays a batch of episodes
turn by turn against the policy's inference cluster, `observations` encodes an environment's observation turns,
`env_rollout` is what the driver calls each step (training and held-out episodes), `env_workers` the env role:
environments held by CPU Ray actors instead of the driver. The command `roll-agentic` runs the RLVR pipeline
(`roll.pipeline.rlvr`) with an `env:` block, by default `examples/config/agentic_calculator.yaml`.
May import: `roll.pipeline.base` and every layer below; `roll.pipeline.rlvr` imports it, never the reverse.
"""
