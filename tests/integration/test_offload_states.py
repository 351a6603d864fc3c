"""Offloading DeepSpeed engine states (roll/third_party/deepspeed): round trips, training parity, leaks, disk, errors.

Engine scenarios run on two real DeepSpeed ranks (gloo, CPU accelerator) spawned once for the module; each scenario
function below runs on both ranks and returns plain data that the test asserts on. Round trips are checked
independently of the module: every live tensor of the scenario is copied beforehand, and each original storage is
held so that its use count shows whether anything in the process still references it after the offload.
"""

from __future__ import annotations

import errno
import gc
import os
import queue
import socket
import time
import traceback
import weakref
from datetime import timedelta
from typing import Any

import pytest
import torch

SCALAR_BYTES = 16  # grad-norm and overflow scalars stay on the device; anything larger must move
CONFIGS: dict[str, tuple[int, bool, dict[str, Any]]] = {  # name: (ZeRO stage, inference-only, config overrides)
    "zero0": (0, False, {}),
    "zero1": (1, False, {}),
    "zero2": (2, False, {"zero_optimization": {"overlap_comm": True, "contiguous_gradients": True}}),
    "zero3": (3, False, {}),
    "infer": (3, True, {}),
    "zero0_fp32": (0, False, {"bf16": {"enabled": False}}),
    "zero1_fp32_grads": (1, False, {"data_types": {"grad_accum_dtype": "fp32"}}),
    "zero2_cpu_adam": (2, False, {"zero_optimization": {"offload_optimizer": {"device": "cpu"}}}),
    "zero3_cpu_offload": (
        3,
        False,
        {"zero_optimization": {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}},
    ),
}
# Stage 0 in fp32 and inference engines: no master copy (the module's parameters are the master weights), and step()
# frees the gradients, so other_params is empty between steps.
STATELESS_OTHER_PARAMS = {"zero0_fp32", "infer"}


# ---------------------------------------------------------------------------------------------- rank processes


def _rank_main(rank: int, world_size: int, port: int, inbox: Any, outbox: Any) -> None:
    """A DeepSpeed rank that runs the scenarios it is sent until it receives None."""
    import logging

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK="0"
    )
    os.environ["DS_ACCELERATOR"] = "cpu"  # the same CPU path on GPU machines: both ranks share one device
    torch.set_num_threads(1)
    import deepspeed

    deepspeed.utils.logger.setLevel(logging.ERROR)
    deepspeed.init_distributed(dist_backend="gloo", timeout=timedelta(seconds=120))
    while (task := inbox.get()) is not None:
        name, kwargs = task
        try:
            outbox.put((rank, True, globals()[name](**kwargs)))
        except BaseException:
            outbox.put((rank, False, traceback.format_exc()))


class _Ranks:
    """Two spawned DeepSpeed ranks that stay up for the module."""

    def __init__(self, world_size: int = 2) -> None:
        context = torch.multiprocessing.get_context("spawn")
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        self._inboxes = [context.Queue() for _ in range(world_size)]
        self._outbox = context.Queue()
        self._processes = [
            context.Process(target=_rank_main, args=(rank, world_size, port, inbox, self._outbox), daemon=True)
            for rank, inbox in enumerate(self._inboxes)
        ]
        for process in self._processes:
            process.start()

    def run(self, scenario: str, timeout: float = 240, **kwargs: Any) -> list[Any]:
        """Run `scenario(**kwargs)` on every rank; returns the results by rank, or fails with the ranks' tracebacks."""
        if not all(process.is_alive() for process in self._processes):
            pytest.fail("a DeepSpeed rank died in an earlier test", pytrace=False)
        for inbox in self._inboxes:
            inbox.put((scenario, kwargs))
        outcomes = {}
        for _ in self._inboxes:
            try:
                rank, ok, payload = self._outbox.get(timeout=timeout)
            except queue.Empty:
                for process in self._processes:  # a rank hangs: no later scenario can trust these ranks
                    process.kill()
                pytest.fail(f"{scenario} did not finish within {timeout} s", pytrace=False)
            outcomes[rank] = (ok, payload)
        failures = [f"rank {rank}:\n{payload}" for rank, (ok, payload) in sorted(outcomes.items()) if not ok]
        if failures:
            pytest.fail("\n".join(failures), pytrace=False)
        return [outcomes[rank][1] for rank in sorted(outcomes)]

    def close(self) -> None:
        """Stop the ranks."""
        for inbox in self._inboxes:
            inbox.put(None)
        for process in self._processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()


@pytest.fixture(scope="module")
def ranks() -> Any:
    """The module's two DeepSpeed ranks."""
    pool = _Ranks()
    assert pool.run("ready", timeout=300) == [0, 1]
    yield pool
    pool.close()


# ---------------------------------------------------------------------------------------------- helpers (ranks)


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    """`base` updated with `extra`, recursing into nested dicts."""
    merged = dict(base)
    for key, value in extra.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and key in merged else value
    return merged


def _engine(config: str, *, hidden: int = 64, layers: int = 1, model: Any = None) -> Any:
    """A patched DeepSpeed engine of the named config over an MLP with a frozen first layer (or `model`)."""
    import deepspeed

    from roll.third_party.deepspeed.offload_states_patch import patch_engine

    stage, infer, extra = CONFIGS[config]
    torch.manual_seed(0)
    if model is None:
        blocks = [torch.nn.Linear(32, hidden), torch.nn.ReLU()]
        for _ in range(layers):
            blocks += [torch.nn.Linear(hidden, hidden), torch.nn.LayerNorm(hidden)]
        model = torch.nn.Sequential(*blocks, torch.nn.Linear(hidden, 8))
        model[0].requires_grad_(False)
        model.register_buffer("step_scale", torch.ones(8))
    ds_config = {
        "train_micro_batch_size_per_gpu": 4,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 64, "reduce_bucket_size": 1 << 20},
    }
    if not infer:
        ds_config["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2}}
    ds_config = _merge(ds_config, extra)
    trainable = None if infer else [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, config=ds_config, model_parameters=trainable)
    return patch_engine(engine)


def _batch(engine: Any, step: int) -> dict[str, torch.Tensor]:
    """Inputs of one step, different on every rank and step."""
    generator = torch.Generator().manual_seed(1000 * torch.distributed.get_rank() + step)
    if hasattr(engine.module, "config"):
        return {"input_ids": torch.randint(0, 64, (4, 16), generator=generator)}
    dtype = torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    return {"input": torch.randn(4, 32, generator=generator).to(dtype)}


def _loss(engine: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The scalar training loss of a batch."""
    if "input_ids" in batch:
        return engine(input_ids=batch["input_ids"], labels=batch["input_ids"]).loss
    return engine(batch["input"]).float().pow(2).mean()


def _train(engine: Any, steps: int, first: int = 0) -> list[float]:
    """Train `steps` steps (forward only for inference engines); returns the losses."""
    losses = []
    for step in range(first, first + steps):
        if engine.basic_optimizer is None:
            with torch.no_grad():
                losses.append(_loss(engine, _batch(engine, step)).item())
            continue
        loss = _loss(engine, _batch(engine, step))
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def _outputs(engine: Any) -> torch.Tensor:
    """Forward outputs on a fixed batch, computed without gradients."""
    with torch.no_grad():
        batch = _batch(engine, 999)
        if "input_ids" in batch:
            return engine(input_ids=batch["input_ids"]).logits.float()
        return engine(batch["input"]).float()


def _live_tensors() -> list[torch.Tensor]:
    """Every tensor object in the process that owns bytes."""
    gc.collect()
    return [
        obj
        for obj in gc.get_objects()
        if isinstance(obj, torch.Tensor)
        and obj.layout == torch.strided
        and obj.device.type != "meta"
        and obj.untyped_storage().nbytes() > 0
    ]


class _Snapshot:
    """Copies of the tensors created since `before`, and a handle on each of their storages.

    The tensors themselves are held weakly: the scan also finds garbage still in flight, e.g. the output of a finished
    all-gather that gloo's worker thread has not let go of yet, and a strong reference here would keep it alive.
    """

    def __init__(self, engine: Any, before: list[torch.Tensor]) -> None:
        from roll.third_party.deepspeed.state_fields import collect_storage_groups

        release = getattr(engine.optimizer, "empty_partition_cache", None)
        if release is not None:
            release()  # gathered ZeRO-3 parameters are a cache, not a state
        known = {id(tensor) for tensor in before}
        scratch = {
            id(tensor)
            for groups in collect_storage_groups(engine).values()
            for group in groups
            if group.scratch
            for tensor in group.tensors
        }
        tensors = [tensor for tensor in _live_tensors() if id(tensor) not in known]
        self.copies = [
            (weakref.ref(tensor), tensor.detach().clone()) for tensor in tensors if id(tensor) not in scratch
        ]
        handles: dict[int, torch.UntypedStorage] = {}
        for tensor in tensors:
            handles.setdefault(tensor.untyped_storage().data_ptr(), tensor.untyped_storage())
        self.storages = list(handles.values())

    def still_held(self, patience: float = 5.0) -> list[int]:
        """Sizes of the original storages that something besides this snapshot still references.

        References that go away within `patience` seconds do not count: garbage cycles, and gloo's worker thread,
        which drops a finished collective (and with it the output tensor) only after `wait()` has returned.
        """
        from roll.third_party.deepspeed.storage_mover import storage_use_count

        held = [s for s in self.storages if s.nbytes() > SCALAR_BYTES and storage_use_count(s) > 1]
        if held:  # perhaps only garbage cycles: collect and look again
            gc.collect()
        deadline = time.monotonic() + patience
        while (held := [s for s in held if storage_use_count(s) > 1]) and time.monotonic() < deadline:
            time.sleep(0.01)
        return [s.nbytes() for s in held]

    def mismatched(self) -> list[tuple[int, ...]]:
        """Shapes of the tensors whose bytes differ from their copies."""
        return [
            tuple(copy.shape)
            for ref, copy in self.copies
            if (tensor := ref()) is not None and not _same_bytes(tensor.detach(), copy)
        ]


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality (NaNs included)."""
    return a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _spill_links(nvme_dir: str) -> list[str]:
    """Open files of this process under `nvme_dir`."""
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            continue
    return [link for link in links if link.startswith(nvme_dir)]


# ---------------------------------------------------------------------------------------------- scenarios (ranks)


def ready() -> int:
    """This rank's number, once DeepSpeed is up."""
    return torch.distributed.get_rank()


def round_trip(config: str, nvme_dir: str) -> dict[str, Any]:
    """Offload everything to host memory, then to disk, reloading after each; report what each check saw."""
    before = _live_tensors()
    engine = _engine(config)
    _train(engine, 2)
    outputs = _outputs(engine)
    checks: dict[str, Any] = {}
    for device in ("cpu", "nvme"):
        snapshot = _Snapshot(engine, [*before, outputs])
        offloaded = engine.offload_states(device=device, nvme_dir=nvme_dir)
        still_held = snapshot.still_held()
        reloaded = engine.reload_states()
        checks[device] = {
            "offload": offloaded,
            "reload": reloaded,
            "still_held": still_held,
            "mismatched": snapshot.mismatched(),
            "same_outputs": _same_bytes(_outputs(engine), outputs),
        }
        del snapshot
    engine.destroy()
    return checks


def parity(config: str, nvme_dir: str, steps: int = 4) -> dict[str, list[float]]:
    """Losses of plain training, and of training that offloads everything between steps, with a generation-like
    phase (weights only, forward without gradients) in between."""
    plain = _train(_engine(config), steps)
    engine = _engine(config)
    offloaded = []
    for step in range(steps):
        offloaded += _train(engine, 1, first=step)
        device = ("cpu", "nvme")[step % 2]
        engine.offload_states(device=device, nvme_dir=nvme_dir)
        engine.reload_states(include=["model_params"])
        _outputs(engine)
        engine.offload_states(include=["model_params"], device=device, nvme_dir=nvme_dir)
        engine.reload_states()
    return {"plain": plain, "offloaded": offloaded}


def cycles(nvme_dir: str, count: int = 50) -> dict[str, Any]:
    """Host memory and open files after cycle 5 and after the last of `count` offload/reload cycles."""
    from roll.platforms.platform import host_rss_bytes

    engine = _engine("zero3", hidden=512, layers=4)
    _train(engine, 1)
    samples = []
    for cycle in range(count):
        report = engine.offload_states(device=("cpu", "nvme")[cycle % 2], nvme_dir=nvme_dir)
        engine.reload_states()
        if cycle in (4, count - 1):
            gc.collect()
            samples.append((host_rss_bytes(), len(os.listdir("/proc/self/fd"))))
    return {"samples": samples, "state_bytes": sum(report.moved_bytes.values()), "files": os.listdir(nvme_dir)}


def disk_rss(nvme_dir: str) -> dict[str, Any]:
    """RSS before and after offloading to disk, and the spill files seen meanwhile."""
    from roll.platforms.platform import host_rss_bytes
    from roll.third_party.deepspeed.storage_mover import trim_host_heap

    engine = _engine("zero1", hidden=1024, layers=4)
    _train(engine, 1)
    outputs = _outputs(engine)
    gc.collect()
    trim_host_heap()
    rss_before = host_rss_bytes()
    report = engine.offload_states(device="nvme", nvme_dir=nvme_dir)
    rss_offloaded = host_rss_bytes()
    named_files, open_spills = os.listdir(nvme_dir), _spill_links(nvme_dir)
    engine.reload_states()
    return {
        "moved": sum(report.moved_bytes.values()),
        "rss_drop": rss_before - rss_offloaded,
        "named_files": named_files,
        "open_spills_offloaded": len(open_spills),
        "open_spills_reloaded": len(_spill_links(nvme_dir)),
        "same_outputs": _same_bytes(_outputs(engine), outputs),
    }


def frozen(config: str, nvme_dir: str) -> dict[str, Any]:
    """A tiny Qwen2 whose embeddings and first layer are frozen (as under LoRA): do the frozen weights move?"""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from roll.third_party.deepspeed.storage_mover import storage_use_count

    torch.manual_seed(0)
    qwen_config = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    model = Qwen2ForCausalLM(qwen_config)
    for module in (model.model.embed_tokens, model.model.layers[0]):
        module.requires_grad_(False)
    engine = _engine(config, model=model)
    _train(engine, 1)
    outputs = _outputs(engine)
    if hasattr(engine.optimizer, "empty_partition_cache"):
        engine.optimizer.empty_partition_cache()
    frozen_tensors = [
        tensor
        for param in engine.module.parameters()
        if not param.requires_grad
        for tensor in (param, getattr(param, "ds_tensor", None))
        if tensor is not None and tensor.untyped_storage().nbytes() > 0
    ]
    storages = list({t.untyped_storage().data_ptr(): t.untyped_storage() for t in frozen_tensors}.values())
    del frozen_tensors
    report = engine.offload_states(include="model_params", device="nvme", nvme_dir=nvme_dir)
    gc.collect()
    held = [s.nbytes() for s in storages if storage_use_count(s) > 1]
    frozen_bytes = sum(s.nbytes() for s in storages)
    del storages
    engine.reload_states()
    return {
        "frozen_bytes": frozen_bytes,
        "held": held,
        "moved": report.moved_bytes,
        "same_outputs": _same_bytes(_outputs(engine), outputs),
    }


def repeats(nvme_dir: str) -> dict[str, Any]:
    """Reload before any offload, a double offload, partial includes to host and disk, double reloads."""
    before = _live_tensors()
    engine = _engine("zero2")
    _train(engine, 1)
    snapshot = _Snapshot(engine, before)
    calls = [
        engine.reload_states(),
        engine.offload_states(include=["optimizer_states"]),
        engine.offload_states(include=["optimizer_states"]),
        engine.offload_states(device="nvme", nvme_dir=nvme_dir),
        engine.reload_states(include="model_params"),
        engine.reload_states(include="model_params"),
        engine.reload_states(),
        engine.reload_states(),
    ]
    return {"calls": calls, "mismatched": snapshot.mismatched(), "losses": _train(engine, 1, first=1)}


def phases(nvme_dir: str) -> dict[str, Any]:
    """A generation phase needing the weights only, then a training phase that raises."""
    from roll.third_party.deepspeed.offload_states_patch import offload_phase

    engine = _engine("zero3")
    _train(engine, 1)
    engine.offload_states()
    with offload_phase(engine, {"model_params"}, device="nvme", nvme_dir=nvme_dir) as generation:
        _outputs(engine)
    try:
        with offload_phase(engine, None, device="nvme", nvme_dir=nvme_dir) as training:
            _train(engine, 1, first=1)
            raise RuntimeError("phase failed")
    except RuntimeError as error:
        raised = str(error)
    return {"generation": generation, "training": training, "raised": raised}


def disk_error(nvme_dir: str) -> dict[str, Any]:
    """A disk that fails once the third state kind starts writing: the two kinds already on disk must come back
    and the engine must come out of the failed offload unchanged."""
    from roll.third_party.deepspeed import spill_file

    before = _live_tensors()
    engine = _engine("zero2")
    _train(engine, 1)
    snapshot = _Snapshot(engine, before)
    fds = len(os.listdir("/proc/self/fd"))
    write_all, files = spill_file._write_all, set()

    def failing_write(fd: int, data: memoryview, offset: int) -> None:
        files.add(fd)
        if len(files) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        write_all(fd, data, offset)

    spill_file._write_all = failing_write
    try:
        engine.offload_states(device="nvme", nvme_dir=nvme_dir)
    except OSError as error:
        raised = error.errno
    finally:
        spill_file._write_all = write_all
    after_error = {
        "raised": raised,
        "mismatched": snapshot.mismatched(),
        "reload_moved": sum(engine.reload_states().moved_bytes.values()),
        "fds": len(os.listdir("/proc/self/fd")) - fds,
    }
    engine.offload_states(device="nvme", nvme_dir=nvme_dir)
    engine.reload_states()
    return {**after_error, "mismatched_retry": snapshot.mismatched(), "files": os.listdir(nvme_dir)}


# ---------------------------------------------------------------------------------------------- tests


@pytest.mark.parametrize("config", list(CONFIGS))
def test_round_trip_frees_every_storage_and_restores_it_bit_for_bit(ranks: Any, config: str, tmp_path: Any) -> None:
    for rank, checks in enumerate(ranks.run("round_trip", config=config, nvme_dir=str(tmp_path))):
        for device, check in checks.items():
            where = f"rank {rank}, {config}, {device}"
            offload, reload = check["offload"], check["reload"]
            assert check["still_held"] == [], f"{where}: storages still referenced after offload"
            assert offload.stale_bytes == 0, where
            assert check["mismatched"] == [], f"{where}: tensors changed by the round trip"
            assert check["same_outputs"], where
            assert offload.moved_bytes["model_params"] > 0, where
            if not CONFIGS[config][1]:
                assert offload.moved_bytes["optimizer_states"] > 0, where
            if config not in STATELESS_OTHER_PARAMS:
                assert offload.moved_bytes["other_params"] > 0, where
            assert set(offload.resident_bytes) == {"host" if device == "cpu" else "nvme"}, where
            assert reload.moved_bytes == offload.moved_bytes, where
            assert set(reload.resident_bytes) == {"cpu"}, where


@pytest.mark.parametrize("config", ["zero0", "zero1", "zero2", "zero3", "zero1_fp32_grads", "zero3_cpu_offload"])
def test_training_with_offload_between_steps_matches_training_without(ranks: Any, config: str, tmp_path: Any) -> None:
    for rank, losses in enumerate(ranks.run("parity", config=config, nvme_dir=str(tmp_path))):
        assert losses["offloaded"] == losses["plain"], f"rank {rank}"
        assert len(set(losses["plain"])) == len(losses["plain"]), "the model should be learning"


def test_fifty_cycles_keep_host_memory_and_open_files_flat(ranks: Any, tmp_path: Any) -> None:
    for result in ranks.run("cycles", nvme_dir=str(tmp_path)):
        (rss_early, fds_early), (rss_late, fds_late) = result["samples"]
        assert result["state_bytes"] > 4 << 20
        assert rss_late - rss_early < result["state_bytes"] / 2, "host memory grew over 45 cycles"
        assert fds_late == fds_early
        assert result["files"] == []


def test_disk_offload_frees_host_memory_and_leaves_no_files(ranks: Any, tmp_path: Any) -> None:
    for result in ranks.run("disk_rss", nvme_dir=str(tmp_path)):
        assert result["moved"] > 16 << 20
        assert result["rss_drop"] >= 0.8 * result["moved"], result
        assert result["named_files"] == [] and result["open_spills_offloaded"] == 3
        assert result["open_spills_reloaded"] == 0
        assert result["same_outputs"]


@pytest.mark.parametrize("config", ["zero2", "zero3"])
def test_frozen_parameters_are_offloaded(ranks: Any, config: str, tmp_path: Any) -> None:
    for result in ranks.run("frozen", config=config, nvme_dir=str(tmp_path)):
        assert result["held"] == []
        assert result["moved"]["model_params"] > result["frozen_bytes"] > 0
        assert result["same_outputs"]


def test_double_offload_and_reload_before_offload_are_harmless(ranks: Any, tmp_path: Any) -> None:
    for result in ranks.run("repeats", nvme_dir=str(tmp_path)):
        moved = [{kind: n for kind, n in call.moved_bytes.items() if n} for call in result["calls"]]
        resident = [call.resident_bytes for call in result["calls"]]
        assert moved[0] == {} and moved[2] == {} and moved[5] == {} and moved[7] == {}
        assert set(moved[1]) == {"optimizer_states"}
        assert set(moved[3]) == {"model_params", "other_params"}
        assert set(moved[4]) == {"model_params"}
        assert set(moved[6]) == {"other_params", "optimizer_states"}
        assert resident[1]["host"] == moved[1]["optimizer_states"] and resident[1]["cpu"] > 0
        assert set(resident[3]) == {"host", "nvme"}
        assert set(resident[7]) == {"cpu"}
        assert result["mismatched"] == []
        assert len(result["losses"]) == 1


def test_offload_phase_reloads_what_the_phase_needs_and_offloads_it_even_on_error(ranks: Any, tmp_path: Any) -> None:
    for result in ranks.run("phases", nvme_dir=str(tmp_path)):
        (enter, leave), (train_enter, train_leave) = result["generation"], result["training"]
        assert enter.action == "reload" and leave.action == "offload"
        assert {kind for kind, n in enter.moved_bytes.items() if n} == {"model_params"}
        assert set(enter.resident_bytes) == {"cpu", "host"}
        assert set(leave.resident_bytes) == {"host", "nvme"}
        assert result["raised"] == "phase failed"
        assert all(train_enter.moved_bytes.values()) and all(train_leave.moved_bytes.values())
        assert set(train_leave.resident_bytes) == {"nvme"}


def test_a_failed_disk_offload_leaves_the_engine_unchanged(ranks: Any, tmp_path: Any) -> None:
    for result in ranks.run("disk_error", nvme_dir=str(tmp_path)):
        assert result["raised"] == errno.ENOSPC
        assert result["mismatched"] == [] and result["reload_moved"] == 0 and result["fds"] == 0
        assert result["mismatched_retry"] == [] and result["files"] == []


# ---------------------------------------------------------------------------------------------- in-process tests


class _FakeEngine:
    """What patching reads from an engine: the module, the optimizer and the ZeRO offload configs."""

    def __init__(self, optimizer: Any = None, offload_device: str | None = None) -> None:
        self.module = torch.nn.Linear(4, 4)
        self.optimizer = optimizer
        self._offload_device = offload_device

    def zero_offload_param(self) -> None:
        return None

    def zero_offload_optimizer(self) -> Any:
        return None if self._offload_device is None else type("Config", (), {"device": self._offload_device})()


def test_unsupported_deepspeed_versions_and_engines_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    import deepspeed

    from roll.third_party.deepspeed.state_fields import UnsupportedDeepSpeedError, check_supported

    monkeypatch.setattr(deepspeed, "__version__", "0.16.3")
    with pytest.raises(UnsupportedDeepSpeedError, match=r"DeepSpeed >= 0\.16\.4, found 0\.16\.3"):
        check_supported(_FakeEngine())
    monkeypatch.setattr(deepspeed, "__version__", "0.16.4")
    check_supported(_FakeEngine())
    renamed = type("DeepSpeedZeroOptimizer", (), {"bit16_groups_flat": [], "optimizer": None})()
    with pytest.raises(UnsupportedDeepSpeedError, match=r"lacks .*parallel_partitioned_bit16_groups"):
        check_supported(_FakeEngine(renamed))
    with pytest.raises(UnsupportedDeepSpeedError, match="MyOptimizer"):
        check_supported(_FakeEngine(type("MyOptimizer", (), {})()))
    with pytest.raises(UnsupportedDeepSpeedError, match="offload_optimizer to nvme"):
        check_supported(_FakeEngine(offload_device="nvme"))


def test_calls_validate_their_arguments_and_patching_twice_is_harmless(tmp_path: Any) -> None:
    from roll.third_party.deepspeed.offload_states_patch import patch_engine

    engine = patch_engine(_FakeEngine())
    offload_states = engine.offload_states
    assert patch_engine(engine).offload_states is offload_states
    with pytest.raises(ValueError, match="valid states: model_params, other_params, optimizer_states"):
        engine.offload_states(include=["lp_params"])
    with pytest.raises(ValueError, match="one of cpu, nvme"):
        engine.offload_states(device="disk")
    with pytest.raises(ValueError, match="needs nvme_dir"):
        engine.offload_states(device="nvme")
    weight = engine.module.weight.detach().clone()
    report = engine.offload_states(include="model_params", device="nvme", nvme_dir=str(tmp_path))
    assert report.moved_bytes == {"model_params": 80} and engine.module.weight.numel() == 0
    assert engine.reload_states().moved_bytes["model_params"] == 80
    assert torch.equal(engine.module.weight, weight)


def test_host_buffer_pool_reuses_buffers_of_the_same_size() -> None:
    from roll.third_party.deepspeed.storage_mover import HostBufferPool

    pool = HostBufferPool(lambda nbytes: torch.empty(nbytes, dtype=torch.uint8))
    first = pool.take(64)
    pool.give(first)
    assert pool.take(32) is not first and pool.take(64) is first
    pool.give(first)
    pool.drop_free()
    assert pool.take(64) is not first


def test_spill_files_have_no_name_and_give_back_what_was_written(tmp_path: Any) -> None:
    from roll.third_party.deepspeed.spill_file import SpillFile

    spill = SpillFile(tmp_path, staging=lambda: pytest.fail("host tensors are written directly"))
    chunks = [torch.randint(0, 256, (n,), dtype=torch.uint8) for n in (1000, 77, 4096)]
    offsets = [spill.write(chunk) for chunk in chunks]
    assert offsets == [0, 1000, 1077] and os.listdir(tmp_path) == []
    for chunk, offset in reversed(list(zip(chunks, offsets, strict=True))):
        restored = torch.empty_like(chunk)
        spill.read_into(offset, restored)
        assert torch.equal(restored, chunk)
    spill.close()
    spill.close()
    with pytest.raises(OSError):
        spill.read_into(0, torch.empty(1, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_storages_round_trip_through_pinned_buffers_and_disk(tmp_path: Any) -> None:
    from roll.third_party.deepspeed.spill_file import SpillFile
    from roll.third_party.deepspeed.storage_mover import DiskParking, HostBufferPool, HostParking, StorageGroup

    flat = torch.randn(1 << 20, device="cuda")
    view = flat[10:20]
    staging = torch.empty(1 << 16, dtype=torch.uint8, pin_memory=True)  # small: many chunks
    pool = HostBufferPool(lambda nbytes: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))
    for parking in (HostParking(pool, non_blocking=True), DiskParking(SpillFile(tmp_path, lambda: staging))):
        expected = flat.clone()
        parked = parking.park_all([StorageGroup(flat.untyped_storage(), [flat, view])])
        torch.cuda.synchronize()
        assert not flat.is_cuda or flat.numel() == 0
        for stored in parked:
            parking.restore(stored)
        torch.cuda.synchronize()
        assert flat.is_cuda and torch.equal(flat, expected)
        assert view.data_ptr() == flat.data_ptr() + 40 and torch.equal(view, expected[10:20])
