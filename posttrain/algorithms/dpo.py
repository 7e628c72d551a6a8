"""Direct preference optimisation (`posttrain dpo`): sigmoid DPO (conservative with
`dpo.loss.label_smoothing`), robust rDPO, IPO, SLiC's hinge, or reference-free SimPO or ORPO by
`dpo.loss.name` (`posttrain.losses.DPOLoss`), keys as NeMo RL's `dpo` section.

`run(cfg)` = `setup(cfg)` + `dpo_train(setup)`. Batch sizes count pairs
(`policy.train_global_batch_size: 16` = 16 chosen/rejected pairs per step). Reference
logprobs come from the reference copy of the initial policy (none for SimPO and ORPO); those
of the validation pairs are computed once, and again after `policy.reference_sync` moves it.
"""

from __future__ import annotations

from posttrain.algorithms.offline import (
    OfflineSetup,
    evaluate,
    offline_setup,
    offline_train,
    pair_policy_config,
    run_and_export,
)
from posttrain.data.batch import BatchedDataDict
from posttrain.data.processors import (
    collate_pairs,
    process_preference_rows,
)
from posttrain.losses import DPOLoss
from posttrain.schemas import DPOMasterConfig


def setup(cfg: DPOMasterConfig) -> OfflineSetup:
    loss_fn = DPOLoss.from_config(cfg.dpo)
    return offline_setup(cfg, "dpo", process_preference_rows, collate_pairs, loss_fn,
                         pair_policy_config(cfg.policy), init_reference=loss_fn.needs_reference)


def validate(s: OfflineSetup) -> dict[str, float]:
    """Loss, preference accuracy and rewards over the validation pairs (no update)."""
    policy = s.run.policy
    if s.loss_fn.needs_reference:
        for batch in s.val_batches:
            if "reference_logprobs" not in batch:
                batch["reference_logprobs"] = policy.get_reference_logprobs(batch)["reference_logprobs"]
    return evaluate(s.loss_fn, s.val_batches, lambda b: policy.get_logprobs(b)["logprobs"])


def dpo_train(s: OfflineSetup) -> dict[str, float]:
    policy = s.run.policy

    def reference(batch: BatchedDataDict) -> None:  # the frozen initial policy
        batch["reference_logprobs"] = policy.get_reference_logprobs(batch)["reference_logprobs"]

    # Rows 2i / 2i+1 of a batch are the chosen / rejected sides of pair i.
    return offline_train(s, s.cfg.dpo, lambda rows: collate_pairs(rows, s.tokenizer.pad_token_id),
                         lambda: validate(s), show="accuracy",
                         prepare=reference if s.loss_fn.needs_reference else None)


def run(cfg: DPOMasterConfig) -> dict[str, float]:
    return run_and_export(lambda: setup(cfg), dpo_train)
