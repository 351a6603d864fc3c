"""Every YAML under examples/config composes with Hydra and validates against its schema."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig

from roll.cli import ENTRIES
from roll.configs.hydra_defaults import register_schema_defaults
from roll.configs.loader import load_pipeline_config, yaml_names
from roll.configs.schema import ConfigError
from roll.datasets.gsm8k_format import write_gsm8k_format
from roll.envs.builtin.arithmetic import tool_use_rows
from roll.envs.builtin.frozen_lake import noisy_expert_rows
from roll.envs.builtin.guess_number import bisection_rows
from roll.models.model_providers import load_tokenizer
from roll.pipeline.base.pipeline import BasePipeline
from roll.pipeline.base.pipeline_config import PipelineConfig
from roll.pipeline.cluster_check.cluster_check_config import ClusterCheckConfig
from roll.pipeline.diffusion.reward_fl_config import RewardFLConfig
from roll.pipeline.distill.distill_config import DistillConfig
from roll.pipeline.dpo.dpo_config import DPOConfig
from roll.pipeline.rlvr.rlvr_config import RLVRConfig
from roll.pipeline.rm.rm_config import RMConfig
from roll.pipeline.sft.sft_config import SFTConfig
from roll.utils.imports import import_object
from tests.conftest import CONFIG_DIR, REPO_ROOT
from tests.pipeline_runs import config_error_of

DEEPSPEED_BLOCKS = sorted(p.stem for p in CONFIG_DIR.glob("deepspeed_zero*.yaml"))
EXPECTED_STAGES = {
    "deepspeed_zero": 0,
    "deepspeed_zero2": 2,
    "deepspeed_zero2_cpuoffload": 2,
    "deepspeed_zero3": 3,
    "deepspeed_zero3_cpuoffload": 3,
}

PIPELINE_SCHEMAS = {
    "cluster_check": ClusterCheckConfig,
    "sft_arithmetic": SFTConfig,
    "rlvr_arithmetic": RLVRConfig,
    "rlvr_qwen2.5_0.5b_8gpu": RLVRConfig,
    "rlvr_qwen2.5_0.5b_cpu": RLVRConfig,
    "sft_arithmetic_chat": SFTConfig,
    "rlvr_arithmetic_chat": RLVRConfig,
    "dpo_arithmetic": DPOConfig,
    "rm_arithmetic": RMConfig,
    "rm_prm_arithmetic": RMConfig,
    "rlvr_prm_arithmetic": RLVRConfig,
    "distill_arithmetic": DistillConfig,
    "distill_onpolicy_arithmetic": RLVRConfig,
    "agentic_guess_number": RLVRConfig,
    "sft_guess_number": SFTConfig,
    "agentic_calculator": RLVRConfig,
    "sft_calculator": SFTConfig,
    "agentic_frozen_lake": RLVRConfig,
    "agentic_unit_conversion": RLVRConfig,
    "agentic_calculator_agent": RLVRConfig,
    "agentic_mixed": RLVRConfig,
    "sft_vlm_colour": SFTConfig,
    "rlvr_vlm_colour": RLVRConfig,
    "rlvr_qwen2.5_vl_3b_gpu": RLVRConfig,
    "agentic_framed_colour": RLVRConfig,
    "sft_frozen_lake": SFTConfig,
    "reward_fl_shapes": RewardFLConfig,
    "reward_fl_sd15_lora_gpu": RewardFLConfig,
    "reward_fl_flow_shapes": RewardFLConfig,
    "reward_fl_flow_video": RewardFLConfig,
    "reward_fl_wan22_lora_gpu": RewardFLConfig,
    "reward_fl_sd35_flow_grpo_gpu": RewardFLConfig,
}
# The recipes whose policy is a vision-language model (an SFT export of one, or a hub id).
VISION_LANGUAGE_RECIPES = ("rlvr_vlm_colour", "agentic_framed_colour", "rlvr_qwen2.5_vl_3b_gpu")
SCHEMA_NODES = {
    "cluster_check": ClusterCheckConfig,
    "sft": SFTConfig,
    "rlvr": RLVRConfig,
    "agentic": RLVRConfig,
    "dpo": DPOConfig,
    "rm": RMConfig,
    "distill": DistillConfig,
    "reward_fl": RewardFLConfig,
}


def compose_config(name: str, overrides: list[str] | None = None, config_dir: Path = CONFIG_DIR) -> DictConfig:
    for node, schema in SCHEMA_NODES.items():
        register_schema_defaults(node, schema)
    searchpath = [f"hydra.searchpath=[file://{CONFIG_DIR}]"] if config_dir != CONFIG_DIR else []
    with initialize_config_dir(config_dir=str(config_dir), version_base=None):
        return compose(config_name=name, overrides=searchpath + (overrides or []))


def load_config(name: str, overrides: list[str]) -> PipelineConfig:
    """Pipeline YAML `name` with `overrides`, composed and converted into its validated schema (as an entry does)."""
    return load_pipeline_config(compose_config(name, overrides), PIPELINE_SCHEMAS[name], yaml_names([CONFIG_DIR]))


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_each_entry_point_names_a_schema_a_pipeline_and_a_yaml_of_that_schema(name: str) -> None:
    entry = ENTRIES[name]
    schema = import_object(entry.schema, name)
    assert schema is SCHEMA_NODES[name] and PIPELINE_SCHEMAS[entry.config_name] is schema
    assert issubclass(import_object(entry.pipeline_cls, name), BasePipeline)


def test_the_five_deepspeed_blocks_exist() -> None:
    assert sorted(EXPECTED_STAGES) == DEEPSPEED_BLOCKS


@pytest.mark.parametrize("block", DEEPSPEED_BLOCKS)
def test_deepspeed_block_composes_and_is_referenced_per_role(block: str) -> None:
    overrides = [
        "platform=cpu",
        "devices_per_node=2",
        "actor_infer=null",
        "actor_train.strategy_args.strategy_name=deepspeed_train",
        f"actor_train.strategy_args.strategy_config=${{{block}}}",
    ]
    cfg = compose_config("all_deepspeed_blocks", overrides, config_dir=REPO_ROOT / "tests" / "configs")
    config = load_pipeline_config(cfg, ClusterCheckConfig, yaml_names([CONFIG_DIR]))
    strategy = config.actor_train.strategy_args
    assert strategy is not None and strategy.strategy_name == "deepspeed_train"
    assert strategy.strategy_config["zero_optimization"]["stage"] == EXPECTED_STAGES[block]
    offload = strategy.strategy_config["zero_optimization"].get("offload_optimizer", {}).get("device")
    assert (offload == "cpu") == block.endswith("cpuoffload")


def test_every_yaml_is_a_block_or_a_known_pipeline() -> None:
    names = {p.stem for p in CONFIG_DIR.glob("*.yaml")}
    assert names == set(DEEPSPEED_BLOCKS) | {"fsdp2", "fsdp2_cpuoffload"} | set(PIPELINE_SCHEMAS)


AGENTIC_TRANSCRIPTS = {
    "sft_guess_number": lambda: bisection_rows(16, "<eos>") * 4,
    "sft_calculator": lambda: tool_use_rows(range(64), 0.3, "<eos>"),
    "sft_frozen_lake": lambda: noisy_expert_rows(range(16), 0.5, "<eos>"),
}


def local_inputs(name: str, tmp_path: Path) -> list[str]:
    """Overrides pointing a recipe at inputs this machine has: a tiny model and, for file data, GSM8K-format files.

    Validation checks that models and data exist; the recipes name an SFT export (made by the first
    command of scripts/run.sh) or a downloaded model and data.
    """
    if name == "distill_onpolicy_arithmetic":  # its student and teacher are exports of earlier runs
        return ["devices_per_node=2", "pretrain=tiny://qwen2", "teacher.model_args.model_name_or_path=tiny://qwen2"]
    if name == "reward_fl_sd15_lora_gpu":  # a Stable Diffusion directory and a prompt file
        (tmp_path / "prompts.txt").write_text("".join(f"a photo of a cat, style {i}\n" for i in range(100)))
        model = "pretrain='tiny-diffusion://unet?image_size=8&base_channels=8&text_hidden_size=16'"
        return [model, f"data.prompt_file={tmp_path / 'prompts.txt'}"]
    if name in ("reward_fl_wan22_lora_gpu", "reward_fl_sd35_flow_grpo_gpu"):  # hub models, a prompt file, a face
        (tmp_path / "prompts.txt").write_text("".join(f"a portrait, style {i}\n" for i in range(100)))
        inputs = [f"data.prompt_file={tmp_path / 'prompts.txt'}"]
        if name == "reward_fl_sd35_flow_grpo_gpu":
            return [*inputs, "pretrain='tiny-diffusion://sd3'"]
        from PIL import Image

        Image.new("RGB", (8, 8), (200, 150, 120)).save(tmp_path / "face.png")
        face = [f"reward.kwargs.reference_image={tmp_path / 'face.png'}", "reward.kwargs.encoder=owner/face-encoder"]
        return [*inputs, *face, "pretrain='tiny-diffusion://wan'"]
    if name == "rlvr_prm_arithmetic":  # its reward is rm_prm_arithmetic.yaml's export: a one-label token classifier
        prm = tmp_path / "prm"
        load_tokenizer("tiny://qwen2").save_pretrained(prm)
        labels = {"architectures": ["Qwen2ForTokenClassification"], "id2label": {"0": "LABEL_0"}}
        (prm / "config.json").write_text(json.dumps(labels))
        return ["devices_per_node=2", "pretrain=tiny://qwen2", f"rewards.math.model_args.model_name_or_path={prm}"]
    if name == "agentic_unit_conversion":  # its command puts examples/envs on the PYTHONPATH; here the repository is
        return ["devices_per_node=2", "env.name=examples.envs.unit_conversion.unit_conversion"]
    if name == "agentic_calculator_agent":  # its command puts examples/agents on the PYTHONPATH, and a warm start
        agent = "env.agent=examples.agents.calculator_agent.calculator_agent"
        return ["devices_per_node=2", "pretrain=tiny://qwen2", agent]
    if name in VISION_LANGUAGE_RECIPES:  # a vision-language policy; the GPU one's data is a hub dataset
        hub = ["data.train_file=", "data.eval_file="] if "gpu" in name else ["devices_per_node=2"]
        return ["pretrain='tiny://qwen2_5_vl?max_position_embeddings=2048'", *hub]
    if name in AGENTIC_TRANSCRIPTS:  # their transcripts come from scripts/make_agentic_sft_data.py
        rows = "".join(json.dumps(row) + "\n" for row in AGENTIC_TRANSCRIPTS[name]())
        (tmp_path / "train.jsonl").write_text(rows)
        data = tmp_path / "train.jsonl"
        return ["devices_per_node=2", f"data.train_file={data}", f"data.eval_file={data}"]
    if not name.endswith("_chat") and "gpu" not in name:  # the _chat recipes read GSM8K-format files
        # Their YAML starts from an SFT export (rm_prm: the RM export), or (distill) takes the RLVR export as the
        # teacher.
        from_export = name.startswith(("rlvr", "dpo", "distill", "rm_prm", "agentic"))
        return ["devices_per_node=2", "pretrain=tiny://qwen2"] if from_export else ["devices_per_node=2"]
    paths = write_gsm8k_format(tmp_path, 19, "+-", 0)
    files = [f"data.train_file={paths['train.parquet']}", f"data.eval_file={paths['test.parquet']}"]
    if "gpu" in name:
        return ["pretrain='tiny://qwen2?max_position_embeddings=2048'", *files]
    files.append("devices_per_node=2")
    return [*files, "pretrain=tiny://qwen2"] if name.startswith("rlvr") else files


@pytest.mark.parametrize("name", sorted(PIPELINE_SCHEMAS))
def test_every_pipeline_yaml_validates(name: str, tmp_path: Path) -> None:
    cfg = compose_config(name, local_inputs(name, tmp_path))
    config = load_pipeline_config(cfg, PIPELINE_SCHEMAS[name], yaml_names([CONFIG_DIR]))
    assert config.roles(), f"{name} declares no role"
    for role in config.roles().values():
        assert role.world_size and role.world_size >= 1


def test_any_schema_field_overrides_without_plus() -> None:
    overrides = ["platform=cpu", "devices_per_node=2", "actor_train.model_args.dtype=fp32", "seed=7"]
    config = load_pipeline_config(compose_config("cluster_check", overrides), ClusterCheckConfig)
    assert config.actor_train.model_args.dtype == "fp32" and config.seed == 7


def test_a_schema_node_is_built_once_and_rebuilt_when_its_store_entry_changes() -> None:
    store = ConfigStore.instance().repo
    register_schema_defaults("cluster_check", ClusterCheckConfig)
    made = store["cluster_check_schema.yaml"]
    register_schema_defaults("cluster_check", ClusterCheckConfig)
    assert store["cluster_check_schema.yaml"] is made, "the same schema again reuses its node"
    register_schema_defaults("cluster_check", SFTConfig)
    assert "export_dir" in store["cluster_check_schema.yaml"].node, "another schema under the name replaces the node"
    ConfigStore.instance().store(name="cluster_check_schema", node={"replaced": True})
    register_schema_defaults("cluster_check", ClusterCheckConfig)
    rebuilt = store["cluster_check_schema.yaml"].node
    assert "replaced" not in rebuilt and rebuilt.batch_size == ClusterCheckConfig().batch_size
    config = load_pipeline_config(compose_config("cluster_check", ["batch_size=12"]), ClusterCheckConfig)
    assert config.batch_size == 12


def test_command_line_override_reaches_dataclass() -> None:
    cfg = compose_config("cluster_check", ["devices_per_node=4", "batch_size=12", "actor_infer.device_mapping=2-3"])
    config = load_pipeline_config(cfg, ClusterCheckConfig)
    assert config.batch_size == 12 and config.actor_infer is not None and config.actor_infer.devices == [2, 3]


def test_unreferenced_unknown_top_level_key_is_an_error() -> None:
    cfg = compose_config("cluster_check", ["+batch_sise=4"])
    with pytest.raises(ConfigError, match=r"unknown config key 'batch_sise' \(did you mean 'batch_size'\?\)"):
        load_pipeline_config(cfg, ClusterCheckConfig)


def test_unreferenced_block_needs_its_yaml_beside_the_pipeline() -> None:
    cfg = compose_config("all_deepspeed_blocks", ["platform=cpu"], config_dir=REPO_ROOT / "tests" / "configs")
    with pytest.raises(ConfigError, match="unknown config key 'deepspeed_zero'"):
        load_pipeline_config(cfg, ClusterCheckConfig)


def test_unknown_nested_key_in_yaml_is_an_error() -> None:
    cfg = compose_config("cluster_check", ["+actor_train.devise_mapping=1"])
    with pytest.raises(ConfigError, match=r"'actor_train.devise_mapping' \(did you mean 'device_mapping'\?\)"):
        load_pipeline_config(cfg, ClusterCheckConfig)


def test_an_optional_role_the_yaml_never_mentions_is_absent(tmp_path: Path) -> None:
    """A user's RLVR YAML written without `critic: null` / `teacher: null` loads with neither role; setting one
    of the role's fields keeps it (and then the role must be complete)."""
    own = "\n".join(
        line
        for line in (CONFIG_DIR / "rlvr_arithmetic.yaml").read_text().splitlines()
        if line not in ("critic: null", "teacher: null")
    )
    (tmp_path / "my_rlvr.yaml").write_text(own)
    overrides = ["pretrain=tiny://qwen2", "platform=cpu", "devices_per_node=2"]
    blocks = yaml_names([CONFIG_DIR])
    config = load_pipeline_config(compose_config("my_rlvr", overrides, tmp_path), RLVRConfig, blocks)
    assert config.critic is None and config.teacher is None
    with pytest.raises(ConfigError, match=r"critic\.worker_cls is empty"):
        load_pipeline_config(
            compose_config("my_rlvr", [*overrides, "critic.device_mapping=0"], tmp_path), RLVRConfig, blocks
        )


def test_entry_point_reports_config_error_in_one_line_before_ray() -> None:
    message = config_error_of("examples/start_cluster_check.py", "devices_per_node=2", "actor_train.device_mapping=0-7")
    assert message.startswith("actor_train.device_mapping uses device(s) [2, 3, 4, 5, 6, 7]")


@pytest.mark.parametrize("block", DEEPSPEED_BLOCKS)
def test_gpu_recipe_validates_with_every_deepspeed_block(block: str, tmp_path: Path) -> None:
    name = "rlvr_qwen2.5_0.5b_8gpu"
    overrides = [*local_inputs(name, tmp_path), f"actor_train.strategy_args.strategy_config=${{{block}}}"]
    config = load_pipeline_config(compose_config(name, overrides), RLVRConfig, yaml_names([CONFIG_DIR]))
    assert config.platform == "cuda" and config.total_devices == 8
    assert config.actor_infer.strategy_args.strategy_name == "vllm"
    resolved = config.actor_train.strategy_args.strategy_config
    assert resolved["zero_optimization"]["stage"] == EXPECTED_STAGES[block]


def test_engine_blocks_are_checked_when_the_config_loads() -> None:
    """A wrong vllm key fails at config time, naming the field, before any engine or Ray actor starts."""
    cfg = compose_config("rlvr_qwen2.5_0.5b_8gpu", ["+actor_infer.strategy_args.strategy_config.kv_cache_gb=4"])
    with pytest.raises(ConfigError, match=r"actor_infer\.strategy_args\.strategy_config\.kv_cache_gb' \(did you mean"):
        load_pipeline_config(cfg, RLVRConfig, yaml_names([CONFIG_DIR]))


def test_an_impossible_weight_sync_route_is_a_config_error() -> None:
    overrides = ["platform=cpu", "devices_per_node=3", "actor_infer.device_mapping=2", "weight_sync_method=colocated"]
    cfg = compose_config("rlvr_arithmetic", overrides)
    with pytest.raises(ConfigError, match=r"weight_sync_method=colocated: inference worker 0 \(devices \[2\]\)"):
        load_pipeline_config(cfg, RLVRConfig, yaml_names([CONFIG_DIR]))
