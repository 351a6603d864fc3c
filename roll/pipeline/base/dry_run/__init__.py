"""The dry run: what a validated run would do and how much memory each rank would need, without starting it.

- `plan`: the printed dry run: where every rank goes, how a step's batch divides over the roles, and
  each rank's memory estimate against its budget.

The memory estimate is plain arithmetic from a role's config and its model's config.json alone (no
torch, no Ray, no weights); docs/memory_estimate.md compares it with measured DeepSpeed runs. By what
it estimates, lowest first:

- `model_shape`: a model's shape and exact parameter count (dense Llama/Mistral/Qwen decoders), LoRA's;
- `model_states`: ZeRO's model states and the optimizer step's working set, as DeepSpeed keeps them;
- `activations`: activations kept for backward, the logits, the KV cache;
- `backend_ranks`: what one training, inference or engine (vLLM, SGLang) rank holds, phase by phase;
- `rank_estimate`: `estimate_rank`, a role's rank against its device or host memory (`RankEstimate`).
- `node_estimate`: a CPU run's node, every process of it summed at the step's peak, against what Ray's
  memory monitor allows; `check_node_memory` refuses a run over it before Ray starts (the entry point).

May import: `roll.configs`, `roll.models` (the tiny-model module, lazily), `roll.distributed.scheduler`
and `roll.distributed.executor` (the plan, the node estimate), and `roll.pipeline.base.pipeline_config` (the
plan and the node estimate only:
`pipeline_config` imports `model_shape`, so this file imports nothing); never a pipeline family.
"""
