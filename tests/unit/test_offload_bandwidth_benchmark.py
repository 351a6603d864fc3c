"""The offload benchmark's ZeRO-Infinity mode without an engine: its ZeRO block and its disk counters."""

from __future__ import annotations

import os
from pathlib import Path

from benchmarks.offload_bandwidth import HIDDEN, build_parser, disk_io, infinity_zero_block


def test_both_devices_get_the_same_block_with_swap_buffers_of_one_layer(tmp_path: Path) -> None:
    assert build_parser().parse_args(["--zero-infinity"]).zero_infinity
    cpu, nvme = infinity_zero_block("cpu", str(tmp_path)), infinity_zero_block("nvme", str(tmp_path))
    assert cpu["offload_param"] == {"device": "cpu"} and cpu["offload_optimizer"] == {"device": "cpu"}
    assert {k: v for k, v in nvme.items() if not k.startswith("offload_")} == {
        k: v for k, v in cpu.items() if not k.startswith("offload_")
    }
    # DeepSpeed's defaults would pin 5 x 1e8 parameter elements: the buffers hold one layer, the largest partition.
    assert nvme["offload_param"]["buffer_size"] == nvme["sub_group_size"] == HIDDEN * HIDDEN
    assert nvme["offload_param"]["nvme_path"] == nvme["offload_optimizer"]["nvme_path"] == str(tmp_path)


def test_disk_io_counts_bytes_written_to_storage(tmp_path: Path) -> None:
    _, written = disk_io()
    with open(tmp_path / "file", "wb") as file:
        file.write(os.urandom(1 << 20))
        file.flush()
        os.fsync(file.fileno())
    assert disk_io()[1] - written >= 1 << 20
