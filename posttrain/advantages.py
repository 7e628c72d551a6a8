"""Advantage estimators and reward transforms of the GRPO family: pure functions of tensors.

Shapes: every function works on one value per sample, `[N]` (N = prompts x generations);
`group_ids [N]` says which prompt each sample answers (any integers; equal id = same group).
The GRPO loop broadcasts the `[N]` advantages over the response tokens.

Estimators by name (`compute_advantages(name, ...)`, registry `ADVANTAGE_ESTIMATORS`):

    grpo          A_i = (r_i - b_i) / std       GRPO, DeepSeekMath https://arxiv.org/abs/2402.03300
                  b_i = mean of the group's other samples (leave_one_out) or of the whole group;
                  std = the group's sample std (Bessel), or the whole batch's (Lite PPO), or none
    rloo          A_i = r_i - mean_{j != i} r_j  RLOO https://arxiv.org/abs/2402.14740
    dr_grpo       A_i = r_i - mean_g r           Dr.GRPO https://arxiv.org/abs/2503.20783: no std
                  division (it favours too-easy / too-hard groups); the paper's other fix, a
                  constant instead of a per-response length normalizer, is the loss side:
                  `loss_fn.token_level_loss=true` divides by the global token count
    reinforce_pp  A = whiten(r - mean_g r) over the whole batch  REINFORCE++ https://arxiv.org/abs/2501.03262
                  (the "-baseline" variant for several samples per prompt; groups of one
                  sample get no baseline, as in the original REINFORCE++)

On-policy distillation (`on_policy_distillation_advantages`, `grpo.adv_estimator=
on_policy_distillation`) is token-level and comes from logprobs, not rewards:

    A_t = log pi_teacher(x_t | x_<t) - log pi_old(x_t | x_<t)   on the student's own samples x

the negative of the per-token reverse KL KL(pi || pi_teacher) estimated at the sampled token,
so that the policy gradient with these advantages descends the reverse KL to the teacher
("discount zero": each token is credited with its own term only). GKD, Agarwal et al.
https://arxiv.org/abs/2306.13649; Lu & Thinking Machines, "On-Policy Distillation" (2025).

Reward transforms: `scale_rewards` (linear map of a clamped range), DAPO overlong reward
shaping (`apply_overlong_reward_shaping`), overlong filtering (`overlong_filter_mask`) and
dynamic sampling (`dynamic_sampling_keep`), DAPO https://arxiv.org/abs/2503.14476.
"""

from __future__ import annotations

from typing import Callable

import torch

_Groups = tuple[torch.Tensor, torch.Tensor, int]


def _groups(rewards: torch.Tensor, group_ids: torch.Tensor, valid_mask: torch.Tensor | None) -> _Groups:
    """(group index per sample [N], valid mask as float [N], number of groups), with checks."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be [N], got shape {tuple(rewards.shape)}")
    group_ids = torch.as_tensor(group_ids, device=rewards.device)
    if group_ids.shape != rewards.shape:
        raise ValueError(f"group_ids {tuple(group_ids.shape)} and rewards {tuple(rewards.shape)} must have the same shape")
    if valid_mask is None:
        valid = torch.ones_like(rewards, dtype=torch.float32)
    else:
        valid = torch.as_tensor(valid_mask, device=rewards.device).float()
        if valid.shape != rewards.shape:
            raise ValueError(f"valid_mask {tuple(valid.shape)} and rewards {tuple(rewards.shape)} must have the same shape")
    _, inverse = torch.unique(group_ids, return_inverse=True)
    return inverse, valid, int(inverse.max()) + 1 if inverse.numel() else 0


def _group_sum(x: torch.Tensor, inverse: torch.Tensor, n_groups: int) -> torch.Tensor:
    return torch.zeros(n_groups, dtype=x.dtype, device=x.device).index_add_(0, inverse, x)


def _batch_mean_std(x: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean and sample std (Bessel) of `x [N]` over the samples where `valid [N]` (float 0/1) is 1."""
    n = valid.sum()
    mean = _only(x, valid).sum() / n.clamp(min=1)
    return mean, torch.sqrt(_only((x - mean).square(), valid).sum() / (n - 1).clamp(min=1))


def _only(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """`x` where `valid` is 1, else 0: a left-out sample's NaN or inf reward times 0 stayed NaN
    and took its group's (REINFORCE++: the batch's) statistics with it."""
    return torch.where(valid > 0, x, torch.zeros_like(x))


def baseline_and_std(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    leave_one_out: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample baseline and group std of the rewards.

    Args:
        rewards: `[N]` float.
        group_ids: `[N]` int, samples with the same id form a group (one prompt).
        valid_mask: `[N]` 0/1; only valid samples enter the baseline and the std (None = all).
        leave_one_out: baseline_i = mean of the OTHER valid samples of i's group (RLOO style);
            otherwise the mean of all valid samples of the group.
    Returns:
        baseline `[N]`, std `[N]`: std = sqrt(sum_j (r_j - mean_g)^2 / (n_g - 1)) over the n_g
        valid samples of the group (the group's spread, the same for every member).
        A group with fewer than 2 valid samples has nothing to compare with, and one whose valid
        rewards are all equal no spread: its baseline is each sample's own reward (advantage 0
        exactly) and its std is 0. Both float64: rewards that differ by about one float32 step
        (a reward model's scores) have a float32 mean whose rounding is as large as their spread,
        and over that tiny std every sample of such a group got a positive advantage.
    """
    r = rewards.double()
    return _baseline_and_std(r, *_groups(r, group_ids, valid_mask), leave_one_out)


def _baseline_and_std(r: torch.Tensor, inverse: torch.Tensor, valid: torch.Tensor, n_groups: int,
                      leave_one_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """`baseline_and_std` of float64 rewards `r` whose groups `_groups` has found."""
    valid = valid.double()
    n_g = _group_sum(valid, inverse, n_groups)
    sum_g = _group_sum(_only(r, valid), inverse, n_groups)
    mean_g = sum_g / n_g.clamp(min=1)
    n, s = n_g[inverse], sum_g[inverse]
    if leave_one_out:
        others = n - valid
        baseline = (s - _only(r, valid)) / others.clamp(min=1)
    else:
        baseline = mean_g[inverse]
    sq_dev_g = _group_sum(_only((r - mean_g[inverse]).square(), valid), inverse, n_groups)
    std = torch.sqrt(sq_dev_g / (n_g - 1).clamp(min=1))[inverse]
    # A group whose valid rewards are all equal is told so, not computed: its mean rounds (eight
    # rewards of 0.9 sum and divide to 0.9 + 1 ulp in float32), and that residue over a 1-ulp std
    # gave every sample of an all-solved group an advantage of -0.94 at a fractional reward.
    big = torch.finfo(r.dtype).max
    is_valid = valid > 0
    hi = r.new_full((n_groups,), -big).scatter_reduce(0, inverse, torch.where(is_valid, r, -big), "amax")
    lo = r.new_full((n_groups,), big).scatter_reduce(0, inverse, torch.where(is_valid, r, big), "amin")
    lonely = (n < 2) | (hi == lo)[inverse]
    baseline = torch.where(lonely, r, baseline)
    std = torch.where(lonely, torch.zeros_like(std), std)
    return baseline, std


def grpo_advantages(
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    leave_one_out: bool = True,
    normalize: bool | str = True,
    valid_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """GRPO: A_i = (r_i - b_i) / sigma, the division only where sigma > 0 (b_i: `baseline_and_std`).

    `normalize` picks sigma: "group" (or True) the std of i's group, DeepSeekMath
    https://arxiv.org/abs/2402.03300; "batch" the std of the rewards over all valid samples of
    the batch (Bessel), one scale for every group: Lite PPO's group mean with batch std, Liu et
    al. https://arxiv.org/abs/2508.08221 (TRL's `scale_rewards="batch"`), under which a group with
    one success in 16 (group std 0.25) is not pushed twice as hard as one split evenly (0.52);
    "none" (or False) no division. `[N]` rewards and group ids -> `[N]` float32 advantages. A group
    whose rewards are all equal has advantage 0 with any baseline and scale, and so has a sample
    `valid_mask` leaves out (it has no verdict to compare).
    """
    scale = {True: "group", False: "none"}.get(normalize, normalize)
    if scale not in ("group", "batch", "none"):
        raise ValueError(f"normalize={normalize!r}: expected 'group' (or True), 'batch' or 'none' (or False)")
    r = rewards.double()
    inverse, valid, n_groups = _groups(r, group_ids, valid_mask)
    baseline, std = _baseline_and_std(r, inverse, valid, n_groups, leave_one_out)
    adv = r - baseline
    if scale == "batch":
        std = _batch_mean_std(r, valid)[1].expand_as(adv)
    if scale != "none":
        adv = torch.where(std > 0, adv / torch.where(std > 0, std, torch.ones_like(std)), adv)
    return _only(adv, valid).float()


def rloo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, valid_mask: torch.Tensor | None = None) -> torch.Tensor:
    """RLOO: A_i = r_i - mean_{j != i, j in group} r_j (no std). https://arxiv.org/abs/2402.14740"""
    return grpo_advantages(rewards, group_ids, leave_one_out=True, normalize=False, valid_mask=valid_mask)


def dr_grpo_advantages(rewards: torch.Tensor, group_ids: torch.Tensor, valid_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Dr.GRPO: A_i = r_i - mean_group r (no std division). https://arxiv.org/abs/2503.20783

    Pair with `loss_fn.token_level_loss=true` (sum over tokens / global token count) for the
    paper's removal of the per-response length normalization.
    """
    return grpo_advantages(rewards, group_ids, leave_one_out=False, normalize=False, valid_mask=valid_mask)


def reinforce_pp_advantages(
    rewards: torch.Tensor, group_ids: torch.Tensor, valid_mask: torch.Tensor | None = None
) -> torch.Tensor:
    """REINFORCE++: A = (a - mean(a)) / std(a), a_i = r_i - mean_group r, statistics over the
    valid samples of the whole batch (global batch normalization). https://arxiv.org/abs/2501.03262

    Groups with a single valid sample keep a_i = r_i (no baseline, the original REINFORCE++).
    `[N]` -> `[N]` (float32; 0 for a sample `valid_mask` leaves out); a batch with zero spread
    gives the centred values unscaled.
    """
    r = rewards.double()
    inverse, valid, n_groups = _groups(r, group_ids, valid_mask)
    baseline, _ = _baseline_and_std(r, inverse, valid, n_groups, leave_one_out=False)
    n = _group_sum(valid, inverse, n_groups)[inverse]
    centred = torch.where(n >= 2, r - baseline, r)
    mean, std = _batch_mean_std(centred, valid)
    return _only((centred - mean) / std if std > 0 else centred - mean, valid).float()


ADVANTAGE_ESTIMATORS: dict[str, Callable[..., torch.Tensor]] = {
    "grpo": grpo_advantages,
    "rloo": rloo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}


def compute_advantages(
    name: str,
    rewards: torch.Tensor,
    group_ids: torch.Tensor,
    valid_mask: torch.Tensor | None = None,
    *,
    leave_one_out: bool = True,
    normalize: bool | str = True,
) -> torch.Tensor:
    """`[N]` advantages from the estimator registered as `name` (unknown names list the valid ones).

    `leave_one_out` and `normalize` (grpo.use_leave_one_out_baseline / grpo.normalize_rewards)
    apply to "grpo" only; the other estimators fix both by definition (module docstring).
    """
    if name not in ADVANTAGE_ESTIMATORS:
        raise ValueError(f"unknown advantage estimator {name!r}; valid: {', '.join(sorted(ADVANTAGE_ESTIMATORS))}")
    if name == "grpo":
        return grpo_advantages(rewards, group_ids, leave_one_out, normalize, valid_mask)
    return ADVANTAGE_ESTIMATORS[name](rewards, group_ids, valid_mask)


def on_policy_distillation_advantages(
    teacher_logprobs: torch.Tensor, logprobs: torch.Tensor, token_mask: torch.Tensor
) -> torch.Tensor:
    """`[B, S]` per-token advantages log pi_teacher - log pi_old on the masked (generated) tokens,
    0 elsewhere (module docstring). All inputs `[B, S]`, token-aligned (position t holds the
    logprob of token t); `logprobs` are the policy's before the update (prev_logprobs), not the
    sampler's (generation_logprobs: top-k/top-p renormalise them)."""
    if not (teacher_logprobs.shape == logprobs.shape == token_mask.shape):
        raise ValueError(f"teacher_logprobs {tuple(teacher_logprobs.shape)}, logprobs {tuple(logprobs.shape)} and "
                         f"token_mask {tuple(token_mask.shape)} must have the same [B, S] shape")
    return (teacher_logprobs.float() - logprobs.float()) * token_mask


# --------------------------------------------------------------------------- reward transforms


def scale_rewards(
    rewards: torch.Tensor,
    source_min: float = 0.0,
    source_max: float = 1.0,
    target_min: float = 0.0,
    target_max: float = 1.0,
) -> torch.Tensor:
    """Clamp `[N]` rewards to [source_min, source_max], then map that range linearly onto
    [target_min, target_max]: r' = t_min + (clamp(r) - s_min) / (s_max - s_min) * (t_max - t_min)."""
    if source_max <= source_min:
        raise ValueError(f"reward_scaling: source_max ({source_max}) must exceed source_min ({source_min})")
    r = rewards.float().clamp(min=source_min, max=source_max)
    return target_min + (r - source_min) / (source_max - source_min) * (target_max - target_min)


def apply_overlong_reward_shaping(
    rewards: torch.Tensor,
    response_lengths: torch.Tensor,
    max_response_length: int,
    overlong_buffer_length: int,
    overlong_buffer_penalty: float,
) -> torch.Tensor:
    """DAPO soft overlong punishment (https://arxiv.org/abs/2503.14476, eq. 13), added to `[N]` rewards.

    With L = response length, L_max = max_response_length, L_buf = overlong_buffer_length:
        0                                           if L <= L_max - L_buf
        (L_max - L_buf - L) / L_buf * penalty       if L_max - L_buf < L <= L_max
        -penalty                                    if L > L_max
    """
    if not 0 < overlong_buffer_length <= max_response_length:
        raise ValueError(
            f"reward_shaping: overlong_buffer_length ({overlong_buffer_length}) must be in "
            f"(0, max_response_length={max_response_length}]"
        )
    excess = response_lengths.float() - (max_response_length - overlong_buffer_length)
    penalty = (excess / overlong_buffer_length).clamp(min=0.0, max=1.0) * overlong_buffer_penalty
    return rewards.float() - penalty


def overlong_filter_mask(truncated: torch.Tensor, sample_mask: torch.Tensor | None = None) -> torch.Tensor:
    """DAPO overlong filtering: `[N]` sample mask that is 0 for truncated samples.

    Truncated samples still count in their group's baseline (compute the advantages without
    this mask); only their loss is dropped, since a cut-off answer is not evidence against
    its reasoning.
    """
    keep = 1.0 - truncated.float()
    return keep if sample_mask is None else keep * sample_mask.float()


def dynamic_sampling_keep(rewards: torch.Tensor, group_ids: torch.Tensor,
                          valid_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """DAPO dynamic sampling: indices `[K]` (ascending) of the samples whose group's rewards are
    not all equal, by the environments' rewards (DAPO filters on accuracy): before scaling and
    overlong shaping, whose length penalty alone can tell a group of equally right answers apart.
    Such groups have zero advantage under every group baseline and only dilute the batch (shaped:
    one that ranks length, not correctness); the loop generates more batches (up to
    `grpo.dynamic_sampling_max_gen_batches`) until enough groups are kept. `valid_mask` `[N]`:
    only those samples' rewards count (those the baseline is over: an environment's failure's
    placeholder 0 made a group of equal scored rewards look varied, and it trained nothing).

    Metrics: dynamic_sampling/groups, /groups_kept, /zero_variance_fraction.
    """
    r = rewards.float()
    inverse, valid, n_groups = _groups(r, group_ids, valid_mask)
    scored = valid > 0
    hi = torch.full((n_groups,), float("-inf"), device=r.device).scatter_reduce(
        0, inverse, torch.where(scored, r, float("-inf")), reduce="amax")
    lo = torch.full((n_groups,), float("inf"), device=r.device).scatter_reduce(
        0, inverse, torch.where(scored, r, float("inf")), reduce="amin")
    varied = hi > lo
    keep = torch.nonzero(varied[inverse]).flatten()
    kept = int(varied.sum())
    return keep, {
        "dynamic_sampling/groups": float(n_groups),
        "dynamic_sampling/groups_kept": float(kept),
        "dynamic_sampling/zero_variance_fraction": 1.0 - kept / n_groups if n_groups else 0.0,
    }
