"""Reward functions and the sandbox that runs them; shared by every pipeline that scores responses."""
