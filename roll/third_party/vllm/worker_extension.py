"""Methods mixed into every vLLM worker (`LLM(worker_extension_cls=...)`), called with `LLM.collective_rpc`.

A weight sync is a session: `roll_begin_weight_sync`, one `roll_load_weights` per bucket, then
`roll_finish_weight_sync`. It uses vLLM's layerwise reload, which rebuilds a layer (fused q/k/v,
gate/up, repacked CPU kernels) once every part of it has arrived, whichever bucket each part came
in. Loading each bucket as its own `reload_weights` call instead would rebuild a layer from only the
parts in that bucket and leave the rest uninitialised. The method names must not collide with the
worker's own (the CPU worker already has `update_weights`), hence the `roll_` prefix.

Over a weight-broadcast group each engine worker is a member of its own (worker i takes the i-th of
its actor's ranks): `roll_receive_bucket` receives a bucket's tensors straight into this worker's
device and loads them into the open sync, while the actor reads the protocol's headers.
"""

from __future__ import annotations

import torch
from safetensors.torch import load_file
from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload

from roll.distributed.weight_sync.broadcast import BroadcastGroup
from roll.distributed.weight_sync.buckets import TensorSpec

# vLLM's CPU attention runs AMX tile kernels for bf16 whenever the CPU has AMX (CPUID), but Linux
# faults (SIGILL) on tile instructions until the process has asked for them (arch_prctl
# ARCH_REQ_XCOMP_PERM), and a spawned process starts without that permission. oneDNN asks on its
# first AMX GEMM, which vLLM's small-GEMM kernel skips below 5 rows, so an engine process whose first
# step is one short prompt reaches attention first and dies. vLLM imports this module in every worker
# process before it loads the model: ask here (a no-op returning False on CPUs without AMX).
torch.cpu._init_amx()

# A bucket arrives as the tensors themselves when the engine runs in the caller's process, or as the
# path of a safetensors file when it runs in other processes (tensors do not survive the RPC there).
Bucket = list[tuple[str, torch.Tensor]] | str


class WeightSyncExtension:
    """Streams Hugging Face-named weights into the model this vLLM worker runs, in place."""

    model_runner: object  # set by the vLLM worker this class is mixed into
    rank: int  # this engine worker's rank in its engine (the tensor-parallel rank without pipeline stages)
    device: torch.device

    def roll_begin_weight_sync(self) -> None:
        """Start a sync: layers wait, on the meta device, until all of their weights have been loaded."""
        initialize_layerwise_reload(self.model_runner.get_model())

    def roll_load_weights(self, bucket: Bucket) -> None:
        """Load one bucket of `(name, tensor)` pairs (or a safetensors file of them) into the open sync."""
        named_tensors = load_file(bucket).items() if isinstance(bucket, str) else bucket
        self.model_runner.get_model().load_weights(iter(named_tensors))

    def roll_finish_weight_sync(self) -> None:
        """Close the sync: put back untouched layers and drop caches derived from the old weights."""
        runner = self.model_runner
        finalize_layerwise_reload(runner.get_model(), runner.model_config)
        runner.reset_lora_state()
        runner.reset_encoder_cache()
        runner.reset_mm_cache()

    def roll_join_weight_broadcast(
        self, master_addr: str, master_port: int, ranks: tuple[int, ...], world_size: int, backend: str
    ) -> None:
        """Join the weight-broadcast group as `ranks[self.rank]`, receiving on this worker's device."""
        rank = ranks[self.rank]
        self.roll_weight_group = BroadcastGroup(master_addr, master_port, rank, world_size, backend, self.device)

    def roll_receive_bucket(self, specs: list[list]) -> None:
        """Receive the announced bucket (specs as JSON lists) over the group and load it into the open sync."""
        bucket = self.roll_weight_group.receive_bucket([TensorSpec.from_json(spec) for spec in specs])
        self.model_runner.get_model().load_weights(iter(bucket))
