"""Supervised fine-tuning (`posttrain sft`): NLL on assistant tokens, normalized by the
global valid-token count (`posttrain.losses.NLLLoss`).

`run(cfg)` = `setup(cfg)` + `sft_train(setup)`. Sequence packing and dynamic batching are the
policy's (`policy.sequence_packing`, `policy.dynamic_batching`). Validation loss (mean NLL per
assistant token of the held-out rows) every `sft.val_period` steps and after the last step
(`sft.val_at_end`).
"""

from __future__ import annotations

from posttrain.algorithms.offline import (
    OfflineSetup,
    evaluate,
    offline_setup,
    offline_train,
    run_and_export,
)
from posttrain.data.processors import collate, process_sft_rows
from posttrain.losses import NLLLoss
from posttrain.schemas import SFTMasterConfig


def setup(cfg: SFTMasterConfig) -> OfflineSetup:
    return offline_setup(cfg, "sft", process_sft_rows, collate, NLLLoss(), cfg.policy)


def validate(s: OfflineSetup) -> dict[str, float]:
    """Mean NLL per assistant token over the validation batches (no update)."""
    return evaluate(s.loss_fn, s.val_batches, lambda b: s.run.policy.get_logprobs(b)["logprobs"])


def sft_train(s: OfflineSetup) -> dict[str, float]:
    return offline_train(s, s.cfg.sft, lambda rows: collate(rows, s.tokenizer.pad_token_id),
                         lambda: validate(s), show="loss")


def run(cfg: SFTMasterConfig) -> dict[str, float]:
    return run_and_export(lambda: setup(cfg), sft_train)
