"""Supervised fine-tuning (`posttrain sft`): NLL on assistant tokens, normalized by the
global valid-token count (`posttrain.losses.NLLLoss`).

`run(cfg)` = `setup(cfg)` + `sft_train(setup)`. Sequence packing and dynamic batching are the
policy's (`policy.sequence_packing`, `policy.dynamic_batching`). Validation loss (mean NLL per
assistant token of the held-out rows) every `sft.val_period` steps and after the last step.
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
    resume,
    run_and_export,
    start_run,
    total_steps,
)
from posttrain.data.batch import BatchedDataDict
from posttrain.data.datasets import load_rows
from posttrain.data.loader import RowLoader
from posttrain.data.processors import collate, load_tokenizer, process_sft_rows
from posttrain.losses import NLLLoss
from posttrain.schemas import SFTMasterConfig


@dataclass
class SFTSetup:
    cfg: SFTMasterConfig
    run: OfflineRun
    tokenizer: Any
    loader: RowLoader  # yields lists of tokenized examples
    val_batches: list[BatchedDataDict]
    loss_fn: NLLLoss
    start_step: int
    total_steps: int


def setup(cfg: SFTMasterConfig) -> SFTSetup:
    """Data first (a bad file fails before any worker starts), then logger, workers, resume."""
    import torch

    torch.manual_seed(cfg.sft.seed)
    tokenizer = load_tokenizer(cfg.policy.tokenizer)
    max_len = max_sequence_length(cfg)
    train, train_stats = process_sft_rows(load_rows(cfg.data, "train"), tokenizer, cfg.data, max_len)
    val, val_stats = process_sft_rows(load_rows(cfg.data, "val"), tokenizer, cfg.data, max_len)
    val_batches = [collate(c, tokenizer.pad_token_id) for c in chunks(val, cfg.sft.val_global_batch_size)]
    loader = RowLoader(train, cfg.policy.train_global_batch_size, shuffle=cfg.data.shuffle, seed=cfg.sft.seed,
                       max_epochs=cfg.sft.max_num_epochs)

    run, latest = start_run(cfg, "sft", cfg.policy)
    log_data_stats(run.logger, {"train": train_stats, "val": val_stats})
    try:
        start_step = resume(run, latest, loader)
    except BaseException:
        run.shutdown()
        raise
    return SFTSetup(cfg=cfg, run=run, tokenizer=tokenizer, loader=loader,
                    val_batches=val_batches[: cfg.sft.val_batches], loss_fn=NLLLoss(), start_step=start_step,
                    total_steps=total_steps(cfg.sft.max_num_steps, cfg.sft.max_num_epochs, loader))


def validate(s: SFTSetup) -> dict[str, float]:
    """Mean NLL per assistant token over the validation batches (no update)."""
    return evaluate(s.loss_fn, s.val_batches, lambda b: s.run.policy.get_logprobs(b)["logprobs"])


def sft_train(s: SFTSetup) -> dict[str, float]:
    return offline_train(s, s.cfg.sft, lambda rows: collate(rows, s.tokenizer.pad_token_id),
                         lambda: validate(s), show="loss")

def run(cfg: SFTMasterConfig) -> dict[str, float]:
    return run_and_export(setup(cfg), sft_train)
