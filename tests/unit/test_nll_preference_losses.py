"""NLL, DPO (sigmoid/IPO/SimPO/ORPO) and Bradley-Terry losses against hand-computed values."""

import math
import re

import pytest
import torch

from posttrain.data.batch import BatchedDataDict
from posttrain.losses import BradleyTerryLoss, DPOLoss, NLLLoss, valid_counts
from posttrain.losses.preference import preference_pair_losses
from posttrain.schemas import DPOConfig


def logsig(x):
    return math.log(1 / (1 + math.exp(-x)))


def test_nll_hand_computed_and_global_normalization():
    curr = torch.tensor([[0.0, -1.0, -2.0, -9.0], [0.0, -3.0, -4.0, -5.0], [0.0, -7.0, -7.0, -7.0]])
    mb = BatchedDataDict(
        token_mask=torch.tensor([[0, 1, 1, 0], [0, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.float32),
        sample_mask=torch.tensor([1.0, 1.0, 0.0]),  # the third row is dropped
    )
    toks, seqs = valid_counts(mb)
    assert toks.item() == 4
    loss, metrics = NLLLoss()(curr, mb, toks, seqs)
    assert loss.item() == pytest.approx((1 + 2 + 4 + 5) / 4)
    assert metrics["num_valid_tokens"] == 4
    # Micro-batches divided by the GLOBAL count sum to the full-batch loss.
    parts = [NLLLoss()(curr[i : i + 1], mb.select_indices([i]), toks, seqs)[0] for i in range(3)]
    assert sum(parts).item() == pytest.approx(loss.item())


def test_validation_metrics_are_means_over_the_whole_validation_set():
    # A batch of 1 token at NLL 1 and one of 3 tokens at NLL 3: 2.5 per token, not the batches'
    # mean of 2.0 (which weighs a short batch's tokens three times as much).
    from posttrain.algorithms.offline import evaluate

    masks = [[0.0, 1, 0, 0], [0.0, 1, 1, 1]]
    logprobs = {1: [0.0, -1, 0, 0], 3: [0.0, -3, -3, -3]}  # by the batch's token count
    batches = [BatchedDataDict(token_mask=torch.tensor([mask]), sample_mask=torch.ones(1)) for mask in masks]
    m = evaluate(NLLLoss(), batches, lambda b: torch.tensor([logprobs[int(b["token_mask"].sum())]]))
    assert m["loss"] == pytest.approx(2.5) and m["num_valid_tokens"] == 4


def _pair_batch(policy_rows, ref_rows, mask_rows, sample_mask=None):
    """A 2-pair batch: rows (chosen0, rejected0, chosen1, rejected1) of per-token logprobs."""
    n = len(policy_rows)
    return (
        torch.tensor(policy_rows, requires_grad=True),
        BatchedDataDict(
            reference_logprobs=torch.tensor(ref_rows),
            token_mask=torch.tensor(mask_rows, dtype=torch.float32),
            sample_mask=torch.ones(n) if sample_mask is None else torch.tensor(sample_mask),
        ),
    )


# Sequence sums: policy c0=-2, r0=-4, c1=-1, r1=-1; reference c0=-3, r0=-3, c1=-2, r1=0.
POLICY = [[0.0, -1.0, -1.0], [0.0, -2.0, -2.0], [0.0, -1.0, 0.0], [0.0, -0.5, -0.5]]
REF = [[0.0, -1.5, -1.5], [0.0, -1.0, -2.0], [0.0, -2.0, 0.0], [0.0, 0.0, 0.0]]
MASK = [[0, 1, 1], [0, 1, 1], [0, 1, 0], [0, 1, 1]]


def test_dpo_sigmoid_hand_computed():
    curr, mb = _pair_batch(POLICY, REF, MASK)
    beta = 0.5
    # log-ratios: c0 = 1, r0 = -1, c1 = 1, r1 = -1 -> h = 2 for both pairs.
    loss, m = DPOLoss(beta=beta)(curr, mb, *valid_counts(mb))
    assert loss.item() == pytest.approx(-logsig(beta * 2), abs=1e-6)
    assert m["accuracy"] == 1.0
    assert m["rewards_chosen_mean"] == pytest.approx(0.5) and m["rewards_rejected_mean"] == pytest.approx(-0.5)
    assert m["reward_margin"] == pytest.approx(1.0)
    # At the start the policy is the reference: every reward is 0, and a tie is not a right answer.
    start, start_mb = _pair_batch(REF, REF, MASK)
    assert DPOLoss(beta=beta)(start, start_mb, *valid_counts(start_mb))[1]["accuracy"] == 0.0
    loss.backward()
    # d loss / d policy logprob of a chosen token = -beta * sigmoid(-beta h) / n_pairs.
    g = -beta * (1 / (1 + math.exp(beta * 2))) / 2
    assert curr.grad[0, 1].item() == pytest.approx(g, abs=1e-6)
    assert curr.grad[1, 1].item() == pytest.approx(-g, abs=1e-6)
    assert curr.grad[:, 0].abs().sum().item() == 0  # unmasked positions get no gradient


def test_dpo_average_logprobs_sft_term_and_weights():
    curr, mb = _pair_batch(POLICY, REF, MASK)
    # Means: policy c0=-1, r0=-2, c1=-1, r1=-0.5; ref c0=-1.5, r0=-1.5, c1=-2, r1=0
    # log-ratios: c0=.5, r0=-.5 (h=1); c1=1, r1=-.5 (h=1.5)
    fn = DPOLoss(beta=1.0, average_log_probs=True, sft_loss_weight=0.3, preference_loss_weight=2.0)
    loss, m = fn(curr, mb, *valid_counts(mb))
    pref = (-logsig(1.0) - logsig(1.5)) / 2
    sft = (1.0 + 1.0) / 2  # mean over pairs of -mean chosen logprob
    assert m["preference_loss"] == pytest.approx(pref, abs=1e-6)
    assert m["sft_loss"] == pytest.approx(sft, abs=1e-6)
    assert loss.item() == pytest.approx(2.0 * pref + 0.3 * sft, abs=1e-6)
    # sft_average_log_probs=False: the SFT term sums the chosen tokens.
    _, m = DPOLoss(beta=1.0, average_log_probs=True, sft_average_log_probs=False)(curr, mb, *valid_counts(mb))
    assert m["sft_loss"] == pytest.approx((2.0 + 1.0) / 2, abs=1e-6)


def test_ipo_and_simpo_hand_computed():
    curr, mb = _pair_batch(POLICY, REF, MASK)
    beta = 0.25
    loss, _ = DPOLoss(beta=beta, name="ipo", average_log_probs=False)(curr, mb, *valid_counts(mb))
    assert loss.item() == pytest.approx((2 - 1 / (2 * beta)) ** 2, abs=1e-6)  # sums: h = 2 for both pairs
    # IPO's default is means (test_dpo_average_logprobs_sft_term_and_weights: h = 1 and 1.5).
    loss, _ = DPOLoss(beta=beta, name="ipo")(curr, mb, *valid_counts(mb))
    assert loss.item() == pytest.approx(((1 - 2) ** 2 + (1.5 - 2) ** 2) / 2, abs=1e-6)
    # SimPO: reference-free, length-averaged: c0=-1, r0=-2 (d=1); c1=-1, r1=-0.5 (d=-0.5).
    mb_no_ref = BatchedDataDict({k: v for k, v in mb.items() if k != "reference_logprobs"})
    loss, m = DPOLoss(beta=2.0, name="simpo", simpo_gamma=0.5)(curr, mb_no_ref, *valid_counts(mb))
    assert loss.item() == pytest.approx((-logsig(2.0 * 1 - 0.5) - logsig(2.0 * -0.5 - 0.5)) / 2, abs=1e-6)
    assert m["accuracy"] == 0.5


def log_odds(mean_logprob):
    p = math.exp(mean_logprob)
    return math.log(p / (1 - p))


def test_orpo_hand_computed():
    curr, mb = _pair_batch(POLICY, REF, MASK)
    mb_no_ref = BatchedDataDict({k: v for k, v in mb.items() if k != "reference_logprobs"})
    # Reference-free, means: c0=-1, r0=-2, c1=-1, r1=-0.5; lambda = beta = 0.1 outside the sigmoid.
    beta = 0.1
    fn = DPOLoss(beta=beta, name="orpo")
    assert not fn.needs_reference and fn.average_log_probs and fn.sft_loss_weight == 1.0
    loss, m = fn(curr, mb_no_ref, *valid_counts(mb))
    pref = (-beta * logsig(log_odds(-1) - log_odds(-2)) - beta * logsig(log_odds(-1) - log_odds(-0.5))) / 2
    nll = (1 + 1) / 2  # the chosen responses' mean token NLL, over the pairs
    assert m["preference_loss"] == pytest.approx(pref, abs=1e-6) and m["sft_loss"] == pytest.approx(nll, abs=1e-6)
    assert loss.item() == pytest.approx(pref + nll, abs=1e-6)
    assert m["accuracy"] == 0.5 and m["rewards_chosen_mean"] == pytest.approx(beta * -1)
    loss.backward()
    # d/d(chosen token 1 of pair 0): NLL -1/(2 pairs * 2 tokens) plus the odds term's
    # -beta * sigmoid(-(lo_c - lo_r)) * dlo/dl / (2 pairs * 2 tokens), dlo/dl = 1 / (1 - p).
    d = log_odds(-1) - log_odds(-2)
    g = -1 / 4 - beta / (1 + math.exp(d)) / (1 - math.exp(-1)) / 4
    assert curr.grad[0, 1].item() == pytest.approx(g, abs=1e-6)
    # A response the model is certain of (p = 1) keeps the loss finite.
    certain, mb1 = _pair_batch([[0.0, 0.0], [0.0, -1.0]], [[0.0, 0.0], [0.0, 0.0]], [[0, 1], [0, 1]])
    loss, _ = DPOLoss(beta=beta, name="orpo")(certain, mb1, *valid_counts(mb1))
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(certain.grad).all()
    # Near p = 1 the odds term is the formula's (TRL's), not a clamp's: a clamp at -1e-6 gave
    # every p above 1 - 1e-6 the same log-odds, 0.0693 here, and no gradient on the rejected side.
    near = torch.tensor([-1e-7], dtype=torch.float64, requires_grad=True)
    far = torch.tensor([-1e-9], dtype=torch.float64, requires_grad=True)
    value = preference_pair_losses(near, far, beta, "orpo")
    value.sum().backward()
    assert value.item() == pytest.approx(-beta * logsig(log_odds(-1e-7) - log_odds(-1e-9)), rel=1e-6)
    assert value.item() == pytest.approx(0.461512, rel=1e-5) and far.grad.item() == pytest.approx(9.9e7, rel=0.01)


def test_dpo_micro_batches_sum_and_sample_mask():
    curr, mb = _pair_batch(POLICY, REF, MASK, sample_mask=[1.0, 1.0, 0.0, 0.0])
    toks, seqs = valid_counts(mb)
    fn = DPOLoss(beta=0.1, sft_loss_weight=1.0)
    loss, m = fn(curr, mb, toks, seqs)
    only_first, _ = fn(curr[:2], mb.select_indices([0, 1]), toks, seqs)
    assert loss.item() == pytest.approx(only_first.item()) and m["num_valid_samples"] == 1
    curr, mb = _pair_batch(POLICY, REF, MASK)
    toks, seqs = valid_counts(mb)
    full, _ = fn(curr, mb, toks, seqs)
    halves = [fn(curr[i : i + 2], mb.select_indices([i, i + 1]), toks, seqs)[0] for i in (0, 2)]
    assert sum(halves).item() == pytest.approx(full.item())


def test_bradley_terry_hand_computed():
    scores = torch.tensor([2.0, 1.0, 0.0, 3.0], requires_grad=True)
    mb = BatchedDataDict(sample_mask=torch.ones(4), token_mask=torch.ones(4, 2))
    loss, m = BradleyTerryLoss()(scores, mb, torch.tensor(8.0), torch.tensor(4.0))
    assert loss.item() == pytest.approx((-logsig(1.0) - logsig(-3.0)) / 2, abs=1e-6)
    assert m["accuracy"] == 0.5
    assert m["rewards_chosen_mean"] == pytest.approx(1.0) and m["rewards_rejected_mean"] == pytest.approx(2.0)
    loss.backward()
    assert scores.grad[0].item() == pytest.approx(-(1 - 1 / (1 + math.exp(-1.0))) / 2, abs=1e-6)


def test_bad_inputs_and_registry():
    with pytest.raises(ValueError, match="valid: sigmoid, ipo, simpo"):
        DPOLoss(name="kto")
    with pytest.raises(ValueError, match="even number of rows"):
        BradleyTerryLoss()(torch.zeros(3), BatchedDataDict(sample_mask=torch.ones(3)), torch.tensor(1.0),
                           torch.tensor(3.0))
    # A pair is in or out as a whole: with one row masked the divisor (valid rows / 2) counted
    # half a pair that the sum left out (2.5 for 2 pairs: the loss scaled by 0.8).
    for fn, curr in ((BradleyTerryLoss(), torch.zeros(6)), (DPOLoss(), torch.zeros(6, 2))):
        mb = BatchedDataDict(sample_mask=torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 1.0]), token_mask=torch.ones(6, 2),
                             reference_logprobs=torch.zeros(6, 2))
        with pytest.raises(ValueError, match=r"keeps one row of pair 1 \(rows 2, 3: 1, 0\)"):
            fn(curr, mb, torch.tensor(6.0), torch.tensor(5.0))
    with pytest.raises(ValueError, match=r"scores \[b\]"):
        BradleyTerryLoss()(torch.zeros(2, 3), BatchedDataDict(sample_mask=torch.ones(2)), torch.tensor(1.0),
                           torch.tensor(2.0))
    dpo = DPOLoss.from_config(DPOConfig(reference_policy_kl_penalty=0.2, preference_average_log_probs=True))
    assert (dpo.beta, dpo.average_log_probs, dpo.sft_average_log_probs, dpo.name) == (0.2, True, True, "sigmoid")
    # Unset: each loss's convention (sums for DPO, means for IPO and SimPO); the SFT term follows.
    for name, average in (("sigmoid", False), ("ipo", True), ("simpo", True), ("orpo", True)):
        fn = DPOLoss.from_config(DPOConfig.model_validate({"loss": {"name": name}}))
        assert (fn.average_log_probs, fn.sft_average_log_probs) == (average, average), name
        # Unset, the SFT term is ORPO's NLL half (weight 1) and off for the others.
        assert fn.sft_loss_weight == (1.0 if name == "orpo" else 0.0), name
    orpo = DPOLoss.from_config(DPOConfig.model_validate({"loss": {"name": "orpo"}, "sft_loss_weight": 0}))
    assert orpo.sft_loss_weight == 0
    fn = DPOLoss.from_config(DPOConfig.model_validate({"loss": {"name": "ipo"}, "preference_average_log_probs": False}))
    assert not fn.average_log_probs
    for fn in (NLLLoss(), dpo, BradleyTerryLoss()):
        assert fn.loss_type in ("token", "sequence")
    assert dpo.needs_pairs and BradleyTerryLoss.needs_pairs and not NLLLoss.needs_pairs


def test_settings_that_make_the_loss_non_finite_or_constant_are_refused_at_load():
    # Each was accepted: inf beta made every step NaN (skipped as "non-finite gradients"), a NaN
    # weight likewise, a negative weight trained the NLL upward, two zero weights trained nothing,
    # SimPO's gamma with another loss was ignored without a word.
    from posttrain.config import ConfigError, load_config

    cases = [(["dpo.reference_policy_kl_penalty=.inf"], "dpo.reference_policy_kl_penalty: got inf, expected a finite number"),
             (["dpo.preference_loss_weight=.nan"], "dpo.preference_loss_weight: got nan, expected a finite number"),
             (["dpo.sft_loss_weight=-1"], "dpo.sft_loss_weight: got -1, expected greater than or equal to 0"),
             (["dpo.preference_loss_weight=0"], "dpo.preference_loss_weight=0 with no dpo.sft_loss_weight"),
             (["dpo.loss.name=orpo", "dpo.preference_loss_weight=0", "dpo.sft_loss_weight=0"],
              "dpo.preference_loss_weight=0 with no dpo.sft_loss_weight"),
             (["dpo.loss.name=ipo", "dpo.reference_policy_kl_penalty=1e-20"], "IPO's loss, the square of a margin"),
             (["dpo.loss.simpo_gamma=1.0"], "dpo.loss.simpo_gamma=1.0 is SimPO's margin; dpo.loss.name=sigmoid")]
    for overrides, message in cases:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config("dpo", None, overrides)
    with pytest.raises(ConfigError, match="kto.desirable_weight: got inf, expected a finite number"):
        load_config("kto", None, ["kto.desirable_weight=.inf"])
    # What stays valid: ORPO's NLL alone, the SFT term alone, gamma at its default (a resolved
    # config.yaml writes it) or with SimPO, IPO at a small beta.
    for overrides in (["dpo.loss.name=orpo", "dpo.preference_loss_weight=0"],
                      ["dpo.preference_loss_weight=0", "dpo.sft_loss_weight=1"], ["dpo.loss.simpo_gamma=0.5"],
                      ["dpo.loss.name=simpo", "dpo.loss.simpo_gamma=1.0"],
                      ["dpo.loss.name=ipo", "dpo.reference_policy_kl_penalty=1e-6"]):
        load_config("dpo", None, overrides)


@pytest.mark.parametrize("name", ["sigmoid", "ipo", "simpo"])
def test_zero_beta_is_refused_at_load(name):
    # beta = 0 makes the sigmoid and SimPO losses constants (log 2, -log sigma(-gamma)) with no gradient
    # and every reward 0: the run trained nothing, silently; IPO divides by it. The config names the key
    # (IPO failed in the loss, with a traceback, after the data was tokenized).
    from posttrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"dpo.reference_policy_kl_penalty: got 0, expected greater than 0"):
        load_config("dpo", None, ["dpo.reference_policy_kl_penalty=0", f"dpo.loss.name={name}"])
    curr, mb = _pair_batch([[0.0, -1.0], [0.0, -2.0]], [[0.0, -1.5], [0.0, -1.5]], [[0, 1], [0, 1]])
    loss, m = DPOLoss(beta=0.0)(curr, mb, *valid_counts(mb))
    loss.backward()
    # What the run got: log 2 whatever the policy, and no gradient.
    assert loss.item() == pytest.approx(math.log(2)) and curr.grad.abs().sum() == 0 and m["reward_margin"] == 0


def test_ktos_reference_point_is_the_mismatched_pairs_mean_log_ratio_and_never_below_zero():
    from posttrain.algorithms.kto import reference_point

    class Policy:  # what reference_point asks of the policy: its logprobs of the mismatched pairs
        def __init__(self, logprobs):
            self.logprobs = logprobs

        def get_logprobs(self, batch):
            return {"logprobs": self.logprobs}

    mismatched = BatchedDataDict(token_mask=torch.tensor([[0, 1, 1], [0, 1, 0]], dtype=torch.float32))
    ref = torch.tensor([[0.0, -1.0, -1.0], [0.0, -1.0, -1.0]])
    # Token sums of log pi - log pi_ref over each pair's response: 2 x 0.5 and 1 x 1, mean 1.
    assert reference_point(Policy(ref + 0.5 * torch.tensor([[9.0, 1, 1], [9, 2, 9]])), mismatched, ref).item() == 1.0
    # A policy below the reference on them: z is 0 (KTO's max(0, KL)), not -1.5.
    assert reference_point(Policy(ref - 1.0), mismatched, ref).item() == 0.0


def test_kto_hand_computed_and_summed_over_micro_batches():
    from posttrain.losses import KTOLoss

    # Three examples, responses of two tokens (position 0 is the prompt): r = sum(policy - ref).
    curr = torch.tensor([[0.0, -1.0, -1.0], [0.0, -2.0, -3.0], [0.0, -1.0, -4.0]], requires_grad=True)
    mb = BatchedDataDict(
        reference_logprobs=torch.tensor([[0.0, -1.5, -1.5], [0.0, -2.0, -2.0], [0.0, -1.0, -1.0]]),
        token_mask=torch.tensor([[0, 1, 1], [0, 1, 1], [0, 1, 1]], dtype=torch.float32),
        sample_mask=torch.ones(3),
        kto_label=torch.tensor([1.0, 0.0, 1.0]),  # desirable, undesirable, desirable
        kto_kl=torch.full((3,), 0.25),
        kto_desirable=torch.full((3,), 2.0),
    )
    beta, w_d, w_u = 0.5, 1.0, 1.5
    r = [1.0, -1.0, -3.0]
    sig = lambda x: 1 / (1 + math.exp(-x))  # noqa: E731
    per = [w_d * (1 - sig(beta * (r[0] - 0.25))), w_u * (1 - sig(beta * (0.25 - r[1]))),
           w_d * (1 - sig(beta * (r[2] - 0.25)))]
    loss_fn = KTOLoss(beta, w_d, w_u)
    loss, m = loss_fn(curr, mb, torch.tensor(6.0), torch.tensor(3.0))
    assert loss.item() == pytest.approx(sum(per) / 3)
    assert m["kl"] == pytest.approx(0.25)
    assert m["rewards_desirable_mean"] == pytest.approx(beta * (r[0] + r[2]) / 2)
    assert m["rewards_undesirable_mean"] == pytest.approx(beta * r[1])
    assert m["reward_margin"] == pytest.approx(beta * (r[0] + r[2]) / 2 - beta * r[1])
    # Example 0 above the reference point (desirable: right), 1 below it (undesirable: right), 2 below (wrong).
    assert m["accuracy"] == pytest.approx(2 / 3)
    # d loss / d curr[0, 1] = -w_d * sigma'(beta (r - z)) * beta / 3: the response tokens only.
    loss.backward()
    s0 = sig(beta * (r[0] - 0.25))
    g = -w_d * s0 * (1 - s0) * beta / 3
    assert curr.grad[0].tolist() == pytest.approx([0.0, g, g])
    # Micro-batches with the global counts sum to the whole batch's loss and metrics.
    parts = [loss_fn(curr[i : i + 1].detach(), mb.select_indices([i]), torch.tensor(6.0), torch.tensor(3.0))
             for i in range(3)]
    assert sum(p[0].item() for p in parts) == pytest.approx(loss.item())
    for key in ("rewards_desirable_mean", "rewards_undesirable_mean", "accuracy", "kl"):
        assert sum(p[1][key] for p in parts) == pytest.approx(m[key])
    # A global batch without undesirable examples has no mean reward for them, nor a margin (they
    # were logged as 0 and minus the other mean); the rest is measured as before.
    one_label = mb.copy()
    one_label.update(kto_label=torch.ones(3), kto_desirable=torch.full((3,), 3.0))
    _, m1 = loss_fn(curr.detach(), one_label, torch.tensor(6.0), torch.tensor(3.0))
    assert set(m1) == {"loss", "kl", "accuracy", "num_valid_samples", "rewards_desirable_mean"}
    assert m1["rewards_desirable_mean"] == pytest.approx(beta * sum(r) / 3)
    from posttrain.schemas import KTOConfig

    built = KTOLoss.from_config(KTOConfig(reference_policy_kl_penalty=0.2, undesirable_weight=2.0))
    assert (built.beta, built.desirable_weight, built.undesirable_weight) == (0.2, 1.0, 2.0)
    with pytest.raises(ValueError, match="KTO needs beta > 0"):
        KTOLoss(0.0)


def test_robust_hinge_and_label_smoothing_hand_computed():
    # One pair of log-ratios, chosen 1.5 and rejected -0.5: h = 2, and beta h = 1 at beta 0.5.
    c, r = torch.tensor([1.5]), torch.tensor([-0.5])
    eps = 0.1
    smoothed = -(1 - eps) * logsig(1.0) - eps * logsig(-1.0)
    assert preference_pair_losses(c, r, 0.5, "sigmoid", label_smoothing=eps).item() == pytest.approx(smoothed)
    assert preference_pair_losses(c, r, 0.5, "sigmoid").item() == pytest.approx(-logsig(1.0))
    robust = (-(1 - eps) * logsig(1.0) + eps * logsig(-1.0)) / (1 - 2 * eps)
    assert preference_pair_losses(c, r, 0.5, "robust", label_smoothing=eps).item() == pytest.approx(robust)
    assert preference_pair_losses(c, r, 0.5, "robust").item() == pytest.approx(-logsig(1.0))  # eps 0: DPO
    assert preference_pair_losses(c, r, 0.25, "hinge").item() == pytest.approx(0.5)  # max(0, 1 - 0.5)
    assert preference_pair_losses(c, r, 0.5, "hinge").item() == 0.0  # margin reached: no loss, no gradient
    # Through the config: sums of logprobs for robust and hinge (as TRL), as for sigmoid.
    for name in ("robust", "hinge"):
        fn = DPOLoss.from_config(DPOConfig.model_validate({"loss": {"name": name, "label_smoothing": 0.0}}))
        assert fn.name == name and not fn.average_log_probs
    assert DPOLoss.from_config(DPOConfig.model_validate({"loss": {"label_smoothing": 0.2}})).label_smoothing == 0.2
    from posttrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"dpo.loss.label_smoothing=0.1 is of the sigmoid and robust losses; "
                                          r"dpo.loss.name=hinge does not read it"):
        load_config("dpo", None, ["dpo.loss.name=hinge", "dpo.loss.label_smoothing=0.1"])
    with pytest.raises(ConfigError, match=r"dpo.loss.label_smoothing: got 0.5, expected less than 0.5"):
        load_config("dpo", None, ["dpo.loss.name=robust", "dpo.loss.label_smoothing=0.5"])


def test_kto_weight_advice_lands_inside_the_papers_range():
    from posttrain.algorithms.kto import weight_advice

    # kto_en_demo's 75 desirable and 64 undesirable rows at desirable_weight=3: the advice was 3.52,
    # whose ratio 225 / 225.28 = 0.9987 is below 1, so the same warning came back ("1.00 : 1").
    advice = weight_advice(75, 64, 3.0, 1.0)
    assert advice.endswith("weigh 3.52 : 1; the KTO paper advises desirable_weight * n_desirable / "
                           "(undesirable_weight * n_undesirable) in [1, 4/3], e.g. kto.undesirable_weight=3.51")
    assert weight_advice(75, 64, 3.0, 3.51) is None
    assert "weigh 0.999 : 1" in weight_advice(75, 64, 3.0, 3.52)
    assert weight_advice(10, 100, 1.0, 1.0).endswith("kto.undesirable_weight=0.1")
    assert weight_advice(10, 100, 1.0, 0.1) is None
    assert "with one kind only" in weight_advice(0, 5, 1.0, 1.0)
