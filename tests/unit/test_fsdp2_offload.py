"""fsdp2_train's phase offloading: every state storage leaves (to a spill file on CPU) and comes back bit for bit, with
every tensor that views it still valid."""

from __future__ import annotations

from pathlib import Path

import torch

from roll.distributed.strategy.fsdp2_offload import StateOffloader


def test_round_trip_through_a_spill_file_is_bit_exact_and_frees_the_storages(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    flat = torch.randn(1000, generator=generator)  # a padded flat shard and the parameter views into it
    weight, bias = flat[:900].view(30, 30), flat[900:990]
    exp_avg = torch.randn(30, 30, generator=generator, dtype=torch.bfloat16)
    step = torch.tensor(7.0)
    states = {"model_params": [weight, bias, flat], "grads": [torch.zeros(0)], "optimizer_states": [exp_avg, step]}
    before = [t.clone() for t in (flat, exp_avg, step)]
    offloader = StateOffloader()
    offloaded = offloader.offload(states, "nvme", str(tmp_path / "spill"))
    assert offloaded["offload_states/offload/moved_bytes/model_params"] == 4000  # the shared storage once
    assert offloaded["offload_states/offload/moved_bytes/optimizer_states"] == 30 * 30 * 2 + 4
    assert all(t.untyped_storage().nbytes() == 0 for t in (flat, weight, bias, exp_avg, step))
    assert offloader.offload(states, "nvme", str(tmp_path / "spill"))["offload_states/offload/moved_bytes/grads"] == 0
    assert offloader.reload({"optimizer_states"})["offload_states/reload/moved_bytes/optimizer_states"] == 1804
    assert flat.untyped_storage().nbytes() == 0 and offloader.file is not None  # the rest stays on disk
    reloaded = offloader.reload()
    assert reloaded["offload_states/reload/moved_bytes/model_params"] == 4000
    for tensor, expected in zip((flat, exp_avg, step), before, strict=True):
        assert torch.equal(tensor, expected)
    assert torch.equal(weight, before[0][:900].view(30, 30)) and torch.equal(bias, before[0][900:990])
    weight.add_(1)  # the views still share the flat buffer
    assert torch.equal(flat[:900], before[0][:900] + 1)
    assert offloader.file is None  # the spill file is closed once everything is back


def test_host_memory_target_leaves_host_storages_alone() -> None:
    tensor = torch.ones(10)
    offloader = StateOffloader()
    metrics = offloader.offload({"model_params": [tensor]}, "cpu")
    assert metrics["offload_states/offload/moved_bytes/model_params"] == 0 and tensor.untyped_storage().nbytes() == 40
    offloader.reload()
    assert torch.equal(tensor, torch.ones(10))
