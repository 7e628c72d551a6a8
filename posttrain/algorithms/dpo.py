"""Direct preference optimisation (`posttrain dpo`): sigmoid DPO, IPO or reference-free
SimPO by `dpo.loss.name` (`posttrain.losses.DPOLoss`), keys as NeMo RL's `dpo` section.

`run(cfg)` = `setup(cfg)` + `dpo_train(setup)`. Batch sizes count pairs
(`policy.train_global_batch_size: 16` = 16 chosen/rejected pairs per step). Reference
logprobs come from the frozen reference copy of the initial policy (none for SimPO); those
of the validation pairs never change, so they are computed once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.algorithms.offline import (
    OfflineRun,
    chunks,
    evaluate,
    log_data_stats,
    max_sequence_length,
    offline_train,
    pair_policy_config,
    resume,
    run_and_export,
    start_run,
    total_steps,
)
from posttrain.data.batch import BatchedDataDict
from posttrain.data.datasets import load_rows
from posttrain.data.loader import RowLoader
from posttrain.data.processors import (
    collate_pairs,
    load_tokenizer,
    process_preference_rows,
)
from posttrain.losses import DPOLoss
from posttrain.schemas import DPOMasterConfig


@dataclass
class DPOSetup:
    cfg: DPOMasterConfig
    run: OfflineRun
    tokenizer: Any
    loader: RowLoader  # yields lists of (chosen, rejected) example pairs
    val_batches: list[BatchedDataDict]
    loss_fn: DPOLoss
    start_step: int
    total_steps: int


def setup(cfg: DPOMasterConfig) -> DPOSetup:
    """Data first (a bad file fails before any worker starts), then logger, workers, resume."""
    import torch

    torch.manual_seed(cfg.dpo.seed)
    tokenizer = load_tokenizer(cfg.policy.tokenizer)
    max_len = max_sequence_length(cfg)
    train, train_stats = process_preference_rows(load_rows(cfg.data, "train"), tokenizer, cfg.data, max_len)
    val, val_stats = process_preference_rows(load_rows(cfg.data, "val"), tokenizer, cfg.data, max_len)
    val_batches = [collate_pairs(c, tokenizer.pad_token_id) for c in chunks(val, cfg.dpo.val_global_batch_size)]
    loader = RowLoader(train, cfg.policy.train_global_batch_size, shuffle=cfg.data.shuffle, seed=cfg.dpo.seed,
                       max_epochs=cfg.dpo.max_num_epochs)
    loss_fn = DPOLoss.from_config(cfg.dpo)

    run, latest = start_run(cfg, "dpo", pair_policy_config(cfg.policy), init_reference=loss_fn.needs_reference)
    log_data_stats(run.logger, {"train": train_stats, "val": val_stats})
    try:
        start_step = resume(run, latest, loader)
    except BaseException:
        run.shutdown()
        raise
    return DPOSetup(cfg=cfg, run=run, tokenizer=tokenizer, loader=loader, val_batches=val_batches[: cfg.dpo.val_batches],
                    loss_fn=loss_fn, start_step=start_step,
                    total_steps=total_steps(cfg.dpo.max_num_steps, cfg.dpo.max_num_epochs, loader))


def validate(s: DPOSetup) -> dict[str, float]:
    """Loss, preference accuracy and rewards over the validation pairs (no update)."""
    policy = s.run.policy
    if s.loss_fn.needs_reference:
        for batch in s.val_batches:
            if "reference_logprobs" not in batch:
                batch["reference_logprobs"] = policy.get_reference_logprobs(batch)["reference_logprobs"]
    return evaluate(s.loss_fn, s.val_batches, lambda b: policy.get_logprobs(b)["logprobs"])


def dpo_train(s: DPOSetup) -> dict[str, float]:
    policy = s.run.policy

    def reference(batch: BatchedDataDict) -> None:  # the frozen initial policy
        batch["reference_logprobs"] = policy.get_reference_logprobs(batch)["reference_logprobs"]

    # Rows 2i / 2i+1 of a batch are the chosen / rejected sides of pair i.
    return offline_train(s, s.cfg.dpo, lambda rows: collate_pairs(rows, s.tokenizer.pad_token_id),
                         lambda: validate(s), show="accuracy",
                         prepare=reference if s.loss_fn.needs_reference else None)

def run(cfg: DPOMasterConfig) -> dict[str, float]:
    return run_and_export(setup(cfg), dpo_train)
