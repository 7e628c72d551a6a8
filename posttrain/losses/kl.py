"""Per-token KL estimators between a sampling policy and a reference policy.

Schulman's estimators ("Approximating KL Divergence", http://joschu.net/blog/kl-approx.html)
of KL(pi || pi_ref) from tokens sampled from pi. With log r = log pi_ref(x) - log pi(x):

    k1 = -log r                    unbiased, high variance, can be negative
    k2 = (log r)^2 / 2             biased, low variance, >= 0
    k3 = (r - 1) - log r           unbiased, low variance, >= 0 (used by GRPO, DeepSeekMath
                                   https://arxiv.org/abs/2402.03300, eq. 4)

k3 is exp(log r): a large |log r| overflows, so log r is clamped to +-input_clamp_value
before the estimator and the estimate to +-output_clamp_value after it (NeMo RL's defaults
20 and 10); None turns either clamp off.
"""

from __future__ import annotations

import torch

KL_TYPES = ("k1", "k2", "k3")


def calculate_kl(
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    kl_type: str = "k3",
    input_clamp_value: float | None = 20.0,
    output_clamp_value: float | None = 10.0,
) -> torch.Tensor:
    """Elementwise estimate of KL(pi || pi_ref) for tokens sampled from pi.

    Args:
        logprobs: `[...]` log pi(x) of the sampled tokens.
        reference_logprobs: `[...]` log pi_ref(x) of the same tokens (same shape).
        kl_type: "k1", "k2" or "k3" (see the module docstring for the formulas).
        input_clamp_value: clamp log(pi_ref/pi) to [-v, v] first; None = no clamp.
        output_clamp_value: clamp the estimate to [-v, v]; None = no clamp.
    Returns:
        `[...]` the per-element estimate (not reduced).
    """
    if kl_type not in KL_TYPES:
        raise ValueError(f"unknown kl_type {kl_type!r}; valid: {', '.join(KL_TYPES)}")
    if logprobs.shape != reference_logprobs.shape:
        raise ValueError(
            f"calculate_kl: logprobs {tuple(logprobs.shape)} and reference_logprobs "
            f"{tuple(reference_logprobs.shape)} must have the same shape"
        )
    log_ratio = reference_logprobs - logprobs
    if input_clamp_value is not None:
        log_ratio = log_ratio.clamp(min=-input_clamp_value, max=input_clamp_value)
    if kl_type == "k1":
        kl = -log_ratio
    elif kl_type == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = torch.exp(log_ratio) - 1.0 - log_ratio
    if output_clamp_value is not None:
        kl = kl.clamp(min=-output_clamp_value, max=output_clamp_value)
    return kl


def generation_mismatch(generation_logprobs: torch.Tensor, logprobs: torch.Tensor,
                        kl_type: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, how far the generation engine's logprobs are from the policy's: exp|gen - policy|
    (`token_mult_prob_error`, 1 where they agree) and the `kl_type` estimate of KL(gen || policy)
    without clamps (`gen_kl_error`); the caller reduces them over its tokens. Both inputs must be
    finite (padding zeroed)."""
    return (torch.exp((generation_logprobs - logprobs).abs()),
            calculate_kl(generation_logprobs, logprobs, kl_type, None, None))
