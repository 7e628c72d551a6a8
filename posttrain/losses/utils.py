"""Masked reductions shared by every loss.

All losses in `posttrain.losses` reduce with these so that "divide by the GLOBAL valid
token (or sequence) count" means the same thing everywhere: a micro-batch loss is its
masked sum divided by the count over the whole global batch (all micro-batches, all
workers), so summing micro-batch losses gives the global loss and the gradient does not
depend on how the batch was split.
"""

from __future__ import annotations

from typing import Mapping

import torch


def masked_mean(
    values: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    global_normalization_factor: torch.Tensor | float | None = None,
) -> torch.Tensor:
    """sum(values * mask, dim) / N, with N = `global_normalization_factor` or sum(mask, dim).

    Shapes: `values` and `mask` broadcast together (e.g. both `[B, S]`); `dim=None` reduces
    everything to a scalar, `dim=-1` gives `[B]`. A zero denominator gives 0 (not NaN):
    an empty row or micro-batch contributes nothing.
    """
    mask = mask.to(values.dtype)
    num = (values * mask).sum() if dim is None else (values * mask).sum(dim=dim)
    if global_normalization_factor is None:
        den = mask.sum() if dim is None else mask.expand_as(values).sum(dim=dim)
    else:
        den = torch.as_tensor(global_normalization_factor, dtype=values.dtype, device=values.device)
    safe = torch.where(den != 0, den, torch.ones_like(den))
    return torch.where(den != 0, num / safe, torch.zeros_like(num))


def masked_min(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Smallest value where mask != 0; +inf when the mask is empty (neutral for a min-reduce)."""
    sel = values[mask != 0]
    return float(sel.min()) if sel.numel() else float("inf")


def masked_max(values: torch.Tensor, mask: torch.Tensor) -> float:
    """Largest value where mask != 0; -inf when the mask is empty (neutral for a max-reduce)."""
    sel = values[mask != 0]
    return float(sel.max()) if sel.numel() else float("-inf")


def valid_counts(batch: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid tokens, valid sequences) of a token-aligned batch, the losses' normalizers.

    tokens = sum(token_mask[:, 1:] * sample_mask[:, None]); sequences = sum(sample_mask).
    Position 0 holds no logprob (nothing predicts the first token), so it never counts.
    The policy worker sums these over the global batch (all micro-batches and workers) and
    passes the totals as `global_valid_toks` / `global_valid_seqs`.
    """
    token_mask = batch["token_mask"][:, 1:].float()
    sample_mask = batch["sample_mask"].float()
    return (token_mask * sample_mask[:, None]).sum(), sample_mask.sum()
