"""Driver-side processing of a rollout: rewards into token rewards, KL, advantages, dynamic sampling, overlong
penalty and filtering."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from roll.algorithms import reward_shaping
from roll.algorithms.advantages import get_advantage_estimator
from roll.algorithms.episode_rows import EPISODE_INDEX, EpisodeRows, episode_groups
from roll.algorithms.kl import apply_kl_penalty
from roll.configs.algorithm_config import AlgorithmArguments
from roll.configs.worker_config import WorkerConfig
from roll.distributed.scheduler.protocol import DataProto
from roll.pipeline.base.rollout_batches import concat_rollouts
from roll.pipeline.rlvr.rlvr_config import TOKEN_LEVEL_ESTIMATORS
from roll.utils.functionals import masked_mean


def outcome_token_rewards(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Each sequence's score on its last response token, zero elsewhere: `[B]` -> `[B, R]`.

    Keeps `token_rewards.sum(-1) == scores` for every row: an empty response (no token in its mask)
    gets its score at position 0 although that position is masked out. Outcome estimators (grpo,
    rloo) sum a row's token rewards, so its score still counts in its group's statistics; token-level
    estimators (gae, reinforce_plus_plus) skip masked positions, and the row has no token to train.
    """
    token_rewards = torch.zeros(response_mask.shape, dtype=torch.float32)
    # The last masked-in position, not the count: a multi-turn mask has holes on environment tokens.
    positions = torch.arange(1, response_mask.shape[1] + 1)
    last = ((response_mask != 0) * positions).max(-1).values.sub(1).clamp(min=0)
    token_rewards[torch.arange(len(scores)), last] = scores.float()
    return token_rewards


def compute_advantages(
    batch: DataProto,
    group_index: torch.Tensor,
    algorithm: AlgorithmArguments,
    kl_coef: float,
    excluded: torch.Tensor | None = None,
) -> tuple[DataProto, dict[str, float]]:
    """Add `token_rewards`, `advantages` and `returns` to `batch`; return it with reward/KL metrics.

    Token rewards: the score (times `score_weight`) on the last response token (multi-turn episodes under gae
    or reinforce_plus_plus: their `turn_rewards` instead, each turn's on its last sampled token, discounted
    by `algorithm.gamma` per token and their `turn_discounts` between turns), minus the KL
    penalty to the reference per token, plus the teacher's per-token signal when the batch holds `teacher_log_probs`.

    `excluded` (bool `[B]`, e.g. episodes whose environment failed: their 0 is no reward) marks rows left out of
    every statistic (group and batch normalisation, GRPO / RLOO groups, whitening) and of the loss: their
    `response_mask` is zeroed in place, and they get no advantage.

    A batch with `episode_index` (agent episodes of several segments, `roll.algorithms.episode_rows`) has the
    statistics of its episodes, one score each, whatever their rows: reward normalisation over episodes, and for
    GRPO / RLOO each episode's score (its last row's, plus the token rewards such as the KL penalty of all its
    rows) in its group, its advantage then given to every row of it. Token-level estimators take each row as
    its own trajectory, with the reward on each segment's last sampled token (`turn_rewards`).
    """
    data = batch.batch
    norm_groups = torch.zeros_like(group_index) if algorithm.reward_norm == "batch" else group_index
    if excluded is not None and bool(excluded.any()):
        excluded = excluded.bool()
        group_index, norm_groups = _isolated(group_index, excluded), _isolated(norm_groups, excluded)
        data["response_mask"] = data["response_mask"] * (~excluded).unsqueeze(-1).to(data["response_mask"].dtype)
    mask = data["response_mask"]
    episodes = EpisodeRows.of(data[EPISODE_INDEX]) if EPISODE_INDEX in data else None
    outcome = algorithm.adv_estimator not in TOKEN_LEVEL_ESTIMATORS
    norm_mode = "none" if algorithm.reward_norm == "none" else "group"

    def normalized(scores: torch.Tensor) -> torch.Tensor:
        if episodes is None:
            return reward_shaping.normalize_scores(scores, norm_groups, norm_mode)
        per_episode = episodes.per_episode(scores), episodes.per_episode(norm_groups)
        return episodes.to_rows(reward_shaping.normalize_scores(*per_episode, norm_mode))

    scores = normalized(data["scores"].float())
    if algorithm.reward_clip is not None:
        scores = reward_shaping.clip_scores(scores, -algorithm.reward_clip, algorithm.reward_clip)
    if episodes is not None and outcome:  # an episode's score counts once in its sum of token rewards
        scores = scores * episodes.is_last()
    token_rewards = outcome_token_rewards(algorithm.score_weight * scores, mask)
    gamma: float | torch.Tensor = algorithm.gamma
    if "turn_rewards" in data and algorithm.adv_estimator in TOKEN_LEVEL_ESTIMATORS:
        # Multi-turn: each turn's reward on its last sampled token, for estimators that credit tokens one by one,
        # and env.turn_gamma from a turn's last sampled token to the next turn's first. What the score's processing
        # changed (reward_norm, the overlong penalty: the score as trained minus the score as the turns gave it)
        # goes on the last sampled token, so these estimators read them too.
        as_given = data["verifier_scores"].float() if "verifier_scores" in data else data["scores"].float()
        processed = normalized(data["scores"].float())
        token_rewards = data["turn_rewards"].float() + outcome_token_rewards(processed - as_given, mask)
        token_rewards = algorithm.score_weight * token_rewards
        gamma = algorithm.gamma * data["turn_discounts"].float()
        if algorithm.reward_clip is not None:
            token_rewards = token_rewards.clamp(-algorithm.reward_clip, algorithm.reward_clip)
    metrics: dict[str, float] = {}
    if "teacher_log_probs" in data:
        # On-policy distillation: minus the k1 estimate of KL(actor || teacher) at each sampled token.
        token_rewards, teacher_kl = apply_kl_penalty(
            token_rewards, data["old_log_probs"], data["teacher_log_probs"], mask, algorithm.teacher_kl_coef, "k1"
        )
        metrics["actor/teacher_reverse_kl"] = teacher_kl.mean().item()
    if "ref_log_probs" in data:
        penalty_coef = kl_coef if algorithm.kl_penalty_coef > 0 or algorithm.adaptive_kl_target else 0.0
        token_rewards, sequence_kl = apply_kl_penalty(
            token_rewards, data["old_log_probs"], data["ref_log_probs"], mask, penalty_coef, algorithm.kl_penalty_kind
        )
        metrics["actor/kl"] = sequence_kl.mean().item()
        metrics["actor/kl_coef"] = penalty_coef
    estimator = get_advantage_estimator(algorithm.adv_estimator)
    extra = {
        "grpo": {"norm_by_std": algorithm.norm_adv_by_std},
        "gae": {"whiten": algorithm.whiten_advantages},
    }.get(algorithm.adv_estimator, {})
    if episodes is not None and outcome:
        # One sequence per episode: the sum of its rows' token rewards, its advantage given to each of its rows.
        sums = episodes.sum(token_rewards.sum(-1))
        groups = episodes.per_episode(group_index)
        per_episode, _ = estimator(sums.unsqueeze(-1), torch.ones_like(sums).unsqueeze(-1), group_index=groups, **extra)
        advantages = episodes.to_rows(per_episode.squeeze(-1)).unsqueeze(-1) * mask.to(token_rewards.dtype)
        returns = advantages.clone()
    else:
        advantages, returns = estimator(
            token_rewards,
            mask,
            values=data.get("values"),
            group_index=group_index,
            gamma=gamma,
            lam=algorithm.lam,
            **extra,
        )
    metrics["critic/advantages_mean"] = masked_mean(advantages, mask).item()
    metrics["critic/returns_mean"] = masked_mean(returns, mask).item()
    added = DataProto.from_dict(tensors={"token_rewards": token_rewards, "advantages": advantages, "returns": returns})
    return batch.union(added), metrics


def _isolated(group_index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """`group_index` with each of `rows` (bool `[B]`) in a new group of its own: no other row's statistics see it."""
    isolated = group_index.clone()
    start = int(group_index.max()) + 1 if len(group_index) else 0
    isolated[rows] = torch.arange(start, start + int(rows.sum()), dtype=group_index.dtype)
    return isolated


def consumer_row_multiple(trainers: Iterable[WorkerConfig], forward_roles: Iterable[WorkerConfig]) -> int:
    """The row count a step's batch must be a multiple of for every role that takes it.

    A training role needs whole optimizer steps on each rank (per_device_train_batch_size x
    gradient_accumulation_steps x dp size); a forward-only role (reference) needs its dp size.
    """
    multiples = [role.dp_size for role in forward_roles]
    multiples += [optimizer_step_rows(role) for role in trainers]
    return math.lcm(*multiples)


def optimizer_step_rows(role: WorkerConfig) -> int:
    """The rows of one optimizer step of a training role over all its ranks."""
    args = role.training_args
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * role.dp_size


def keep_informative_groups(
    batch: DataProto,
    group_index: torch.Tensor,
    row_multiple: int,
    max_rows: int | None = None,
    excluded: torch.Tensor | None = None,
) -> tuple[DataProto, torch.Tensor, dict[str, float]]:
    """Dynamic sampling: drop the groups whose samples all scored the same (they carry no GRPO signal).

    Groups are judged on `verifier_scores` (the reward before the overlong penalty; for a 0/1 verifier this is
    DAPO's 0 < correct < n), else on `scores`. The kept rows are cut to at most `max_rows` and to a multiple of
    both `row_multiple` (see `consumer_row_multiple`) and the group size, dropping whole informative groups
    from the end, so every role accepts the batch and no group is split. May return no rows. The `excluded` rows
    (bool `[B]`: failed episodes, see `compute_advantages`) are not judged: a group is judged on its other rows.
    """
    keep = _informative(batch, group_index, excluded)
    kept_groups = torch.unique_consecutive(group_index[keep])
    if EPISODE_INDEX in batch.batch:  # groups of as many rows as their episodes' segments: `pad_rows` evens them
        return _whole_groups(batch, group_index, kept_groups, len(batch) if max_rows is None else max_rows)
    group_size = int((group_index == group_index[0]).sum())
    unit_groups = math.lcm(row_multiple, group_size) // group_size
    usable = min(len(kept_groups), len(batch) if max_rows is None else max_rows // group_size)
    chosen = torch.isin(group_index, kept_groups[: usable // unit_groups * unit_groups])
    indices = torch.nonzero(chosen).squeeze(-1)
    metrics = {
        "rollout/kept_fraction": chosen.float().mean().item(),
        "rollout/informative_groups": float(len(kept_groups)),
    }
    return batch[indices], group_index[indices], metrics


def _whole_groups(
    batch: DataProto, group_index: torch.Tensor, groups: torch.Tensor, max_rows: int
) -> tuple[DataProto, torch.Tensor, dict[str, float]]:
    """The rows of `groups`, the first ones that fit in `max_rows` together."""
    sizes = torch.stack([(group_index == group).sum() for group in groups]) if len(groups) else torch.zeros(0)
    fitting = groups[: int((sizes.cumsum(0) <= max_rows).sum())]
    chosen = torch.isin(group_index, fitting)
    indices = torch.nonzero(chosen).squeeze(-1)
    metrics = {"rollout/kept_fraction": chosen.float().mean().item(), "rollout/informative_groups": float(len(groups))}
    return batch[indices], group_index[indices], metrics


def rollout_groups(batch: DataProto, group_size: int) -> torch.Tensor:
    """Each row's GRPO group: of its episode (`episode_index`, episodes of several rows), else of its place in
    `group_size` repeats of each prompt or seed."""
    if EPISODE_INDEX in batch.batch:
        return episode_groups(batch.batch[EPISODE_INDEX], group_size)
    return reward_shaping.group_index_from_repeat(len(batch) // group_size, group_size, interleave=True)


def append_round(
    batch: DataProto, group_index: torch.Tensor, more: DataProto, group_size: int, pad_id: int
) -> tuple[DataProto, torch.Tensor]:
    """Dynamic sampling's next round `more` after `batch`: prompts widened to one width, its groups (and episodes)
    numbered after `batch`'s."""
    if EPISODE_INDEX in more.batch:
        more.batch[EPISODE_INDEX] = more.batch[EPISODE_INDEX] + int(batch.batch[EPISODE_INDEX].max()) + 1
    more_index = rollout_groups(more, group_size)
    more_index = more_index - int(more_index.min()) + int(group_index.max()) + 1
    return concat_rollouts([batch, more], pad_id), torch.cat([group_index, more_index])


def pad_rows(batch: DataProto, group_index: torch.Tensor, row_multiple: int) -> tuple[DataProto, torch.Tensor]:
    """A batch of agent episodes (`episode_index`, a variable number of rows) padded to a multiple of `row_multiple`
    rows, which every role that takes it needs: copies of its first rows, each an episode and a group of its own,
    with no token in the loss and marked `reward_failed` so that no statistic counts them. Other batches as they
    are (their row count is a multiple by configuration).

    The padding rows are spread evenly between the episodes: each optimizer step normalises its loss over its own
    rows, so padding gathered at the end would leave the last step a few real rows that weigh as much as a full one.
    """
    if EPISODE_INDEX not in batch.batch or len(batch) % row_multiple == 0:
        return batch, group_index
    padded, extra = batch.pad_to_divisor(row_multiple)
    added = torch.arange(len(batch), len(padded))
    data = padded.batch
    data["response_mask"][added] = 0
    data["reward_failed"][added] = 1.0
    data[EPISODE_INDEX][added] = int(batch.batch[EPISODE_INDEX].max()) + 1 + torch.arange(extra)
    groups = torch.cat([group_index, int(group_index.max()) + 1 + torch.arange(extra, dtype=group_index.dtype)])
    # Each real row at its episode's first row's place in (0, 1), each padding row at its own: a stable sort by
    # place interleaves them and keeps an episode's rows together and in order.
    episodes = EpisodeRows.of(batch.batch[EPISODE_INDEX])
    first = torch.zeros(len(episodes.last), dtype=torch.long).scatter_reduce(
        0, episodes.row_episode, torch.arange(len(batch)), "amin", include_self=False
    )
    places = torch.cat([first[episodes.row_episode] / len(batch), (torch.arange(extra) + 0.5) / extra])
    order = torch.argsort(places, stable=True)
    return padded[order], groups[order]


def informative_rows(batch: DataProto, group_index: torch.Tensor, excluded: torch.Tensor | None = None) -> int:
    """How many rows of `batch` belong to groups whose samples (not `excluded`) did not all score the same."""
    return int(_informative(batch, group_index, excluded).sum())


def _informative(batch: DataProto, group_index: torch.Tensor, excluded: torch.Tensor | None = None) -> torch.Tensor:
    """Bool `[B]`: the rows whose group's `verifier_scores` (else `scores`) are not all equal, `excluded` rows left
    out (each takes its group's highest score of the others, so it adds no spread)."""
    data = batch.batch
    scores = data.get("verifier_scores", data["scores"]).float()
    if excluded is not None and bool(excluded.any()):
        excluded = excluded.bool()
        _, inverse = torch.unique(group_index, return_inverse=True)
        highs = torch.full((int(inverse.max()) + 1,), -math.inf).scatter_reduce(
            0, inverse, scores.masked_fill(excluded, -math.inf), "amax"
        )
        scores = torch.where(excluded, highs[inverse], scores)
    return reward_shaping.dynamic_sampling_keep(scores, group_index)


def add_overlong_penalty(
    batch: DataProto, max_new_tokens: int, algorithm: AlgorithmArguments, lengths: torch.Tensor | None = None
) -> float:
    """Add DAPO's soft overlong penalty (`reward_shaping.overlong_penalty`) to `batch`'s scores in place; return
    its mean over the rows. `verifier_scores` keeps the scores without it (dynamic sampling judges on those).

    `lengths` are the rows' lengths counted against `max_new_tokens` (default: their sampled tokens; a multi-turn
    episode's are its whole trajectory, observations included, as its budget is)."""
    batch.batch["verifier_scores"] = batch.batch["scores"].float().clone()
    penalty = reward_shaping.overlong_penalty(
        batch.batch["response_mask"].sum(-1) if lengths is None else lengths,
        max_new_tokens,
        algorithm.overlong_buffer_len,
        algorithm.overlong_penalty_factor,
    )
    batch.batch["scores"] = batch.batch["scores"].float() + penalty
    return penalty.mean().item()


def mask_truncated_responses(batch: DataProto) -> float:
    """DAPO's overlong filtering: zero, in place, the response mask of the rows the engine cut at
    `max_new_tokens` (the rollout's `truncated`); return the fraction of rows masked.

    Run after the advantages: truncated samples still count in their group's statistics, but get no loss.
    """
    data = batch.batch
    truncated = data["truncated"]
    data["response_mask"] = data["response_mask"] * (~truncated).unsqueeze(-1).to(data["response_mask"].dtype)
    return truncated.float().mean().item()
