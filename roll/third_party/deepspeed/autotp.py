"""Full values of parameters DeepSpeed AutoTP has sharded over a tensor-parallel group (and ZeRO-3 partitioned).

AutoTP replaces each linear layer it shards with a layer of its own (`LinearLayer` for column-parallel,
`LinearAllreduce` for row-parallel, `fused_LinearLayer` and `SubParamLinearLayer` for fused projections
such as QKV) and gives each sharded parameter two bound methods of that layer: `gather_params(params)` sets
`.data` of the tensors it is given to the concatenated shards (an all-gather over the tensor-parallel group)
and `_tp_partition(params)` splits them again. A layer tells its bias from its weight by identity
(`param is self.bias`), so it must be handed its own parameters: the gather here runs on the real
parameters, as DeepSpeed's `GatherReplacedLayerParams` does. Unlike it, the exit does not re-split the
gathered values: each parameter gets back the very shard tensor it held (under ZeRO 1-2 a view of the
optimizer's flat buffer), so training goes on exactly where it was.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch


def tensor_parallel_layer(param: torch.nn.Parameter) -> torch.nn.Module | None:
    """The AutoTP layer that holds `param` as a shard, or None when the parameter is whole on every rank."""
    gather = getattr(param, "gather_params", None)
    return getattr(gather, "__self__", None)


@contextlib.contextmanager
def gathered_parameters(params: Sequence[torch.nn.Parameter], zero3: bool) -> Iterator[None]:
    """Inside the context every parameter of `params` holds its full value; every rank of the model must enter.

    At ZeRO-3 the parameters are first gathered over the data-parallel ranks, together with the other
    parameters of their AutoTP layers (a layer gathers its weight and bias in one call). Outside the
    context each parameter holds exactly the tensor it held before.
    """
    layers = list({id(layer): layer for p in params if (layer := tensor_parallel_layer(p)) is not None}.values())
    layer_params = [q for layer in layers for q in layer.parameters(recurse=False)]
    zero_params = list({id(p): p for p in [*params, *layer_params]}.values())
    import deepspeed

    with deepspeed.zero.GatheredParameters(zero_params, enabled=zero3):
        shards: list[tuple[torch.nn.Parameter, torch.Tensor]] = []
        try:
            for layer in layers:
                own = list(layer.parameters(recurse=False))  # weight first, then bias, as DeepSpeed passes them
                shards.extend((param, param.data) for param in own)
                with torch.no_grad():
                    layer.gather_params(own)
            yield
        finally:
            for param, shard in shards:
                param.data = shard
