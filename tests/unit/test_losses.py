"""ClippedPGLoss: every variant against per-token values written out by hand.

The fixture batch (position 0 is never used):
    row 0: valid tokens at positions 2, 3 with ratios pi/pi_prev = 1.5, 0.5 and advantage +1
    row 1: valid tokens at positions 1, 2, 3 with ratios 1.1, 0.7, 2.0 and advantage -1
pi_prev = 0.4 on every token, so pi = 0.6, 0.2 | 0.44, 0.28, 0.8. Masked positions hold
garbage that must not leak into anything.
"""

import math

import pytest
import torch
from pydantic import ValidationError

from posttrain.losses import ClippedPGLoss, masked_mean, valid_counts
from posttrain.schemas import ClippedPGLossConfig

L = math.log
PI = [[0.6, 0.2], [0.44, 0.28, 0.8]]  # pi on the valid tokens, row by row
RATIOS = [[1.5, 0.5], [1.1, 0.7, 2.0]]
ADV = [1.0, -1.0]
# PPO per token, eps = 0.2: max(-A r, -A clip(r, 0.8, 1.2))
PPO = [[-1.2, -0.5], [1.1, 0.8, 2.0]]


def make_batch(gen_weights=None):
    """gen_weights: pi_prev / pi_gen per valid token (default: generator = trainer)."""
    garbage = 37.0
    token_mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]], dtype=torch.float32)
    prev = torch.full((2, 4), garbage)
    curr = torch.full((2, 4), garbage)
    gen = torch.full((2, 4), garbage)
    adv = torch.zeros(2, 4)
    positions = [[2, 3], [1, 2, 3]]
    for i, pos in enumerate(positions):
        for k, t in enumerate(pos):
            prev[i, t] = L(0.4)
            curr[i, t] = L(PI[i][k])
            w = 1.0 if gen_weights is None else gen_weights[i][k]
            gen[i, t] = L(0.4) - L(w)
            adv[i, t] = ADV[i]
    batch = {
        "prev_logprobs": prev,
        "generation_logprobs": gen,
        "reference_logprobs": torch.where(token_mask > 0, torch.full((2, 4), L(0.5)), torch.full((2, 4), garbage)),
        "advantages": adv,
        "token_mask": token_mask,
        "sample_mask": torch.ones(2),
    }
    return curr.requires_grad_(), batch


def run(cfg, gen_weights=None, drop_ref=False):
    curr, batch = make_batch(gen_weights)
    if drop_ref:
        batch.pop("reference_logprobs")
    toks, seqs = valid_counts(batch)
    loss, metrics = ClippedPGLoss(cfg)(curr, batch, toks, seqs)
    loss.backward()
    return loss.item(), metrics, curr.grad


def flat(x):
    return [v for row in x for v in row]


def grads_on_valid(grad):
    return [grad[0, 2].item(), grad[0, 3].item(), grad[1, 1].item(), grad[1, 2].item(), grad[1, 3].item()]


def test_valid_counts_skip_position_zero():
    _, batch = make_batch()
    batch["token_mask"][:, 0] = 1.0  # position 0 is never a loss token
    toks, seqs = valid_counts(batch)
    assert toks.item() == 5 and seqs.item() == 2


def test_ppo_token_level():
    loss, m, grad = run({})
    assert loss == pytest.approx(sum(flat(PPO)) / 5, rel=1e-5)  # 2.2 / 5
    # d/dlogpi of -A r is -A r where the unclipped term is taken, 0 where clipping is active
    assert grads_on_valid(grad) == pytest.approx([0.0, -0.5 / 5, 1.1 / 5, 0.0, 2.0 / 5], abs=1e-6)
    assert grad[0, 0] == 0 and grad[0, 1] == 0 and grad[1, 0] == 0
    assert m["clip_fraction"] == pytest.approx(2 / 5)
    assert m["probs_ratio"] == pytest.approx(sum(flat(RATIOS)) / 5, rel=1e-5)
    assert m["probs_ratio_min"] == pytest.approx(0.5, rel=1e-5)
    assert m["probs_ratio_max"] == pytest.approx(2.0, rel=1e-5)
    assert m["probs_ratio_clamped"] == pytest.approx((1.2 + 0.8 + 1.1 + 0.8 + 1.2) / 5, rel=1e-5)
    assert m["probs_ratio_clamped_min"] == pytest.approx(0.8) and m["probs_ratio_clamped_max"] == pytest.approx(1.2)
    assert m["num_valid_samples"] == 2.0
    assert m["token_mult_prob_error"] == pytest.approx(1.0) and m["gen_kl_error"] == pytest.approx(0.0, abs=1e-7)
    assert m["sampling_importance_ratio"] == pytest.approx(1.0)
    entropy = -sum(r * L(p) for r, p in zip(flat(RATIOS), flat(PI))) / 5  # -(pi/pi_gen) log pi, pi_gen = 0.4
    assert m["approx_entropy"] == pytest.approx(entropy, rel=1e-5)
    # beta = 0: no penalty, but the KL to the reference is still reported
    kl = [0.5 / p - 1 - L(0.5 / p) for p in flat(PI)]
    assert m["kl_penalty"] == pytest.approx(sum(kl) / 5, rel=1e-5)


def test_sequence_level_reduction():
    loss, _, grad = run({"token_level_loss": False})
    assert loss == pytest.approx((sum(PPO[0]) / 2 + sum(PPO[1]) / 3) / 2, rel=1e-5)  # 0.225
    assert grads_on_valid(grad) == pytest.approx([0.0, -0.5 / 4, 1.1 / 6, 0.0, 2.0 / 6], abs=1e-6)


def test_dapo_clip_higher():
    loss, m, _ = run({"ratio_clip_min": 0.2, "ratio_clip_max": 0.28})
    assert loss == pytest.approx((-1.28 - 0.5 + 1.1 + 0.8 + 2.0) / 5, rel=1e-5)
    assert m["probs_ratio_clamped_max"] == pytest.approx(1.28)


def test_dual_clip():
    loss, m, grad = run({"ratio_clip_c": 1.5})
    # A = -1 tokens: loss capped at -c A = 1.5, so the r = 2.0 token gives 1.5 and no gradient
    assert loss == pytest.approx((-1.2 - 0.5 + 1.1 + 0.8 + 1.5) / 5, rel=1e-5)
    assert m["dual_clip_fraction"] == pytest.approx(1 / 5)
    assert grad[1, 3].item() == pytest.approx(0.0)


def test_reinforce_disable_ppo_ratio():
    loss, m, grad = run({"disable_ppo_ratio": True})
    expected = sum(-a * L(p) for a, row in zip(ADV, PI) for p in row) / 5
    assert loss == pytest.approx(expected, rel=1e-5)
    assert grads_on_valid(grad) == pytest.approx([-0.2, -0.2, 0.2, 0.2, 0.2], abs=1e-6)
    assert m["clip_fraction"] == 0.0
    assert m["probs_ratio"] == pytest.approx(sum(flat(RATIOS)) / 5, rel=1e-5)  # still reported


def test_force_on_policy_ratio():
    loss, m, grad = run({"force_on_policy_ratio": True})
    assert loss == pytest.approx((-1 - 1 + 1 + 1 + 1) / 5, rel=1e-6)
    assert grads_on_valid(grad) == pytest.approx([-0.2, -0.2, 0.2, 0.2, 0.2], abs=1e-6)
    assert m["probs_ratio"] == pytest.approx(1.0) and m["clip_fraction"] == 0.0


def test_cispo():
    loss, m, grad = run({"use_cispo": True})
    clipped = [[1.2, 0.8], [1.1, 0.8, 1.2]]
    expected = sum(-ADV[i] * w * L(p) for i in range(2) for w, p in zip(clipped[i], PI[i])) / 5
    assert loss == pytest.approx(expected, rel=1e-5)
    # every token keeps a gradient: -A * clip(r) / N
    assert grads_on_valid(grad) == pytest.approx([-1.2 / 5, -0.8 / 5, 1.1 / 5, 0.8 / 5, 1.2 / 5], abs=1e-6)
    assert m["clip_fraction"] == pytest.approx(4 / 5)  # all but r = 1.1 are outside [0.8, 1.2]


def test_gspo_sequence_ratios():
    loss, m, _ = run({"sequence_level_importance_ratios": True, "token_level_loss": False})
    s0 = math.sqrt(1.5 * 0.5)  # 0.866, inside [0.8, 1.2]
    s1 = (1.1 * 0.7 * 2.0) ** (1 / 3)  # 1.1548
    assert loss == pytest.approx((-s0 + s1) / 2, rel=1e-5)
    assert m["probs_ratio"] == pytest.approx((2 * s0 + 3 * s1) / 5, rel=1e-5)
    # with a tighter clip the sequence ratio is clipped as one
    loss, _, _ = run({"sequence_level_importance_ratios": True, "token_level_loss": False, "ratio_clip_max": 0.1})
    assert loss == pytest.approx((-s0 + max(s1, 1.1)) / 2, rel=1e-5)


def test_gspo_corrects_the_generators_mismatch_with_the_whole_sequences_weight():
    # The weight of a sequence is pi_prev(y) / pi_gen(y), the product over its tokens (2 x 2 and
    # 0.5 x 1 x 3), not their geometric mean, which shrank the correction (2, 1.5^(1/3)).
    cfg = {"sequence_level_importance_ratios": True, "token_level_loss": False,
           "use_importance_sampling_correction": True}
    loss, m, _ = run(cfg, gen_weights=[[2.0, 2.0], [0.5, 1.0, 3.0]])
    s0, s1 = math.sqrt(1.5 * 0.5), (1.1 * 0.7 * 2.0) ** (1 / 3)
    assert loss == pytest.approx((4.0 * -s0 + 1.5 * s1) / 2, rel=1e-5)
    assert m["sampling_importance_ratio"] == pytest.approx((2 * 4.0 + 3 * 1.5) / 5, rel=1e-5)


def test_kl_penalty_and_on_policy_approximation():
    beta = 0.1
    kl = [0.5 / p - 1 - L(0.5 / p) for p in flat(PI)]  # k3 with pi_ref = 0.5
    loss, m, _ = run({"reference_policy_kl_penalty": beta})
    assert loss == pytest.approx(sum(flat(PPO)) / 5 + beta * sum(kl) / 5, rel=1e-5)
    assert m["kl_penalty"] == pytest.approx(sum(kl) / 5, rel=1e-5)
    # weights pi / pi_gen = the ratios here (generator = trainer)
    loss, m, _ = run({"reference_policy_kl_penalty": beta, "use_on_policy_kl_approximation": True})
    weighted = sum(r * k for r, k in zip(flat(RATIOS), kl)) / 5
    assert loss == pytest.approx(sum(flat(PPO)) / 5 + beta * weighted, rel=1e-5)
    k1 = [L(p / 0.5) for p in flat(PI)]
    loss, m, _ = run({"reference_policy_kl_penalty": beta, "reference_policy_kl_type": "k1"})
    assert m["kl_penalty"] == pytest.approx(sum(k1) / 5, rel=1e-5)


def test_kl_requires_reference_logprobs():
    _, m, _ = run({}, drop_ref=True)
    assert m["kl_penalty"] == 0.0
    with pytest.raises(KeyError, match="reference_logprobs"):
        run({"reference_policy_kl_penalty": 0.1}, drop_ref=True)


W = [[2.0, 1.0], [0.5, 1.0, 3.0]]  # pi_prev / pi_gen per valid token


def test_importance_sampling_correction_and_mismatch_metrics():
    loss, m, _ = run({"use_importance_sampling_correction": True}, gen_weights=W)
    assert loss == pytest.approx(sum(w * l for w, l in zip(flat(W), flat(PPO))) / 5, rel=1e-5)  # 0.89
    assert m["sampling_importance_ratio"] == pytest.approx(sum(flat(W)) / 5, rel=1e-5)
    # exp(|log pi_gen - log pi_prev|) = max(w, 1/w)
    assert m["token_mult_prob_error"] == pytest.approx((2 + 1 + 2 + 1 + 3) / 5, rel=1e-5)
    assert m["gen_kl_error"] == pytest.approx(sum(w - 1 - L(w) for w in flat(W)) / 5, rel=1e-5)
    # without the correction the loss ignores the mismatch
    loss, _, _ = run({}, gen_weights=W)
    assert loss == pytest.approx(sum(flat(PPO)) / 5, rel=1e-5)


@pytest.mark.parametrize(
    "kind,lo,hi,weights,oob",
    [
        ("tis", None, 2.5, [2.0, 1.0, 0.5, 1.0, 2.5], 1 / 5),
        ("icepop", 0.6, 2.5, [2.0, 1.0, 0.0, 1.0, 0.0], 2 / 5),
        # geometric means: row 0 sqrt(2) = 1.41 (outside [0.6, 1.3]), row 1 (1.5)^(1/3) = 1.14
        ("seq-mask-tis", 0.6, 1.3, [0.0, 0.0, 0.5, 1.0, 3.0], 2 / 5),
    ],
)
def test_truncated_importance_sampling(kind, lo, hi, weights, oob):
    cfg = {
        "use_importance_sampling_correction": True,
        "truncated_importance_sampling_type": kind,
        "truncated_importance_sampling_ratio": hi,
        "truncated_importance_sampling_ratio_min": lo,
    }
    loss, m, _ = run(cfg, gen_weights=W)
    assert loss == pytest.approx(sum(w * l for w, l in zip(weights, flat(PPO))) / 5, rel=1e-5)
    assert m["is_oob_ratio"] == pytest.approx(oob)


@pytest.mark.parametrize("kind", ["icepop", "seq-mask-tis"])
def test_truncation_drops_an_overflowing_weight_without_a_nan(kind):
    # Row 0's last token was sampled at pi_gen = e^-100 of the trainer's 0.4: w = 0.4 e^100 is inf
    # in float32, which icepop (token) and seq-mask-tis (row 0's geometric mean) drop; a 0 * inf
    # put a NaN into the loss and its gradient. Expected: the same as a large finite weight.
    cfg = {"use_importance_sampling_correction": True, "truncated_importance_sampling_type": kind,
           "truncated_importance_sampling_ratio": 2.5, "truncated_importance_sampling_ratio_min": 0.6}
    results = []
    for log_gen in (-100.0, -80.0):  # w = inf, w = 0.4 e^80 (finite)
        curr, batch = make_batch()
        batch["generation_logprobs"][0, 3] = log_gen
        loss, m = ClippedPGLoss(cfg)(curr, batch, *valid_counts(batch))
        loss.backward()
        results.append((loss.item(), curr.grad, m["is_oob_ratio"], m["sampling_importance_ratio"]))
    (l_inf, g_inf, oob_inf, w_inf), (l_big, g_big, oob_big, w_big) = results
    # icepop: row 0's token 3 out (weight 0); seq-mask-tis: all of row 0 out.
    expected = PPO[0][0] + sum(PPO[1]) if kind == "icepop" else sum(PPO[1])
    assert l_inf == pytest.approx(expected / 5, rel=1e-5) and l_inf == l_big
    assert torch.equal(g_inf, g_big) and torch.isfinite(g_inf).all()
    assert oob_inf == oob_big == pytest.approx(1 / 5 if kind == "icepop" else 2 / 5)
    assert w_inf == w_big and math.isfinite(w_inf)


def test_sample_mask_drops_a_row():
    curr, batch = make_batch()
    batch["sample_mask"] = torch.tensor([0.0, 1.0])
    toks, seqs = valid_counts(batch)
    assert toks.item() == 3 and seqs.item() == 1
    loss, m = ClippedPGLoss({})(curr, batch, toks, seqs)
    assert loss.item() == pytest.approx(sum(PPO[1]) / 3, rel=1e-5)
    assert m["num_valid_samples"] == 1.0


def test_a_batch_without_a_valid_token_reports_no_per_token_means():
    # Every sample masked (overlong filtering with all of them truncated): probs_ratio,
    # token_mult_prob_error, sampling_importance_ratio... were 0, which the worker's mean over the
    # optimizer steps averaged into the others' (a step of ratio 1 and an empty one logged 0.5).
    curr, batch = make_batch(gen_weights=W)
    batch["sample_mask"] = torch.zeros(2)
    cfg = {"reference_policy_kl_penalty": 0.1, "use_importance_sampling_correction": True,
           "truncated_importance_sampling_ratio": 2.5}
    loss, m = ClippedPGLoss(cfg)(curr, batch, *valid_counts(batch))
    assert loss.item() == 0.0
    assert m == {"pg_loss": 0.0, "kl_penalty": 0.0, "num_valid_samples": 0.0}
    loss.backward()
    assert curr.grad.abs().sum() == 0


def _random_batch(b=6, s=7, seed=0):
    g = torch.Generator().manual_seed(seed)
    token_mask = (torch.rand(b, s, generator=g) > 0.3).float()
    token_mask[:, 0] = 0
    batch = {
        "prev_logprobs": -torch.rand(b, s, generator=g) * 2,
        "generation_logprobs": -torch.rand(b, s, generator=g) * 2,
        "reference_logprobs": -torch.rand(b, s, generator=g) * 2,
        "advantages": torch.randn(b, 1, generator=g).expand(b, s).clone(),
        "token_mask": token_mask,
        "sample_mask": torch.tensor([1.0, 1.0, 0.0, 1.0, 1.0, 1.0])[:b],
    }
    curr = -torch.rand(b, s, generator=g) * 2
    return curr, batch


@pytest.mark.parametrize(
    "cfg",
    [
        {"reference_policy_kl_penalty": 0.05, "ratio_clip_c": 3.0},
        {"token_level_loss": False, "reference_policy_kl_penalty": 0.05},
        {"token_level_loss": False, "sequence_level_importance_ratios": True},
        {"use_cispo": True, "use_importance_sampling_correction": True},
    ],
)
def test_microbatches_sum_to_the_global_loss(cfg):
    curr, batch = _random_batch()
    loss_fn = ClippedPGLoss(cfg)
    toks, seqs = valid_counts(batch)

    whole = curr.clone().requires_grad_()
    full_loss, full_metrics = loss_fn(whole, batch, toks, seqs)
    full_loss.backward()

    parts = curr.clone().requires_grad_()
    total, summed, mins, maxs = 0.0, {}, {}, {}
    for start in range(0, 6, 2):
        mb = {k: v[start : start + 2] for k, v in batch.items()}
        loss, metrics = loss_fn(parts[start : start + 2], mb, toks, seqs)
        loss.backward()
        total += loss.item()
        for k, v in metrics.items():
            if k.endswith("_min"):
                mins[k] = min(mins.get(k, math.inf), v)
            elif k.endswith("_max"):
                maxs[k] = max(maxs.get(k, -math.inf), v)
            else:
                summed[k] = summed.get(k, 0.0) + v
    assert total == pytest.approx(full_loss.item(), rel=1e-5)
    assert torch.allclose(parts.grad, whole.grad, atol=1e-7)
    for k, v in {**summed, **mins, **maxs}.items():
        assert v == pytest.approx(full_metrics[k], rel=1e-5, abs=1e-7), k


@pytest.mark.parametrize(
    "cfg",
    [
        {},
        {"ratio_clip_c": 100.0, "use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 2.0},
        {"token_level_loss": False, "sequence_level_importance_ratios": True},
        {"use_cispo": True},
        {"disable_ppo_ratio": True},
        {"force_on_policy_ratio": True},
        {"reference_policy_kl_penalty": 0.05},
    ],
)
def test_zero_gradient_rows_have_exactly_zero_gradient(cfg):
    """The rows zero_gradient_rows names (the policy worker leaves them out of training) get a
    gradient of exactly 0 under every variant, and the others do not: row 0 has a zero advantage,
    row 2 sample_mask 0 (with a nonzero advantage), the rest random advantages. Clipping bounds
    wide enough that no trained row is clipped to a zero gradient."""
    curr, batch = _random_batch()
    batch["advantages"][0] = 0.0
    batch["advantages"][3, 2:] = 0.0  # zero on some tokens only: still trained
    loss_fn = ClippedPGLoss({"ratio_clip_min": 0.99, "ratio_clip_max": 100.0, **cfg})
    curr.requires_grad_()
    loss, _ = loss_fn(curr, batch, *valid_counts(batch))
    loss.backward()
    zero = loss_fn.zero_gradient_rows(batch)
    kl = cfg.get("reference_policy_kl_penalty", 0) > 0
    assert zero.tolist() == [not kl, False, True, False, False, False]  # the KL penalty trains every row
    assert (curr.grad[zero] == 0).all()
    assert (curr.grad[~zero].abs().sum(dim=1) > 0).all()


def test_no_row_is_skipped_under_the_entropy_quantile():
    # The high-entropy floor is a quantile over the micro-batch's valid tokens, a zero-advantage
    # row's among them: leaving that row out moved the floor and changed the other rows' update.
    curr, batch = _random_batch()
    batch["advantages"][0] = 0.0
    batch["token_entropy"] = torch.rand(curr.shape, generator=torch.Generator().manual_seed(1))
    batch["token_entropy"][0] = 10.0  # row 0 holds the highest entropies
    loss_fn = ClippedPGLoss({"top_entropy_quantile": 0.3, "ratio_clip_min": 0.99, "ratio_clip_max": 100.0})
    assert not loss_fn.zero_gradient_rows(batch).any()
    whole = curr.clone().requires_grad_()
    loss_fn(whole, batch, *valid_counts(batch))[0].backward()
    rest = {k: v[1:] for k, v in batch.items()}
    part = curr[1:].clone().requires_grad_()
    loss_fn(part, rest, *valid_counts(batch))[0].backward()
    assert not torch.allclose(whole.grad[1:], part.grad)  # why the row must stay


def test_entropy_quantile_counts_exactly():
    from posttrain.losses.policy_gradient import _quantile_floor

    # 0.28 * 25 is 7.000000000000001 in floats: ceil kept 8 tokens.
    for top, n, keep in ((0.28, 25, 7), (0.14, 50, 7), (0.2, 10, 2), (0.21, 10, 3), (0.01, 10, 1)):
        values = torch.arange(float(n))
        assert int((values >= _quantile_floor(values, top)).sum()) == keep, (top, n)


def test_config_defaults_validation_and_pickling():
    import pickle

    loss_fn = ClippedPGLoss({"ratio_clip_max": 0.28})
    assert loss_fn.cfg.ratio_clip_min == 0.2 and loss_fn.cfg.reference_policy_kl_type == "k3"
    assert ClippedPGLoss({}).cfg.ratio_clip_max == 0.2  # PPO's symmetric clip unless asked (DAPO: 0.28)
    with pytest.raises(ValidationError, match="ratio_clip_min"):  # 1 - 1.5 < 0: no ratio is below it
        ClippedPGLoss({"ratio_clip_min": 1.5})
    assert loss_fn.loss_type == "token" and loss_fn.needs_pairs is False
    assert ClippedPGLoss(ClippedPGLossConfig(token_level_loss=False)).loss_type == "sequence"
    assert pickle.loads(pickle.dumps(loss_fn)).cfg == loss_fn.cfg
    with pytest.raises(ValidationError, match="token_level_loss=false"):
        ClippedPGLoss({"sequence_level_importance_ratios": True})
    with pytest.raises(ValidationError, match="use_importance_sampling_correction"):
        ClippedPGLoss({"truncated_importance_sampling_ratio": 2.0})
    with pytest.raises(ValidationError, match="ratio_min"):
        ClippedPGLoss({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
                       "truncated_importance_sampling_ratio": 2.0})
    with pytest.raises(ValidationError, match="mutually exclusive"):
        ClippedPGLoss({"use_cispo": True, "disable_ppo_ratio": True})
    for mode in ("use_cispo", "disable_ppo_ratio", "force_on_policy_ratio"):  # accepted and ignored before
        with pytest.raises(ValidationError, match=rf"ratio_clip_c \(dual clip\) has no effect with loss_fn.{mode}"):
            ClippedPGLoss({mode: True, "ratio_clip_c": 3.0})
    # GSPO's weight is the product over the sequence, unbounded by seq-mask-tis's geometric-mean
    # bounds: 1.5 per token over 40 tokens passed [0.5, 2] and weighed the loss by 1.1e7.
    with pytest.raises(ValidationError, match="seq-mask-tis keeps token-level weights"):
        ClippedPGLoss({"sequence_level_importance_ratios": True, "token_level_loss": False,
                       "use_importance_sampling_correction": True, "truncated_importance_sampling_type": "seq-mask-tis",
                       "truncated_importance_sampling_ratio": 2.0, "truncated_importance_sampling_ratio_min": 0.5})
    # Accepted and ignored before: truncation keys without the ratio that turns it on, a lower
    # bound tis never uses.
    with pytest.raises(ValidationError, match="truncated_importance_sampling_type and loss_fn.truncated_"
                                              "importance_sampling_ratio_min set, but loss_fn.truncated_"):
        ClippedPGLoss({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": "icepop",
                       "truncated_importance_sampling_ratio_min": 0.5})
    with pytest.raises(ValidationError, match="ratio_min has no effect with loss_fn.truncated_importance_"
                                              "sampling_type=tis"):
        ClippedPGLoss({"use_importance_sampling_correction": True, "truncated_importance_sampling_ratio": 2.0,
                       "truncated_importance_sampling_ratio_min": 0.5})
    # NeMo RL's default type, null (no truncation), loads as it does there: a NeMo loss_fn section carries over.
    assert ClippedPGLoss({"truncated_importance_sampling_type": None}).cfg.truncated_importance_sampling_ratio is None
    with pytest.raises(ValidationError, match="truncated_importance_sampling_type is null: name how"):
        ClippedPGLoss({"use_importance_sampling_correction": True, "truncated_importance_sampling_type": None,
                       "truncated_importance_sampling_ratio": 2.0})
    with pytest.raises(ValidationError, match="use_on_policy_kl_approximation=true weighs the KL penalty"):
        ClippedPGLoss({"use_on_policy_kl_approximation": True})  # accepted and ignored before
    assert ClippedPGLoss({"use_on_policy_kl_approximation": True, "reference_policy_kl_penalty": 0.1})
    assert ClippedPGLoss({"sequence_level_importance_ratios": True, "token_level_loss": False,
                          "ratio_clip_c": 3.0}).cfg.ratio_clip_c == 3.0
    with pytest.raises(ValidationError, match="ratio_clp_min"):
        ClippedPGLoss({"ratio_clp_min": 0.1})


def test_bad_batch_errors_name_the_key():
    curr, batch = make_batch()
    batch.pop("advantages")
    with pytest.raises(KeyError, match="advantages"):
        ClippedPGLoss({})(curr, batch, 5, 2)
    curr, batch = make_batch()
    batch["prev_logprobs"] = batch["prev_logprobs"][:, :3]
    with pytest.raises(ValueError, match="prev_logprobs"):
        ClippedPGLoss({})(curr, batch, 5, 2)


def test_masked_mean():
    v = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 0.0]])
    assert masked_mean(v, m).item() == pytest.approx(2.0)
    assert masked_mean(v, m, dim=-1).tolist() == pytest.approx([2.0, 0.0])  # empty row -> 0, not NaN
    assert masked_mean(v, m, global_normalization_factor=8).item() == pytest.approx(0.5)
    assert masked_mean(v, torch.zeros(2, 3)).item() == 0.0


def test_non_finite_padding_does_not_leak():
    curr, batch = make_batch(gen_weights=W)
    pad = batch["token_mask"] == 0
    with torch.no_grad():
        curr[pad] = float("-inf")
    for key, value in (("prev_logprobs", float("nan")), ("generation_logprobs", float("-inf")),
                       ("reference_logprobs", float("inf")), ("advantages", float("nan"))):
        batch[key] = batch[key].masked_fill(pad, value)
    toks, seqs = valid_counts(batch)
    cfg = {"reference_policy_kl_penalty": 0.1, "use_importance_sampling_correction": True, "token_level_loss": False}
    loss, metrics = ClippedPGLoss(cfg)(curr, batch, toks, seqs)
    loss.backward()
    clean_curr, clean_batch = make_batch(gen_weights=W)
    clean_loss, clean_metrics = ClippedPGLoss(cfg)(clean_curr, clean_batch, toks, seqs)
    assert loss.item() == pytest.approx(clean_loss.item(), rel=1e-6)
    assert torch.isfinite(curr.grad).all() and (curr.grad[pad] == 0).all()
    for k, v in metrics.items():
        assert v == pytest.approx(clean_metrics[k], rel=1e-6), k


@pytest.mark.parametrize("cfg", [{}, {"reference_policy_kl_penalty": 0.05, "use_importance_sampling_correction": True},
                                 {"token_level_loss": False, "sequence_level_importance_ratios": True}])
def test_missing_prev_logprobs_means_on_policy(cfg):
    """Without prev_logprobs (one optimizer step per batch) the loss, gradient and metrics are
    those of prev = the current logprobs: ratio 1, no clipping."""
    curr, batch = _random_batch()
    toks, seqs = valid_counts(batch)
    loss_fn = ClippedPGLoss(cfg)
    results = []
    for with_prev in (True, False):
        b = dict(batch)
        if with_prev:
            b["prev_logprobs"] = curr.clone()
        else:
            del b["prev_logprobs"]
        x = curr.clone().requires_grad_()
        loss, metrics = loss_fn(x, b, toks, seqs)
        loss.backward()
        results.append((loss.detach(), x.grad, metrics))
    (l1, g1, m1), (l2, g2, m2) = results
    assert torch.equal(l1, l2) and torch.equal(g1, g2)
    assert m1 == m2
    assert m2["probs_ratio"] == pytest.approx(1.0) and m2["clip_fraction"] == 0.0
    assert g2.abs().sum() > 0


def test_top_entropy_quantile_trains_the_high_entropy_tokens_only():
    # Entropies of the 5 valid tokens (row 0: positions 2, 3; row 1: 1, 2, 3); garbage elsewhere.
    curr, batch = make_batch()
    ent = torch.full((2, 4), 99.0)
    for (i, t), h in zip([(0, 2), (0, 3), (1, 1), (1, 2), (1, 3)], [0.1, 0.9, 0.5, 0.7, 0.3]):
        ent[i, t] = h
    batch["token_entropy"] = ent
    toks, seqs = valid_counts(batch)
    loss_fn = ClippedPGLoss({"top_entropy_quantile": 0.4})
    assert loss_fn.needs_entropy and not ClippedPGLoss({}).needs_entropy
    loss, m = loss_fn(curr, batch, toks, seqs)
    loss.backward()
    # ceil(0.4 * 5) = 2 tokens kept, entropies 0.9 and 0.7: PPO terms -0.5 (row 0) and 0.8 (row 1,
    # clipped there: no gradient); the other three count in the divisor with 0.
    assert loss.item() == pytest.approx((-0.5 + 0.8) / 5, rel=1e-5)
    assert grads_on_valid(curr.grad) == pytest.approx([0.0, -0.5 / 5, 0.0, 0.0, 0.0], abs=1e-6)
    assert m["entropy_kept_fraction"] == pytest.approx(2 / 5)
    # Every other metric is over all valid tokens, as without the option.
    assert m["clip_fraction"] == pytest.approx(2 / 5) and m["probs_ratio_max"] == pytest.approx(2.0, rel=1e-5)
    # Ties at the floor stay in: q = 0.2 keeps the one token at 0.9, and a second one at 0.9 with it.
    ent[1, 3] = 0.9
    _, m = ClippedPGLoss({"top_entropy_quantile": 0.2})(curr.detach(), batch, toks, seqs)
    assert m["entropy_kept_fraction"] == pytest.approx(2 / 5)
    del batch["token_entropy"]
    with pytest.raises(KeyError, match="top_entropy_quantile < 1 needs batch\\['token_entropy'\\]"):
        loss_fn(curr, batch, toks, seqs)
    with pytest.raises(ValidationError):
        ClippedPGLossConfig(top_entropy_quantile=0.0)
