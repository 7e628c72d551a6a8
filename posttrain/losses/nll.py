"""Negative log-likelihood (SFT) loss, normalized by the global valid-token count."""

from __future__ import annotations

import torch

from posttrain.data.batch import BatchedDataDict
from posttrain.losses.utils import masked_mean


class NLLLoss:
    """Token-level NLL for supervised fine-tuning.

        loss = - sum_{b,t} mask[b,t] * log p(x_{b,t} | x_{b,<t}) / N_global

    where mask = token_mask * sample_mask (assistant tokens of kept rows) and N_global is the
    number of such tokens in the whole global batch (all micro-batches, all workers), so the
    micro-batch losses sum to the mean NLL per token of the global batch and the gradient
    does not depend on how the batch is split.

    Inputs: curr `[b, S]` token-aligned logprobs (position t = log p(token_t | <t)),
    mb["token_mask"] `[b, S]`, mb["sample_mask"] `[b]`; global_valid_toks: scalar tensor.
    Metrics (already divided by the global count, so they sum over micro-batches like the
    loss): loss; num_valid_tokens is this micro-batch's count (sums to the global count).
    """

    loss_type = "token"
    needs_pairs = False

    def __call__(
        self,
        curr: torch.Tensor,
        mb: BatchedDataDict,
        global_valid_toks: torch.Tensor,
        global_valid_seqs: torch.Tensor,
    ) -> tuple[torch.Tensor, dict[str, float]]:
        mask = mb["token_mask"].to(curr.dtype) * mb["sample_mask"].to(curr.dtype).unsqueeze(-1)  # [b, S]
        loss = masked_mean(-curr, mask, global_normalization_factor=global_valid_toks)
        return loss, {"loss": loss.item(), "num_valid_tokens": mask.sum().item()}
