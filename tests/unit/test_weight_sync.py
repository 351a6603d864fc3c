"""Weight sync: the routing plan, bucket packing, and the broadcast protocol between real gloo members."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator

import pytest
import torch

from roll.distributed.weight_sync.broadcast import (
    BroadcastGroup,
    SyncAborted,
    SyncHeaders,
    host_store,
    open_store,
    receive_weights,
    send_weights,
)
from roll.distributed.weight_sync.buckets import TensorSpec, iter_buckets, pack_flat, spec_of, unpack_flat
from roll.distributed.weight_sync.colocated import open_bucket, share_bucket
from roll.distributed.weight_sync.plan import devices_per_worker, plan_weight_sync
from roll.models.hf_weights import check_weight_shapes

# ---- the plan -----------------------------------------------------------------------------------


def test_colocated_workers_take_the_rank_on_their_first_device() -> None:
    plan = plan_weight_sync([[0], [1], [2], [3]], [[0], [1], [2], [3]])
    assert plan.colocated == {0: (0,), 1: (1,), 2: (2,), 3: (3,)}
    assert plan.broadcast_ranks == {} and plan.broadcast_world_size == 0


def test_tensor_parallel_workers_on_shared_devices_read_from_the_rank_on_their_first_device() -> None:
    # 4 training ranks, 2 inference workers with TP=2 on the same 4 devices.
    plan = plan_weight_sync([[0], [1], [2], [3]], devices_per_worker([0, 1, 2, 3], 2), infer_tp_size=2)
    assert plan.colocated == {0: (0,), 2: (1,)}
    assert plan.broadcast_world_size == 0


def test_separate_tensor_parallel_workers_get_one_group_rank_per_shard() -> None:
    plan = plan_weight_sync([[0], [1]], devices_per_worker([2, 3, 4, 5, 6, 7], 2), infer_tp_size=2)
    assert plan.colocated == {}
    assert plan.broadcast_ranks == {0: (1, 2), 1: (3, 4), 2: (5, 6)}
    assert plan.broadcast_world_size == 7


def test_auto_mixes_routes_and_every_worker_has_exactly_one() -> None:
    # Training ranks own two devices each; workers 0 and 1 sit on them, workers 2 and 3 elsewhere.
    plan = plan_weight_sync([[0, 1], [2, 3]], [[1], [2], [4], [5]])
    assert plan.colocated == {0: (0,), 1: (1,)}
    assert plan.broadcast_ranks == {2: (1,), 3: (2,)} and plan.broadcast_world_size == 3
    routed = [w for workers in plan.colocated.values() for w in workers] + list(plan.broadcast_ranks)
    assert sorted(routed) == [0, 1, 2, 3]


def test_forced_methods() -> None:
    assert plan_weight_sync([[0]], [[0], [1]], method="broadcast").broadcast_ranks == {0: (1,), 1: (2,)}
    with pytest.raises(ValueError, match=r"inference worker 1 \(devices \[1\]\) shares no device"):
        plan_weight_sync([[0]], [[0], [1]], method="colocated")
    with pytest.raises(ValueError, match="not one of"):
        plan_weight_sync([[0]], [[0]], method="ipc")  # type: ignore[arg-type]
    # Workers without devices (no device_mapping) can only be reached by broadcast.
    assert plan_weight_sync([[]], [[], []]).broadcast_ranks == {0: (1,), 1: (2,)}


# ---- buckets ------------------------------------------------------------------------------------


def mixed_weights() -> list[tuple[str, torch.Tensor]]:
    """Weights of several dtypes and odd sizes, so packing must align every start."""
    generator = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(3, 5, generator=generator)),
        ("b.weight", torch.randn(7, generator=generator).to(torch.bfloat16)),
        ("c.bias", torch.randn(1, generator=generator).to(torch.float16)),
        ("d.index", torch.arange(5, dtype=torch.int64)),
        ("e.weight", torch.randn(2, 2, 2, generator=generator, dtype=torch.float64)),
    ]


def test_buckets_reach_their_size_and_keep_order() -> None:
    weights = mixed_weights()
    buckets = list(iter_buckets(weights, bucket_bytes=64))
    assert [name for bucket in buckets for name, _ in bucket] == [name for name, _ in weights]
    # a (60 B) needs b (14 B) to pass 64 B; c, d and e (2 + 40 + 64 B) are the rest.
    assert [len(bucket) for bucket in buckets] == [2, 3]
    with pytest.raises(ValueError, match="must be positive"):
        next(iter_buckets(weights, 0))


def test_flat_packing_round_trips_every_dtype_bit_for_bit() -> None:
    weights = mixed_weights()
    flat, specs = pack_flat(weights)
    assert flat.dtype == torch.uint8 and flat.numel() % 64 == 0
    assert specs == [spec_of(name, tensor) for name, tensor in weights]
    assert [TensorSpec.from_json(spec.to_json()) for spec in specs] == specs
    for (name, tensor), (unpacked_name, view) in zip(weights, unpack_flat(flat, specs), strict=True):
        assert unpacked_name == name and view.dtype == tensor.dtype and torch.equal(view, tensor)
        assert view.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()  # views, no copies


def test_shared_bucket_survives_pickling_as_the_object_store_does() -> None:
    import pickle

    weights = mixed_weights()
    shared, _ = share_bucket(weights)
    received = pickle.loads(pickle.dumps(shared, protocol=5))
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(weights, open_bucket(received), strict=True))


def test_shape_check_names_the_weight() -> None:
    shapes = {"lm_head.weight": (4, 2)}
    with pytest.raises(KeyError, match=r"'lm_heed\.weight' \(did you mean 'lm_head\.weight'"):
        check_weight_shapes([("lm_heed.weight", (4, 2))], shapes, "actor_infer")
    with pytest.raises(ValueError, match=r"'lm_head\.weight' has shape \(2, 4\) but the model's is \(4, 2\)"):
        check_weight_shapes([("lm_head.weight", (2, 4))], shapes, "actor_infer")


# ---- the broadcast protocol between real gloo members (threads of this process) ---------------


class Receiver:
    """One inference worker's side: headers through the store, tensors through its own group member."""

    def __init__(self, port: int, rank: int, world_size: int, shapes: dict[str, tuple[int, ...]]) -> None:
        self.rank, self.shapes = rank, shapes
        self.headers = SyncHeaders(open_store("127.0.0.1", port, is_master=False, timeout_s=60))
        self.group = BroadcastGroup("127.0.0.1", port, rank, world_size, "gloo", torch.device("cpu"), timeout_s=60)
        self.loaded: dict[str, torch.Tensor] = {}

    def check(self, specs: list[TensorSpec]) -> None:
        check_weight_shapes(((s.name, s.shape) for s in specs), self.shapes, f"worker@{self.rank}")

    def take(self, specs: list[TensorSpec]) -> int:
        bucket = self.group.receive_bucket(specs)
        self.loaded.update(bucket)
        return sum(spec.nbytes for spec in specs)


def run_all(*calls: Callable[[], object]) -> list[object]:
    """Run the calls in threads at once (as the members of a group must); return results or exceptions."""
    results: list[object] = [None] * len(calls)

    def run(index: int) -> None:
        try:
            results[index] = calls[index]()
        except Exception as exc:  # collected for the test to inspect
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(calls))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not any(thread.is_alive() for thread in threads), "a group member hung"
    return results


@pytest.fixture
def group() -> tuple[BroadcastGroup, SyncHeaders, list[Receiver]]:
    """A source and two receivers in a 3-member gloo group, over the store the source hosts as a worker does."""
    store = host_store(timeout_s=60)
    port = store.port
    shapes = {name: tuple(t.shape) for name, t in mixed_weights()}
    members = run_all(
        lambda: BroadcastGroup("", port, 0, 3, "gloo", torch.device("cpu"), timeout_s=60, store=store),
        lambda: Receiver(port, 1, 3, shapes),
        lambda: Receiver(port, 2, 3, shapes),
    )
    source = members[0]
    return source, SyncHeaders(source.store), members[1:]


def test_the_source_store_holds_its_port_from_the_moment_it_is_hosted() -> None:
    """No other process can bind the port between the source choosing it and the group forming."""
    store = host_store(timeout_s=5)
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("", store.port))


def test_a_broadcast_sync_delivers_every_weight_bit_for_bit_twice_in_a_row(group) -> None:
    source, headers, receivers = group
    weights = mixed_weights()
    for round_ in range(2):  # the second sync runs on the same group, after the first's keys are dropped
        sent = [(name, tensor + round_ if tensor.is_floating_point() else tensor) for name, tensor in weights]
        results = run_all(
            lambda sent=sent: send_weights(headers, source, iter_buckets(sent, 64), [1, 2]),
            *[lambda r=r: receive_weights(r.headers, r.rank, r.check, r.take) for r in receivers],
        )
        total = sum(t.numel() * t.element_size() for _, t in sent)
        assert results == [total, total, total]
        for receiver in receivers:
            assert all(torch.equal(receiver.loaded[name], tensor) for name, tensor in sent)


def test_a_rejected_bucket_aborts_the_sync_on_every_member_naming_the_weight(group) -> None:
    source, headers, receivers = group
    receivers[1].shapes = {**receivers[1].shapes, "d.index": (6,)}  # worker 2 expects another shape
    results = run_all(
        lambda: send_weights(headers, source, iter_buckets(mixed_weights(), 64), [1, 2]),
        *[lambda r=r: receive_weights(r.headers, r.rank, r.check, r.take) for r in receivers],
    )
    for result in results:
        assert isinstance(result, SyncAborted)
        assert "weight 'd.index' has shape (5,) but the model's is (6,)" in str(result)
    # Nothing of the rejected bucket moved (bucket 0 had, which is why a mismatch means a broken config).
    assert "d.index" not in receivers[0].loaded and "a.weight" in receivers[0].loaded
    # The group is still usable: the next sync goes through.
    receivers[1].shapes["d.index"] = (5,)
    results = run_all(
        lambda: send_weights(headers, source, iter_buckets(mixed_weights(), 64), [1, 2]),
        *[lambda r=r: receive_weights(r.headers, r.rank, r.check, r.take) for r in receivers],
    )
    assert not any(isinstance(result, Exception) for result in results)


def test_a_source_failing_between_buckets_ends_every_receiver_with_its_error(group) -> None:
    source, headers, receivers = group

    def failing_buckets() -> Iterator[list[tuple[str, torch.Tensor]]]:
        buckets = iter_buckets(mixed_weights(), 64)
        yield next(buckets)
        raise RuntimeError("gather of bucket 1 failed")

    results = run_all(
        lambda: send_weights(headers, source, failing_buckets(), [1, 2]),
        *[lambda r=r: receive_weights(r.headers, r.rank, r.check, r.take) for r in receivers],
    )
    assert isinstance(results[0], RuntimeError) and "gather of bucket 1 failed" in str(results[0])
    for result in results[1:]:
        assert isinstance(result, SyncAborted)
        assert "aborted at bucket 1" in str(result) and "gather of bucket 1 failed" in str(result)
    results = run_all(  # the next sync goes through on the same group
        lambda: send_weights(headers, source, iter_buckets(mixed_weights(), 64), [1, 2]),
        *[lambda r=r: receive_weights(r.headers, r.rank, r.check, r.take) for r in receivers],
    )
    assert not any(isinstance(result, Exception) for result in results)


def test_an_hf_infer_role_keeps_shared_tensors_of_its_dtype_and_copies_the_others() -> None:
    from types import SimpleNamespace

    from roll.configs.worker_config import ModelArguments, StrategyArguments, WorkerConfig
    from roll.distributed.strategy.hf_strategy import HfInferStrategy
    from roll.platforms import get_platform

    config = WorkerConfig(model_args=ModelArguments(), strategy_args=StrategyArguments(strategy_name="hf_infer"))
    strategy = HfInferStrategy(SimpleNamespace(worker_config=config, local_rank=0, platform=get_platform("cpu")))
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2)).eval()
    model.config = SimpleNamespace()  # where hf_infer turns the KV cache on
    strategy.initialize(lambda: model)
    live = [("0.weight", torch.randn(2, 3)), ("0.bias", torch.randn(2)), ("1.weight", torch.randn(2, 2).double())]
    strategy.load_weights(live, share=True)
    assert model[0].weight.data_ptr() == live[0][1].data_ptr() and model[0].bias.data_ptr() == live[1][1].data_ptr()
    assert model[1].weight.dtype == torch.float32 and torch.equal(model[1].weight, live[2][1].float())
    copied = [("1.bias", torch.randn(2))]
    strategy.load_weights(copied)
    assert model[1].bias.data_ptr() != copied[0][1].data_ptr() and torch.equal(model[1].bias, copied[0][1])
    with pytest.raises(ValueError, match=r"0\.weight"):
        strategy.load_weights([("0.weight", torch.randn(3, 3))], share=True)
