"""vLLM internals roll relies on: the worker extension that streams new weights into a running engine."""
