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
    check_finite,
    chunks,
    evaluate,
    log_data_stats,
    max_sequence_length,
    resume,
    save,
    start_run,
    total_steps,
)
from posttrain.data.batch import BatchedDataDict
from posttrain.data.datasets import load_rows
from posttrain.data.loader import RowLoader
from posttrain.data.processors import collate, load_tokenizer, process_sft_rows
from posttrain.logging import Timer
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
    cfg, policy, logger = s.cfg, s.run.policy, s.run.logger
    sft = cfg.sft
    timer = Timer()
    val_metrics: dict[str, float] = {}
    last: dict[str, float] = {}
    if sft.val_at_start and s.start_step == 0:
        val_metrics = validate(s)
        logger.log_metrics(val_metrics, step=0, prefix="val")
    logger.start_progress(s.total_steps, s.start_step)
    step = s.start_step
    while step < s.total_steps:
        timer.reset()
        # ---- data
        with timer.time("data"):
            batch = collate(next(s.loader), s.tokenizer.pad_token_id)
        # ---- policy update (one optimizer step on the global batch)
        with timer.time("training"):
            train_metrics = policy.train(batch, s.loss_fn)
        step += 1
        check_finite(step, train_metrics["loss"])
        # ---- validation
        if sft.val_period and (step % sft.val_period == 0 or step == s.total_steps):
            with timer.time("validation"):
                val_metrics = validate(s)
            logger.log_metrics(val_metrics, step=step, prefix="val")
        # ---- checkpoint
        last = {**train_metrics, "tokens_per_s": train_metrics["num_tokens"] / timer.metrics("")["training"],
                "epoch": s.loader.epoch}
        if s.run.checkpointer.should_save(step) or (cfg.checkpointing.enabled and step == s.total_steps):
            with timer.time("checkpoint"):
                save(s.run, cfg, step, s.loader, {**{f"train:{k}": v for k, v in last.items()},
                                                   **{f"val:{k}": v for k, v in val_metrics.items()}})
        # ---- logging
        logger.log_metrics({**last, **timer.metrics()}, step=step, prefix="train")
        logger.update_progress(step, {"loss": last["loss"], **{f"val_{k}": v for k, v in val_metrics.items()
                                                               if k == "loss"}})
    logger.plot()
    return {"step": step, **{f"train/{k}": v for k, v in last.items()},
            **{f"val/{k}": v for k, v in val_metrics.items()}}


def run(cfg: SFTMasterConfig) -> dict[str, float]:
    s = setup(cfg)
    try:
        result = sft_train(s)
        if cfg.checkpointing.export_hf_at_end:
            s.run.policy.export_hf(s.run.run_dir / "hf")
        return result
    finally:
        s.run.shutdown()
