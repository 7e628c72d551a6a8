"""What SFT, DPO and reward-model training share: they train on a fixed dataset, so their
runs start, validate, checkpoint and resume the same way, and one loop (`offline_train`)
serves all three; each algorithm module supplies its batches, its validation and the metric
it shows beside the progress bar.

Pair algorithms (DPO, RM) count their batch sizes in PAIRS, as NeMo RL does:
`policy.train_global_batch_size: 32` trains on 32 chosen/rejected pairs (64 rows) per
optimizer step; `pair_policy_config` gives the policy the row counts.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from posttrain.checkpoint import (
    EXPORT_DIR,
    CheckpointManager,
    MetricNameError,
    final_export_dir,
    restore_rng_state,
    stop_message,
    train_then_export,
    unless_complete,
)
from posttrain.config import ConfigError, InputError, to_yaml
from posttrain.data.batch import BatchedDataDict
from posttrain.data.datasets import run_rows, shared_rows_note
from posttrain.data.loader import RowLoader
from posttrain.data.processors import load_policy_tokenizer, note_dropped_system, shown_example
from posttrain.distributed.cluster import RayVirtualCluster
from posttrain.logging import Logger, Timer
from posttrain.losses.utils import valid_counts
from posttrain.policy.fsdp_worker import check_compile_backend
from posttrain.policy.hf_io import load_model_configs
from posttrain.policy.lm_policy import Policy
from posttrain.policy.optim import check_optimizer
from posttrain.runtime import freeze_setup_objects
from posttrain.schemas import PolicyConfig

log = logging.getLogger(__name__)


@dataclass
class OfflineRun:
    """The live parts of a run: run folder, logger, checkpoints, workers."""

    run_dir: Path
    logger: Logger
    checkpointer: CheckpointManager
    cluster: RayVirtualCluster
    policy: Policy

    def shutdown(self) -> None:
        self.logger.close()
        self.policy.shutdown()
        self.cluster.shutdown()


def max_sequence_length(cfg: Any) -> int:
    """Tokens per row: `policy.max_total_sequence_length`, or `data.max_input_seq_length` if smaller."""
    limit = cfg.policy.max_total_sequence_length
    return min(limit, cfg.data.max_input_seq_length) if cfg.data.max_input_seq_length else limit


def pair_policy_config(policy: PolicyConfig) -> PolicyConfig:
    """The policy config with batch sizes in rows for a pair algorithm (2 rows per pair)."""
    return policy.model_copy(update={
        "train_global_batch_size": 2 * policy.train_global_batch_size,
        "train_micro_batch_size": 2 * policy.train_micro_batch_size,
        "logprob_batch_size": 2 * policy.logprob_batch_size,
    })


def chunks(items: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(items[i : i + size]) for i in range(0, len(items), size)]


def start_run(
    cfg: Any, algorithm: str, policy_cfg: PolicyConfig, loader: RowLoader, *, max_steps: int,
    model_kind: str = "causal_lm", init_reference: bool = False,
) -> tuple[OfflineRun, ResumePoint | None]:
    """Logger, checkpoint manager (its latest checkpoint is checked against the data and
    `max_steps`, and `loader` set to its data position, before any worker starts: `resume_point`),
    cluster and policy; returns the run and the checkpoint to resume from (or None)."""
    load_model_configs(policy_cfg, with_reference=init_reference, model_kind=model_kind, check_files=True)  # before Ray
    check_optimizer(policy_cfg)
    check_compile_backend(policy_cfg.compile)
    # Nothing is sampled here, so the loss trains and validation measures the model's own
    # distribution: the policy's logprobs are of logits / policy.generation.temperature (for RL,
    # the sampler's distribution), which a policy section shared with a GRPO config may set.
    generation = policy_cfg.generation.model_copy(update={"temperature": 1.0})
    policy_cfg = policy_cfg.model_copy(update={"generation": generation})
    run_dir = Path(cfg.logger.log_dir)
    checkpointer = CheckpointManager(
        cfg.checkpointing, signature={"algorithm": algorithm, "model_name": cfg.policy.model_name}, policy=cfg.policy
    )
    point = resume_point(cfg, checkpointer, loader, max_steps)
    logger = training_logger(cfg, checkpointer, point)
    try:
        cluster = RayVirtualCluster(cfg.cluster)
    except BaseException:
        logger.close()
        raise
    try:
        policy = Policy(cluster, policy_cfg, init_reference=init_reference, model_kind=model_kind,
                        export_bos=cfg.data.add_bos,
                        export_eos=cfg.data.add_eos and model_kind == "sequence_classification")
    except BaseException:
        logger.close()
        cluster.shutdown()
        raise
    return OfflineRun(run_dir, logger, checkpointer, cluster, policy), point


def training_logger(cfg: Any, checkpointer: CheckpointManager, point: ResumePoint | None) -> Logger:
    """The Logger of a training run in `logger.log_dir`: resumed from `point`, it continues the
    logs there; started over, it first moves an earlier run's logs and its final export (hf/,
    which this run's would overwrite) aside."""
    check_export_is_not_an_input(cfg, fresh=point is None)
    # Before the Logger reads checkpointer.run_id: a resumed run's is its checkpoint's (None: one
    # saved before run ids, which its logs cannot be compared with).
    named = checkpointer is not None and point is not None and checkpointer.adopt_run_id(point.path) is not None
    logger = Logger(cfg.logger, cfg.logger.log_dir, hparams=cfg.model_dump(mode="json"), fresh=point is None,
                    also_move=(EXPORT_DIR,), exclusive="logger.log_dir",
                    resumed_from=None if point is None else point.step,
                    run_id=None if checkpointer is None else checkpointer.run_id,
                    compare_run_id=named)
    if checkpointer is not None:
        logger.metric_checks.append(checkpointer.check_metric_name)
    if checkpointer is not None and checkpointer.moved_aside is not None:  # said as the logs' move is
        logger.console(f"the earlier run's checkpoints in {checkpointer.dir} were moved to {checkpointer.moved_aside} "
                       "(checkpointing.start_fresh=true)")
    return logger


def check_export_is_not_an_input(cfg: Any, fresh: bool) -> None:
    """Fail when a model the run loads lies in `<logger.log_dir>/hf/`, the final export of the
    run there, which a fresh start moves aside (the workers then found no such folder) and
    `checkpointing.export_hf_at_end` replaces with this run's: what the error message for a run
    folder given as a model (`policy.model_name=<log_dir>`) advises, with the same config."""
    export = (Path(cfg.logger.log_dir) / EXPORT_DIR).resolve()
    if not (fresh and export.exists()) and not cfg.checkpointing.export_hf_at_end:
        return
    what = ("would move aside as an earlier run's (this run starts over)" if fresh and export.exists() else
            "would replace with its own (checkpointing.export_hf_at_end)")
    for key, name in (("policy.model_name", cfg.policy.model_name), ("policy.tokenizer.name", cfg.policy.tokenizer.name),
                      ("policy.reference_model_name", cfg.policy.reference_model_name)):
        if name and export in (Path(name).resolve(), *Path(name).resolve().parents):
            raise ConfigError(f"{key}={name} is in {export}, the final export of logger.log_dir={cfg.logger.log_dir}, "
                              f"which this run {what}: copy the model out of it, or set another logger.log_dir")


@dataclass(frozen=True)
class ResumePoint:
    """The checkpoint a run resumes from, checked against its data and step budget (`resume_point`)."""

    path: Path
    info: dict[str, Any]  # its training_info.json
    last_step: int  # the run's last step: its max_num_steps, or fewer when its epochs left end it first

    @property
    def step(self) -> int:
        return int(self.info["step"])


def resume_point(cfg: Any, checkpointer: CheckpointManager, loader: RowLoader, max_steps: int) -> ResumePoint | None:
    """The latest checkpoint of the run (None: it starts over), with `loader` set to its data
    position. Fails before any worker starts on a foreign checkpoint, data that no longer
    matches it, a step budget below its step, or a run already complete (GRPO's and the
    offline algorithms' alike; the checkpoint's algorithm names their config section)."""
    latest = checkpointer.latest()
    if latest is None:
        return None
    key = f"{checkpointer.signature['algorithm']}.max_num_steps"
    checkpointer.restore_data_position(latest, loader, to_yaml(cfg))
    checkpointer.check_steps_left(latest, max_steps, key)
    info = checkpointer.load_info(latest)
    # The epochs left count too: a rerun of a run whose data ran out started its workers,
    # exported again and printed an empty result.
    point = ResumePoint(latest, info, loader.last_step(max_steps, int(info["step"])))
    checkpointer.check_complete(latest, point.last_step, key, final_export_dir(cfg), Path(cfg.logger.log_dir))
    return point


def resume(point: ResumePoint, policy: Any, checkpointer: CheckpointManager, logger: Any, cfg: Any,
           loader: RowLoader, max_steps: int) -> int:
    """Restore policy, optimizer and RNGs from `point` (the data position `resume_point` did, in
    `loader`) and say so; the step to start at."""
    policy.load_checkpoint(point.path / "policy")
    restore_rng_state(checkpointer.load_rng_state(point.path))
    # Named for what ends the run: raising max_num_steps alone trains nothing more when the epochs ran out.
    ends = (f"{checkpointer.signature['algorithm']}.max_num_epochs={loader.max_epochs}"
            if point.last_step < max_steps else None)
    logger.console(checkpointer.resume_message(point.path, point.step, to_yaml(cfg), point.last_step, ends_by=ends))
    return point.step


def save(run: OfflineRun, cfg: Any, step: int, loader: RowLoader, metrics: dict[str, float],
         validation_pending: bool = False) -> Path:
    """Checkpoint `step`: policy, data position, RNGs, config (`CheckpointManager.save`); the plots
    are redrawn with it, as GRPO's, so a run killed outright has its curves up to its last checkpoint.
    `validation_pending`: a stop signal skipped the step's validation, which a resume makes up."""
    info = {"epoch": loader.epoch, "consumed_samples": loader.served, "dataloader": loader.state_dict()}
    with run.logger.timed_save(step):
        path = run.checkpointer.save(step, run.policy, info, to_yaml(cfg), metrics, validation_pending)
    run.logger.plot()
    return path


def evaluate(
    loss_fn: Callable, batches: list[BatchedDataDict], forward: Callable[[BatchedDataDict], torch.Tensor]
) -> dict[str, float]:
    """The loss function's metrics over all `batches` without training.

    `forward(batch)` gives the loss input (`[B, S]` logprobs or `[B]` scores). The counts are
    taken over all batches, like a global batch, so the summed metrics are means over the
    whole validation set (per token for NLL, per pair for DPO/RM).
    """
    toks = sum(valid_counts(b)[0] for b in batches)
    seqs = sum(valid_counts(b)[1] for b in batches)
    out: dict[str, float] = {}
    with torch.no_grad():
        for batch in batches:
            _, metrics = loss_fn(forward(batch), batch, toks, seqs)
            for k, v in metrics.items():
                out[k] = out.get(k, 0.0) + float(v)
    return out


def log_data_stats(logger: Logger, stats: dict[str, dict[str, int]]) -> None:
    """Log the tokenization counts (kept / truncated / dropped rows) of each split."""
    for split, counts in stats.items():
        # Counts, not step metrics: one sentence on the console (the step line would pick out
        # `no_loss` as a "loss" and show only it).
        logger.log_metrics(counts, step=0, prefix=f"data/{split}", console=False)
        logger.console(
            f"data {split}: {counts['kept']} of {counts['rows']} rows kept ({counts['truncated']} truncated, "
            f"{counts['dropped']} dropped as too long, {counts['no_loss']} without a loss token"
            + (f", {counts['identical']} pairs whose sides are the same tokens" if "identical" in counts else "") + ")"
            # The steps of an epoch count examples: a row whose chat template re-renders its earlier turns
            # once later ones follow (Qwen3's) is one per turn (processors.tokenize_conversation).
            + (f", as {counts['examples']} examples: one per turn where the chat template re-renders earlier "
               "turns" if "examples" in counts else "")
        )
        if counts["dropped"] * 2 > counts["rows"]:  # TRL truncates: most of a file gone is rarely meant
            log.warning("data %s: %d of %d rows (%.0f%%) are longer than the context and dropped (data.truncation=drop):"
                        " raise policy.max_total_sequence_length, or set data.truncation=truncate", split,
                        counts["dropped"], counts["rows"], 100 * counts["dropped"] / counts["rows"])


def check_packing_budgets(policy: PolicyConfig, data: "OfflineData", logprobs_of_train: bool, max_len: int) -> None:
    """Sequence packing puts each training row whole (each chosen/rejected pair together, which the
    pair loss needs in one micro-batch) in one micro-batch, and fails the step that draws one longer
    than the token budget: fail before any worker starts.

    Training units go through `train_mb_tokens`. Logprob passes (validation, and DPO's reference
    logprobs of the training rows when `logprobs_of_train`) need no pairs: they pack row by row,
    so only the longest row must fit `logprob_mb_tokens`; with KTO's labelled rows, also the
    longest mismatched pair its KL estimate can draw (`collate_kto`: a row's prompt with another
    row's response, cut at `max_len`), which may be longer than any row.
    """
    sp = policy.sequence_packing
    if not sp.enabled:
        return
    units = data.loader.rows
    pairs = isinstance(units[0], tuple)
    rows = [ex for unit in units for ex in unit] if pairs else units
    longest_row = max(len(ex["input_ids"]) for ex in rows)
    longest_unit = max(sum(len(ex["input_ids"]) for ex in unit) for unit in units) if pairs else longest_row
    what = "pair (chosen + rejected, packed together)" if pairs else "row"
    checks = [("train", what, longest_unit, "train_mb_tokens")]
    if logprobs_of_train:
        checks.append(("train", "row", longest_row, "logprob_mb_tokens"))
    if not pairs and "label" in rows[0]:  # KTO
        starts = [ex["loss_mask"].index(1) for ex in rows]
        longest = max(starts) + max(len(ex["input_ids"]) - start for ex, start in zip(rows, starts))
        checks.append(("train", "mismatched pair (a row's prompt with another's response, KTO's KL estimate)",
                       min(max_len, longest), "logprob_mb_tokens"))
    if data.val_batches:
        longest_val = max(int(b[key].max()) for b in data.val_batches for key in ("input_lengths", "kl_input_lengths")
                          if key in b)
        checks.append(("val", "row", longest_val, "logprob_mb_tokens"))
    for split, what, longest, key in checks:
        if longest > getattr(sp, key):
            raise InputError(f"policy.sequence_packing.{key}={getattr(sp, key)} is less than the longest {split} "
                             f"{what}, {longest} tokens: raise it to at least {longest}")


@dataclass
class OfflineSetup:
    """What the loop of an offline algorithm works with (the same for SFT, DPO and RM)."""

    cfg: Any
    run: OfflineRun
    tokenizer: Any
    loader: RowLoader  # yields lists of tokenized examples (of (chosen, rejected) pairs for DPO/RM)
    val_batches: list[BatchedDataDict]
    loss_fn: Any
    start_step: int
    total_steps: int


@dataclass
class OfflineData:
    """An offline algorithm's tokenized data: what `offline_setup` reads before any worker starts."""

    tokenizer: Any
    loader: RowLoader
    val_batches: list[BatchedDataDict]  # the first `algo.val_batches`: what validation runs on
    stats: dict[str, dict[str, int]]  # per split: rows, kept, truncated, dropped, no_loss (, identical: pairs;
    # examples: SFT rows split by turn)


def offline_data(cfg: Any, algorithm: str, process_rows: Callable, collate_fn: Callable) -> OfflineData:
    """Tokenizer, training loader and validation batches; fails on bad data with an InputError.

    `algorithm`: the name of the algorithm's config section ("sft"); `process_rows(rows, tokenizer, data_cfg, max_len)`
    tokenizes and counts; `collate_fn(examples, pad_id)` makes a batch.
    """
    algo = getattr(cfg, algorithm)
    tokenizer = load_policy_tokenizer(cfg.policy)
    max_len = max_sequence_length(cfg)
    examples, stats = {"val": []}, {}
    rows_of = dict(zip(("train", "val"), run_rows(cfg.data, algo)))  # its errors name the file
    for split, rows in rows_of.items():
        if not rows and split == "val":  # a run that never validates
            continue
        try:
            examples[split], stats[split] = process_rows(rows, tokenizer, cfg.data, max_len)
        except InputError as e:
            raise InputError(f"{split} split: {e}") from e
    note_dropped_system(tokenizer, rows_of["train"] + rows_of["val"])
    first = examples["train"][0]  # a pair for DPO and RM: chosen, then rejected
    log.info("first training example as the model reads it (loss on the text in «»): %s",
             " / ".join(shown_example(tokenizer, e) for e in (first if isinstance(first, tuple) else (first,))))
    if (note := shared_rows_note(rows_of["train"], rows_of["val"])) is not None:
        log.warning("%s", note)
    # Only the batches validation runs on: a row past them must not fail the packing check.
    val_batches = [collate_fn(c, tokenizer.pad_token_id)
                   for c in chunks(examples["val"], algo.val_global_batch_size)[: algo.val_batches]]
    try:
        loader = RowLoader(examples["train"], cfg.policy.train_global_batch_size, shuffle=cfg.data.shuffle,
                           seed=algo.seed, max_epochs=algo.max_num_epochs, batch_key="policy.train_global_batch_size",
                           section=algorithm)
    except InputError as e:
        # Fewer rows than a batch: the counts that say why are logged only once the run starts, and
        # "add data" is the wrong advice when the context length left most of the file out.
        train = stats["train"]
        left_out = train["rows"] - train["kept"]
        why = (f"; {left_out} of the split's {train['rows']} rows were left out ({train['dropped']} longer than "
               f"{max_len} tokens, dropped; {train['no_loss']} without a loss token in their first {max_len}): "
               "a longer policy.max_total_sequence_length / data.max_input_seq_length keeps those the limit cut"
               if left_out else "")
        raise InputError(f"train split: {e}{why}") from None
    return OfflineData(tokenizer, loader, val_batches, stats)


def offline_setup(
    cfg: Any,
    algorithm: str,
    process_rows: Callable,
    collate_fn: Callable,
    loss_fn: Any,
    policy_cfg: PolicyConfig,
    **policy_kwargs: Any,
) -> OfflineSetup:
    """Data first (`offline_data`: a bad file fails before any worker starts), then logger,
    workers, resume. `policy_kwargs` go to `start_run` (model_kind, init_reference)."""
    algo = getattr(cfg, algorithm)
    torch.manual_seed(algo.seed)
    data = offline_data(cfg, algorithm, process_rows, collate_fn)
    check_packing_budgets(policy_cfg, data, logprobs_of_train=policy_kwargs.get("init_reference", False),
                          max_len=max_sequence_length(cfg))
    run, point = start_run(cfg, algorithm, policy_cfg, data.loader, max_steps=algo.max_num_steps, **policy_kwargs)
    log_data_stats(run.logger, data.stats)
    start_step = 0
    if point is not None:
        try:
            start_step = resume(point, run.policy, run.checkpointer, run.logger, cfg, data.loader, algo.max_num_steps)
        except BaseException:
            run.shutdown()
            raise
    return OfflineSetup(cfg=cfg, run=run, tokenizer=data.tokenizer, loader=data.loader,
                        val_batches=data.val_batches, loss_fn=loss_fn, start_step=start_step,
                        total_steps=data.loader.last_step(algo.max_num_steps, start_step))


def offline_train(
    s: Any,
    algo: Any,
    make_batch: Callable[[list[Any]], BatchedDataDict],
    validate: Callable[[], dict[str, float]],
    show: str,
    prepare: Callable[[BatchedDataDict], None] | None = None,
) -> dict[str, float]:
    """The training loop of SFT, DPO and RM, phase by phase.

    `s`: the algorithm's setup (cfg, run, loader, loss_fn, start_step, total_steps); `algo`:
    its config section (val_period, val_at_start, val_at_end); `make_batch(rows)`: the training batch;
    `prepare(batch)`: optional extra inputs computed before the update (DPO's reference
    logprobs), timed as "reference_logprobs"; `show`: the metric shown beside the progress bar.
    """
    policy, logger = s.run.policy, s.run.logger
    timer = Timer()
    val_metrics: dict[str, float] = {}
    val_step = 0  # the step val_metrics are of: a stop skips the validation due at its step
    last: dict[str, float] = {}
    logger.start_progress(s.total_steps, s.start_step)  # before step 0's validation line: "val step 0/<total>"
    if algo.val_at_start and s.start_step == 0:
        val_metrics = validate()
        logger.log_metrics(val_metrics, step=0, prefix="val")
    # Unless the resumed config turned validation off: then nothing would be compared with it.
    if (algo.val_period or algo.val_at_end) and (pending := s.run.checkpointer.pending_validation(s.start_step)):
        val_metrics = made_up_validation(s.run.checkpointer, logger, pending, s.start_step, validate)
        val_step = s.start_step
    step = s.start_step
    s.run.checkpointer.start_steps()
    try:
        while step < s.total_steps:
            timer.reset()
            step_start = time.monotonic()
            # ---- data
            with timer.time("data"):
                batch = make_batch(next(s.loader))
            if prepare is not None:
                with timer.time("reference_logprobs"):
                    prepare(batch)
            # ---- policy update (one optimizer step on the global batch)
            with timer.time("training"):
                train_metrics = policy.train(batch, s.loss_fn)
            step += 1
            if policy.sync_reference_if_due(step):
                for b in s.val_batches:
                    b.pop("reference_logprobs", None)  # of the reference before the sync
            # ---- validation (not after a stop signal: the scheduler that sent it kills the job after a
            # grace period, which a long validation before the save would spend)
            measured: dict[str, float] = {}  # this step's validation: only it ranks this step's checkpoint
            due = (algo.val_period and step % algo.val_period == 0) or (algo.val_at_end and step == s.total_steps)
            if due and s.run.checkpointer.stop_signal is None:
                with timer.time("validation"):
                    val_metrics = measured = validate()
                val_step = step
                logger.log_metrics(val_metrics, step=step, prefix="val")
            # ---- logging (before the checkpoint: a run killed once it is saved resumes after this step,
            # which it would never log; the save's time is a record of its own, `Logger.timed_save`)
            # As logged, the checkpoint's metrics: checkpointing.metric_name may name any of them (train:step_time_s).
            last = {**train_metrics, "tokens_per_s": train_metrics["num_tokens"] / timer.metrics("")["training"],
                    "epoch": s.loader.epoch, "step_time_s": time.monotonic() - step_start, **timer.metrics()}
            logger.log_metrics(last, step=step, prefix="train")
            # ---- checkpoint (on schedule, at the end, or when the job's time is up or it is told to stop)
            stop = s.run.checkpointer.stop_reason(last_step=step == s.total_steps)
            if s.run.checkpointer.should_save(step, last=step == s.total_steps or stop is not None):
                save(s.run, s.cfg, step, s.loader, {**{f"train:{k}": v for k, v in last.items()},
                                                     **{f"val:{k}": v for k, v in measured.items()}},
                     validation_pending=bool(due) and not measured)
            logger.update_progress(step, {show: last[show], **({f"val_{show}": val_metrics[show]}
                                                               if show in val_metrics else {})})
            if stop:
                logger.console(stop_message(stop, step, s.cfg.checkpointing))
                break
    except MetricNameError:
        # Found at the first metrics of its kind, after the step that logged them: keep that step.
        if step > s.start_step and s.cfg.checkpointing.enabled:
            save(s.run, s.cfg, step, s.loader, {})
            logger.console(f"checkpointing.metric_name is no metric this run logs: saved step {step} before stopping")
        raise
    logger.plot()
    return {"step": step, **{f"train/{k}": v for k, v in last.items()},
            **{f"val/{k}": v for k, v in val_metrics.items()}, **({"val/step": val_step} if val_metrics else {})}


def made_up_validation(checkpointer: CheckpointManager, logger: Logger, path: Path, step: int,
                       validate: Callable[[], dict[str, float] | None]) -> dict[str, float]:
    """The validation a stop signal skipped at `step`, whose checkpoint `path` the run resumed
    from: measured now on the same weights, logged at that step, and given to the checkpoint
    to rank it (it ranked below every measured one, and the top-k could prune the best).
    `validate` returns None when it was cut short (a stop during GRPO's environments' scoring):
    nothing is logged or recorded then, and the checkpoint's validation stays pending."""
    logger.console(f"validating step {step}, which the stop skipped before its checkpoint")
    metrics = validate()
    if metrics is None:
        return {}
    logger.log_metrics(metrics, step=step, prefix="val")
    checkpointer.record_validation(path, {f"val:{k}": v for k, v in metrics.items()})
    return metrics


def run_and_export(setup: Callable[[], Any], train: Callable[[Any], dict[str, float]]) -> dict[str, float]:
    """`train(setup())`, then the HF export when `checkpointing.export_hf_at_end`; always shuts
    down. A run already complete sets up nothing and returns its final metrics (`unless_complete`)."""

    def setup_and_train() -> dict[str, float]:
        s = setup()
        freeze_setup_objects()
        r = s.run
        return train_then_export(lambda: train(s), r.checkpointer, r.policy, final_export_dir(s.cfg),
                                 r.logger.console, r.shutdown)

    return unless_complete(setup_and_train)
