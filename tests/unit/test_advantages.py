"""Advantage estimators and reward transforms on hand-computed values.

Groups used throughout:
    A (id 0): rewards 1, 0, 0, 0   mean 0.25, sample std sqrt(0.75 / 3) = 0.5
    B (id 1): rewards 1, 1, 1, 1   no spread
    C (id 2): rewards 0.5, 1.5     mean 1.0, sample std sqrt(0.5 / 1) = 0.70711
"""

import math

import pytest
import torch

from posttrain.advantages import (
    ADVANTAGE_ESTIMATORS,
    apply_overlong_reward_shaping,
    baseline_and_std,
    compute_advantages,
    dynamic_sampling_keep,
    grpo_advantages,
    on_policy_distillation_advantages,
    overlong_filter_mask,
    scale_rewards,
)

REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0, 0.5, 1.5])
GROUPS = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1, 2, 2])
S2 = math.sqrt(0.5)


def approx(x):
    return pytest.approx(x, abs=1e-5)


def test_baseline_and_std_leave_one_out():
    baseline, std = baseline_and_std(REWARDS, GROUPS, leave_one_out=True)
    assert baseline.tolist() == approx([0.0, 1 / 3, 1 / 3, 1 / 3, 1, 1, 1, 1, 1.5, 0.5])
    assert std.tolist() == approx([0.5] * 4 + [0.0] * 4 + [S2] * 2)


def test_baseline_and_std_group_mean():
    baseline, std = baseline_and_std(REWARDS, GROUPS, leave_one_out=False)
    assert baseline.tolist() == approx([0.25] * 4 + [1.0] * 4 + [1.0] * 2)
    assert std.tolist() == approx([0.5] * 4 + [0.0] * 4 + [S2] * 2)


def test_grpo_variants():
    assert grpo_advantages(REWARDS, GROUPS).tolist() == approx(
        [2.0, -2 / 3, -2 / 3, -2 / 3, 0, 0, 0, 0, -1 / S2, 1 / S2]
    )
    assert grpo_advantages(REWARDS, GROUPS, leave_one_out=False).tolist() == approx(
        [1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0, -0.5 / S2, 0.5 / S2]
    )
    assert grpo_advantages(REWARDS, GROUPS, leave_one_out=True, normalize=False).tolist() == approx(
        [1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0, -1.0, 1.0]
    )


def test_batch_std_scales_every_group_by_the_std_of_all_rewards():
    # All ten rewards: mean 7 / 10, squared deviations 5 x 0.09 (the ones) + 3 x 0.49 (the zeros)
    # + 0.04 + 0.64 = 2.6, sample variance 2.6 / 9.
    sigma = math.sqrt(2.6 / 9)
    adv = grpo_advantages(REWARDS, GROUPS, leave_one_out=False, normalize="batch")
    assert adv.tolist() == approx([x / sigma for x in [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0, -0.5, 0.5]])
    # One scale for all: A's 1-of-4 success and C's split keep their ratio of centred rewards,
    # where each group's own std put them at 3 and 1.41 (0.75 / 0.5 and 0.5 / S2).
    assert adv[0] / adv[9] == pytest.approx(1.5)
    # Left-out samples leave the std as they leave the baseline: A's 2nd sample invalid ->
    # rewards 1, 0, 0, 1, 1, 1, 1, 0.5, 1.5, mean 7 / 9.
    valid = torch.ones(10)
    valid[1] = 0
    r = [x for i, x in enumerate(REWARDS.tolist()) if i != 1]
    m = sum(r) / 9
    sigma = math.sqrt(sum((x - m) ** 2 for x in r) / 8)
    got = grpo_advantages(REWARDS, GROUPS, leave_one_out=False, normalize="batch", valid_mask=valid)
    assert got[0].item() == approx((1 - 1 / 3) / sigma)
    # The spellings: True / "group" and False / "none" are the same; anything else is refused.
    assert grpo_advantages(REWARDS, GROUPS, normalize="group").tolist() == approx(grpo_advantages(REWARDS, GROUPS).tolist())
    assert (grpo_advantages(REWARDS, GROUPS, normalize="none").tolist()
            == approx(grpo_advantages(REWARDS, GROUPS, normalize=False).tolist()))
    with pytest.raises(ValueError, match="normalize='batc': expected 'group'"):
        grpo_advantages(REWARDS, GROUPS, normalize="batc")
    # No spread anywhere: nothing to divide by, advantages 0.
    assert grpo_advantages(torch.ones(4), torch.tensor([0, 0, 1, 1]), normalize="batch").tolist() == [0.0] * 4


def test_valid_mask_excludes_samples_from_the_statistics():
    # group A with its 2nd sample invalid: valid rewards 1, 0, 0 -> mean 1/3, std sqrt((6/9) / 2)
    valid = torch.tensor([1.0, 0.0, 1.0, 1.0] + [1.0] * 6)
    baseline, std = baseline_and_std(REWARDS, GROUPS, valid_mask=valid, leave_one_out=True)
    assert baseline[:4].tolist() == approx([0.0, 1 / 3, 0.5, 0.5])
    assert std[:4].tolist() == approx([math.sqrt(1 / 3)] * 4)


def test_groups_with_fewer_than_two_valid_samples_get_zero_advantage():
    rewards = torch.tensor([0.7, 1.0, 0.0, 3.0])
    groups = torch.tensor([5, 9, 9, 2])  # any integer ids, in any order
    valid = torch.tensor([1.0, 1.0, 0.0, 1.0])
    for loo in (True, False):
        adv = grpo_advantages(rewards, groups, leave_one_out=loo, valid_mask=valid)
        assert adv.tolist() == approx([0.0, 0.0, 0.0, 0.0])


@pytest.mark.parametrize("reward", [0.1, 0.3, 0.9, -0.45, 2.2, 1 / 3])
def test_a_group_of_equal_fractional_rewards_gets_exactly_zero_advantage(reward):
    # Computed, eight rewards of 0.9 average to 0.9 + 1 ulp in float32, and that residue over the
    # 1-ulp std gave each sample -0.94: an all-solved group pushed down, trained as if informative.
    rewards = torch.tensor([reward] * 8 + [reward] * 3 + [0.0] + [0.0, 1.0])
    groups = torch.tensor([0] * 8 + [1] * 4 + [2] * 2)
    valid = torch.tensor([1.0] * 11 + [0.0] + [1.0] * 2)  # group 1's odd one out is not valid
    for name in ADVANTAGE_ESTIMATORS:
        for normalize in ("group", "batch", "none"):
            adv = compute_advantages(name, rewards, groups, valid, normalize=normalize,
                                     leave_one_out=normalize != "none")
            assert adv[:12].tolist() == [0.0] * 12, (name, normalize)
    # Rewards that differ are compared as before: group 2's 0 and 1 are -+1/sqrt(2) from their mean.
    adv = grpo_advantages(rewards, groups, leave_one_out=False, valid_mask=valid)
    assert adv[12:].tolist() == approx([-S2, S2])


def test_equal_float64_rewards_are_told_equal_not_computed():
    # float64 rewards (a custom reward function's) are not rounded from float32 on the way in:
    # 64 equal ones summed and divided miss their value by an ulp, which over the ulp-sized std
    # gave each sample -0.99.
    rewards = torch.full((64,), -2.449309742605783, dtype=torch.float64)
    for loo in (False, True):
        assert grpo_advantages(rewards, torch.zeros(64, dtype=torch.long), leave_one_out=loo).tolist() == [0.0] * 64


def test_rewards_one_float32_step_apart_keep_the_signs_of_their_differences():
    # In float32 the group mean's rounding was as large as the spread: every sample of
    # [0.9, 0.9, 0.9, 0.9 + 1 ulp] came out positive (0, 0, 0, 1.73; leave-one-out all > 0).
    rewards = torch.tensor([0.9, 0.9, 0.9, 0.9 + 1e-7])
    groups = torch.zeros(4, dtype=torch.long)
    assert grpo_advantages(rewards, groups, leave_one_out=False).tolist() == approx([-0.5, -0.5, -0.5, 1.5])
    assert grpo_advantages(rewards, groups, leave_one_out=True).tolist() == approx([-2 / 3] * 3 + [2.0])
    seven = torch.tensor([0.3] * 7 + [0.3 + 3e-8])
    adv = grpo_advantages(seven, torch.zeros(8, dtype=torch.long), leave_one_out=False)
    assert adv.dtype == torch.float32 and adv[:7].tolist() == approx([-1 / 8 ** 0.5] * 7)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_left_out_non_finite_reward_touches_nothing(bad):
    rewards = torch.tensor([1.0, bad, 0.5, 0.0, 1.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1])
    valid = torch.tensor([1.0, 0.0, 1.0, 1.0, 1.0, 1.0])
    clean = torch.tensor([1.0, 0.5, 0.0, 1.0, 0.0])
    keep = [0, 2, 3, 4, 5]
    for name in ADVANTAGE_ESTIMATORS:
        got = compute_advantages(name, rewards, groups, valid)
        want = compute_advantages(name, clean, torch.tensor([0, 0, 0, 1, 1]))
        assert got[1].item() == 0.0 and got[keep].tolist() == approx(want.tolist()), name


def test_rloo_and_dr_grpo():
    assert compute_advantages("rloo", REWARDS, GROUPS).tolist() == approx(
        [1.0, -1 / 3, -1 / 3, -1 / 3, 0, 0, 0, 0, -1.0, 1.0]
    )
    # leave_one_out / normalize do not apply to the fixed estimators
    assert compute_advantages("dr_grpo", REWARDS, GROUPS, leave_one_out=True, normalize=True).tolist() == approx(
        [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0, -0.5, 0.5]
    )


def test_reinforce_pp_global_normalization():
    # centred a = dr_grpo values, mean 0, sample var (0.75 + 0.5) / 9
    std = math.sqrt(1.25 / 9)
    assert compute_advantages("reinforce_pp", REWARDS, GROUPS).tolist() == approx(
        [0.75 / std] + [-0.25 / std] * 3 + [0.0] * 4 + [-0.5 / std, 0.5 / std]
    )
    # one sample per prompt: no baseline, only the batch whitening
    adv = compute_advantages("reinforce_pp", torch.tensor([1.0, 0.0, 1.0]), torch.tensor([0, 1, 2]))
    s = math.sqrt(1 / 3)
    assert adv.tolist() == approx([(1 / 3) / s, (-2 / 3) / s, (1 / 3) / s])


def test_registry_and_errors():
    import typing

    from posttrain.schemas import GRPOConfig

    assert sorted(ADVANTAGE_ESTIMATORS) == ["dr_grpo", "grpo", "reinforce_pp", "rloo"]
    # The config's choices: the registry's, and distillation's (its advantages need the teacher's logprobs).
    choices = typing.get_args(GRPOConfig.model_fields["adv_estimator"].annotation)
    assert sorted(choices) == sorted([*ADVANTAGE_ESTIMATORS, "on_policy_distillation"])
    assert compute_advantages("grpo", REWARDS, GROUPS, leave_one_out=False, normalize=False).tolist() == approx(
        [0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0, -0.5, 0.5]
    )
    with pytest.raises(ValueError, match="dr_grpo, grpo, reinforce_pp, rloo"):
        compute_advantages("ppo", REWARDS, GROUPS)
    with pytest.raises(ValueError, match="group_ids"):
        grpo_advantages(REWARDS, GROUPS[:3])


def test_scale_rewards():
    r = torch.tensor([-1.0, 0.0, 0.5, 1.0, 2.0])
    assert scale_rewards(r, 0.0, 1.0, -1.0, 1.0).tolist() == approx([-1.0, -1.0, 0.0, 1.0, 1.0])
    assert scale_rewards(r, 0.0, 2.0, 0.0, 10.0).tolist() == approx([0.0, 0.0, 2.5, 5.0, 10.0])
    with pytest.raises(ValueError, match="source_max"):
        scale_rewards(r, 1.0, 1.0, 0.0, 1.0)


def test_overlong_reward_shaping():
    # L_max 10, buffer 4: free up to 6, then -1/4 per token, -1 from 10 on
    lengths = torch.tensor([5, 6, 7, 8, 10, 12])
    out = apply_overlong_reward_shaping(torch.ones(6), lengths, 10, 4, 1.0)
    assert out.tolist() == approx([1.0, 1.0, 0.75, 0.5, 0.0, 0.0])
    out = apply_overlong_reward_shaping(torch.zeros(6), lengths, 10, 4, 0.5)
    assert out.tolist() == approx([0.0, 0.0, -0.125, -0.25, -0.5, -0.5])
    with pytest.raises(ValueError, match="overlong_buffer_length"):
        apply_overlong_reward_shaping(torch.ones(2), torch.tensor([1, 2]), 10, 20, 1.0)


def test_overlong_filtering_keeps_truncated_samples_in_the_baseline():
    truncated = torch.tensor([True, False, True, False])
    assert overlong_filter_mask(truncated).tolist() == [0.0, 1.0, 0.0, 1.0]
    assert overlong_filter_mask(truncated, torch.tensor([1.0, 0.0, 1.0, 1.0])).tolist() == [0.0, 0.0, 0.0, 1.0]
    # the advantages are computed over all samples; the mask only removes the loss
    adv = grpo_advantages(torch.tensor([1.0, 0.0, 0.0, 0.0]), torch.zeros(4, dtype=torch.long))
    assert adv.tolist() == approx([2.0, -2 / 3, -2 / 3, -2 / 3])
    # So does the GRPO loop: over the 3 untruncated samples alone, the mean 1/3 and std 0.58 gave
    # 1.15, -0.58, -0.58.
    from posttrain.algorithms.grpo import _rewards_to_advantages
    from posttrain.data.batch import BatchedDataDict
    from posttrain.schemas import GRPOConfig

    batch = BatchedDataDict(rewards=torch.tensor([1.0, 0.0, 0.0, 0.0]), response_lengths=torch.full((4,), 4.0),
                            truncated=torch.tensor([False, False, False, True]),
                            env_errors=torch.zeros(4, dtype=torch.bool), group_ids=torch.zeros(4, dtype=torch.long),
                            token_mask=torch.ones(4, 1))
    _rewards_to_advantages(GRPOConfig(overlong_filtering=True, use_leave_one_out_baseline=False), batch, 4)
    assert batch["sample_mask"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert batch["advantages"][:, 0].tolist() == approx([1.5, -0.5, -0.5, -0.5])


def test_dynamic_sampling_keeps_groups_with_reward_variance():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5, 1.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 3, 3])
    keep, metrics = dynamic_sampling_keep(rewards, groups)
    assert keep.tolist() == [0, 1, 6, 7]
    assert metrics == {
        "dynamic_sampling/groups": 4.0,
        "dynamic_sampling/groups_kept": 2.0,
        "dynamic_sampling/zero_variance_fraction": 0.5,
    }
    keep, metrics = dynamic_sampling_keep(torch.ones(4), torch.tensor([0, 0, 1, 1]))
    assert keep.tolist() == [] and metrics["dynamic_sampling/zero_variance_fraction"] == 1.0
    # Scored rewards 1, 1, 1 beside a failed environment's 0 (out of the baseline): no signal,
    # dropped; so is a group with one scored sample. Group 2 varies among its scored samples.
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 0.0])
    groups = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    scored = torch.tensor([1, 1, 1, 0, 1, 0, 1, 1, 0])
    assert dynamic_sampling_keep(rewards, groups)[0].tolist() == list(range(9))
    keep, metrics = dynamic_sampling_keep(rewards, groups, scored)
    assert keep.tolist() == [6, 7, 8] and metrics["dynamic_sampling/groups_kept"] == 1.0


def test_on_policy_distillation_advantages_are_teacher_minus_own_logprobs_on_generated_tokens():
    teacher = torch.tensor([[0.0, -1.0, -0.5, -2.0], [0.0, -0.1, -3.0, 0.0]])
    own = torch.tensor([[0.0, -2.0, -0.5, -1.0], [0.0, -0.2, -1.0, 0.0]])
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, 1.0, 1.0, 0.0]])
    adv = on_policy_distillation_advantages(teacher, own, mask)
    # Where the teacher finds a token likelier than the policy did, the token is reinforced.
    assert adv.tolist() == [[0.0, 1.0, 0.0, -1.0], [0.0, approx(0.1), -2.0, 0.0]]
    with pytest.raises(ValueError, match=r"same \[B, S\] shape"):
        on_policy_distillation_advantages(teacher, own[:, :3], mask)


def test_the_grpo_loop_scales_rewards_before_the_overlong_shaping():
    # Shaped first, the scaling's clamp to [source_min, source_max] took the penalty back off a
    # wrong overlong answer (0 - 1 -> 0): it scored as a wrong short one. Scaled first (NeMo RL's
    # order), [0, 1] -> [-1, 1], then the full penalty of 1 past max_response_length.
    from posttrain.algorithms.grpo import _rewards_to_advantages
    from posttrain.data.batch import BatchedDataDict
    from posttrain.schemas import GRPOConfig

    g = GRPOConfig(adv_estimator="dr_grpo",
                   reward_scaling={"enabled": True, "target_min": -1.0, "target_max": 1.0},
                   reward_shaping={"enabled": True, "overlong_buffer_length": 2, "overlong_buffer_penalty": 1.0,
                                   "max_response_length": 4})
    batch = BatchedDataDict(rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]),
                            response_lengths=torch.tensor([2.0, 5.0, 2.0, 3.0]),
                            truncated=torch.zeros(4, dtype=torch.bool), env_errors=torch.zeros(4, dtype=torch.bool),
                            group_ids=torch.zeros(4, dtype=torch.long), token_mask=torch.ones(4, 1))
    _rewards_to_advantages(g, batch, max_new_tokens=4)
    # Rewards 1, -1 - 1 = -2, -1, 1 - 0.5 = 0.5 (half the buffer): mean -0.375.
    assert batch["advantages"][:, 0].tolist() == pytest.approx([1.375, -1.625, -0.625, 0.875])
    # The penalty each sample took, for the step's reward_shaping_penalty (no metric showed it).
    assert batch["shaping_penalty"].tolist() == pytest.approx([0.0, 1.0, 0.0, 0.5])


def test_a_kl_penalty_in_the_reward_takes_each_samples_own_tokens():
    # reward - beta * sum over the sample's trained tokens of (log pi_old - log pi_ref), before the
    # baseline; a masked token (prompt, environment output) is not the sample's own.
    from posttrain.algorithms.grpo import _rewards_to_advantages
    from posttrain.data.batch import BatchedDataDict
    from posttrain.schemas import GRPOConfig

    mask = torch.tensor([[0.0, 1.0, 1.0, 0.0], [0.0, 1.0, 1.0, 1.0], [0.0, 0.0, 1.0, 1.0], [0.0, 1.0, 0.0, 0.0]])
    prev = torch.tensor([[-9.0, -1.0, -2.0, -9.0], [0.0, -1.0, -1.0, -1.0], [0.0, 0.0, -0.5, -0.5],
                         [0.0, -3.0, 5.0, 0.0]])
    ref = torch.tensor([[0.0, -1.5, -2.5, 0.0], [0.0, -1.0, -1.0, -1.0], [7.0, 7.0, -1.5, -1.5], [0.0, -2.0, 0.0, 0.0]])
    batch = BatchedDataDict(rewards=torch.tensor([1.0, 1.0, 0.0, 0.0]), response_lengths=torch.full((4,), 2.0),
                            truncated=torch.zeros(4, dtype=torch.bool), env_errors=torch.zeros(4, dtype=torch.bool),
                            group_ids=torch.zeros(4, dtype=torch.long), token_mask=mask, prev_logprobs=prev,
                            reference_logprobs=ref)
    _rewards_to_advantages(GRPOConfig(adv_estimator="dr_grpo", reward_kl_penalty=0.5), batch, max_new_tokens=4)
    assert batch["reward_kl"].tolist() == pytest.approx([1.0, 0.0, 2.0, -1.0])
    # Rewards 1 - 0.5, 1, 0 - 1, 0 + 0.5: mean 0.25.
    assert batch["advantages"][:, -1].tolist() == pytest.approx([0.0, 0.75, -1.25, 0.0])
    assert batch["advantages"][3, 1].item() == pytest.approx(0.25)


def test_the_grpo_loop_divides_by_the_std_its_config_names():
    from posttrain.algorithms.grpo import _rewards_to_advantages
    from posttrain.data.batch import BatchedDataDict
    from posttrain.schemas import GRPOConfig

    def advantages(normalize) -> list[float]:
        batch = BatchedDataDict(rewards=torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 0.0]),
                                response_lengths=torch.full((6,), 2.0), truncated=torch.zeros(6, dtype=torch.bool),
                                env_errors=torch.zeros(6, dtype=torch.bool),
                                group_ids=torch.tensor([0, 0, 0, 0, 1, 1]), token_mask=torch.ones(6, 1))
        g = GRPOConfig(normalize_rewards=normalize, use_leave_one_out_baseline=False)
        _rewards_to_advantages(g, batch, max_new_tokens=4)
        return batch["advantages"][:, 0].tolist()

    # Centred: 0.75, -0.25 x 3 | 0.5, -0.5. Group stds 0.5 and sqrt(0.5); the batch's: 2 ones and
    # 4 zeros, mean 1/3, sample variance (2 x 4/9 + 4 x 1/9) / 5 = 4/15.
    assert advantages(True) == approx([1.5, -0.5, -0.5, -0.5, 0.5 / S2, -0.5 / S2])
    sigma = math.sqrt(4 / 15)
    assert advantages("batch") == approx([x / sigma for x in [0.75, -0.25, -0.25, -0.25, 0.5, -0.5]])
    assert advantages("none") == approx([0.75, -0.25, -0.25, -0.25, 0.5, -0.5])


def test_on_policy_distillation_trains_the_samples_whose_verification_failed():
    # The reward is only logged under distillation: a verifier that raised or timed out says
    # nothing about the sample's teacher logprobs, which were its training signal (it was masked).
    from posttrain.algorithms.grpo import _rewards_to_advantages
    from posttrain.data.batch import BatchedDataDict
    from posttrain.schemas import GRPOConfig

    def mask(estimator: str) -> list[float]:
        batch = BatchedDataDict(rewards=torch.tensor([1.0, 0.0]), response_lengths=torch.tensor([2.0, 2.0]),
                                truncated=torch.tensor([False, False]), env_errors=torch.tensor([False, True]),
                                group_ids=torch.zeros(2, dtype=torch.long), token_mask=torch.ones(2, 1))
        _rewards_to_advantages(GRPOConfig(adv_estimator=estimator), batch, max_new_tokens=4)
        return batch["sample_mask"].tolist()

    assert mask("on_policy_distillation") == [1.0, 1.0]
    assert mask("grpo") == [1.0, 0.0]  # mask_env_error_samples: no evidence against the answer


def test_the_logged_teacher_reverse_kl_is_the_students_not_the_samplers():
    # Student [.5, .5], teacher [.9, .1], the sampler (older weights in async GRPO) [.9, .1]: of
    # 10 one-token samples 9 are token 0. Their plain mean of log pi - log pi_teacher is -0.372,
    # a negative "KL"; weighted by pi / pi_sampler it is KL(student || teacher) = 0.511.
    from posttrain.algorithms.grpo import _distillation_advantages
    from posttrain.data.batch import BatchedDataDict

    def batch(sampler: list[float]) -> BatchedDataDict:
        tokens = [0] * 9 + [1]
        column = lambda p: torch.tensor([[0.0, math.log(p[t])] for t in tokens])  # noqa: E731
        return BatchedDataDict(prev_logprobs=column([0.5, 0.5]), reference_logprobs=column([0.9, 0.1]),
                               generation_logprobs=column(sampler), token_mask=torch.tensor([[0.0, 1.0]] * 10),
                               sample_mask=torch.ones(10))

    kl = 0.5 * math.log(0.5 / 0.9) + 0.5 * math.log(0.5 / 0.1)
    assert _distillation_advantages(batch([0.9, 0.1])) == approx(kl)
    b = batch([0.5, 0.5])  # the sampler is the student: the plain mean
    assert _distillation_advantages(b) == approx(-float(b["advantages"].sum()) / 10)
    assert b["advantages"][:, 1].tolist() == approx([math.log(0.9 / 0.5)] * 9 + [math.log(0.1 / 0.5)])


def test_a_sample_whose_environment_failed_leaves_its_groups_baseline():
    # Reward-model scores -4, -4.5, -3.5 and a too-long fourth sample's placeholder 0: kept in the
    # baseline, the 0 made every scored answer look bad (-0.65, -0.98, -0.33 with the group std).
    from posttrain.algorithms.grpo import _rewards_to_advantages
    from posttrain.data.batch import BatchedDataDict
    from posttrain.schemas import GRPOConfig

    def run(**kw) -> BatchedDataDict:
        batch = BatchedDataDict(rewards=torch.tensor([-4.0, -4.5, -3.5, 0.0]), response_lengths=torch.full((4,), 2.0),
                                truncated=torch.zeros(4, dtype=torch.bool),
                                env_errors=torch.tensor([False, False, False, True]),
                                group_ids=torch.zeros(4, dtype=torch.long), token_mask=torch.ones(4, 1))
        _rewards_to_advantages(GRPOConfig(use_leave_one_out_baseline=False, **kw), batch, max_new_tokens=4)
        return batch

    batch = run()
    assert batch["sample_mask"].tolist() == [1.0, 1.0, 1.0, 0.0]
    assert batch["advantages"][:3, 0].tolist() == approx([0.0, -1.0, 1.0])  # mean -4, std 0.5
    # Trained as a wrong answer instead: in the baseline and the loss.
    unmasked = run(mask_env_error_samples=False)
    assert unmasked["sample_mask"].tolist() == [1.0] * 4
    sigma = math.sqrt((1 + 1.5**2 + 0.5**2 + 3**2) / 3)  # about the mean -3
    assert unmasked["advantages"][:, 0].tolist() == approx([-1 / sigma, -1.5 / sigma, -0.5 / sigma, 3 / sigma])


def test_a_step_without_a_sample_in_the_loss_says_why():
    # Every response truncated under overlong filtering: the step trains nothing, which its metrics
    # said only as num_valid_samples 0, step after step.
    from posttrain.algorithms.grpo import _no_sample_in_the_loss, _rewards_to_advantages
    from posttrain.data.batch import BatchedDataDict
    from posttrain.schemas import GRPOConfig

    def reason(truncated: list[bool], errors: list[bool]) -> str | None:
        g = GRPOConfig(overlong_filtering=True)
        batch = BatchedDataDict(rewards=torch.tensor([1.0, 0.0, 0.0]), response_lengths=torch.full((3,), 4.0),
                                truncated=torch.tensor(truncated), env_errors=torch.tensor(errors),
                                group_ids=torch.zeros(3, dtype=torch.long), token_mask=torch.ones(3, 1))
        _rewards_to_advantages(g, batch, max_new_tokens=4)
        return _no_sample_in_the_loss(g, batch)

    assert reason([True, False, True], [False, False, False]) is None
    assert reason([True, True, True], [False, False, False]) == (
        "none of the 3 samples is in the loss, so this step trains nothing: 3 truncated (grpo.overlong_filtering; "
        "a longer policy.generation.max_new_tokens or policy.max_total_sequence_length keeps them)")
    assert reason([True, False, True], [False, True, False]).endswith(
        "2 truncated (grpo.overlong_filtering; a longer policy.generation.max_new_tokens or "
        "policy.max_total_sequence_length keeps them); 1 with an environment error (grpo.mask_env_error_samples)")
