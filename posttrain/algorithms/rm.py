"""Reward-model training (`posttrain rm`): Bradley-Terry on a one-label
`AutoModelForSequenceClassification` (`posttrain.losses.BradleyTerryLoss`).

`run(cfg)` = `setup(cfg)` + `rm_train(setup)`. Batch sizes count pairs, as in DPO. The
score of a sequence is the head's output at its last token; metrics are the pairwise
accuracy and the mean chosen/rejected rewards. A trained RM (exported with
`checkpointing.export_hf_at_end`) scores GRPO rollouts through the `reward_model`
environment (`posttrain.environments.reward_model`).
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
from posttrain.losses import BradleyTerryLoss
from posttrain.schemas import RMMasterConfig


@dataclass
class RMSetup:
    cfg: RMMasterConfig
    run: OfflineRun
    tokenizer: Any
    loader: RowLoader  # yields lists of (chosen, rejected) example pairs
    val_batches: list[BatchedDataDict]
    loss_fn: BradleyTerryLoss
    start_step: int
    total_steps: int


def setup(cfg: RMMasterConfig) -> RMSetup:
    """Data first (a bad file fails before any worker starts), then logger, workers, resume."""
    import torch

    torch.manual_seed(cfg.rm.seed)
    tokenizer = load_tokenizer(cfg.policy.tokenizer)
    max_len = max_sequence_length(cfg)
    train, train_stats = process_preference_rows(load_rows(cfg.data, "train"), tokenizer, cfg.data, max_len)
    val, val_stats = process_preference_rows(load_rows(cfg.data, "val"), tokenizer, cfg.data, max_len)
    val_batches = [collate_pairs(c, tokenizer.pad_token_id) for c in chunks(val, cfg.rm.val_global_batch_size)]
    loader = RowLoader(train, cfg.policy.train_global_batch_size, shuffle=cfg.data.shuffle, seed=cfg.rm.seed,
                       max_epochs=cfg.rm.max_num_epochs)

    run, latest = start_run(cfg, "rm", pair_policy_config(cfg.policy), model_kind="sequence_classification")
    log_data_stats(run.logger, {"train": train_stats, "val": val_stats})
    try:
        start_step = resume(run, latest, loader)
    except BaseException:
        run.shutdown()
        raise
    return RMSetup(cfg=cfg, run=run, tokenizer=tokenizer, loader=loader, val_batches=val_batches[: cfg.rm.val_batches],
                   loss_fn=BradleyTerryLoss(), start_step=start_step,
                   total_steps=total_steps(cfg.rm.max_num_steps, cfg.rm.max_num_epochs, loader))


def validate(s: RMSetup) -> dict[str, float]:
    """Loss, pairwise accuracy and mean rewards over the validation pairs (no update)."""
    return evaluate(s.loss_fn, s.val_batches, lambda b: s.run.policy.get_scores(b)["scores"])


def rm_train(s: RMSetup) -> dict[str, float]:
    # Rows 2i / 2i+1 of a batch are the chosen / rejected sides of pair i.
    return offline_train(s, s.cfg.rm, lambda rows: collate_pairs(rows, s.tokenizer.pad_token_id),
                         lambda: validate(s), show="accuracy")

def run(cfg: RMMasterConfig) -> dict[str, float]:
    return run_and_export(setup(cfg), rm_train)
