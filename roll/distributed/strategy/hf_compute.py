"""Forward passes and generation on a Hugging Face model, shared by the HF and DeepSpeed backends."""

from __future__ import annotations

import functools
from collections import defaultdict

import torch
import torch.nn.functional as F
from transformers import PreTrainedTokenizerBase

from roll.configs.worker_config import GeneratingArguments
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.strategy import ForwardFunc
from roll.models.model_providers import load_tokenizer


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only attended tokens, so left padding does not shift them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def model_inputs(batch: DataProto, device: torch.device | str) -> dict[str, torch.Tensor]:
    """`input_ids`, `attention_mask` and `position_ids` of a batch, on `device`."""
    input_ids = batch.batch["input_ids"].to(device)
    attention_mask = batch.batch["attention_mask"].to(device)
    position_ids = batch.batch.get("position_ids")
    position_ids = position_ids_from_mask(attention_mask) if position_ids is None else position_ids.to(device)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids}


@torch.no_grad()
def forward_in_micro_batches(
    model: torch.nn.Module,
    batch: DataProto,
    forward_func: ForwardFunc,
    micro_batch_size: int,
    device: torch.device | str,
) -> dict[str, torch.Tensor]:
    """Run `model` in eval mode (no dropout) then `forward_func` on micro-batches of `batch`; concatenate the metrics.

    Eval mode is set on every call: a training strategy leaves its model in train mode after an update.
    """
    model.eval()
    collected: dict[str, list[torch.Tensor]] = defaultdict(list)
    for micro_batch in batch.split(micro_batch_size):
        output = model(**model_inputs(micro_batch, device), use_cache=False)
        _, metrics = forward_func(micro_batch, output)
        for key, value in metrics.items():
            collected[key].append(value.detach().cpu())
    return {key: torch.cat(values) for key, values in collected.items()}


def generation_kwargs(args: GeneratingArguments, pad_token_id: int, eos_token_id: int | list[int]) -> dict:
    """`model.generate` keyword arguments for `args`."""
    kwargs: dict = {
        "max_new_tokens": args.max_new_tokens,
        "do_sample": args.do_sample,
        "num_return_sequences": args.num_return_sequences,
        "pad_token_id": pad_token_id,
        "eos_token_id": eos_token_id,
    }
    if args.do_sample:
        kwargs.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k if args.top_k > 0 else None)
    return kwargs


@functools.cache
def cached_tokenizer(model_path: str) -> PreTrainedTokenizerBase:
    """The tokenizer of `model_path`, loaded once per process."""
    return load_tokenizer(model_path)


@torch.no_grad()
def generate_in_micro_batches(
    model: torch.nn.Module,
    batch: DataProto,
    args: GeneratingArguments,
    micro_batch_size: int,
    device: torch.device | str,
    synced_ranks: bool = False,
    model_path: str = "",
) -> torch.Tensor:
    """Prompts followed by up to `max_new_tokens` generated tokens, padded to that full width (eval mode).

    `synced_ranks` keeps ZeRO-3 ranks stepping together until every rank has finished (each
    forward gathers parameters from all ranks), so ranks whose sequences end early do not hang
    the others. Every rank must then get the same number of micro-batches. `stop_strings` end a
    sample after the first stop string (kept, as vLLM keeps it); matching them needs the tokenizer
    of `model_path`.
    """
    model.eval()
    config = model.generation_config
    pad_id = config.pad_token_id if config.pad_token_id is not None else config.eos_token_id
    kwargs = generation_kwargs(args, pad_id, config.eos_token_id)
    if args.stop_strings:
        if not model_path:
            raise ValueError("generation with stop_strings needs the model path, whose tokenizer matches them")
        kwargs.update(stop_strings=list(args.stop_strings), tokenizer=cached_tokenizer(model_path))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    outputs = []
    for micro_batch in batch.split(micro_batch_size):
        inputs = model_inputs(micro_batch, device)
        inputs.pop("position_ids")  # generate derives positions from the mask at every step
        output = model.generate(**inputs, **kwargs, synced_gpus=synced_ranks, use_cache=True)
        width = inputs["input_ids"].shape[1] + args.max_new_tokens
        outputs.append(F.pad(output, (0, width - output.shape[1]), value=pad_id).cpu())
    return torch.cat(outputs)
