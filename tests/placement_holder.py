"""A driver that holds every CPU of one node of a running Ray cluster ($RAY_ADDRESS) until it is killed.

`python -m tests.placement_holder <resource> <cpus>` reserves `cpus` CPUs together with custom resource
`resource` (so on the node that has it), prints "holding" and sleeps. It imports only Ray: the tests that wait for
"holding" do not wait for torch or roll to load.
"""

from __future__ import annotations

import os
import sys
import time


def hold(resource: str, cpus: float) -> None:
    """Reserve `cpus` CPUs of the node with custom resource `resource` and keep them until killed."""
    import ray
    from ray.util.placement_group import placement_group

    ray.init(address=os.environ["RAY_ADDRESS"])
    group = placement_group([{"CPU": cpus, resource: 1.0}])
    ray.get(group.ready(), timeout=60)
    print("holding", flush=True)
    time.sleep(600)


if __name__ == "__main__":
    hold(sys.argv[1], float(sys.argv[2]))
