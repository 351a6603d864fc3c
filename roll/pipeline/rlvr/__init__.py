"""RLVR: reinforcement learning with verifiable rewards (GRPO, RLOO, REINFORCE++, PPO with GAE).

`rlvr_pipeline` is the driver loop, `phases` names the phases of one step and the roles each needs
resident, `step_plan` the step's decisions (which log-prob passes run,
and whether together), `rollout` the driver-side processing of a generated batch (token rewards, advantages,
dynamic sampling), `async_generation` the overlap of generation with training, `reward_worker` the
reward role that runs verifiable reward functions. May import: `roll.pipeline.base` and every layer below.
"""
