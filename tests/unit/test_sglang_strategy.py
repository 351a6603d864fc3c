"""sglang strategy: the adapter against a fake `sglang.Engine` (SGLang has no CPU build), and a real-engine test.

The fake has the public names and signatures of `sglang.Engine` (python/sglang/srt/entrypoints/engine.py)
and its results' shape (`output_ids`, `meta_info.output_token_logprobs` as `(logprob, token_id, text)`, and
from `logprob_start_len` on `input_token_logprobs` and `input_top_logprobs`, None at position 0, as SGLang's
docs and tokenizer manager give them);
it generates with a transformers model, and like SGLang it loads weights by name without rejecting
unknown ones, so the name and shape checks under test are the adapter's own.
"""

from __future__ import annotations

import datetime
import sys
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM

from roll.configs.schema import ConfigError
from roll.configs.worker_config import GeneratingArguments, ModelArguments, StrategyArguments, WorkerConfig
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.strategy.hf_compute import generate_in_micro_batches, position_ids_from_mask
from roll.distributed.strategy.sglang_strategy import SglangStrategy
from roll.distributed.strategy.strategy import Generation
from roll.distributed.weight_sync.broadcast import (
    BroadcastGroup,
    SyncHeaders,
    host_store,
    open_store,
    receive_weights,
    send_weights,
)
from roll.distributed.weight_sync.buckets import iter_buckets
from roll.models.model_providers import load_model, load_tokenizer
from roll.models.tiny import make_tiny_model
from roll.platforms import get_platform
from roll.utils.functionals import length_mask
from tests.unit.test_weight_sync import run_all

GREEDY = GeneratingArguments(max_new_tokens=10, do_sample=False)
# ServerArgs fields the adapter may pass (checked against SGLang's server_args.py).
SERVER_ARGS = {
    "model_path",
    "dtype",
    "random_seed",
    "tp_size",
    "mem_fraction_static",
    "context_length",
    "enable_memory_saver",
    "enable_weights_cpu_backup",
}


class FakeEngine:
    """`sglang.Engine` as roll uses it, generating with a transformers model."""

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(kwargs.keys() - SERVER_ARGS)
        if unknown:
            raise TypeError(f"ServerArgs.__init__() got an unexpected keyword argument {unknown[0]!r}")
        self.kwargs = kwargs
        dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[kwargs["dtype"]]
        self.model = AutoModelForCausalLM.from_pretrained(kwargs["model_path"], dtype=dtype).eval()
        self.eos_token_id = self.model.generation_config.eos_token_id
        self.calls: list[tuple[str, Any]] = []
        self.released = False
        self.session = False
        self.groups: dict[str, torch.distributed.ProcessGroup] = {}

    def generate(
        self,
        prompt: list[str] | str | None = None,
        sampling_params: list[dict] | dict | None = None,
        input_ids: list[list[int]] | list[int] | None = None,
        image_data: Any = None,
        return_logprob: list[bool] | bool | None = False,
        logprob_start_len: list[int] | int | None = None,
        top_logprobs_num: list[int] | int | None = None,
        stream: bool = False,
    ) -> list[dict]:
        if self.released:
            raise RuntimeError("generate while memory is released")
        self.calls.append(("generate", {"input_ids": input_ids, "sampling_params": sampling_params}))
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(input_ids)
        results = [self._one(ids, p, bool(return_logprob)) for ids, p in zip(input_ids, params, strict=True)]
        if return_logprob and logprob_start_len is not None:
            starts = logprob_start_len if isinstance(logprob_start_len, list) else [logprob_start_len] * len(input_ids)
            for ids, start, result in zip(input_ids, starts, results, strict=True):
                result["meta_info"].update(self._input_log_probs(ids, start, top_logprobs_num or 0))
        return results

    @torch.no_grad()
    def _input_log_probs(self, ids: list[int], start: int, top: int) -> dict:
        """SGLang's input log-probs of tokens start... (entry i: token start + i given the tokens before it)."""
        log_probs = torch.log_softmax(self.model(torch.tensor([ids])).logits[0].float(), -1)
        tokens, tops = [], []
        for position in range(start, len(ids)):
            if position == 0:
                tokens.append((None, ids[0], None))
                tops.append(None)
                continue
            row = log_probs[position - 1]
            values, indices = row.topk(top)
            tokens.append((float(row[ids[position]]), ids[position], None))
            tops.append([(float(v), int(i), None) for v, i in zip(values, indices, strict=True)])
        return {"input_token_logprobs": tokens, "input_top_logprobs": tops}

    @torch.no_grad()
    def _one(self, ids: list[int], params: dict, return_logprob: bool) -> dict:
        generator = torch.Generator().manual_seed(params.get("sampling_seed", 0))
        tokens: list[int] = []
        entries = []
        for _ in range(params["max_new_tokens"]):
            logits = self.model(torch.tensor([ids + tokens])).logits[0, -1].float()
            log_probs = torch.log_softmax(logits, -1)
            if params["temperature"] == 0:
                token = int(logits.argmax())
            else:
                token = int(
                    torch.multinomial(torch.softmax(logits / params["temperature"], -1), 1, generator=generator)
                )
            tokens.append(token)
            entries.append((float(log_probs[token]), token, None))
            if token == self.eos_token_id:
                break
        meta = {"finish_reason": {"type": "stop" if tokens[-1] == self.eos_token_id else "length"}}
        if return_logprob:
            meta["output_token_logprobs"] = entries
        return {"text": "", "output_ids": tokens, "meta_info": meta}

    def begin_weight_update(self, selector: str = "all") -> dict:
        self.calls.append(("begin_weight_update", selector))
        if self.session:
            return {"success": False, "message": "a weight-update session is already open"}
        self.session = True
        return {"success": True, "message": "Success"}

    def end_weight_update(self) -> dict:
        self.calls.append(("end_weight_update", None))
        if not self.session:
            return {"success": False, "message": "no weight-update session is open"}
        self.session = False
        return {"success": True, "message": "Success"}

    def flush_cache(self) -> None:
        self.calls.append(("flush_cache", None))

    def _load(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name in params:
                    params[name].copy_(tensor)

    def update_weights_from_tensor(
        self, named_tensors: list[tuple[str, torch.Tensor]], load_format: str | None = None, flush_cache: bool = True
    ) -> tuple[bool, str]:
        self.calls.append(("update_weights_from_tensor", named_tensors))
        if not self.session:
            return False, "update_weights_from_tensor must run between begin_weight_update() and end_weight_update()"
        self._load(named_tensors)
        return True, "Succeeded to update parameter online."

    def init_weights_update_group(
        self,
        master_address: str,
        master_port: int,
        rank_offset: int,
        world_size: int,
        group_name: str,
        backend: str = "nccl",
    ) -> tuple[bool, str]:
        """What SGLang's TP rank 0 does (srt/utils/common.py init_custom_process_group)."""
        from torch.distributed.distributed_c10d import Backend, _new_process_group_helper, _world, rendezvous

        self.calls.append(("init_weights_update_group", rank_offset))
        timeout = datetime.timedelta(seconds=60)
        url = f"tcp://{master_address}:{master_port}"
        store, rank, size = next(rendezvous(url, rank_offset, world_size, timeout=timeout))
        store = torch.distributed.PrefixStore(group_name, store)
        group, _ = _new_process_group_helper(
            size, rank, [], Backend(backend), store, group_name=group_name, backend_options=None, timeout=timeout
        )
        _world.pg_group_ranks[group] = {i: i for i in range(size)}
        self.groups[group_name] = group
        return True, "Succeeded to initialize custom process group."

    def update_weights_from_distributed(
        self,
        names: list[str],
        dtypes: list[str],
        shapes: list[list[int]],
        group_name: str = "weight_update_group",
        flush_cache: bool = True,
        load_format: str | None = None,
    ) -> tuple[bool, str]:
        """What SGLang's receiver does: one broadcast from rank 0 per tensor, in `names` order."""
        self.calls.append(("update_weights_from_distributed", names))
        if not self.session:
            return (
                False,
                "update_weights_from_distributed must run between begin_weight_update() and end_weight_update()",
            )
        tensors = [torch.empty(shape, dtype=getattr(torch, dtype)) for dtype, shape in zip(dtypes, shapes, strict=True)]
        for tensor in tensors:
            torch.distributed.broadcast(tensor, src=0, group=self.groups[group_name])
        self._load(list(zip(names, tensors, strict=True)))
        return True, "Succeeded to update parameter online."

    def release_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.calls.append(("release_memory_occupation", tags))
        self.released = True

    def resume_memory_occupation(self, tags: list[str] | None = None) -> None:
        self.calls.append(("resume_memory_occupation", tags))
        self.released = False

    def shutdown(self) -> None:
        self.calls.append(("shutdown", None))


def role_config(model_path: str, strategy_config: dict | None = None, dtype: str = "fp32") -> WorkerConfig:
    """A resolved one-worker sglang role."""
    config = WorkerConfig(
        worker_cls="roll.distributed.executor.worker.Worker",
        world_size=1,
        model_args=ModelArguments(model_name_or_path=model_path, dtype=dtype),
        strategy_args=StrategyArguments(strategy_name="sglang", strategy_config=strategy_config or {}),
    )
    config.resolve("actor_infer", 0)
    return config


def start(config: WorkerConfig, platform: str = "cpu") -> SglangStrategy:
    """An initialised SglangStrategy for a stand-in worker (rank 0 on `platform`)."""
    strategy = SglangStrategy(SimpleNamespace(worker_config=config, rank=0, platform=get_platform(platform)))
    strategy.initialize(lambda: None)
    return strategy


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[str, torch.Tensor]]:
    model = AutoModelForCausalLM.from_pretrained(make_tiny_model(tmp_path_factory.mktemp("seed1"), seed=1))
    return [(name, p.detach().clone()) for name, p in model.named_parameters()]


@pytest.fixture(scope="module")
def batch(model_path: str) -> DataProto:
    encoded = load_tokenizer(model_path)([f"{a}*{b}=" for a in range(3) for b in range(4)], padding=True)
    return DataProto.from_dict(tensors={k: torch.tensor(encoded[k]) for k in ("input_ids", "attention_mask")})


@pytest.fixture
def fake_sglang(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sglang", SimpleNamespace(Engine=FakeEngine))


def hf_reference(model_path: str, batch: DataProto, weights: list | None = None) -> Generation:
    """What hf_infer generates greedily for `batch`, optionally after loading `weights`."""
    model = load_model(ModelArguments(model_name_or_path=model_path, dtype="fp32")).eval()
    if weights:
        model.load_state_dict(dict(weights))
    return generate_in_micro_batches(model, batch, GREEDY, len(batch), "cpu")


def same_generation(a: Generation, b: Generation) -> bool:
    """The same ids, lengths and stop reasons."""
    pairs = [(a.output_ids, b.output_ids), (a.response_lengths, b.response_lengths), (a.truncated, b.truncated)]
    return all(torch.equal(x, y) for x, y in pairs)


def test_config_errors_name_the_key(model_path: str) -> None:
    with pytest.raises(ConfigError, match=r"mem_fraction\b.*did you mean 'mem_fraction_static'"):
        SglangStrategy.parse_config(role_config(model_path, {"mem_fraction": 0.5}))
    with pytest.raises(ConfigError, match=r"engine_kwargs sets \['tp_size'\]"):
        SglangStrategy.parse_config(role_config(model_path, {"engine_kwargs": {"tp_size": 2}}))


def test_missing_sglang_fails_with_the_reason(monkeypatch: pytest.MonkeyPatch, model_path: str) -> None:
    monkeypatch.setitem(sys.modules, "sglang", None)
    with pytest.raises(ImportError, match="GPU builds only"):
        start(role_config(model_path))


def test_engine_arguments_and_greedy_output_in_hf_infer_layout(
    fake_sglang: None, model_path: str, batch: DataProto
) -> None:
    strategy = start(role_config(model_path, {"sleep_level": 2}, dtype="bf16"))
    engine = strategy.engine
    assert engine.kwargs["dtype"] == "bfloat16" and engine.kwargs["enable_weights_cpu_backup"] is False
    engine.model.float()  # compare tokens with the fp32 hf_infer reference
    assert same_generation(strategy.generate(batch, GREEDY), hf_reference(model_path, batch))
    _, request = engine.calls[-1]
    mask = batch.batch["attention_mask"].bool()
    assert request["input_ids"] == [row[m].tolist() for row, m in zip(batch.batch["input_ids"], mask, strict=True)]
    assert request["sampling_params"] == {"max_new_tokens": 10, "n": 1, "stop": None, "temperature": 0.0}


def test_samples_are_prompt_major_seeded_per_row_with_log_probs(
    fake_sglang: None, model_path: str, batch: DataProto
) -> None:
    strategy = start(role_config(model_path))
    args = GeneratingArguments(max_new_tokens=10, num_return_sequences=3, temperature=0.9, seed=11, stop_strings=["="])
    generation = strategy.generate_with_log_probs(batch, args)
    output, log_probs = generation.output_ids, generation.log_probs
    _, request = strategy.engine.calls[-1]
    prompts = request["input_ids"]
    assert len(prompts) == 3 * len(batch) and prompts[0] == prompts[1] == prompts[2] != prompts[3]
    assert [p["sampling_seed"] for p in request["sampling_params"]] == list(range(11, 11 + 3 * len(batch)))
    assert request["sampling_params"][0]["stop"] == ["="] and request["sampling_params"][0]["top_k"] == -1
    prompt_length = batch.batch["input_ids"].shape[1]
    assert output.shape == (3 * len(batch), prompt_length + 10) and log_probs.shape == (3 * len(batch), 10)
    assert torch.equal(output[:, :prompt_length], batch.batch["input_ids"].repeat_interleave(3, dim=0))
    pad = load_tokenizer(model_path).pad_token_id
    replay = strategy.engine.generate(
        input_ids=prompts, sampling_params=request["sampling_params"], return_logprob=True
    )
    for row, result in enumerate(replay):
        ids, length = result["output_ids"], len(result["output_ids"])
        assert generation.response_lengths[row] == length
        assert generation.truncated[row] == (result["meta_info"]["finish_reason"]["type"] == "length")
        assert output[row, prompt_length : prompt_length + length].tolist() == ids
        assert (output[row, prompt_length + length :] == pad).all() and (log_probs[row, length:] == 0).all()
        expected = torch.tensor([entry[0] for entry in result["meta_info"]["output_token_logprobs"]])
        assert torch.allclose(log_probs[row, :length], expected)
    assert generation.truncated.any() and not generation.truncated.all()  # samples ended both ways


def test_scores_of_given_responses_come_from_input_log_probs_like_hf_infer(
    fake_sglang: None, model_path: str, batch: DataProto
) -> None:
    # UNTESTED on a real SGLang engine: this checks the adapter against SGLang's documented input log-probs.
    strategy = start(role_config(model_path))
    rows = len(batch)
    response_mask = length_mask(torch.arange(rows) % 4 + 1, 4)
    responses = torch.randint(1, 60, (rows, 4), generator=torch.Generator().manual_seed(0)) * response_mask
    input_ids = torch.cat([batch.batch["input_ids"], responses], dim=1)
    attention_mask = torch.cat([batch.batch["attention_mask"], response_mask], dim=1)
    scored = DataProto.from_dict(
        tensors={"input_ids": input_ids, "attention_mask": attention_mask, "responses": responses}
    )
    log_probs = strategy.response_log_probs(scored)
    indices, top = strategy.response_top_k(scored, 3)
    _, request = strategy.engine.calls[-1]
    assert request["sampling_params"] == {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0, "top_k": -1}
    model = load_model(ModelArguments(model_name_or_path=model_path, dtype="fp32")).eval()
    with torch.no_grad():
        logits = model(input_ids, attention_mask=attention_mask, position_ids=position_ids_from_mask(attention_mask))
    hf = torch.log_softmax(logits.logits[:, -5:-1].float(), -1)  # the positions predicting the 4 response columns
    mask = response_mask.bool()
    hf_log_probs = hf.gather(-1, responses[..., None])[..., 0]
    assert torch.allclose(log_probs[mask], hf_log_probs[mask], atol=1e-4) and (log_probs[~mask] == 0).all()
    hf_top, hf_indices = hf.topk(3)
    assert torch.equal(indices[mask], hf_indices[mask]) and torch.allclose(top[mask], hf_top[mask], atol=1e-4)


def test_load_weights_checks_then_updates_the_engine(
    fake_sglang: None, model_path: str, batch: DataProto, new_weights: list
) -> None:
    strategy = start(role_config(model_path, dtype="bf16"))
    engine = strategy.engine
    with pytest.raises(KeyError, match=r"'model\.norm\.weigth' \(did you mean 'model\.norm\.weight'"):
        strategy.load_weights([("model.norm.weigth", torch.ones(128))])
    with pytest.raises(ValueError, match=r"'lm_head\.weight' has shape \(3, 128\)"):
        strategy.load_weights([("lm_head.weight", torch.ones(3, 128))])
    assert not [call for call, _ in engine.calls if call == "update_weights_from_tensor"]
    strategy.load_weights(new_weights[:7])
    with pytest.raises(RuntimeError, match="lacks"):
        strategy.generate(batch, GREEDY)  # half a sync is never served
    strategy.load_weights(new_weights[7:])
    calls = [call for call, _ in engine.calls]
    assert calls[-5:] == [
        "begin_weight_update",
        "update_weights_from_tensor",
        "update_weights_from_tensor",
        "end_weight_update",
        "flush_cache",
    ]
    _, sent = engine.calls[-3]
    assert {t.dtype for _, t in sent} == {torch.bfloat16}  # cast to the engine's dtype before serialising
    engine.model.float().load_state_dict(dict(new_weights))  # same values, fp32 for the token comparison
    assert same_generation(strategy.generate(batch, GREEDY), hf_reference(model_path, batch, new_weights))


def test_offload_releases_and_a_level_2_wake_waits_for_a_full_sync(
    fake_sglang: None, model_path: str, batch: DataProto, new_weights: list
) -> None:
    strategy = start(role_config(model_path, {"sleep_level": 2}))
    assert set(strategy.offload_states()) == {"engine"}
    with pytest.raises(RuntimeError, match="asleep"):
        strategy.generate(batch, GREEDY)
    strategy.load_states()
    assert [call for call, _ in strategy.engine.calls] == ["release_memory_occupation", "resume_memory_occupation"]
    strategy.load_weights(new_weights[:3])
    with pytest.raises(RuntimeError, match=r"lacks .* level-2 sleep"):
        strategy.generate(batch, GREEDY)
    strategy.load_weights(new_weights[3:])
    assert strategy.generate(batch, GREEDY).output_ids.shape == (len(batch), batch.batch["input_ids"].shape[1] + 10)
    strategy.shutdown()


@pytest.mark.gpu
def test_real_engine_generates_like_hf_infer_and_takes_new_weights(
    model_path: str, batch: DataProto, new_weights: list
) -> None:
    pytest.importorskip("sglang", reason="SGLang has no CPU build; this test needs a CUDA machine with sglang")
    if not torch.cuda.is_available():
        pytest.skip("SGLang needs a CUDA device")
    strategy = start(role_config(model_path, {"mem_fraction_static": 0.3}), platform="cuda")
    try:
        assert same_generation(strategy.generate(batch, GREEDY), hf_reference(model_path, batch))
        strategy.offload_states()
        strategy.load_states()
        strategy.load_weights(new_weights)
        generation = strategy.generate_with_log_probs(batch, GREEDY)
        assert same_generation(generation, hf_reference(model_path, batch, new_weights))
        log_probs = generation.log_probs
        assert log_probs.dtype == torch.float32 and (log_probs <= 0).all()
    finally:
        strategy.shutdown()


def test_weights_arrive_over_the_broadcast_group_as_sglang_receives_them(
    fake_sglang: None, model_path: str, batch: DataProto, new_weights: list
) -> None:
    """roll's group source against SGLang's own group construction and per-tensor receive order."""
    strategy = start(role_config(model_path))
    store = host_store(timeout_s=60)  # the source hosts the store first, as a training worker does
    port = store.port
    group, _ = run_all(  # the group forms only when both members are joining
        lambda: BroadcastGroup("", port, 0, 2, "gloo", torch.device("cpu"), timeout_s=60, store=store),
        lambda: strategy.join_weight_broadcast("127.0.0.1", port, (1,), 2, "gloo"),
    )
    receiver_headers = SyncHeaders(open_store("127.0.0.1", port, is_master=False, timeout_s=60))
    sent, loaded = run_all(
        lambda: send_weights(SyncHeaders(group.store), group, iter_buckets(new_weights, 2**16), [1]),
        lambda: receive_weights(receiver_headers, 1, strategy.check_weights, strategy.receive_weight_bucket),
    )
    assert loaded == sent == sum(t.numel() * t.element_size() for _, t in new_weights)
    calls = [call for call, _ in strategy.engine.calls]
    assert calls[0] == "init_weights_update_group" and calls[1] == "begin_weight_update"
    assert calls[-2:] == ["end_weight_update", "flush_cache"] and "update_weights_from_distributed" in calls
    assert same_generation(strategy.generate(batch, GREEDY), hf_reference(model_path, batch, new_weights))
