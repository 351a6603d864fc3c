"""The distributed runtime: `scheduler` (DataProto, dispatch, placement, Ray start), `weight_sync` (transports),
`strategy` (backends) and `executor` (clusters and workers).
"""
