"""Losses: pure functions of tensors, picklable callables shipped to the policy workers.

Every loss follows the contract of docs/architecture.md:
`loss, metrics = loss_fn(curr, batch, global_valid_toks, global_valid_seqs)`, reduced by the
GLOBAL counts so micro-batch losses sum to the global loss; `loss_fn.loss_type` is
"token" or "sequence" and `loss_fn.needs_pairs` says whether rows come in chosen/rejected pairs.
"""

from __future__ import annotations

from posttrain.losses.kl import calculate_kl, generation_mismatch
from posttrain.losses.nll import NLLLoss
from posttrain.losses.policy_gradient import ClippedPGLoss
from posttrain.losses.preference import BradleyTerryLoss, DPOLoss, KTOLoss
from posttrain.losses.utils import masked_mean, valid_counts

__all__ = ["BradleyTerryLoss", "ClippedPGLoss", "DPOLoss", "KTOLoss", "NLLLoss", "calculate_kl", "generation_mismatch",
           "masked_mean", "valid_counts"]
