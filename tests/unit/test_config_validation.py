"""Every field of every config schema has a validity rule, and a bad value is a one-line ConfigError before Ray.

The fields are found by introspection, so a field added without a rule fails
`test_every_field_declares_a_rule`, and every rule is exercised with a value it must reject.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import re
import time
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import pytest
import ray
from omegaconf import OmegaConf

from roll.configs.hydra_defaults import dataclass_in, schema_defaults
from roll.configs.loader import load_pipeline_config, yaml_names
from roll.configs.model_dir import TOKENIZER_FILES
from roll.configs.schema import ConfigError, Rule, field_rule, from_dict
from roll.models.tiny import build_char_tokenizer
from roll.pipeline.base.checkpoint_state import save_driver_state
from roll.pipeline.base.pipeline_config import PipelineConfig
from roll.pipeline.base.training_loop import TrainingRunPipeline
from roll.pipeline.cluster_check.cluster_check_config import ClusterCheckConfig
from roll.pipeline.distill.distill_config import DistillConfig
from roll.pipeline.dpo.dpo_config import DPOConfig
from roll.pipeline.rlvr.rlvr_config import RLVRConfig
from roll.pipeline.rm.rm_config import RMConfig
from roll.pipeline.sft.sft_config import SFTConfig
from tests.conftest import CONFIG_DIR
from tests.pipeline_runs import config_error_of
from tests.unit.test_hydra_configs import compose_config

PIPELINES: dict[type[PipelineConfig], tuple[str, list[str]]] = {
    RLVRConfig: ("rlvr_arithmetic", ["pretrain=tiny://qwen2"]),
    SFTConfig: ("sft_arithmetic", []),
    ClusterCheckConfig: ("cluster_check", []),
    DPOConfig: ("dpo_arithmetic", ["pretrain=tiny://qwen2"]),
    RMConfig: ("rm_arithmetic", ["pretrain=tiny://qwen2"]),
    DistillConfig: ("distill_arithmetic", ["pretrain=tiny://qwen2"]),
}
ON_THIS_MACHINE = ["platform=cpu", "devices_per_node=2"]
BLOCKS = yaml_names([CONFIG_DIR])


def schema_classes(schema: type, seen: set[type] | None = None) -> set[type]:
    """`schema` and every dataclass reachable from its fields (also inside lists and mappings)."""
    seen = set() if seen is None else seen
    seen.add(schema)
    for tp in typing.get_type_hints(schema).values():
        for inner in (tp, *typing.get_args(tp)):
            nested = dataclass_in(inner)
            if nested is not None and nested not in seen:
                schema_classes(nested, seen)
    return seen


ALL_SCHEMAS = set().union(*(schema_classes(p) for p in PIPELINES))


def type_checks_it(tp: Any) -> bool:
    """Literal, bool and (optional) dataclass fields are fully checked by their type."""
    return typing.get_origin(tp) is Literal or tp is bool or dataclass_in(tp) is not None


def init_fields(schema: type) -> Iterator[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(schema)
    for f in dataclasses.fields(schema):
        if f.init:
            yield f, hints[f.name]


def test_every_field_declares_a_rule() -> None:
    expected = {
        "RLVRConfig",
        "RewardConfig",
        "EnvArguments",
        "EnvSource",
        "SFTConfig",
        "ClusterCheckConfig",
        "DataArguments",
        "AlgorithmArguments",
    }
    expected |= {"DPOConfig", "PreferenceLossArguments", "PreferenceDataArguments"}
    expected |= {"RMConfig", "FaultToleranceArguments"}
    expected |= {"DistillConfig", "DistillLossArguments"}
    expected |= {"WorkerConfig", "ModelArguments", "StrategyArguments", "TrainingArguments", "GeneratingArguments"}
    assert {c.__name__ for c in ALL_SCHEMAS} == expected  # PipelineConfig's fields are walked in each pipeline
    missing, unexplained = [], []
    for schema in ALL_SCHEMAS:
        for f, tp in init_fields(schema):
            rule = field_rule(f)
            if rule is None and not type_checks_it(tp):
                missing.append(f"{schema.__name__}.{f.name}")
            if rule is not None and rule.deferred and rule.bad is None:
                unexplained.append(f"{schema.__name__}.{f.name} (checked in validate, but gives no bad example)")
    assert not missing, f"fields without a validity rule (metadata=check(...) or any_value(reason)): {missing}"
    assert not unexplained, unexplained


def test_any_value_markers_give_a_reason() -> None:
    marked = {
        f"{schema.__name__}.{f.name}": rule.anything
        for schema in ALL_SCHEMAS
        for f, _ in init_fields(schema)
        if (rule := field_rule(f)) is not None and rule.anything
    }
    assert marked, "expected a few explicit any-value fields"
    assert all(len(reason) > 20 for reason in marked.values()), marked


@pytest.mark.parametrize("schema", list(PIPELINES), ids=lambda s: s.__name__)
def test_defaults_satisfy_their_own_rules(schema: type) -> None:
    from_dict(schema, schema_defaults(schema))


def bad_value(tp: Any, rule: Rule | None) -> Any:
    """A value the field must reject: the rule's own example, else one derived from its type and bounds."""
    if rule is not None and rule.bad is not None:
        return rule.bad
    options = [a for a in typing.get_args(tp) if a is not type(None)]
    base = options[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(options) == 1 else tp
    if typing.get_origin(base) is Literal:
        return "not-a-choice"
    if base is bool:
        return "yes"
    if rule is None:
        return 5  # a dataclass
    for bound, offset in ((rule.gt, 0), (rule.ge, -1), (rule.lt, 0), (rule.le, 1)):
        if bound is not None:
            return int(bound + offset) if base is int else float(bound + offset)
    if rule.choices or rule.pattern:
        return "not valid!"
    if rule.nonempty:
        return (typing.get_origin(base) or base)()
    if rule.items is not None:
        return [bad_value(typing.get_args(base)[0], rule.items)]
    raise AssertionError(f"cannot derive a bad value from {rule}; give the rule bad=...")


def field_cases() -> list[tuple[type, str, Any]]:
    """One (pipeline schema, dotted path, bad value) per field of every schema, found by walking the defaults.

    Fields that accept any value of their type are left out (test_any_value_markers_give_a_reason), and
    so are fields without a rule (test_every_field_declares_a_rule fails for them).
    """
    cases, seen = [], set()

    def walk(pipeline: type, schema: type, data: dict[str, Any], path: str) -> None:
        for f, tp in init_fields(schema):
            where = f"{path}.{f.name}" if path else f.name
            rule = field_rule(f)
            if (schema, f.name) not in seen:
                seen.add((schema, f.name))
                if (rule is None and type_checks_it(tp)) or (rule is not None and not rule.anything):
                    cases.append((pipeline, where, bad_value(tp, rule)))
            value, nested = data.get(f.name), dataclass_in(tp)
            if nested is not None and isinstance(value, dict):
                walk(pipeline, nested, value, where)
            elif typing.get_origin(tp) is dict and dataclass_in(typing.get_args(tp)[1]) and isinstance(value, dict):
                for key, item in value.items():
                    walk(pipeline, dataclass_in(typing.get_args(tp)[1]), item, f"{where}.{key}")
            elif typing.get_origin(tp) is list and (item_schema := dataclass_in(typing.get_args(tp)[0])) is not None:
                # A list's items (env.sources) have no default to set a bad value in: each rule of theirs is
                # exercised by its own tests (tests/unit/test_env_sources.py).
                seen.update((item_schema, g.name) for g, _ in init_fields(item_schema))

    for pipeline in PIPELINES:
        walk(pipeline, pipeline, schema_defaults(pipeline), "")
    walked = {schema for schema, _ in seen}
    assert walked == ALL_SCHEMAS - {PipelineConfig}, ALL_SCHEMAS - walked
    return cases


CASES = field_cases()


@pytest.fixture(scope="module")
def valid_configs(tmp_path_factory: pytest.TempPathFactory) -> dict[type, dict[str, Any]]:
    """Each pipeline's example YAML, composed for this machine and resolved to plain data (valid as it is)."""
    output_dir = tmp_path_factory.mktemp("output")
    configs = {}
    for schema, (name, overrides) in PIPELINES.items():
        cfg = compose_config(name, [*ON_THIS_MACHINE, *overrides, f"output_dir={output_dir}"])
        configs[schema] = OmegaConf.to_container(cfg, resolve=True)
        load_pipeline_config(copy.deepcopy(configs[schema]), schema, BLOCKS)
    return configs


@pytest.fixture(autouse=True)
def no_ray(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Validation must never start Ray."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("validation called ray.init")

    monkeypatch.setattr(ray, "init", refuse)
    running = ray.is_initialized()  # the session's Ray of earlier integration tests may be up
    yield
    assert ray.is_initialized() == running


def assert_names_field(message: str, path: str) -> None:
    assert "\n" not in message, message
    assert re.search(rf"(^|[\s'(]){re.escape(path)}([=:\s.\['(]|$)", message), f"{path!r} not named in: {message}"


@pytest.mark.parametrize(
    ("schema", "path", "bad"), CASES, ids=[f"{schema.__name__}:{path}" for schema, path, _ in CASES]
)
def test_a_bad_value_of_every_field_is_a_one_line_error_naming_it(
    valid_configs: dict[type, dict[str, Any]], schema: type, path: str, bad: Any
) -> None:
    data = copy.deepcopy(valid_configs[schema])
    *parents, leaf = path.split(".")
    node = data
    for part in parents:
        node = node[part]
    assert leaf in node, f"{path} is not in the composed {schema.__name__} config"
    node[leaf] = bad
    with pytest.raises(ConfigError) as error:
        load_pipeline_config(data, schema, BLOCKS)
    assert_names_field(str(error.value), path)


def write_problems(path: Path, count: int) -> str:
    path.write_text("".join(json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}) + "\n" for i in range(count)))
    return str(path)


def fake_model(directory: Path, *, chat_template: bool = True, **config: int) -> str:
    """A model directory holding only what validation reads: config.json and a tokenizer (the tiny char-level one,
    with or without its chat template)."""
    directory.mkdir()
    sizes = {"max_position_embeddings": 512, "num_hidden_layers": 2, "hidden_size": 128, "num_attention_heads": 4}
    (directory / "config.json").write_text(json.dumps({**sizes, "num_key_value_heads": 2, **config}))
    tokenizer = build_char_tokenizer()
    tokenizer.chat_template = tokenizer.chat_template if chat_template else None
    tokenizer.save_pretrained(directory)
    return str(directory)


def rlvr(*overrides: str) -> RLVRConfig:
    cfg = compose_config("rlvr_arithmetic", [*ON_THIS_MACHINE, "pretrain=tiny://qwen2", *overrides])
    return load_pipeline_config(cfg, RLVRConfig, BLOCKS)


def dpo(*overrides: str) -> DPOConfig:
    cfg = compose_config("dpo_arithmetic", [*ON_THIS_MACHINE, "pretrain=tiny://qwen2", *overrides])
    return load_pipeline_config(cfg, DPOConfig, BLOCKS)


def sft(*overrides: str) -> SFTConfig:
    return load_pipeline_config(compose_config("sft_arithmetic", [*ON_THIS_MACHINE, *overrides]), SFTConfig, BLOCKS)


def test_the_issue_examples_name_field_value_and_range() -> None:
    cases = {
        "actor_train.training_args.learning_rate=-1": (
            "actor_train.training_args.learning_rate=-1.0 is out of range: it must be > 0 and <= 1"
        ),
        "actor_train.training_args.gradient_accumulation_steps=0": (
            "actor_train.training_args.gradient_accumulation_steps=0 is out of range: it must be >= 1"
        ),
        "max_steps=-1": "max_steps=-1 is out of range: it must be >= 1",
    }
    for override, message in cases.items():
        with pytest.raises(ConfigError) as error:
            rlvr(override)
        assert str(error.value) == message


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["actor_infer.generating_args.temperature=0"],
            "actor_infer.generating_args.temperature=0 samples greedily: set "
            "actor_infer.generating_args.do_sample=false for greedy decoding",
        ),
        (["actor_infer.generating_args.top_k=1"], r"top_k=1 samples greedily: set .*do_sample=false"),
        (["actor_infer.generating_args.top_p=0"], r"top_p=0.0 is out of range: it must be > 0 and <= 1"),
        (
            ["actor_train.training_args.max_steps=5", "actor_train.training_args.warmup_steps=10"],
            r"actor_train.training_args.warmup_steps=10 is more than actor_train.training_args.max_steps=5",
        ),
        (
            ["actor_train.strategy_args.offload_device=nvme"],
            r"actor_train.strategy_args.offload_device=nvme needs actor_train.strategy_args.offload_dir",
        ),
        (
            ["actor_infer.generating_args.max_new_tokens=600"],
            r"data.max_prompt_length=16 \+ actor_infer.generating_args.max_new_tokens=600 = 616 tokens is more than "
            r"actor_train.model_args.model_name_or_path's max_position_embeddings=512",
        ),
        (["pretrain=/no/such/model"], r"actor_train.model_args.model_name_or_path='/no/such/model': no such directory"),
        (
            ["pretrain='tiny://qwen2?layers=3'"],
            r"actor_train.model_args.model_name_or_path: .*unknown tiny-model option",
        ),
        (["actor_train.worker_cls=roll.pipeline.base.rl_workers.NoSuchWorker"], r"actor_train.worker_cls .* cannot be"),
        (["rewards.math.reward_fn=roll.rewards.functions.nothing"], r"rewards.math.reward_fn: reward_fn .* cannot"),
        (["rollout_batch_size=1024"], r"rollout_batch_size=1024 is more than the \d+ training problems"),
        (
            [
                "algorithm.dynamic_sampling=true",
                "algorithm.adv_estimator=reinforce_plus_plus",
                "actor_infer.generating_args.num_return_sequences=1",
                "rollout_batch_size=128",
            ],
            r"algorithm.dynamic_sampling .*num_return_sequences=1 every prompt would be dropped",
        ),
        (
            ["algorithm.dynamic_sampling_max_rounds=3"],
            r"dynamic_sampling_max_rounds=3 refills .*dynamic_sampling is false",
        ),
        (
            ["algorithm.use_kl_loss=true", "algorithm.kl_loss_kind=k1"],
            r"algorithm.kl_loss_kind=k1 with algorithm.use_kl_loss=true: as a loss, .* zero expected gradient",
        ),
        (["resume_from_checkpoint=latest"], r"resume_from_checkpoint='latest': no complete checkpoint in /"),
        (["resume_from_checkpoint=step_3"], r"resume_from_checkpoint='step_3': no complete checkpoint at /.*step_3;"),
    ],
)
def test_relations_and_inputs_are_checked_in_validate(overrides: list[str], message: str, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=message) as error:
        rlvr(f"output_dir={tmp_path}", *overrides)
    assert "\n" not in str(error.value)


def test_greedy_decoding_at_temperature_zero_is_valid() -> None:
    config = rlvr("actor_infer.generating_args.temperature=0", "actor_infer.generating_args.do_sample=false")
    assert config.actor_infer.generating_args.temperature == 0


def test_data_files_exist_parse_and_hold_a_batch(tmp_path: Path) -> None:
    train, held_out = write_problems(tmp_path / "train.jsonl", 40), write_problems(tmp_path / "eval.jsonl", 5)
    config = rlvr(f"data.train_file={train}", f"data.eval_file={held_out}")
    assert config.data.train_file == train
    small = write_problems(tmp_path / "small.jsonl", 3)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"prompt": "1+1="}\n')
    for overrides, message in [
        ([f"data.train_file={small}", f"data.eval_file={held_out}"], r"rollout_batch_size=32 is more than the 3 "),
        (
            [f"data.train_file={train}", f"data.eval_file={empty}"],
            r"data.eval_file='.*empty.jsonl': it holds no problems",
        ),
        (
            [f"data.train_file={broken}", f"data.eval_file={held_out}"],
            r"data.train_file='.*broken.jsonl': no column 'answer' \(data.answer_key\); its columns are 'prompt'$",
        ),
        ([f"data.train_file={train}"], r"data.eval_file is empty but data.train_file is set: give both"),
        (
            [f"data.train_file={train}", f"data.eval_file={tmp_path}/none.jsonl"],
            r"data.eval_file='.*none.jsonl': no such",
        ),
    ]:
        with pytest.raises(ConfigError, match=message):
            rlvr(*overrides)


def test_a_generation_that_cannot_fit_in_memory_names_what_to_lower(tmp_path: Path) -> None:
    model = fake_model(tmp_path / "long", max_position_embeddings=10**7)
    no_budgets = ("actor_train.max_tokens_per_microbatch=null", "reference.max_tokens_per_microbatch=null")
    with pytest.raises(ConfigError, match=r"raise actor_train.max_tokens_per_microbatch to at least 5000016"):
        rlvr(f"pretrain={model}", "actor_infer.generating_args.max_new_tokens=5000000")
    with pytest.raises(ConfigError) as error:
        rlvr(f"pretrain={model}", "actor_infer.generating_args.max_new_tokens=5000000", *no_budgets)
    message = str(error.value)
    assert re.match(r"actor_infer would hold about \d+\.\d GiB of KV cache while generating \(2 workers x 16 ", message)
    assert message.endswith(
        "lower actor_infer.generating_args.max_new_tokens, actor_infer.infer_batch_size or "
        "actor_infer.generating_args.num_return_sequences"
    )
    assert rlvr(f"pretrain={model}", "actor_infer.generating_args.max_new_tokens=1000").platform == "cpu"


def test_model_directory_needs_a_parsing_config_and_a_tokenizer(tmp_path: Path) -> None:
    model = Path(fake_model(tmp_path / "model"))
    for name in TOKENIZER_FILES:
        (model / name).unlink(missing_ok=True)
    with pytest.raises(ConfigError, match=r"holds no tokenizer"):
        rlvr(f"pretrain={model}")
    (model / "tokenizer_config.json").write_text("{")
    with pytest.raises(ConfigError, match=r"tokenizer_config.json does not parse"):
        rlvr(f"pretrain={model}")
    (model / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"holds no config.json"):
        rlvr(f"pretrain={model}")


def test_sft_checks_response_length_and_batch_against_its_inputs(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"max_response_length=600 = 616 tokens is more than actor_train"):
        sft("max_response_length=600")
    small = write_problems(tmp_path / "small.jsonl", 10)
    with pytest.raises(ConfigError, match=r"batch_size=64 is more than the 10 training problems"):
        sft(f"data.train_file={small}", f"data.eval_file={small}")


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "actor_train.training_args.learning_rate=-1",
            "config error: actor_train.training_args.learning_rate=-1.0 is out of range: it must be > 0 and <= 1",
        ),
        ("pretrain=/no/such/model", "config error: actor_train.model_args.model_name_or_path='/no/such/model'"),
    ],
)
def test_the_entry_point_exits_2_with_one_line_before_ray(override: str, message: str) -> None:
    started = time.monotonic()
    error = config_error_of("examples/start_rlvr_pipeline.py", "platform=cpu", "devices_per_node=2", override)
    assert f"config error: {error}".startswith(message), error
    assert time.monotonic() - started < 60


def dotted_fields(data: dict[str, Any], path: str = "") -> Iterator[str]:
    """The field paths in `data` whose value is a dotted path of one of roll's objects (worker classes, reward
    functions: whatever validation imports)."""
    for key, value in data.items():
        if isinstance(value, dict):
            yield from dotted_fields(value, f"{path}{key}.")
        elif isinstance(value, str) and re.fullmatch(r"roll(\.\w+)+", value):
            yield f"{path}{key}"


@pytest.mark.parametrize("schema", list(PIPELINES), ids=lambda s: s.__name__)
def test_a_user_module_that_raises_on_import_is_a_config_error_naming_it(
    valid_configs: dict[type, dict[str, Any]], schema: type, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "user_code_that_raises.py").write_text("import math\n\nRATIO = 1 / 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    fields = list(dotted_fields(valid_configs[schema]))
    assert any(field.endswith("worker_cls") for field in fields), fields
    for field in fields:
        data = copy.deepcopy(valid_configs[schema])
        *parents, leaf = field.split(".")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = "user_code_that_raises.Thing"
        with pytest.raises(ConfigError) as error:
            load_pipeline_config(data, schema, BLOCKS)
        assert_names_field(str(error.value), field)
        assert (
            "cannot be imported: module 'user_code_that_raises' raised ZeroDivisionError: division by zero "
            f"({tmp_path}/user_code_that_raises.py:3)"
        ) in str(error.value)


@pytest.mark.parametrize(
    ("name", "schema", "model_setting"),
    [
        ("sft_arithmetic", SFTConfig, "actor_train.model_args.model_name_or_path"),
        ("rlvr_arithmetic", RLVRConfig, "pretrain"),
        ("dpo_arithmetic", DPOConfig, "pretrain"),
        ("distill_arithmetic", DistillConfig, "student.model_args.model_name_or_path"),
    ],
)
def test_a_check_that_needs_the_tokenizer_runs_in_validate_for_built_in_data_too(
    tmp_path: Path, name: str, schema: type, model_setting: str
) -> None:
    model = fake_model(tmp_path / "model", chat_template=False)
    overrides = [*ON_THIS_MACHINE, f"output_dir={tmp_path}", f"{model_setting}={model}"]
    overrides.append("data.apply_chat_template=true")
    if schema is DistillConfig:
        overrides.append(f"pretrain={model}")  # the teacher
    with pytest.raises(ConfigError, match=r"^data.apply_chat_template=true but the tokenizer of .* has no chat templ"):
        load_pipeline_config(compose_config(name, overrides), schema, BLOCKS)


def test_an_output_directory_that_cannot_be_written_is_a_config_error(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    for overrides, setting in [
        ([f"output_dir={blocker}/out"], "output_dir"),
        ([f"output_dir={tmp_path}", f"run_dir={blocker}/run"], "run_dir"),
        ([f"output_dir={tmp_path}", f"export_dir={blocker}/model"], "export_dir"),
    ]:
        fix = f"{blocker} is a file, not a directory; point {setting} at a writable directory"
        with pytest.raises(ConfigError, match=rf"^{setting}='{blocker}/\w+' cannot be written: {fix}$"):
            rlvr(*overrides)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_sglang_on_a_cpu_platform_is_refused_before_ray_starts() -> None:
    refused = r"^actor_infer.strategy_args.strategy_name='sglang' needs GPUs .* this run's platform is cpu: use vllm"
    with pytest.raises(ConfigError, match=refused):
        rlvr("actor_infer.strategy_args.strategy_name=sglang")


@pytest.mark.parametrize("place", ["/proc/roll_output", "/sys/roll_output"])
def test_an_output_directory_the_system_refuses_is_a_config_error_not_a_traceback(place: str) -> None:
    with pytest.raises(
        ConfigError, match=rf"^output_dir='{place}' cannot be written: /\w+ refuses new folders \(.+\); "
    ):
        rlvr(f"output_dir={place}")
    assert not Path(place).exists()


def test_resume_from_checkpoint_auto_resumes_when_there_is_a_checkpoint_and_starts_afresh_when_not(
    tmp_path: Path,
) -> None:
    output = f"output_dir={tmp_path}"
    assert rlvr(output, "resume_from_checkpoint=auto").resume_from_checkpoint == ""
    config = rlvr(output)
    save_driver_state(config.checkpoint_root, "step_3", {"step": 3, "sampler": {}, "val_history": []})
    assert rlvr(output, "resume_from_checkpoint=auto").resume_from_checkpoint == "latest"


def test_resume_from_checkpoint_honours_a_full_path_exactly_as_given(tmp_path: Path) -> None:
    other = tmp_path / "other_run" / "checkpoints"
    state = {"step": 2, "sampler": {"epoch": 0, "position": 4}, "val_history": []}
    save_driver_state(other, "step_2", state)
    output = f"output_dir={tmp_path / 'new'}"
    config = rlvr(output, f"resume_from_checkpoint={other / 'step_2'}")
    assert (config.resume_root, config.resume_tag) == (other, "step_2")
    assert (rlvr(output, f"resume_from_checkpoint={other / 'latest'}").resume_tag) is None
    with pytest.raises(ConfigError, match=rf"no complete checkpoint at {other}/step_9; name a saved step"):
        rlvr(output, f"resume_from_checkpoint={other / 'step_9'}")
    # A bare tag and `latest` name this run's own checkpoints.
    save_driver_state(config.checkpoint_root, "step_1", state)
    assert rlvr(output, "resume_from_checkpoint=step_1").resume_root == config.checkpoint_root
    assert rlvr(output, "resume_from_checkpoint=latest").resume_root == config.checkpoint_root

    class Run(TrainingRunPipeline):
        trained_role = "actor_train"

    loaded: list[object] = []
    run = object.__new__(Run)
    run.config = dpo(output, f"resume_from_checkpoint={other / 'step_2'}")
    run.clusters = {"actor_train": types.SimpleNamespace(load_checkpoint=lambda *where: loaded.append(where))}
    run.sampler = types.SimpleNamespace(load_state_dict=loaded.append)
    assert run.resume() == state
    assert loaded == [(str(other / "actor_train"), "step_2"), state["sampler"]]


def test_auto_dtype_becomes_the_platforms_choice_for_every_role(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`model_args.dtype=auto` leaves validate() as a precision the backends know, on every role."""
    from roll.distributed.strategy.deepspeed_config import resolve_deepspeed_config
    from roll.platforms.cpu import CpuPlatform

    for choice in ("bf16", "fp32"):
        monkeypatch.setattr(CpuPlatform, "preferred_dtype", lambda self, choice=choice: choice)
        config = rlvr(f"output_dir={tmp_path}", "actor_train.model_args.dtype=auto", "reference.model_args.dtype=auto")
        dtypes = {name: role.model_args.dtype for name, role in config.roles().items()}
        assert dtypes["actor_train"] == dtypes["reference"] == choice
        assert dtypes["actor_infer"] == "fp32"  # named in the YAML: kept
        deepspeed = resolve_deepspeed_config(config.actor_train, training=True)
        assert deepspeed["bf16"]["enabled"] is (choice == "bf16")
