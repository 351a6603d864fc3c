"""Reward functions, the child process that runs them with a deadline (`reward_process`) and the code sandbox
that runs a response's program (`code_sandbox`); shared by every pipeline that scores responses."""
