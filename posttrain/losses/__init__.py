"""Losses: pure functions of tensors, picklable callables shipped to the policy workers.

Every loss follows the contract of docs/architecture.md:
`loss, metrics = loss_fn(curr, batch, global_valid_toks, global_valid_seqs)`, reduced by the
GLOBAL counts so micro-batch losses sum to the global loss; `loss_fn.loss_type` is
"token" or "sequence" and `loss_fn.needs_pairs` says whether rows come in chosen/rejected pairs.
"""

from __future__ import annotations

from typing import Any, Callable

from posttrain.losses.kl import calculate_kl
from posttrain.losses.nll import NLLLoss
from posttrain.losses.policy_gradient import ClippedPGLoss
from posttrain.losses.preference import BradleyTerryLoss, DPOLoss, KTOLoss
from posttrain.losses.utils import masked_mean, valid_counts

# Loss classes by name; each takes its config section (a schema object or a dict).
LOSSES: dict[str, Callable[[Any], Any]] = {
    "clipped_pg": ClippedPGLoss,
    "nll": lambda cfg: NLLLoss(),
    "dpo": DPOLoss.from_config,  # the `dpo` section
    "bradley_terry": lambda cfg: BradleyTerryLoss(),
    "kto": KTOLoss.from_config,  # the `kto` section
}


def build_loss(name: str, cfg: Any = None) -> Any:
    """The loss registered as `name`, built from `cfg`; an unknown name lists the valid ones."""
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; valid: {', '.join(sorted(LOSSES))}")
    return LOSSES[name](cfg)


__all__ = ["LOSSES", "BradleyTerryLoss", "ClippedPGLoss", "DPOLoss", "KTOLoss", "NLLLoss", "build_loss", "calculate_kl",
           "masked_mean", "valid_counts"]
