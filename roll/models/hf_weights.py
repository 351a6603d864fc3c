"""A model's full weights by Hugging Face name, with LoRA adapters merged into their base layers.

This is what an exported directory holds and what inference engines load: the names and shapes of
the plain base model, whether or not training used PEFT adapters.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from roll.configs.schema import closest_spelling
from roll.utils.grouping import iter_groups

# gather(params) must make the full values of `params` readable inside the context (ZeRO-3
# partitions them).
Gather = Callable[[list[torch.nn.Parameter]], contextlib.AbstractContextManager]
# Parameters are gathered in groups of about this many bytes: one collective per group, not per tensor.
GATHER_GROUP_BYTES = 64 * 2**20


def _full_bytes(param: torch.nn.Parameter) -> int:
    return getattr(param, "ds_numel", param.numel()) * param.element_size()


def is_peft_model(model: torch.nn.Module) -> bool:
    """Whether `model` is a PEFT model, without importing peft where none was made."""
    # peft costs a worker ~0.3 s of CPU to import; a model can only be a PeftModel once peft is loaded.
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(model, peft.PeftModel)


def hf_named_weights(model: torch.nn.Module, gather: Gather | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(name, tensor)` for every weight of the plain model, on the parameters' device.

    Without `gather` (parameters whole) the tensors are the parameters' own data, valid until the
    model next changes; with it they are copies made while their group was gathered. For a PEFT
    model the adapter weights are folded into their base layers (`W + scaling * B @ A`, the delta
    transposed for layers with LoRA's `fan_in_fan_out`, which store `[in, out]` weights),
    full-trained heads (`modules_to_save`) replace the originals, and the PEFT name prefixes are
    removed.
    """
    if not is_peft_model(model):
        named = list(model.named_parameters())
        if gather is None:
            for name, param in named:
                yield name, param.data.detach()
            return
        for group in iter_groups(named, GATHER_GROUP_BYTES, lambda item: _full_bytes(item[1])):
            with gather([param for _, param in group]):
                for name, param in group:
                    yield name, param.data.detach().clone()
        return
    from peft.tuners.lora import LoraLayer

    gather = gather or (lambda params: contextlib.nullcontext())
    base = model.get_base_model()
    adapter = model.active_adapter
    for name, param in base.named_parameters():
        if ".lora_" in name or ".original_module." in name:
            continue
        if ".modules_to_save." in name:
            with gather([param]):
                yield name.replace(f".modules_to_save.{adapter}", ""), param.data.detach().clone()
            continue
        owner_name, _, leaf = name.rpartition(".base_layer.")
        owner = base.get_submodule(owner_name) if owner_name else None
        if isinstance(owner, LoraLayer) and leaf == "weight" and adapter in owner.lora_A:
            lora_a, lora_b = owner.lora_A[adapter].weight, owner.lora_B[adapter].weight
            with gather([param, lora_a, lora_b]):
                delta = (lora_b.data.float() @ lora_a.data.float()) * owner.scaling[adapter]
                if getattr(owner, "fan_in_fan_out", False):
                    # Conv1D-style layers (GPT-2) store their weight as [in, out]; B @ A is [out, in].
                    delta = delta.T
                yield f"{owner_name}.weight", (param.data.float() + delta).to(param.dtype)
            continue
        with gather([param]):
            yield name.replace(".base_layer", ""), param.data.detach().clone()


def hf_weight_shapes(model_path: str) -> tuple[dict[str, tuple[int, ...]], frozenset[str]]:
    """Shapes of every Hugging Face weight name of a causal LM (tied aliases included), and the names a full sync sends.

    Built on the meta device from the config alone, so it costs no memory whatever the model size.
    """
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    return shapes, frozenset(name for name, _ in model.named_parameters())


def check_weight_shapes(
    named_shapes: Iterable[tuple[str, Sequence[int]]], shapes: dict[str, tuple[int, ...]], owner: str
) -> None:
    """Raise KeyError for a name the model lacks, ValueError for a wrong shape; both name the weight."""
    for name, shape in named_shapes:
        if name not in shapes:
            raise KeyError(f"{owner}: the model has no weight {name!r}{closest_spelling(name, shapes)}")
        if tuple(shape) != tuple(shapes[name]):
            expected = tuple(shapes[name])
            raise ValueError(f"{owner}: weight {name!r} has shape {tuple(shape)} but the model's is {expected}")
