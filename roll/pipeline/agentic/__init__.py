"""Agentic RL: multi-turn episodes of an environment (`roll.envs`) as the RLVR pipeline's rollout.

`agentic_config` is the `env:` block of the schema (`EnvArguments`), `multi_turn` plays a batch of episodes
turn by turn against the policy's inference cluster, `observations` encodes an environment's observation turns,
`env_rollout` is what the driver calls each step (training and held-out episodes), `env_workers` the env role:
environments held by CPU Ray actors instead of the driver, `sources` several environments in one run
(`env.sources`: each episode's source drawn by weight from its seed, per-source metrics). A user's agent
(`env.agent`) plays episodes through an OpenAI-compatible endpoint instead: `agent_rollout` runs the agents
(`agent_runner`) and builds the batch (a row per segment), `agent_tasks` gives them their tasks (an environment's
reset or a data row), `chat_server` serves the endpoint, `chat_api` is its wire format, `agent_session` an episode's
calls and segments of ids as sampled, `generation_queue` the agents' calls batched into actor_infer generations,
`mixed_rollout` sources played by agents beside sources played in their environments. The command `roll-agentic`
runs the RLVR pipeline (`roll.pipeline.rlvr`) with an `env:` block, by default
`examples/config/agentic_calculator.yaml`.
May import: `roll.pipeline.base` and every layer below; `roll.pipeline.rlvr` imports it, never the reverse.
"""
