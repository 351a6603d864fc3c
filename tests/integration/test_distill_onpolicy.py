"""On-policy distillation in RLVR end to end: a smaller student samples, an hf_infer teacher scores its tokens, the
REINFORCE++ update trains on that signal, and the policy is exported (RLVR's resume is tested in test_rlvr_pipeline)."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM

from tests.rlvr_runs import run_rlvr, small_policy_config

pytestmark = pytest.mark.slow

# Two steps of 4 prompts x 4 samples of at most 4 tokens, 8 held-out prompts; the 128-wide teacher on the student's
# device.
TWO_STEPS = (
    "actor_infer.generating_args.max_new_tokens=4",
    "teacher.model_args.model_name_or_path=tiny://qwen2",
    "teacher.device_mapping=0",
    "eval_batch_size=8",
    "max_steps=2",
    "eval_steps=2",
)


def test_the_teachers_log_probs_reward_the_students_samples(ray_session: None, tmp_path: Path) -> None:
    rows = run_rlvr(small_policy_config("distill_onpolicy_arithmetic", tmp_path, *TWO_STEPS))
    assert [row["step"] for row in rows] == [0, 1, 2]
    for step in (1, 2):
        row = rows[step]
        assert row["time/teacher_log_probs_s"] > 0 and row["time/old_log_probs_s"] > 0
        assert "actor/teacher_reverse_kl" in row and "actor/loss" in row and "time/reference_log_probs_s" not in row
    # Two random models disagree: the student's samples are far from the teacher's likely tokens.
    assert rows[1]["actor/teacher_reverse_kl"] > 0
    assert rows[2]["actor/teacher_reverse_kl"] != rows[1]["actor/teacher_reverse_kl"]

    run_dir = tmp_path / "distill_onpolicy"
    model = AutoModelForCausalLM.from_pretrained(run_dir / "model")
    assert model.config.hidden_size == 64  # the student's export, not the teacher's
