"""Rank 0 holds its process group's rendezvous port from the moment it names it: no other process can take it."""

from __future__ import annotations

import socket

import pytest

from roll.configs.worker_config import WorkerConfig
from roll.distributed.executor.worker import Worker


def worker(monkeypatch: pytest.MonkeyPatch, rank: int) -> Worker:
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", str(rank))
    config = WorkerConfig()
    config.name = "actor_train"
    return Worker(config)


def test_the_named_port_is_held_and_the_other_ranks_reach_its_store(monkeypatch: pytest.MonkeyPatch) -> None:
    host = worker(monkeypatch, 0)
    address, port = host.open_rendezvous()
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as other, pytest.raises(OSError):
        other.bind(("", port))  # what a second run on the node asking for a port could otherwise have been given
    guest = worker(monkeypatch, 1)  # MASTER_ADDR/PORT are in its environment, as the Cluster starts it
    monkeypatch.setenv("MASTER_ADDR", address)
    monkeypatch.setenv("MASTER_PORT", str(port))
    guest.rendezvous_store().set("hello", "from rank 1")
    assert host.rendezvous_store().get("hello") == b"from rank 1"
