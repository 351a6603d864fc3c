"""Tests for ``roll.distributed.scheduler.protocol.DataProto``."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch

from roll.distributed.scheduler.protocol import DataProto


def make_proto(n: int = 4) -> DataProto:
    """A DataProto with two tensors, an object array and meta_info; row i carries value i."""
    return DataProto.from_dict(
        tensors={
            "input_ids": torch.arange(n * 3).reshape(n, 3),
            "rewards": torch.arange(n, dtype=torch.float32),
        },
        non_tensors={"uid": [f"u{i}" for i in range(n)]},
        meta_info={"step": 7},
    )


def assert_proto_equal(a: DataProto, b: DataProto) -> None:
    """Field-by-field equality of two DataProtos (keys, dtypes and values)."""
    assert a.batch.keys() == b.batch.keys()
    for key in a.batch:
        assert a.batch[key].dtype == b.batch[key].dtype, key
        assert torch.equal(a.batch[key], b.batch[key]), key
    assert a.non_tensor_batch.keys() == b.non_tensor_batch.keys()
    for key in a.non_tensor_batch:
        assert a.non_tensor_batch[key].dtype == b.non_tensor_batch[key].dtype, key
        assert np.array_equal(a.non_tensor_batch[key], b.non_tensor_batch[key]), key
    assert a.meta_info == b.meta_info


def test_construction_size_mismatch_names_keys() -> None:
    with pytest.raises(ValueError, match=r"batch sizes differ: input_ids=4, rewards=3, uid=4"):
        DataProto.from_dict(
            tensors={"input_ids": torch.zeros(4, 2), "rewards": torch.zeros(3)},
            non_tensors={"uid": np.arange(4)},
        )


def test_construction_converts_lists_to_object_arrays() -> None:
    data = DataProto.from_dict(non_tensors={"tools": [[1, 2], [3, 4], [5, 6]]})
    tools = data.non_tensor_batch["tools"]
    assert tools.dtype == object and tools.shape == (3,)
    assert tools[1] == [3, 4]
    assert len(data) == 3
    assert len(DataProto()) == 0


def test_construction_rejects_wrong_types() -> None:
    with pytest.raises(TypeError, match="rewards"):
        DataProto.from_dict(tensors={"rewards": np.zeros(3)})  # type: ignore[dict-item]
    with pytest.raises(TypeError, match="scalar"):
        DataProto.from_dict(tensors={"scalar": torch.tensor(1.0)})


def test_getitem_int_keeps_batch_dim() -> None:
    data = make_proto()
    row = data[1]
    assert len(row) == 1
    assert row.batch["input_ids"].tolist() == [[3, 4, 5]]
    assert row.non_tensor_batch["uid"].tolist() == ["u1"]
    assert data[-1].non_tensor_batch["uid"].tolist() == ["u3"]
    with pytest.raises(IndexError):
        data[4]


def test_getitem_slice() -> None:
    data = make_proto()
    assert data[1:3].batch["rewards"].tolist() == [1.0, 2.0]
    assert data[::2].non_tensor_batch["uid"].tolist() == ["u0", "u2"]
    assert data[::-1].batch["rewards"].tolist() == [3.0, 2.0, 1.0, 0.0]


@pytest.mark.parametrize(
    "index",
    [[3, 0], np.array([3, 0]), torch.tensor([3, 0])],
    ids=["list", "ndarray", "tensor"],
)
def test_getitem_index_sequences(index: object) -> None:
    picked = make_proto()[index]
    assert picked.batch["rewards"].tolist() == [3.0, 0.0]
    assert picked.non_tensor_batch["uid"].tolist() == ["u3", "u0"]


@pytest.mark.parametrize(
    "mask",
    [
        [True, False, True, False],
        np.array([True, False, True, False]),
        torch.tensor([True, False, True, False]),
    ],
    ids=["list", "ndarray", "tensor"],
)
def test_getitem_boolean_mask(mask: object) -> None:
    picked = make_proto()[mask]
    assert picked.batch["input_ids"][:, 0].tolist() == [0, 6]
    assert picked.non_tensor_batch["uid"].tolist() == ["u0", "u2"]


def test_getitem_mask_length_mismatch() -> None:
    with pytest.raises(IndexError, match="mask"):
        make_proto()[[True, False]]


def test_meta_info_is_shallow_copied() -> None:
    data = make_proto()
    derived = data[0:2]
    derived.meta_info["step"] = 8
    assert data.meta_info["step"] == 7


def test_select() -> None:
    data = make_proto()
    sub = data.select(batch_keys=["rewards"], non_tensor_keys=[], meta_info_keys=None)
    assert list(sub.batch) == ["rewards"]
    assert sub.non_tensor_batch == {}
    assert sub.meta_info == {"step": 7}
    assert list(data.batch) == ["input_ids", "rewards"]
    with pytest.raises(ValueError, match=r"no batch keys \['nope'\]; available: \['input_ids', 'rewards'\]"):
        data.select(batch_keys=["nope"])


def test_pop_removes_from_self() -> None:
    data = make_proto()
    popped = data.pop(batch_keys=["rewards"], non_tensor_keys=["uid"], meta_info_keys=["step"])
    assert list(popped.batch) == ["rewards"] and list(popped.non_tensor_batch) == ["uid"]
    assert popped.meta_info == {"step": 7}
    assert list(data.batch) == ["input_ids"]
    assert data.non_tensor_batch == {} and data.meta_info == {}
    with pytest.raises(ValueError, match="rewards"):
        data.pop(batch_keys=["rewards"])
    assert list(data.batch) == ["input_ids"]


def test_union_merges_and_checks_conflicts() -> None:
    data = make_proto()
    extra = DataProto.from_dict(
        tensors={"rewards": data.batch["rewards"].clone(), "values": torch.ones(4)},
        meta_info={"step": 7, "temperature": 1.0},
    )
    merged = data.union(extra)
    assert list(merged.batch) == ["input_ids", "rewards", "values"]
    assert merged.meta_info == {"step": 7, "temperature": 1.0}
    assert "values" not in data.batch

    conflict = DataProto.from_dict(tensors={"rewards": torch.zeros(4)})
    with pytest.raises(ValueError, match="'rewards'"):
        data.union(conflict)
    with pytest.raises(ValueError, match="'step'"):
        data.union(DataProto(meta_info={"step": 8}))
    with pytest.raises(ValueError, match="sizes differ"):
        data.union(DataProto.from_dict(tensors={"values": torch.ones(3)}))


def test_rename() -> None:
    data = make_proto()
    renamed = data.rename(["rewards", "uid"], ["scores", "request_id"])
    assert list(renamed.batch) == ["input_ids", "scores"]
    assert list(renamed.non_tensor_batch) == ["request_id"]
    assert torch.equal(renamed.batch["scores"], data.batch["rewards"])
    with pytest.raises(ValueError, match="missing"):
        data.rename("missing", "x")
    with pytest.raises(ValueError, match="merge"):
        data.rename("rewards", "input_ids")


def test_chunk_split_concat_round_trip() -> None:
    data = make_proto(6)
    chunks = data.chunk(3)
    assert [len(c) for c in chunks] == [2, 2, 2]
    assert_proto_equal(DataProto.concat(chunks), data)
    pieces = data.split(4)
    assert [len(p) for p in pieces] == [4, 2]
    assert_proto_equal(DataProto.concat(pieces), data)
    with pytest.raises(ValueError, match="pad_to_divisor"):
        data.chunk(4)


def test_concat_key_mismatch() -> None:
    a = make_proto(2)
    b = make_proto(2).rename("rewards", "scores")
    with pytest.raises(ValueError, match=r"only in part 0 \['rewards'\], only in part 1 \['scores'\]"):
        DataProto.concat([a, b])


def test_repeat() -> None:
    data = DataProto.from_dict(tensors={"x": torch.tensor([10, 20])}, non_tensors={"p": ["a", "b"]})
    inter = data.repeat(3)
    assert inter.batch["x"].tolist() == [10, 10, 10, 20, 20, 20]
    assert inter.non_tensor_batch["p"].tolist() == ["a", "a", "a", "b", "b", "b"]
    tiled = data.repeat(2, interleave=False)
    assert tiled.batch["x"].tolist() == [10, 20, 10, 20]
    assert tiled.non_tensor_batch["p"].tolist() == ["a", "b", "a", "b"]


def test_pad_to_divisor_unpad_round_trip() -> None:
    data = make_proto(3)
    padded, pad_size = data.pad_to_divisor(8)
    assert pad_size == 5 and len(padded) == 8
    assert padded.non_tensor_batch["uid"].tolist() == ["u0", "u1", "u2", "u0", "u1", "u2", "u0", "u1"]
    assert len(padded.chunk(4)) == 4
    assert_proto_equal(padded.unpad(pad_size), data)
    same, no_pad = data.pad_to_divisor(3)
    assert no_pad == 0
    assert_proto_equal(same, data)


def test_to_device() -> None:
    moved = make_proto().to("cpu")
    assert all(t.device.type == "cpu" for t in moved.batch.values())
    assert_proto_equal(moved, make_proto())


def make_mixed_proto() -> DataProto:
    """Four rows covering bf16, fp32, int64, a non-contiguous tensor, object and str arrays."""
    return DataProto.from_dict(
        tensors={
            "bf16": torch.linspace(-2, 2, 4 * 64).reshape(4, 64).to(torch.bfloat16),
            "fp32": torch.randn(4, 128),
            "int64": torch.arange(4 * 32).reshape(4, 32),
            "transposed": torch.arange(4 * 16, dtype=torch.float32).reshape(16, 4).T,
        },
        non_tensors={
            "obj": [{"turn": 0}, [1, 2], None, "text"],
            "strs": np.array(["a", "bb", "ccc", "dddd"]),
        },
        meta_info={"global_step": 3},
    )


def test_pickle_protocol5_out_of_band() -> None:
    data = make_mixed_proto()
    assert not data.batch["transposed"].is_contiguous()
    buffers: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(data, protocol=5, buffer_callback=buffers.append)
    restored = pickle.loads(payload, buffers=buffers)

    assert_proto_equal(restored, data)
    assert restored.non_tensor_batch["obj"][0] == {"turn": 0}
    tensor_bytes = sum(t.numel() * t.element_size() for t in data.batch.values())
    assert sum(b.raw().nbytes for b in buffers) >= tensor_bytes
    assert len(payload) < tensor_bytes  # the payload did not travel in-band
