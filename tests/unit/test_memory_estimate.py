"""The per-rank memory estimate: parameter counts against built models, ZeRO formulas, LoRA, KV cache, activations."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from roll.configs.worker_config import ModelArguments, StrategyArguments, TrainingArguments, WorkerConfig
from roll.distributed.strategy.cpu_kv_cache import cpu_kv_cache_bytes
from roll.pipeline.base.dry_run.activations import (
    activation_bytes,
    kv_cache_bytes,
    layer_activation_bytes,
    logits_bytes,
)
from roll.pipeline.base.dry_run.backend_ranks import ENGINE_DEFAULTS
from roll.pipeline.base.dry_run.model_shape import ModelShape, lora_params, model_shape, tiny_shape
from roll.pipeline.base.dry_run.model_states import GiB, MemoryItem, optimizer_step_bytes, zero_model_states
from roll.pipeline.base.dry_run.rank_estimate import STRATEGY_KINDS, estimate_rank
from tests.conftest import CONFIG_DIR, REPO_ROOT

# TinyModelSpec(): qwen2, hidden 128, 2 layers, 4 heads of 32, 2 KV heads, MLP 256, 88 tokens, untied.
TINY = "tiny://qwen2"
# One layer: q 128·128+128, k and v 128·64+64 each, o 128·128, MLP 3·128·256, two norms of 128.
TINY_LAYER = 16_512 + 2 * 8_256 + 16_384 + 98_304 + 256
TINY_PARAMS = 2 * TINY_LAYER + 88 * 128 + 128 + 88 * 128  # layers, embeddings, final norm, lm_head

# Qwen2.5-0.5B's config.json sizes (tied embeddings): the model card's 0.49B parameters.
QWEN25_05B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_hidden_layers": 24,
    "num_key_value_heads": 2,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32_768,
}

# Per-rank bytes of mixed-precision Adam in the ZeRO paper, for Ψ parameters and N ranks.
PAPER: dict[int, Callable[[int, int], float]] = {
    0: lambda psi, n: 16 * psi,
    1: lambda psi, n: 4 * psi + 12 * psi / n,
    2: lambda psi, n: 2 * psi + 14 * psi / n,
    3: lambda psi, n: 16 * psi / n,
}


def build_and_count(tmp_path: Path, reference: str, kind: str = "causal_lm", **model_args: Any) -> tuple[int, int]:
    """(all, trainable) parameters of the model roll loads for `reference`."""
    from roll.models.model_providers import load_model
    from roll.models.tiny import resolve_model_path

    path = resolve_model_path(reference, cache_dir=str(tmp_path))
    model = load_model(ModelArguments(model_name_or_path=path, **{"dtype": "bf16", **model_args}), kind)
    params = list(model.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def test_tiny_param_count_by_hand() -> None:
    assert TINY_PARAMS == 318_592
    assert tiny_shape(TINY).layer_params() == TINY_LAYER
    assert tiny_shape(TINY).param_count() == TINY_PARAMS


@pytest.mark.parametrize("kind", ["causal_lm", "value", "reward"])
@pytest.mark.parametrize("reference", [TINY, "tiny://llama?tie_word_embeddings=true&hidden_size=64&num_layers=3"])
def test_param_count_equals_the_built_model(tmp_path: Path, reference: str, kind: str) -> None:
    total, _ = build_and_count(tmp_path, reference, kind)
    assert tiny_shape(reference).param_count(kind) == total


def test_tiny_shape_reads_what_resolve_model_path_builds(tmp_path: Path) -> None:
    from roll.models.tiny import resolve_model_path

    for reference in (
        "tiny://qwen2?hidden_size=64&num_layers=1&num_heads=2&num_kv_heads=1&intermediate_size=96&seed=3",
        "tiny://llama?tie_word_embeddings=true&max_position_embeddings=2048",
        "tiny://qwen2?hidden_size=64&num_layers=1&num_heads=2&num_kv_heads=1&vocab_size=1000",
        "tiny://",
    ):
        built = model_shape(resolve_model_path(reference, cache_dir=str(tmp_path)))
        assert tiny_shape(reference) == model_shape(reference) == built
    assert model_shape("tiny://qwen2?vocab_size=1000").vocab_size == 1000
    assert model_shape("tiny://qwen2?vocab_size=1000").stored_dtype == "fp32"
    for bad in ("tiny://qwen2?hiden_size=64", "tiny://gpt2", "tiny://qwen2?vocab_size=5"):
        with pytest.raises(ValueError):
            resolve_model_path(bad, cache_dir=str(tmp_path))
        with pytest.raises(ValueError):
            tiny_shape(bad)


def transformers_configs() -> list[Any]:
    from transformers import LlamaConfig, MistralConfig, Qwen2Config, Qwen3Config

    small = {
        "vocab_size": 100,
        "hidden_size": 64,
        "intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
    }
    return [
        Qwen2Config(**small),
        Qwen2Config(**small, tie_word_embeddings=True),
        LlamaConfig(**small, attention_bias=True, mlp_bias=True),
        LlamaConfig(**{**small, "num_key_value_heads": 4}, head_dim=32),
        Qwen3Config(**small, head_dim=24),
        MistralConfig(**small),
    ]


@pytest.mark.parametrize("config", transformers_configs(), ids=lambda c: c.model_type)
def test_param_count_of_each_layout_equals_transformers(config: Any) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(config)
    shape = ModelShape.from_config(config.to_dict())
    assert shape.param_count() == sum(p.numel() for p in model.parameters())


def test_qwen25_05b_from_its_config() -> None:
    shape = ModelShape.from_config(QWEN25_05B)
    assert shape.param_count() == 494_032_768
    assert shape.head_dim == 64 and shape.qkv_bias and not shape.o_bias
    # A token's keys and values: 24 layers x 2 x (2 KV heads x 64) x 2 bytes.
    assert kv_cache_bytes(shape, 1000) == 1000 * 24 * 2 * 128 * 2 == 12_288_000


def test_shapes_it_cannot_count_are_refused() -> None:
    with pytest.raises(ValueError, match="mixture of experts"):
        ModelShape.from_config({**QWEN25_05B, "model_type": "qwen2_moe", "num_experts": 60})
    with pytest.raises(ValueError, match="no intermediate_size"):
        ModelShape.from_config({k: v for k, v in QWEN25_05B.items() if k != "intermediate_size"})


def test_reading_a_model_directory_imports_no_torch(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(QWEN25_05B))
    code = (
        "import sys; from roll.pipeline.base.dry_run.model_shape import model_shape; "
        f"assert model_shape({str(tmp_path)!r}).param_count() == 494_032_768; "
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=60)


@pytest.mark.parametrize("stage", sorted(PAPER))
def test_zero_totals_are_the_papers(stage: int) -> None:
    for psi, ranks in ((1000, 2), (7_500_000_000, 64)):
        total = sum(item.nbytes for item in zero_model_states(stage, psi, ranks))
        assert total == pytest.approx(PAPER[stage](psi, ranks))


def states(items: tuple[MemoryItem, ...]) -> dict[str, tuple[int, str]]:
    return {item.name: (item.nbytes, item.place) for item in items}


def test_zero_states_by_hand() -> None:
    # Ψ = 1000 parameters on N = 4 ranks, bf16.
    assert states(zero_model_states(0, 1000, 4)) == {
        "params": (2000, "device"),
        "grads": (2000, "device"),
        "fp32 master": (4000, "device"),
        "Adam m+v": (8000, "device"),
    }
    expected = {1: (2000, 2000, 1000, 2000), 2: (2000, 500, 1000, 2000), 3: (500, 500, 1000, 2000)}
    for stage, parts in expected.items():
        assert tuple(item.nbytes for item in zero_model_states(stage, 1000, 4)) == parts
    # A partition that does not divide rounds up: 1001 / 4 -> 251 elements.
    assert zero_model_states(3, 1001, 4)[0].nbytes == 2 * 251


def test_zero_states_fp32_keep_no_separate_master_at_stages_0_and_3() -> None:
    assert states(zero_model_states(0, 1000, 4, dtype="fp32")) == {
        "params": (4000, "device"),
        "grads": (4000, "device"),
        "Adam m+v": (8000, "device"),
    }
    assert [i.nbytes for i in zero_model_states(2, 1000, 4, dtype="fp32")] == [4000, 1000, 1000, 2000]
    assert [i.nbytes for i in zero_model_states(3, 1000, 4, dtype="fp32")] == [1000, 1000, 2000]


def test_zero_states_lora_gives_only_trainable_parameters_grads_and_optimizer_states() -> None:
    # 1000 parameters of which 100 train (adapters), stage 2 on 4 ranks: every parameter stays whole.
    assert [i.nbytes for i in zero_model_states(2, 1000, 4, trainable=100)] == [2000, 50, 100, 200]
    assert [i.nbytes for i in zero_model_states(3, 1000, 4, trainable=100)] == [500, 50, 100, 200]


def test_zero_states_with_offload() -> None:
    assert states(zero_model_states(2, 1000, 4, offload_optimizer="cpu")) == {
        "params": (2000, "device"),
        "grads": (1000, "host"),  # the fp32 gradient partition
        "16-bit staging": (500, "host"),
        "fp32 master": (1000, "host"),
        "Adam m+v": (2000, "host"),
    }
    assert states(zero_model_states(3, 1000, 4, offload_optimizer="cpu", offload_params="cpu")) == {
        "params": (500, "host"),
        "grads": (500, "host"),
        "fp32 master": (1000, "host"),
        "Adam m+v": (2000, "host"),
    }
    nvme = states(zero_model_states(3, 1000, 4, offload_optimizer="nvme", offload_params="nvme"))
    assert nvme["params"][1] == nvme["fp32 master"][1] == nvme["Adam m+v"][1] == "nvme"


def test_optimizer_step_working_set() -> None:
    # Stages 1-3: an fp32 copy of the 250-element partition and AdamW's two fp32 temporaries of it.
    assert states(optimizer_step_bytes(2, 1000, 4)) == {
        "fp32 grad copy": (1000, "device"),
        "AdamW temporaries": (2000, "device"),
    }
    assert [i.nbytes for i in optimizer_step_bytes(0, 1000, 4, largest_param=300)] == [4000, 2400]
    assert [i.nbytes for i in optimizer_step_bytes(0, 1000, 4, dtype="fp32", largest_param=300)] == [2400]
    assert [i.nbytes for i in optimizer_step_bytes(3, 1000, 4, fused_optimizer=True)] == [1000]
    assert optimizer_step_bytes(2, 1000, 4, offload_optimizer="cpu") == ()


def test_lora_trainable_counts_by_hand_and_against_peft(tmp_path: Path) -> None:
    shape = tiny_shape(TINY)
    targets = ["q_proj", "v_proj", "down_proj"]
    # rank 4 x (in + out) per module: q 128+128, v 128+64, down 256+128; 2 layers.
    assert lora_params(shape, 4, targets) == 2 * 4 * (256 + 192 + 384) == 6656
    assert lora_params(shape, 4, targets, "value") == 6656 + 129  # PEFT trains a copy of the score head
    for kind in ("causal_lm", "value", "reward"):
        total, trainable = build_and_count(tmp_path, TINY, kind, lora_rank=4, lora_target_modules=targets)
        assert lora_params(shape, 4, targets, kind) == trainable
        assert shape.param_count(kind) + trainable == total
    with pytest.raises(ValueError, match="match none"):
        lora_params(shape, 4, ["c_attn"])


def test_kv_cache_bytes_by_hand() -> None:
    # 2 layers x (keys + values) x 2 KV heads x 32 dims x 2 bytes = 512 bytes a token in bf16.
    assert kv_cache_bytes(tiny_shape(TINY), 10) == 5120
    assert kv_cache_bytes(tiny_shape(TINY), 10, "fp32") == 10_240


def test_activations_by_hand_and_checkpointing_is_smaller() -> None:
    shape = tiny_shape(TINY)
    # Per token, bf16: two norms (4 + 2·2) x 128, attention 2·2·(128 + 64), MLP 4·2·256 = 4864 bytes a layer.
    tokens = 2 * 16
    assert layer_activation_bytes(shape, 2, 16) == tokens * (2 * 1024 + 768 + 2048) == 155_648
    final_norm = tokens * 1024
    assert activation_bytes(shape, 2, 16) == 2 * 155_648 + final_norm == 344_064
    # Eager attention: query, repeated keys and values, output 4·2·128, and a·s·(4 + 2) of softmax.
    eager = 2 * tokens * (2048 + 1024 + 4 * 16 * 6 + 2048) + final_norm
    assert activation_bytes(shape, 2, 16, fused_attention=False) == eager
    # fp32: norms (4 + 2·4) x 128, attention 2·4·192, MLP 4·4·256.
    assert activation_bytes(shape, 2, 16, "fp32") == 2 * tokens * (3072 + 1536 + 4096) + tokens * 1536
    # Checkpointing: every layer's input (2 bytes x 128 per token), one layer recomputed, the final norm.
    assert activation_bytes(shape, 2, 16, checkpointing=True) == 2 * tokens * 256 + 155_648 + final_norm
    for micro, seq in ((1, 64), (4, 512), (8, 4096)):
        with_ckpt = activation_bytes(shape, micro, seq, checkpointing=True)
        assert with_ckpt < activation_bytes(shape, micro, seq)


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_activations_are_what_autograd_saves(tmp_path: Path, attention: str) -> None:
    import torch

    from roll.models.model_providers import load_model
    from roll.models.tiny import resolve_model_path

    reference = "tiny://qwen2?hidden_size=64&num_heads=4&num_kv_heads=2&intermediate_size=160&num_layers=3"
    args = ModelArguments(model_name_or_path=resolve_model_path(reference, cache_dir=str(tmp_path)), dtype="bf16")
    model = load_model(dataclasses.replace(args, attn_implementation=attention), trainable=True)
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(input_ids=torch.randint(4, 88, (2, 96)), use_cache=False)
    estimate = activation_bytes(tiny_shape(reference), 2, 96, fused_attention=attention != "eager")
    # What the formula leaves out: rotary cos/sin, per-token norm scales, the input ids, sdpa's log-sum-exp.
    assert sum(saved.values()) == pytest.approx(estimate, rel=0.03)


def test_logits_by_hand() -> None:
    shape = tiny_shape(TINY)
    # 2 rows of 10 tokens, 4 scored, vocabulary 88: forward bf16 logits + fp32 copy and log-softmax.
    assert logits_bytes(shape, 2, 10, 4, training=False) == 2 * 88 * (2 * 10 + 4 * 4 * 2)
    assert logits_bytes(shape, 2, 10, 4, training=True) == 2 * 88 * (2 * 2 * 10 + 4 * 4 * 3)
    assert logits_bytes(shape, 2, 10, 4, training=False, kind="value") == 2 * (2 * 10 + 4 * 4 * 2)


def train_role(block: dict[str, Any], ranks: int = 2, **training: Any) -> WorkerConfig:
    role = WorkerConfig(
        worker_cls="roll.pipeline.base.rl_workers.ActorWorker",
        device_mapping=f"0-{ranks - 1}",
        infer_batch_size=4,
        model_args=ModelArguments(model_name_or_path=TINY, dtype="bf16"),
        strategy_args=StrategyArguments(strategy_name="deepspeed_train", strategy_config=block),
        training_args=TrainingArguments(**training),
    )
    role.resolve("actor_train", ranks)
    return role


def example_block(name: str) -> dict[str, Any]:
    return yaml.safe_load((CONFIG_DIR / f"{name}.yaml").read_text())[name]


def test_estimate_of_a_zero3_training_rank() -> None:
    role = train_role(example_block("deepspeed_zero3"), per_device_train_batch_size=2)
    estimate = estimate_rank(role, prompt_length=6, response_length=10, host_memory=64 * GiB, ranks_on_node=4)
    assert estimate is not None and estimate.ranks == 2 and estimate.places == ("device", "host")
    psi = TINY_PARAMS
    assert states(estimate.resident) == {
        "params": (psi, "device"),  # 2 bytes x Ψ/2
        "grads": (psi, "device"),
        "fp32 master": (2 * psi, "device"),
        "Adam m+v": (4 * psi, "device"),
        "buckets": (2 * psi, "device"),  # on CPU the 5e7-element bucket is touched only as far as Ψ gradients fill it
    }
    train = states(estimate.phases["train micro-batch"])
    assert train["activations"][0] == activation_bytes(tiny_shape(TINY), 2, 16)
    # The examples keep up to 1e9 gathered parameters for reuse in backward: the whole model.
    assert train["gathered params"][0] == 2 * psi
    peak = max(estimate.phases, key=lambda name: sum(i.nbytes for i in estimate.phases[name]))
    assert estimate.peak_phase == peak
    assert estimate.total == 10 * psi + sum(i.nbytes for i in estimate.phases[peak])
    assert estimate.budget == 16 * GiB and not estimate.over
    tight = estimate_rank(role, prompt_length=6, response_length=10, host_memory=estimate.total, ranks_on_node=2)
    assert tight is not None and tight.over and "OVER" in tight.lines()[0]


def test_zero3_gathers_one_module_when_nothing_is_kept_for_reuse() -> None:
    block = example_block("deepspeed_zero3")
    limits = ("stage3_max_live_parameters", "stage3_max_reuse_distance", "stage3_prefetch_bucket_size")
    block["zero_optimization"].update(dict.fromkeys(limits, 0))
    estimate = estimate_rank(train_role(block), prompt_length=6, response_length=10)
    assert estimate is not None
    assert states(estimate.phases["train micro-batch"])["gathered params"][0] == 2 * TINY_LAYER


def test_checkpointing_lowers_the_training_phase() -> None:
    block = example_block("deepspeed_zero2")
    plain, ckpt = (
        estimate_rank(
            train_role(block, per_device_train_batch_size=4, gradient_checkpointing=c),
            prompt_length=100,
            response_length=400,
        )
        for c in (False, True)
    )
    assert plain is not None and ckpt is not None

    def activations(estimate: Any) -> int:
        return states(estimate.phases["train micro-batch"])["activations"][0]

    assert activations(ckpt) < activations(plain) and ckpt.total <= plain.total


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIG_DIR.glob("deepspeed_zero*.yaml")))
def test_example_blocks_read_as_deepspeed_config_reads_them(name: str) -> None:
    from roll.distributed.strategy.deepspeed_config import offloads_optimizer, resolve_deepspeed_config, zero_stage

    role = train_role(example_block(name))
    resolved = resolve_deepspeed_config(role, training=True)
    estimate = estimate_rank(role, prompt_length=4, response_length=4)
    assert estimate is not None
    resident = states(estimate.resident)
    partitioned_params = 2 * TINY_PARAMS // 2
    assert (resident["params"][0] == partitioned_params) == (zero_stage(resolved) == 3)
    assert (resident["Adam m+v"][1] == "host") == offloads_optimizer(resolved)
    offload_param = resolved["zero_optimization"].get("offload_param", {}).get("device", "none")
    assert (resident["params"][1] == "host") == (offload_param == "cpu")


def test_lora_role_trains_only_adapters() -> None:
    role = train_role(example_block("deepspeed_zero"), ranks=1)
    role.model_args = dataclasses.replace(role.model_args, lora_rank=4, lora_target_modules=["q_proj", "v_proj"])
    estimate = estimate_rank(role, prompt_length=4, response_length=4)
    assert estimate is not None
    adapters = 2 * 4 * (256 + 192)
    assert states(estimate.resident)["params"][0] == 2 * (TINY_PARAMS + adapters)
    assert states(estimate.resident)["Adam m+v"][0] == 8 * adapters


def engine_role(strategy: str, config: dict[str, Any]) -> WorkerConfig:
    role = WorkerConfig(
        worker_cls="roll.pipeline.base.rl_workers.ActorWorker",
        device_mapping="0",
        model_args=ModelArguments(model_name_or_path=TINY, dtype="bf16"),
        strategy_args=StrategyArguments(strategy_name=strategy, strategy_config=config),
    )
    role.resolve("actor_infer", 1)
    return role


def test_vllm_on_cpu_holds_weights_and_its_kv_space() -> None:
    estimate = estimate_rank(engine_role("vllm", {"kv_cache_space_gb": 2}), prompt_length=8, response_length=8)
    assert estimate is not None and estimate.phases == {}
    assert [i.nbytes for i in estimate.resident] == [2 * TINY_PARAMS, 2 * GiB]
    assert estimate.total == 2 * TINY_PARAMS + 2 * GiB and not estimate.notes


def test_vllm_on_gpu_claims_its_fraction_and_notes_a_queue() -> None:
    role = engine_role("vllm", {"gpu_memory_utilization": 0.5})
    role.generating_args.num_return_sequences = 10**6
    estimate = estimate_rank(role, prompt_length=8, response_length=8, platform="cuda", device_memory=GiB)
    assert estimate is not None and estimate.places == ("device",)
    assert estimate.total == GiB // 2  # weights + KV cache = the claimed half
    assert "queues" in estimate.notes[0]
    unknown = estimate_rank(role, prompt_length=8, response_length=8, platform="cuda")
    assert unknown is not None and unknown.budget is None and not unknown.over


def test_an_inference_role_and_a_role_without_strategy() -> None:
    role = engine_role("hf_infer", {})
    estimate = estimate_rank(role, prompt_length=8, response_length=8)
    assert estimate is not None
    assert states(estimate.resident) == {"params": (2 * TINY_PARAMS, "device")}
    generation = states(estimate.phases["generation"])
    # infer_batch_size 8 prompts x 1 sample x (8 + 64 new tokens) x 512 bytes a token.
    assert generation["KV cache"][0] == 8 * 72 * 512
    role.strategy_args = None
    assert estimate_rank(role, prompt_length=8, response_length=8) is None


def test_engine_defaults_and_strategy_table_match_the_backends() -> None:
    from roll.distributed.strategy.registry import registered_strategies
    from roll.distributed.strategy.sglang_strategy import SglangConfig
    from roll.distributed.strategy.vllm_strategy import VllmConfig

    assert set(STRATEGY_KINDS) == set(registered_strategies())
    defaults = {**dataclasses.asdict(VllmConfig()), **dataclasses.asdict(SglangConfig())}
    assert {key: defaults[key] for key in ENGINE_DEFAULTS} == ENGINE_DEFAULTS
    from roll.models.tiny import TINY_SCHEME

    assert TINY.startswith(TINY_SCHEME) and TINY_SCHEME == "tiny://"  # spelled out in model_shape


def test_a_token_budget_sizes_the_micro_batches_it_forms() -> None:
    def phases(budget: int | None, **training: Any) -> dict[str, int]:
        role = train_role(example_block("deepspeed_zero2"), **training)
        role.max_tokens_per_microbatch = budget
        estimate = estimate_rank(role, prompt_length=6, response_length=10, host_memory=64 * GiB, ranks_on_node=4)
        return {name: estimate.bytes_of(items) for name, items in estimate.phases.items()}

    # 160 tokens hold 10 rows of 16: the forward counts 10 rows, not infer_batch_size's 4; the train
    # micro-batch counts an optimizer step's 8 rows (the budget groups no more), not the 2 of a fixed one.
    budgeted = phases(160, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    fixed = phases(None, per_device_train_batch_size=8, gradient_accumulation_steps=1)
    assert budgeted["train micro-batch"] == fixed["train micro-batch"]
    assert budgeted["log-prob forward"] > phases(None, per_device_train_batch_size=2)["log-prob forward"]


def test_vllm_on_cpu_claims_what_its_sequences_can_fill_when_the_space_is_unset() -> None:
    facts = tiny_shape(TINY).facts
    room = 256 * facts.max_positions * facts.kv_bytes_per_token("bf16")
    estimate = estimate_rank(engine_role("vllm", {}), prompt_length=8, response_length=8)
    assert estimate is not None and [i.nbytes for i in estimate.resident] == [2 * TINY_PARAMS, room]
    assert estimate.resident[1].name == "KV cache (kv_cache_space_gb=null)"
    capped = estimate_rank(engine_role("vllm", {"max_model_len": 10**9}), prompt_length=8, response_length=8)
    assert capped is not None and capped.resident[1].nbytes == GiB
    quarter = estimate_rank(engine_role("vllm", {"kv_cache_space_gb": 0.25}), prompt_length=8, response_length=8)
    assert quarter is not None and quarter.resident[1].nbytes == GiB // 4


def test_cpu_kv_cache_size_rule() -> None:
    assert cpu_kv_cache_bytes(0.5, 1024, 64) == GiB // 2, "a set size wins"
    assert cpu_kv_cache_bytes(None, 1024, 64) == 256 * 64 * 1024
    assert cpu_kv_cache_bytes(None, 4096, 2048) == GiB, "capped at 1 GiB"
    assert cpu_kv_cache_bytes(None, None, 64) == cpu_kv_cache_bytes(None, 1024, None) == GiB, "unknown sizes: the cap"
