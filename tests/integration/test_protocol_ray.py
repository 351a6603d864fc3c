"""DataProto through Ray's object store (needs the embedded Ray)."""

from __future__ import annotations

import ray
import torch

from tests.unit.test_protocol import assert_proto_equal, make_mixed_proto


def test_ray_put_get_round_trip(ray_session: None) -> None:
    data = make_mixed_proto()
    restored = ray.get(ray.put(data))
    assert_proto_equal(restored, data)
    restored.batch["fp32"].add_(1.0)  # tensors coming out of the object store must be writable
    assert torch.equal(restored.batch["fp32"], data.batch["fp32"] + 1.0)
