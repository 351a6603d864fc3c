"""Weight transports between training and inference roles.

The routing plan, buckets, a broadcast group, the colocated hand-over.

May import: `roll.distributed.scheduler`, `roll.configs`, `roll.platforms`, `roll.utils`.
"""
