"""The clipped policy-gradient loss of the GRPO family (PPO, GRPO, DAPO, Dr.GRPO, GSPO, CISPO,
REINFORCE/RLOO), with an optional KL penalty and importance-sampling corrections.

Per valid token t of sequence i (A = advantage, r = pi_theta / pi_prev):

    PPO / GRPO   l = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
                 PPO https://arxiv.org/abs/1707.06347; GRPO (DeepSeekMath) https://arxiv.org/abs/2402.03300
    DAPO         the same with eps_high > eps_low ("clip-higher") and token_level_loss=true
                 https://arxiv.org/abs/2503.14476
    dual clip    for A < 0: l = min(l, -c A), c > 1   https://arxiv.org/abs/1912.09729
    GSPO         r_i = exp(mean_t log(pi_theta/pi_prev)), one ratio per sequence, clipped the same
                 way, with token_level_loss=false   https://arxiv.org/abs/2507.18071
    CISPO        l = -sg(clip(r, 1 - eps_low, 1 + eps_high)) A log pi_theta: clipping bounds the
                 weight but every token keeps a gradient (MiniMax-M1) https://arxiv.org/abs/2506.13585
    REINFORCE    l = -A log pi_theta (disable_ppo_ratio); with leave-one-out advantages this is
                 RLOO https://arxiv.org/abs/2402.14740; with globally normalized advantages,
                 REINFORCE++ https://arxiv.org/abs/2501.03262
    on-policy    r = exp(log pi - sg(log pi)) = 1 (force_on_policy_ratio): gradient of log pi

KL penalty (k1/k2/k3 of `posttrain.losses.kl`): l += beta * KL_t(pi_theta || pi_ref), weighted by
sg(pi_theta / pi_gen) when use_on_policy_kl_approximation (the tokens were sampled from pi_gen).

Importance-sampling correction (use_importance_sampling_correction) of the mismatch between
the generation backend (pi_gen) and the trainer (pi_prev): l *= w, w = pi_prev / pi_gen per token
(GSPO: per sequence, exp(sum_t log(pi_prev/pi_gen))). Truncated IS
(https://fengyao.notion.site/off-policy-rl): "tis" uses min(w, C); "icepop" zeroes tokens with
w outside [C_min, C] (https://arxiv.org/abs/2510.18855); "seq-mask-tis" zeroes whole sequences
whose geometric-mean weight exp(mean_t log w) is outside [C_min, C].

High-entropy tokens (top_entropy_quantile = q < 1; Wang et al., "Beyond the 80/20 Rule",
https://arxiv.org/abs/2506.01939; TRL's top_entropy_quantile): the policy-gradient term keeps only
the valid tokens of the micro-batch whose entropy (of the policy's distribution there,
batch["token_entropy"], which the policy worker adds) is at or above its (1 - q) quantile; the
others contribute 0 but still count in the normalization, and the KL penalty keeps every token.

Reduction: token_level_loss=true: sum over valid tokens / global_valid_toks (the Dr.GRPO /
DAPO token-level normalization, no per-response length bias, https://arxiv.org/abs/2503.20783);
false: per-sequence token mean, summed over valid sequences / global_valid_seqs (original GRPO).
The divisors are GLOBAL counts, so micro-batch losses sum to the global-batch loss.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Any, Mapping

import torch

from posttrain.losses.kl import calculate_kl, generation_mismatch
from posttrain.losses.utils import masked_max, masked_mean, masked_min
from posttrain.schemas import ClippedPGLossConfig

_REQUIRED = ("generation_logprobs", "advantages", "token_mask", "sample_mask")


class ClippedPGLoss:
    """Generalized clipped policy-gradient loss (see the module docstring for every variant).

    `loss, metrics = ClippedPGLoss(cfg)(curr_logprobs, batch, global_valid_toks, global_valid_seqs)`

    Args of `__call__`:
        curr_logprobs: `[B, S]` log pi_theta(token_t | tokens_<t) at position t (position 0 unused), with grad.
        batch: "generation_logprobs", "advantages", "token_mask" (all `[B, S]`), "sample_mask" `[B]`;
            "prev_logprobs" `[B, S]` (the policy before this update; absent means the batch is
            trained in a single optimizer step, where it equals `curr_logprobs` detached); and
            "reference_logprobs" `[B, S]` (needed when the KL penalty is on; when present it is
            also used for the `kl_penalty` metric).
        global_valid_toks: number of valid tokens (token_mask[:, 1:] * sample_mask) in the global batch.
        global_valid_seqs: number of valid sequences (sample_mask) in the global batch.

    Metrics are floats already divided by the global counts, so summing them over
    micro-batches and workers gives the global value; keys ending in `_min` / `_max` are
    micro-batch extremes (reduce with min / max). `num_valid_samples` is a count (sums). A global
    batch without one valid token reports only pg_loss, kl_penalty and num_valid_samples (all 0).
    """

    needs_pairs = False

    def __init__(self, cfg: ClippedPGLossConfig | Mapping[str, Any] | None = None):
        self.cfg = cfg if isinstance(cfg, ClippedPGLossConfig) else ClippedPGLossConfig.model_validate(dict(cfg or {}))
        self.loss_type = "token" if self.cfg.token_level_loss else "sequence"

    @property
    def needs_entropy(self) -> bool:
        """Whether the batch must hold "token_entropy" `[B, S]` (the policy worker adds it)."""
        return self.cfg.top_entropy_quantile < 1.0

    def __call__(
        self,
        curr_logprobs: torch.Tensor,
        batch: Mapping[str, torch.Tensor],
        global_valid_toks: torch.Tensor | float,
        global_valid_seqs: torch.Tensor | float,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        cfg = self.cfg
        self._check(curr_logprobs, batch)
        # Position 0 has no logprob: drop it everywhere.
        dev = curr_logprobs.device
        token_mask = batch["token_mask"][:, 1:].to(dev, torch.float32)
        sample_mask = batch["sample_mask"].to(dev, torch.float32)
        mask = token_mask * sample_mask[:, None]
        valid = mask > 0

        def field(x: torch.Tensor) -> torch.Tensor:
            # Padding may hold -inf/NaN (e.g. a sampler's masked-out logprob); 0 there keeps
            # both the masked sums and their gradients finite (inf * 0 would be NaN).
            return torch.where(valid, x[:, 1:].to(dev, torch.float32), 0.0)

        curr = field(curr_logprobs)
        adv = field(batch["advantages"])
        prev = field(batch["prev_logprobs"]) if "prev_logprobs" in batch else curr.detach()
        gen = field(batch["generation_logprobs"])
        toks = torch.as_tensor(global_valid_toks, dtype=torch.float32, device=dev)
        seqs = torch.as_tensor(global_valid_seqs, dtype=torch.float32, device=dev)

        def reduce(per_token: torch.Tensor) -> torch.Tensor:
            if cfg.token_level_loss:
                return masked_mean(per_token, mask, global_normalization_factor=toks)
            per_seq = masked_mean(per_token, token_mask, dim=-1)
            return masked_mean(per_seq, sample_mask, global_normalization_factor=seqs)

        def tok_mean(x: torch.Tensor) -> float:
            return float(masked_mean(x.detach(), mask, global_normalization_factor=toks))

        # ---- ratios
        if cfg.force_on_policy_ratio:
            ratios = torch.exp(curr - curr.detach())
            clamped = ratios
        elif cfg.disable_ppo_ratio:
            ratios = clamped = None
        else:
            log_ratio = curr - prev
            if cfg.sequence_level_importance_ratios:
                seq_log_ratio = masked_mean(log_ratio, token_mask, dim=-1)
                ratios = torch.exp(seq_log_ratio)[:, None].expand_as(curr)
            else:
                ratios = torch.exp(log_ratio)
            clamped = ratios.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)

        # ---- per-token policy-gradient loss
        zeros = torch.zeros_like(curr)
        clipped_tokens = dual_clipped_tokens = zeros
        if cfg.disable_ppo_ratio:
            per_token = -adv * curr
        elif cfg.use_cispo:
            per_token = -adv * clamped.detach() * curr
            clipped_tokens = (clamped != ratios).float()
        else:
            unclipped, clipped = -adv * ratios, -adv * clamped
            per_token = torch.maximum(unclipped, clipped)
            clipped_tokens = (clipped > unclipped).float()
            if cfg.ratio_clip_c is not None:
                cap = -adv * cfg.ratio_clip_c
                dual_clipped_tokens = ((adv < 0) & (per_token > cap)).float()
                per_token = torch.where(adv < 0, torch.minimum(per_token, cap), per_token)

        # ---- only the micro-batch's high-entropy tokens in the policy-gradient term
        if self.needs_entropy:
            if "token_entropy" not in batch:
                raise KeyError("ClippedPGLoss: loss_fn.top_entropy_quantile < 1 needs batch['token_entropy']")
            token_entropy = field(batch["token_entropy"])
            kept = valid & (token_entropy >= _quantile_floor(token_entropy[valid], cfg.top_entropy_quantile))
            per_token = per_token * kept
            entropy_kept = kept.float()

        # ---- importance-sampling correction of the trainer/generator mismatch
        is_metrics: dict[str, float] = {}
        log_w = torch.nan_to_num(prev - gen, nan=0.0, posinf=0.0, neginf=0.0)
        if cfg.sequence_level_importance_ratios:
            weights = torch.exp((log_w * mask).sum(-1, keepdim=True)).expand_as(curr)
        else:
            weights = torch.exp(log_w)
        if cfg.truncated_importance_sampling_ratio is not None:
            hi, lo = cfg.truncated_importance_sampling_ratio, cfg.truncated_importance_sampling_ratio_min
            kind = cfg.truncated_importance_sampling_type
            if kind == "tis":
                out_of_bounds = (weights > hi).float()
                weights = weights.clamp(max=hi)
            else:
                if kind == "icepop":
                    outside = (weights < lo) | (weights > hi)
                else:  # seq-mask-tis
                    geo_mean = torch.exp(masked_mean(log_w, token_mask, dim=-1))
                    outside = ((geo_mean < lo) | (geo_mean > hi))[:, None].expand_as(curr)
                # Selected, not multiplied by 0: a weight that overflowed to inf (a log-weight past
                # ~88 in float32; GSPO's sequence weight sums a whole response's) is the kind these
                # drop, and inf * 0 would put a NaN into the loss.
                weights = torch.where(outside, 0.0, weights)
                out_of_bounds = outside.float()
            is_metrics["is_oob_ratio"] = tok_mean(out_of_bounds)
        is_metrics["sampling_importance_ratio"] = tok_mean(weights)
        if cfg.use_importance_sampling_correction:
            per_token = per_token * weights.detach()

        pg_loss = reduce(per_token)

        # ---- KL to the reference policy
        # Without a penalty the KL is still reported when reference logprobs are given (no graph).
        beta = cfg.reference_policy_kl_penalty
        kl_value = torch.zeros((), device=dev)
        if beta > 0 and "reference_logprobs" not in batch:
            raise KeyError("ClippedPGLoss: reference_policy_kl_penalty > 0 needs batch['reference_logprobs']")
        if "reference_logprobs" in batch:
            with torch.set_grad_enabled(beta > 0 and torch.is_grad_enabled()):
                ref = field(batch["reference_logprobs"])
                kl = calculate_kl(
                    curr, ref, cfg.reference_policy_kl_type, cfg.kl_input_clamp_value, cfg.kl_output_clamp_value
                )
                if cfg.use_on_policy_kl_approximation:
                    kl_weight = torch.nan_to_num(torch.exp(curr - gen).detach(), nan=0.0, posinf=0.0, neginf=0.0)
                    kl = kl_weight * kl
                kl_value = reduce(kl)
        loss = pg_loss + beta * kl_value if beta > 0 else pg_loss

        # ---- metrics (sum over micro-batches = global value; *_min/*_max reduce by min/max)
        with torch.no_grad():
            true_ratio = ratios if ratios is not None else torch.exp(curr - prev)
            true_clamped = clamped if clamped is not None else true_ratio
            metrics = {"pg_loss": float(pg_loss.detach()), "kl_penalty": float(kl_value.detach()),
                       "num_valid_samples": float(sample_mask.sum())}
            if toks == 0:
                # No valid token in the global batch (every sample masked): the means over its tokens
                # measured nothing, and a 0 (a ratio of 0) would be averaged into the other optimizer
                # steps' values; they are left out, as masked_min's +inf leaves out the extremes.
                return loss, metrics
            entropy = -masked_mean(torch.exp(curr - gen) * curr, mask, global_normalization_factor=toks)
            mult_prob_error, gen_kl = generation_mismatch(gen, prev, cfg.reference_policy_kl_type)
            metrics |= {
                "probs_ratio": tok_mean(true_ratio),
                "probs_ratio_min": masked_min(true_ratio, mask),
                "probs_ratio_max": masked_max(true_ratio, mask),
                "probs_ratio_clamped": tok_mean(true_clamped),
                "probs_ratio_clamped_min": masked_min(true_clamped, mask),
                "probs_ratio_clamped_max": masked_max(true_clamped, mask),
                "clip_fraction": tok_mean(clipped_tokens),
                "dual_clip_fraction": tok_mean(dual_clipped_tokens),
                "token_mult_prob_error": tok_mean(mult_prob_error),
                "gen_kl_error": tok_mean(gen_kl),
                "approx_entropy": float(entropy),
                **is_metrics,
            }
            if self.needs_entropy:
                metrics["entropy_kept_fraction"] = tok_mean(entropy_kept)
        return loss, metrics

    def zero_gradient_rows(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """`[B]` bool: the rows whose loss term and gradient are exactly 0 whatever the logprobs, which
        the policy worker can leave out of the forward and backward passes (still counting them in
        the global normalization) without changing the update: rows with sample_mask 0, and without
        a KL penalty, rows whose advantage is 0 at every token of their token_mask (a GRPO group
        whose samples all got the same reward). Every variant's per-token term is a multiple of A.

        With top_entropy_quantile < 1 no row is named: the high-entropy floor is a quantile over the
        micro-batch's valid tokens, a zero-advantage row's among them, and leaving any row out also
        regroups the micro-batches, so either would move the floor and the tokens it keeps."""
        out = batch["sample_mask"] == 0
        if self.needs_entropy:
            return torch.zeros_like(out)
        if self.cfg.reference_policy_kl_penalty == 0:
            out = out | ((batch["advantages"] * batch["token_mask"]) == 0).all(dim=1)
        return out

    @staticmethod
    def _check(curr: torch.Tensor, batch: Mapping[str, torch.Tensor]) -> None:
        missing = [k for k in _REQUIRED if k not in batch]
        if missing:
            raise KeyError(f"ClippedPGLoss: the batch lacks {missing} (has {sorted(batch)})")
        if curr.dim() != 2:
            raise ValueError(f"ClippedPGLoss: curr_logprobs must be [B, S], got {tuple(curr.shape)}")
        for k in ("prev_logprobs", "generation_logprobs", "advantages", "token_mask", "reference_logprobs"):
            if k in batch and tuple(batch[k].shape) != tuple(curr.shape):
                raise ValueError(
                    f"ClippedPGLoss: batch[{k!r}] has shape {tuple(batch[k].shape)}, "
                    f"curr_logprobs has {tuple(curr.shape)}; token-aligned fields must match"
                )
        if tuple(batch["sample_mask"].shape) != (curr.shape[0],):
            raise ValueError(
                f"ClippedPGLoss: batch['sample_mask'] must be [B]={curr.shape[0]}, got {tuple(batch['sample_mask'].shape)}"
            )


def _quantile_floor(values: torch.Tensor, top: float) -> torch.Tensor:
    """The smallest value among the top `top` share of `values` (1-D): ceil(top * n) of them are at or
    above it (more with ties); +inf when `values` is empty."""
    n = values.numel()
    if n == 0:
        return torch.tensor(float("inf"), device=values.device)
    # In exact decimal arithmetic: float products round up past an integer (0.28 * 25 = 7.000000000000001).
    keep = max(1, math.ceil(Fraction(repr(top)) * n))
    return torch.kthvalue(values, n - keep + 1).values
