"""Forward passes and generation on a Hugging Face model, shared by the HF, DeepSpeed and FSDP2 backends."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from transformers import GenerationConfig, PreTrainedTokenizerBase, StoppingCriteria, StoppingCriteriaList
from transformers.generation.stopping_criteria import StopStringCriteria

from roll.configs.worker_config import GeneratingArguments, WorkerConfig
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.micro_batches import (
    SINGLE_RANK,
    DataParallel,
    MicroBatch,
    TokenBudget,
    plan_micro_batches,
    plan_step_micro_batches,
    restore_rows,
    token_budget,
)
from roll.distributed.strategy.strategy import ForwardFunc, Generation
from roll.models.model_providers import load_tokenizer
from roll.models.vision_inputs import has_images, image_token_id, model_image_kwargs, vision_token_ids
from roll.utils.functionals import length_mask
from roll.utils.sequence_packing import pack_rows, unpack_rows


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


def images_of(model: Any, batch: DataProto, input_ids: torch.Tensor, device: torch.device | str) -> dict[str, Any]:
    """The forward keyword arguments of `batch`'s images for `model` (`roll.models.vision_inputs`); {} for a batch
    without images."""
    if not has_images(batch):
        return {}
    token_id = image_token_id(model)
    if token_id is None:
        raise ValueError("the batch holds images but the model is not a vision-language model (no image_token_id)")
    return model_image_kwargs(batch, input_ids, token_id, device)


def micro_batch_output(model: torch.nn.Module, micro_batch: MicroBatch, device: torch.device | str) -> Any:
    """`model`'s output on a micro-batch; a packed one runs as one row and its logits come back per row.

    A packed row has no attention mask and no KV cache (either turns the detection off): its position ids
    restart at every sequence, from which transformers keeps attention inside each sequence (sdpa, eager).
    Flash-attention also gets the sequences' boundaries as varlen arguments (untested: no GPU ran it).
    """
    inputs = model_inputs(micro_batch.data, device)
    images = images_of(model, micro_batch.data, inputs["input_ids"], device)
    if images and micro_batch.packed:
        raise ValueError("rows with images cannot be packed; set sequence_packing=false for a vision-language model")
    if not micro_batch.packed:
        if images:
            inputs.pop("position_ids")  # the model computes its multimodal rotary positions from mask and grids
        return model(**inputs, **images, use_cache=False)
    packing = pack_rows(inputs["input_ids"], inputs["attention_mask"], inputs["position_ids"])
    varlen = packing.flash_attention_kwargs() if micro_batch.flash_varlen else {}
    output = model(input_ids=packing.input_ids, position_ids=packing.position_ids, use_cache=False, **varlen)
    output.logits = unpack_rows(output.logits, packing)
    return output


def optimizer_step_losses(
    model: torch.nn.Module,
    step_batch: DataProto,
    loss_func: ForwardFunc,
    micro_batch_size: int,
    device: torch.device | str,
    budget: TokenBudget | None = None,
    agree_count: Callable[[int], int] = int,
    before_forward: Callable[[bool], None] | None = None,
    data_parallel: DataParallel = SINGLE_RANK,
) -> Iterator[tuple[torch.Tensor, dict[str, torch.Tensor], bool]]:
    """Forward each micro-batch of one optimizer step; yield (its loss / the step's micro-batch count, metrics, last).

    The caller back-propagates each yielded loss before asking for the next, so their sum is this rank's
    part of the step's loss; `data_parallel` are the ranks whose gradients the engine then averages (see
    `plan_step_micro_batches`). `before_forward(last)` runs before each forward (DeepSpeed marks its
    accumulation boundary).
    """
    micro_batches = plan_step_micro_batches(step_batch, micro_batch_size, budget, agree_count, data_parallel)
    for index, micro_batch in enumerate(micro_batches):
        last = index == len(micro_batches) - 1
        if before_forward is not None:
            before_forward(last)
        loss, metrics = loss_func(micro_batch.data, micro_batch_output(model, micro_batch, device))
        yield loss / len(micro_batches), metrics, last


@torch.no_grad()
def forward_in_micro_batches(
    model: torch.nn.Module,
    batch: DataProto,
    forward_func: ForwardFunc,
    micro_batch_size: int,
    device: torch.device | str,
    budget: TokenBudget | None = None,
    agree_count: Callable[[int], int] = int,
) -> dict[str, torch.Tensor]:
    """Run `model` in eval mode (no dropout) then `forward_func` on micro-batches of `batch`; concatenate the metrics.

    Micro-batches are `micro_batch_size` rows, or formed by `budget` (see `plan_micro_batches`); the
    metrics come back in the batch's row order either way. Eval mode is set on every call: a training
    strategy leaves its model in train mode after an update.
    """
    model.eval()
    micro_batches = plan_micro_batches(batch, micro_batch_size, budget, agree_count)
    outputs = []
    for micro_batch in micro_batches:
        _, metrics = forward_func(micro_batch.data, micro_batch_output(model, micro_batch, device))
        outputs.append({key: value.detach().cpu() for key, value in metrics.items()})
    return restore_rows(micro_batches, outputs, batch)


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


def generation_special_ids(config: GenerationConfig) -> tuple[int, list[int]]:
    """The pad id generation pads with and the EOS ids it stops at, from a model's generation config.

    The EOS id may be a list (Llama-3-Instruct ends on either of two); without a pad id, samples are padded
    with the first EOS, as `model.generate` does.
    """
    eos = config.eos_token_id
    eos_ids = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    pad = config.pad_token_id if config.pad_token_id is not None else next(iter(eos_ids), None)
    if pad is None:
        raise ValueError("the model's generation config has neither a pad_token_id nor an eos_token_id to pad with")
    return pad, eos_ids


class SampleEnds(StoppingCriteria):
    """A stopping criterion that records where each row of one `model.generate` call ended.

    A row ends on a token of `eos_ids` or when its text ends with a stop string: the verdict `model.generate`
    itself reaches on EOS (this criterion returns the same one, so stopping is unchanged), and the one that
    ends a sample on its stop strings (which are therefore not passed to `model.generate`).
    """

    def __init__(
        self, rows: int, prompt_width: int, eos_ids: list[int], stop_strings: StopStringCriteria | None
    ) -> None:
        self.prompt_width = prompt_width
        self.eos_ids = torch.tensor(eos_ids, dtype=torch.long)
        self.stop_strings = stop_strings
        self.ended_at = torch.zeros(rows, dtype=torch.long)  # tokens generated when each row ended; 0 while it runs

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        done = torch.isin(input_ids[:, -1], self.eos_ids.to(input_ids.device))
        if self.stop_strings is not None:
            done |= self.stop_strings(input_ids, scores)
        ended_at = self.ended_at.to(input_ids.device)
        self.ended_at = ended_at.masked_fill(done & (ended_at == 0), input_ids.shape[1] - self.prompt_width)
        return done

    def lengths(self, generated: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's sampled tokens and whether it was cut (never ended) within the call's `generated` steps."""
        truncated = self.ended_at.cpu() == 0
        return self.ended_at.cpu().masked_fill(truncated, generated), truncated


@torch.no_grad()
def generate_in_micro_batches(
    model: torch.nn.Module,
    batch: DataProto,
    args: GeneratingArguments,
    micro_batch_size: int,
    device: torch.device | str,
    synced_ranks: bool = False,
    model_path: str = "",
) -> Generation:
    """Prompts followed by up to `max_new_tokens` generated tokens padded to that full width, with each sample's
    length and stop reason (eval mode).

    `synced_ranks` keeps ZeRO-3 ranks stepping together until every rank has finished (each
    forward gathers parameters from all ranks), so ranks whose sequences end early do not hang
    the others. Every rank must then get the same number of micro-batches. `stop_strings` end a
    sample after the first stop string (kept, as vLLM keeps it); matching them needs the tokenizer
    of `model_path`.
    """
    model.eval()
    pad_id, eos_ids = generation_special_ids(model.generation_config)
    kwargs = generation_kwargs(args, pad_id, eos_ids)
    vision_tokens = vision_token_ids(model)
    if vision_tokens:  # placed by the processor only: a sampled one would be an image token without an image
        kwargs["suppress_tokens"] = vision_tokens
    stop_strings = None
    if args.stop_strings:
        if not model_path:
            raise ValueError("generation with stop_strings needs the model path, whose tokenizer matches them")
        stop_strings = StopStringCriteria(cached_tokenizer(model_path), list(args.stop_strings))
    if args.seed is not None:
        torch.manual_seed(args.seed)
    outputs, lengths, truncated = [], [], []
    for micro_batch in batch.split(micro_batch_size):
        call_kwargs = kwargs
        if has_images(micro_batch) and args.num_return_sequences > 1:
            # generate repeats every tensor by rows, but the images are one tensor of patches: the rows are
            # repeated here instead, each with its own images.
            micro_batch = micro_batch.repeat(args.num_return_sequences, interleave=True)
            call_kwargs = {**kwargs, "num_return_sequences": 1}
        inputs = model_inputs(micro_batch, device)
        inputs.pop("position_ids")  # generate derives positions from the mask at every step
        images = images_of(model, micro_batch, inputs["input_ids"], device)
        prompt_width = inputs["input_ids"].shape[1]
        rows = len(micro_batch) * call_kwargs["num_return_sequences"]
        ends = SampleEnds(rows, prompt_width, eos_ids, stop_strings)
        output = model.generate(
            **inputs,
            **images,
            **call_kwargs,
            stopping_criteria=StoppingCriteriaList([ends]),
            synced_gpus=synced_ranks,
            use_cache=True,
        )
        outputs.append(F.pad(output, (0, prompt_width + args.max_new_tokens - output.shape[1]), value=pad_id).cpu())
        micro_lengths, micro_truncated = ends.lengths(output.shape[1] - prompt_width)
        lengths.append(micro_lengths)
        truncated.append(micro_truncated)
    output_ids, response_lengths = torch.cat(outputs), torch.cat(lengths)
    # model.generate pads the rows that ended only when the config has an EOS; every strategy pads after the length.
    responses = output_ids[:, batch.batch["input_ids"].shape[1] :]
    responses.masked_fill_(length_mask(response_lengths, args.max_new_tokens) == 0, pad_id)
    return Generation(output_ids, response_lengths, torch.cat(truncated))


class ShardedModelCompute:
    """`forward_step` and `generate` of a backend whose ranks hold one model between them (ZeRO-3, AutoTP, FSDP2): they
    run forward passes together, so they agree on a micro-batch count, and generation keeps them stepping until the
    last finishes. The backend sets `device` and names the module forward passes go through (`forward_module`) and
    the Hugging Face model that generates (`unwrapped_model`)."""

    worker: Any
    worker_config: WorkerConfig
    device: torch.device
    weights_gathered_collectively: bool

    @property
    def forward_module(self) -> torch.nn.Module:
        """The module a forward pass calls (the Hugging Face model, or an engine wrapping it)."""
        return self.unwrapped_model

    @property
    def unwrapped_model(self) -> torch.nn.Module:
        """The Hugging Face model."""
        raise NotImplementedError

    def forward_step(self, batch: DataProto, forward_func: ForwardFunc) -> dict[str, torch.Tensor]:
        """Metrics of `forward_func` over micro-batches of `infer_batch_size` rows or of the token budget, no grad."""
        return forward_in_micro_batches(
            self.forward_module,
            batch,
            forward_func,
            self.worker_config.infer_batch_size,
            self.device,
            token_budget(self.worker_config),
            self._agree_count,
        )

    def _agree_count(self, count: int) -> int:
        """The largest of every rank's micro-batch count (a rank's forward pass waits for the others' gathers)."""
        if self.worker.world_size == 1:
            return count
        largest = torch.tensor([count], dtype=torch.int64, device=self.device)  # NCCL reduces device tensors only
        torch.distributed.all_reduce(largest, op=torch.distributed.ReduceOp.MAX)
        return int(largest.item())

    def generate(self, batch: DataProto, generating_args: GeneratingArguments) -> Generation:
        """Continuations of the prompts with their lengths and stop reasons; when the ranks gather weights
        collectively they step together until the last finishes (tensor-parallel peers get the same prompts and
        seed, so they sample the same tokens)."""
        return generate_in_micro_batches(
            self.unwrapped_model,
            batch,
            generating_args,
            self.worker_config.infer_batch_size,
            self.device,
            synced_ranks=self.weights_gathered_collectively and self.worker.world_size > 1,
            model_path=self.worker_config.model_args.model_name_or_path,
        )
