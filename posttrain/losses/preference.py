"""Preference losses: pairwise DPO (sigmoid) and its variants (IPO, SimPO, ORPO, rDPO, SLiC),
Bradley-Terry reward models, and unpaired KTO.

Pair batches interleave rows: row 2i is the chosen response of pair i, row 2i+1 the
rejected one (`needs_pairs = True` tells the policy to keep both in one micro-batch and
worker shard). Losses and metrics are divided by the GLOBAL number of pairs,
`global_valid_seqs / 2` (global_valid_seqs counts rows), so micro-batch values sum to the
global mean.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from posttrain.data.batch import BatchedDataDict
from posttrain.losses.utils import masked_mean
from posttrain.schemas import PREFERENCE_LOSSES, REFERENCE_FREE_LOSSES, PreferenceLossName, sft_loss_weight_of


def sequence_logprobs(logprobs: torch.Tensor, token_mask: torch.Tensor, average: bool) -> torch.Tensor:
    """Per-sequence log-likelihood of the masked tokens: `[B, S]` -> `[B]`, the sum or the mean."""
    return masked_mean(logprobs, token_mask, dim=-1) if average else (logprobs * token_mask).sum(-1)


def preference_pair_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    beta: float,
    name: PreferenceLossName = "sigmoid",
    gamma: float = 0.0,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Per-pair preference losses `[P]` from per-pair scores `[P]`.

    For all but the reference-free "simpo" and "orpo", `chosen`/`rejected` are log-ratios
    log pi(y|x) - log pi_ref(y|x); for those two they are the policy's length-averaged logprobs.
    With h = c - r and eps = `label_smoothing` (the share of pairs whose preference is taken to be
    flipped):
      sigmoid (DPO, https://arxiv.org/abs/2305.18290; with eps > 0 conservative DPO, Mitchell 2023):
                -(1 - eps) log sigma(beta h) - eps log sigma(-beta h)
      robust  (rDPO, https://arxiv.org/abs/2403.00409): the unbiased estimate under flips with
                probability eps, (-(1 - eps) log sigma(beta h) + eps log sigma(-beta h)) / (1 - 2 eps)
      ipo     (IPO, https://arxiv.org/abs/2310.12036):  (h - 1 / (2 beta))^2   (beta = tau)
      hinge   (SLiC-HF, https://arxiv.org/abs/2305.10425): max(0, 1 - beta h)
      simpo   (SimPO, https://arxiv.org/abs/2405.14734): -log sigma(beta h - gamma)
      orpo    (ORPO, https://arxiv.org/abs/2403.07691): -beta log sigma(log odds(c) - log odds(r)),
                odds(l) = p / (1 - p) at p = exp(l), the mean token probability's geometric mean;
                beta is the paper's lambda (beta outside the sigmoid, as there). DPOLoss adds
                ORPO's other half, the NLL of the chosen responses.
    """
    h = chosen - rejected
    eps = label_smoothing
    if name == "sigmoid":
        return -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    if name == "robust":
        return (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    if name == "ipo":
        return (h - 1.0 / (2.0 * beta)) ** 2
    if name == "hinge":
        return torch.relu(1 - beta * h)
    if name == "simpo":
        return -F.logsigmoid(beta * h - gamma)
    if name == "orpo":
        return -beta * F.logsigmoid(_log_odds(chosen) - _log_odds(rejected))
    raise ValueError(f"unknown preference loss {name!r}; valid: {', '.join(PREFERENCE_LOSSES)}")


def _log_odds(mean_logprob: torch.Tensor) -> torch.Tensor:
    """log(p / (1 - p)) at p = exp(mean_logprob) <= 1, stable near p = 1 (expm1, not 1 - exp) and
    finite at p = 1 exactly (the clamp, at the smallest normal number: a sequence the model is
    certain of; a clamp at -1e-6 gave every p above 1 - 1e-6 one log-odds and no gradient)."""
    return mean_logprob - torch.log(-torch.expm1(mean_logprob.clamp(max=-torch.finfo(mean_logprob.dtype).tiny)))


def _pair_mask(sample_mask: torch.Tensor) -> torch.Tensor:
    """`[P]` 0/1 per pair from the `[2P]` rows' sample mask, which must keep or drop a pair's two
    rows together: the losses divide by global_valid_seqs / 2, the valid pairs only then (a lone
    masked row scaled the loss by 2P / (2P + 1))."""
    if sample_mask.shape[0] % 2:
        raise ValueError(f"a pair batch needs an even number of rows (chosen, rejected), got {sample_mask.shape[0]}")
    chosen, rejected = sample_mask[0::2], sample_mask[1::2]
    split = torch.nonzero(chosen != rejected).flatten()
    if split.numel():
        i = int(split[0])
        raise ValueError(f"sample_mask keeps one row of pair {i} (rows {2 * i}, {2 * i + 1}: "
                         f"{chosen[i].item():g}, {rejected[i].item():g}); mask a pair's chosen and rejected together")
    return chosen


def _mean(pair_mask: torch.Tensor, n_pairs: torch.Tensor, values: torch.Tensor) -> float:
    """A metric's share of the global per-pair mean (sums over micro-batches to the mean)."""
    return masked_mean(values, pair_mask, global_normalization_factor=n_pairs).item()


class DPOLoss:
    """DPO and its variants, with an optional SFT term on the chosen responses.

        loss = preference_loss_weight * mean_pairs(preference_pair_losses(...))
             + sft_loss_weight * mean_pairs(-log pi(y_chosen | x))

    Inputs: curr `[b, S]` token-aligned policy logprobs; mb["reference_logprobs"] `[b, S]`
    (not read by the reference-free "simpo" and "orpo"), mb["token_mask"] `[b, S]` (response
    tokens), mb["sample_mask"] `[b]`. beta is `dpo.reference_policy_kl_penalty`. Sequence
    logprobs are token sums, or means when `average_log_probs` (`dpo.preference_average_log_probs`;
    None: means for IPO, as TRL computes it, whose squared loss on sums of hundreds of tokens
    explodes, sums for the others); SimPO and ORPO always use means (SimPO's length normalisation
    is the point of the method; ORPO's odds need a probability per token). The SFT term averages
    over tokens when `sft_average_log_probs` (None: as the preference loss), weighs
    `sft_loss_weight` (None: 1 for ORPO, whose loss is the NLL plus lambda times the odds-ratio
    term, 0 for the others).

    Metrics (per pair, summing over micro-batches to the global mean): loss,
    preference_loss, sft_loss, accuracy (chosen reward > rejected reward), rewards_chosen_mean,
    rewards_rejected_mean, reward_margin; rewards are beta * log-ratio (beta * mean logprob
    for SimPO and ORPO, as TRL reports them).
    """

    loss_type = "sequence"
    needs_pairs = True

    def __init__(
        self,
        beta: float = 0.05,
        name: PreferenceLossName = "sigmoid",
        average_log_probs: bool | None = None,
        sft_average_log_probs: bool | None = None,
        preference_loss_weight: float = 1.0,
        sft_loss_weight: float | None = None,
        simpo_gamma: float = 0.5,
        label_smoothing: float = 0.0,
    ):
        if name not in PREFERENCE_LOSSES:
            raise ValueError(f"unknown dpo.loss.name {name!r}; valid: {', '.join(PREFERENCE_LOSSES)}")
        if name == "ipo" and beta <= 0:
            raise ValueError("IPO needs dpo.reference_policy_kl_penalty > 0 (its target margin is 1 / (2 beta))")
        if label_smoothing and name not in ("sigmoid", "robust"):
            raise ValueError(f"dpo.loss.label_smoothing is of the sigmoid and robust losses, not {name!r}")
        self.beta = beta
        self.name = name
        self.label_smoothing = label_smoothing
        if average_log_probs is None:
            average_log_probs = name == "ipo"
        self.average_log_probs = average_log_probs or name in REFERENCE_FREE_LOSSES
        self.sft_average_log_probs = self.average_log_probs if sft_average_log_probs is None else sft_average_log_probs
        self.preference_loss_weight = preference_loss_weight
        self.sft_loss_weight = sft_loss_weight_of(name, sft_loss_weight)
        self.simpo_gamma = simpo_gamma

    @classmethod
    def from_config(cls, dpo_cfg) -> "DPOLoss":
        """From the `dpo` section (`posttrain.schemas.DPOConfig`)."""
        return cls(
            beta=dpo_cfg.reference_policy_kl_penalty,
            name=dpo_cfg.loss.name,
            average_log_probs=dpo_cfg.preference_average_log_probs,
            sft_average_log_probs=dpo_cfg.sft_average_log_probs,
            preference_loss_weight=dpo_cfg.preference_loss_weight,
            sft_loss_weight=dpo_cfg.sft_loss_weight,
            simpo_gamma=dpo_cfg.loss.simpo_gamma,
            label_smoothing=dpo_cfg.loss.label_smoothing,
        )

    @property
    def needs_reference(self) -> bool:
        return self.name not in REFERENCE_FREE_LOSSES

    def __call__(
        self,
        curr: torch.Tensor,
        mb: BatchedDataDict,
        global_valid_toks: torch.Tensor,
        global_valid_seqs: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb["token_mask"].to(curr.dtype)  # [b, S]
        pair_mask = _pair_mask(mb["sample_mask"].to(curr.dtype))  # [P]
        n_pairs = global_valid_seqs / 2

        policy_seq = sequence_logprobs(curr, mask, self.average_log_probs)  # [b]
        if self.needs_reference:
            ref_seq = sequence_logprobs(mb["reference_logprobs"].to(curr.dtype), mask, self.average_log_probs)
            scores = policy_seq - ref_seq  # log-ratios [b]
        else:
            scores = policy_seq
        chosen, rejected = scores[0::2], scores[1::2]  # [P]
        per_pair = preference_pair_losses(chosen, rejected, self.beta, self.name, self.simpo_gamma,
                                          self.label_smoothing)  # [P]
        pref = masked_mean(per_pair, pair_mask, global_normalization_factor=n_pairs)
        sft_seq = sequence_logprobs(curr[0::2], mask[0::2], self.sft_average_log_probs)  # [P]
        sft = masked_mean(-sft_seq, pair_mask, global_normalization_factor=n_pairs)
        loss = self.preference_loss_weight * pref + self.sft_loss_weight * sft

        with torch.no_grad():
            rc, rr = self.beta * chosen.detach(), self.beta * rejected.detach()
            metrics = {
                "loss": loss.item(),
                "preference_loss": pref.item(),
                "sft_loss": sft.item(),
                "accuracy": _mean(pair_mask, n_pairs, (rc > rr).to(curr.dtype)),
                "rewards_chosen_mean": _mean(pair_mask, n_pairs, rc),
                "rewards_rejected_mean": _mean(pair_mask, n_pairs, rr),
                "reward_margin": _mean(pair_mask, n_pairs, rc - rr),
                "num_valid_samples": pair_mask.sum().item(),
            }
        return loss, metrics


class BradleyTerryLoss:
    """Bradley-Terry reward-model loss (https://arxiv.org/abs/2203.02155, eq. 1):

        loss = mean_pairs( -log sigma(r(x, y_chosen) - r(x, y_rejected)) )

    Inputs: curr = scores `[b]` of a one-label sequence-classification model (rows 2i
    chosen, 2i+1 rejected), mb["sample_mask"] `[b]`. Metrics (per pair, summing over
    micro-batches to the global mean): loss, accuracy (chosen scored higher),
    rewards_chosen_mean, rewards_rejected_mean.
    """

    loss_type = "sequence"
    needs_pairs = True

    def __call__(
        self,
        curr: torch.Tensor,
        mb: BatchedDataDict,
        global_valid_toks: torch.Tensor,
        global_valid_seqs: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        if curr.dim() != 1:
            raise ValueError(f"BradleyTerryLoss takes scores [b], got shape {tuple(curr.shape)}")
        pair_mask = _pair_mask(mb["sample_mask"].to(curr.dtype))  # [P]
        n_pairs = global_valid_seqs / 2
        chosen, rejected = curr[0::2], curr[1::2]  # [P]
        loss = masked_mean(-F.logsigmoid(chosen - rejected), pair_mask, global_normalization_factor=n_pairs)
        with torch.no_grad():
            c, r = chosen.detach(), rejected.detach()
            metrics = {
                "loss": loss.item(),
                "accuracy": _mean(pair_mask, n_pairs, (c > r).to(curr.dtype)),
                "rewards_chosen_mean": _mean(pair_mask, n_pairs, c),
                "rewards_rejected_mean": _mean(pair_mask, n_pairs, r),
                "num_valid_samples": pair_mask.sum().item(),
            }
        return loss, metrics


class KTOLoss:
    """KTO, Kahneman-Tversky optimisation (Ethayarajh et al., https://arxiv.org/abs/2402.01306), on
    unpaired examples labelled desirable or not, as TRL's KTOTrainer computes it:

        r_i    = log pi(y_i | x_i) - log pi_ref(y_i | x_i)              (token sums over the response)
        z      = max(0, mean_j [log pi(y'_j | x_j) - log pi_ref(y'_j | x_j)])
                 the reference point, a KL estimate from mismatched pairs (x_j, y'_j) of the batch,
                 without gradient
        loss_i = lambda_D * (1 - sigma(beta * (r_i - z)))   (y_i desirable)
                 lambda_U * (1 - sigma(beta * (z - r_i)))   (y_i undesirable)
        loss   = sum_i loss_i / the global number of examples

    Inputs: curr `[b, S]` token-aligned policy logprobs; mb["reference_logprobs"] and
    mb["token_mask"] `[b, S]`, mb["sample_mask"] `[b]`, mb["kto_label"] `[b]` (1 desirable, 0 not),
    mb["kto_kl"] `[b]` (z, the same in every row of the global batch) and mb["kto_desirable"] `[b]`
    (the global batch's number of desirable examples, in every row, so that per-label means sum
    over micro-batches). Metrics: loss, kl (z), rewards_desirable_mean and
    rewards_undesirable_mean (beta * r over each label's examples; absent when the global batch
    has none of that label), reward_margin (their difference, when both are there), accuracy (the share of examples on their label's side of the reference point:
    r > z for desirable ones, r < z for the others; a tie is not), num_valid_samples.
    """

    loss_type = "sequence"
    needs_pairs = False
    needs_reference = True  # the reward is a log-ratio to it

    def __init__(self, beta: float = 0.1, desirable_weight: float = 1.0, undesirable_weight: float = 1.0):
        if beta <= 0:
            raise ValueError(f"KTO needs beta > 0, got {beta}")
        self.beta = beta
        self.desirable_weight = desirable_weight
        self.undesirable_weight = undesirable_weight

    @classmethod
    def from_config(cls, kto_cfg) -> "KTOLoss":
        """From the `kto` section (`posttrain.schemas.KTOConfig`)."""
        return cls(kto_cfg.reference_policy_kl_penalty, kto_cfg.desirable_weight, kto_cfg.undesirable_weight)

    def __call__(
        self,
        curr: torch.Tensor,
        mb: BatchedDataDict,
        global_valid_toks: torch.Tensor,
        global_valid_seqs: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb["token_mask"].to(curr.dtype)  # [b, S]
        valid = mb["sample_mask"].to(curr.dtype)  # [b]
        desirable = mb["kto_label"].to(curr.dtype)  # [b]
        z = mb["kto_kl"].to(curr.dtype)  # [b]
        ratio = sequence_logprobs(curr - mb["reference_logprobs"].to(curr.dtype), mask, average=False)  # r [b]
        margin = self.beta * (ratio - z)
        per_example = (desirable * self.desirable_weight * (1 - torch.sigmoid(margin))
                       + (1 - desirable) * self.undesirable_weight * (1 - torch.sigmoid(-margin)))
        loss = masked_mean(per_example, valid, global_normalization_factor=global_valid_seqs)

        with torch.no_grad():
            rewards = self.beta * ratio.detach()
            n_desirable = mb["kto_desirable"].to(curr.dtype)[0]
            n_undesirable = global_valid_seqs - n_desirable
            right = torch.where(desirable > 0, margin.detach() > 0, margin.detach() < 0).to(curr.dtype)
            metrics = {
                "loss": loss.item(),
                "kl": masked_mean(z, valid, global_normalization_factor=global_valid_seqs).item(),
                "accuracy": masked_mean(right, valid, global_normalization_factor=global_valid_seqs).item(),
                "num_valid_samples": valid.sum().item(),
            }
            # A label the global batch has no example of has no mean reward (it logged 0, and the
            # margin minus the other's mean); the counts are global, so every micro-batch agrees.
            if n_desirable > 0:
                d_mean = masked_mean(rewards, valid * desirable, global_normalization_factor=n_desirable)
                metrics["rewards_desirable_mean"] = d_mean.item()
            if n_undesirable > 0:
                u_mean = masked_mean(rewards, valid * (1 - desirable), global_normalization_factor=n_undesirable)
                metrics["rewards_undesirable_mean"] = u_mean.item()
            if n_desirable > 0 and n_undesirable > 0:
                metrics["reward_margin"] = (d_mean - u_mean).item()
        return loss, metrics
