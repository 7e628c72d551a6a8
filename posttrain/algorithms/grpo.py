"""GRPO and its variants (DAPO, GSPO, Dr.GRPO, RLOO, REINFORCE++), single- and multi-turn.

`run(cfg)` = `setup(cfg)` + `grpo_train(setup)`. The loop in `grpo_train` reads top to
bottom, one phase per block, each timed: data, generation (rollouts with rewards),
advantages, logprobs (prev and reference), training, refit, validation, checkpoint, logging.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.advantages import (
    apply_overlong_reward_shaping,
    compute_advantages,
    dynamic_sampling_keep,
    overlong_filter_mask,
    scale_rewards,
)
from posttrain.checkpoint import CheckpointManager, restore_rng_state
from posttrain.config import to_yaml
from posttrain.data.batch import BatchedDataDict
from posttrain.data.datasets import load_rows
from posttrain.data.loader import RowLoader
from posttrain.data.processors import load_tokenizer, tokenize_sft_rows
from posttrain.distributed.cluster import RayVirtualCluster
from posttrain.environments import create_env
from posttrain.evals import pass_at_k
from posttrain.logging import Logger, Timer
from posttrain.losses import ClippedPGLoss, NLLLoss
from posttrain.policy.lm_policy import Policy
from posttrain.rollouts import render_prompt, run_rollouts
from posttrain.schemas import GRPOMasterConfig


@dataclass
class GRPOSetup:
    cfg: GRPOMasterConfig
    run_dir: Path
    tokenizer: Any
    cluster: RayVirtualCluster
    gen_cluster: RayVirtualCluster | None
    policy: Policy
    generation: Any  # GenerationInterface: the policy itself when colocated
    envs: dict[str, Any]
    loader: RowLoader
    val_rows: list[dict]
    loss_fn: ClippedPGLoss
    logger: Logger
    checkpointer: CheckpointManager
    start_step: int
    best_metric: float | None


def _check_prompt_lengths(rows: list[dict], tokenizer, cfg: GRPOMasterConfig, split: str) -> tuple[list[dict], int]:
    """Drop (and count) or reject rows whose prompt leaves no room to answer, per `data.truncation`."""
    limit = cfg.policy.max_total_sequence_length - 1
    kept, dropped = [], 0
    for i, row in enumerate(rows):
        n = len(render_prompt(tokenizer, row["messages"]))
        if n <= limit:
            kept.append(row)
        elif cfg.data.truncation == "drop":
            dropped += 1
        else:
            raise ValueError(
                f"{split} row {i}: the prompt is {n} tokens, longer than policy.max_total_sequence_length - 1 "
                f"({limit}); set data.truncation=drop to drop such rows"
            )
    if not kept:
        raise ValueError(f"no {split} rows left: all {len(rows)} prompts exceed policy.max_total_sequence_length")
    return kept, dropped


def setup(cfg: GRPOMasterConfig) -> GRPOSetup:
    run_dir = Path(cfg.logger.log_dir)
    torch.manual_seed(cfg.grpo.seed)
    tokenizer = load_tokenizer(cfg.policy.tokenizer)
    train_rows, train_dropped = _check_prompt_lengths(load_rows(cfg.data, "train"), tokenizer, cfg, "train")
    val_rows, _ = _check_prompt_lengths(load_rows(cfg.data, "validation"), tokenizer, cfg, "validation")
    val_rows = val_rows[: cfg.grpo.max_val_samples]
    loader = RowLoader(
        train_rows, cfg.grpo.num_prompts_per_step, shuffle=cfg.data.shuffle, seed=cfg.grpo.seed,
        max_epochs=cfg.grpo.max_num_epochs,
    )

    checkpointer = CheckpointManager(
        cfg.checkpointing, signature={"algorithm": "grpo", "model_name": cfg.policy.model_name}
    )
    latest = checkpointer.latest() if cfg.checkpointing.enabled else None

    logger = Logger(cfg.logger, run_dir, hparams=cfg.model_dump(mode="json"))
    if train_dropped:
        logger.log_metrics({"data/prompts_dropped_overlong": train_dropped}, step=0)

    cluster = RayVirtualCluster(cfg.cluster)
    policy = Policy(cluster, cfg.policy, init_reference=cfg.loss_fn.reference_policy_kl_penalty > 0)
    gen_cluster = None
    if cfg.policy.generation.colocated.enabled:
        generation = policy
    else:
        from posttrain.generation.workers import GenerationWorkerGroup

        # Separate placement: generation workers on their own bundles, refit after every step.
        res = cfg.policy.generation.colocated.resources
        gen_cluster = RayVirtualCluster(
            cfg.cluster.model_copy(update={
                "num_nodes": res.num_nodes or 1,
                "gpus_per_node": cfg.cluster.gpus_per_node if res.gpus_per_node is None else res.gpus_per_node,
                "workers_per_node": 1,
            }),
            name="generation",
        )
        generation = GenerationWorkerGroup(
            gen_cluster, backend=cfg.policy.generation.backend, model_path=cfg.policy.model_name,
            cfg=cfg.policy.generation, max_total_sequence_length=cfg.policy.max_total_sequence_length,
            precision=cfg.policy.generation.torch_cfg.precision or cfg.policy.precision,
        )

    task_names = {r.get("task_name", "math") for r in train_rows + val_rows}
    envs = {name: create_env(name, cfg.env.get_worker_cfg(name)) for name in sorted(task_names)}

    start_step, best_metric = 0, None
    if latest is not None:
        info = checkpointer.load_info(latest)
        policy.load_checkpoint(latest / "policy")
        loader.load_state_dict(info["dataloader"])
        restore_rng_state(checkpointer.load_rng_state(latest))
        start_step, best_metric = info["step"], info.get("best_metric")
        logger.console(f"resumed from {latest} at step {start_step}")
    elif cfg.grpo.warmup_sft_steps:
        _warmup_sft(cfg, policy, tokenizer, train_rows, logger)

    return GRPOSetup(
        cfg=cfg, run_dir=run_dir, tokenizer=tokenizer, cluster=cluster, gen_cluster=gen_cluster, policy=policy, generation=generation,
        envs=envs, loader=loader, val_rows=val_rows, loss_fn=ClippedPGLoss(cfg.loss_fn), logger=logger,
        checkpointer=checkpointer, start_step=start_step, best_metric=best_metric,
    )


def _warmup_sft(cfg: GRPOMasterConfig, policy: Policy, tokenizer, rows: list[dict], logger: Logger) -> None:
    """A short SFT on the task's reference answers, so that reward is not zero at GRPO step 0.

    Uses the same optimizer as GRPO; the rows' `answer` is the assistant turn.
    """
    bs = cfg.policy.train_global_batch_size
    loader = RowLoader(rows, bs, shuffle=True, seed=cfg.grpo.seed + 1)
    nll = NLLLoss()
    for step in range(cfg.grpo.warmup_sft_steps):
        sft_rows = [{"messages": r["messages"] + [{"role": "assistant", "content": r["answer"]}]} for r in next(loader)]
        batch = tokenize_sft_rows(sft_rows, tokenizer, cfg.policy.max_total_sequence_length)
        metrics = policy.train(batch, nll)
        logger.log_metrics({"loss": metrics["loss"]}, step=step, prefix="warmup_sft")
    logger.console(f"warm-up SFT: {cfg.grpo.warmup_sft_steps} steps, final loss {metrics['loss']:.3f}")


def validate(s: GRPOSetup, step: int) -> dict[str, float]:
    """Accuracy (mean reward) on the held-out rows; pass@k when several samples per prompt."""
    cfg = s.cfg.grpo
    n = cfg.num_val_generations_per_prompt
    rows = [r for r in s.val_rows for _ in range(n)]
    results, convs = [], []
    for i in range(0, len(rows), cfg.val_batch_size):
        out = run_rollouts(
            s.generation, rows[i : i + cfg.val_batch_size], s.envs, s.tokenizer,
            max_turns=cfg.max_rollout_turns, max_seq_len=s.cfg.policy.max_total_sequence_length,
            greedy=cfg.val_greedy,
        )
        results.append(out.batch["rewards"])
        convs += out.conversations
    rewards = torch.cat(results)
    correct = (rewards > 0).view(-1, n)
    metrics = {"accuracy": float(correct.float().mean()), "reward": float(rewards.mean())}
    if n > 1:
        c = correct.sum(dim=1).tolist()
        for k in sorted({1, n}):
            metrics[f"pass@{k}"] = sum(pass_at_k(n, ci, k) for ci in c) / len(c)
    s.logger.print_samples(
        [{"prompt": cv.messages[0]["content"], "response": cv.messages[-1]["content"], "reward": cv.reward}
         for cv in convs[: s.cfg.logger.num_val_samples_to_print]]
    )
    return metrics


def grpo_train(s: GRPOSetup) -> dict[str, float]:
    cfg, policy, logger = s.cfg, s.policy, s.logger
    g = cfg.grpo
    timer = Timer()
    val_metrics: dict[str, float] = {}
    last: dict[str, float] = {}
    if g.val_at_start and s.start_step == 0:
        policy.prepare_for_generation()
        val_metrics = validate(s, 0)
        logger.log_metrics(val_metrics, step=0, prefix="val")
    logger.start_progress(g.max_num_steps, s.start_step)
    started = time.monotonic()
    step = s.start_step
    while step < g.max_num_steps:
        timer.reset()
        step_start = time.monotonic()
        # ---- data and generation (with dynamic sampling: regenerate until the batch is full)
        kept: list[BatchedDataDict] = []
        rollout_metrics: dict[str, float] = {}
        for gen_round in range(g.dynamic_sampling_max_gen_batches if g.use_dynamic_sampling else 1):
            with timer.time("data"):
                try:
                    prompts = next(s.loader)
                except StopIteration:
                    break
                rows = [r for r in prompts for _ in range(g.num_generations_per_prompt)]
            with timer.time("generation"):
                policy.prepare_for_generation()
                rollout = run_rollouts(
                    s.generation, rows, s.envs, s.tokenizer, max_turns=g.max_rollout_turns,
                    max_seq_len=cfg.policy.max_total_sequence_length,
                )
                policy.finish_generation()
            batch = rollout.batch
            batch["group_ids"] = torch.arange(len(prompts)).repeat_interleave(g.num_generations_per_prompt)
            rollout_metrics = {k: rollout_metrics.get(k, 0.0) + v for k, v in rollout.metrics.items()} if gen_round else rollout.metrics
            # ---- rewards -> advantages
            with timer.time("advantages"):
                rewards = batch["rewards"]
                if g.reward_shaping.enabled:
                    rewards = apply_overlong_reward_shaping(
                        rewards, batch["response_lengths"],
                        g.reward_shaping.max_response_length or cfg.policy.generation.max_new_tokens,
                        g.reward_shaping.overlong_buffer_length, g.reward_shaping.overlong_buffer_penalty,
                    )
                if g.reward_scaling.enabled:
                    rc = g.reward_scaling
                    rewards = scale_rewards(rewards, rc.source_min, rc.source_max, rc.target_min, rc.target_max)
                batch["shaped_rewards"] = rewards
                batch["sample_mask"] = (
                    overlong_filter_mask(batch["truncated"]) if g.overlong_filtering else torch.ones_like(rewards)
                )
                # Overlong-filtered samples stay in their group's baseline (DAPO); only their loss is masked.
                adv = compute_advantages(
                    g.adv_estimator, rewards, batch["group_ids"],
                    leave_one_out=g.use_leave_one_out_baseline, normalize=g.normalize_rewards,
                )
                batch["advantages"] = adv.unsqueeze(1) * batch["token_mask"]
                if g.use_dynamic_sampling:
                    keep, ds_metrics = dynamic_sampling_keep(rewards, batch["group_ids"])
                    rollout_metrics.update(ds_metrics)
                    batch = batch.select_indices(keep)
            kept.append(batch)
            if not g.use_dynamic_sampling or sum(b.size for b in kept) >= len(rows):
                break
        if not kept or sum(b.size for b in kept) == 0:
            logger.console(f"step {step}: no prompts left or no group with reward variance; stopping")
            break
        batch = BatchedDataDict.from_batches(kept, pad_value_dict={"input_ids": s.tokenizer.pad_token_id or 0})
        if g.use_dynamic_sampling:
            batch = batch.slice(0, min(batch.size, len(rows)))
        batch.pop("group_ids")

        # ---- logprobs under the policy before the update, and under the reference
        with timer.time("logprobs"):
            with timer.time("prev"):
                batch["prev_logprobs"] = policy.get_logprobs(batch)["logprobs"]
            if cfg.loss_fn.reference_policy_kl_penalty > 0:
                with timer.time("reference"):
                    batch["reference_logprobs"] = policy.get_reference_logprobs(batch)["reference_logprobs"]
            else:
                batch["reference_logprobs"] = batch["prev_logprobs"]

        # ---- policy update
        with timer.time("training"):
            train_metrics = policy.train(batch, s.loss_fn)

        # ---- refit of separate generation workers (colocated refits inside prepare_for_generation)
        if s.generation is not policy:
            with timer.time("refit"):
                s.generation.update_weights(policy.full_state_dict_ref(), version=step + 1)

        step += 1
        # ---- validation
        if g.val_period and step % g.val_period == 0 or (g.val_at_end and step == g.max_num_steps):
            with timer.time("validation"):
                policy.prepare_for_generation()
                val_metrics = validate(s, step)
            logger.log_metrics(val_metrics, step=step, prefix="val")

        # ---- metrics
        step_time = time.monotonic() - step_start
        gen_time = timer.metrics(prefix="").get("generation", float("nan"))
        last = {
            **rollout_metrics,
            **train_metrics,
            "accuracy": float((batch["rewards"] > 0).float().mean()),
            "tokens_per_s_generation": rollout_metrics["generated_tokens"] / gen_time if gen_time else float("nan"),
            "tokens_per_s_total": float(batch["input_lengths"].sum()) / step_time,
            "step_time_s": step_time,
        }
        logger.log_metrics({**last, **timer.metrics(prefix="timing/")}, step=step, prefix="train")
        logger.log_samples(
            [{"step": step, "text": s.tokenizer.decode(batch["input_ids"][i][: int(batch["input_lengths"][i])]),
              "reward": float(batch["rewards"][i])} for i in range(min(batch.size, cfg.logger.num_samples_to_dump))],
            step=step,
        )
        logger.update_progress(step, {"reward": last["reward"], "loss": last["loss"], **{
            f"val_{k}": v for k, v in val_metrics.items() if k == "accuracy"}})
        if not math.isfinite(last["loss"]):
            raise FloatingPointError(
                f"step {step}: the loss is {last['loss']}; stopping before a bad update is saved "
                "(the last complete checkpoint is kept)"
            )

        # ---- checkpoint
        out_of_time = g.max_wall_time_s is not None and time.monotonic() - started > g.max_wall_time_s
        if cfg.checkpointing.enabled and (step % cfg.checkpointing.save_period == 0 or step == g.max_num_steps or out_of_time):
            with timer.time("checkpoint"):
                _save(s, step, {**{f"train:{k}": v for k, v in last.items()}, **{f"val:{k}": v for k, v in val_metrics.items()}})
        if out_of_time:
            logger.console(f"grpo.max_wall_time_s reached at step {step}: stopping after the checkpoint")
            break

    logger.plot()
    final = {**{f"train/{k}": v for k, v in last.items()}, **{f"val/{k}": v for k, v in val_metrics.items()}}
    return final


def _save(s: GRPOSetup, step: int, metrics: dict[str, float]) -> None:
    name = s.cfg.checkpointing.metric_name
    value = metrics.get(name) if name else None
    if name and value is None:
        raise KeyError(
            f"checkpointing.metric_name={name!r} is not among this step's metrics: {sorted(metrics)}"
        )
    tmp = s.checkpointer.begin_save(step)
    s.policy.save_checkpoint(tmp / "policy")
    info = {
        "step": step,
        "epoch": s.loader.epoch,
        "consumed_samples": step * s.cfg.grpo.num_prompts_per_step * s.cfg.grpo.num_generations_per_prompt,
        "dataloader": s.loader.state_dict(),
        "best_metric": value,
    }
    s.checkpointer.finish_save(tmp, step, info, to_yaml(s.cfg), value)
    s.logger.plot()


def run(cfg: GRPOMasterConfig) -> dict[str, float]:
    s = setup(cfg)
    try:
        final = grpo_train(s)
        if cfg.checkpointing.export_hf_at_end:
            s.policy.export_hf(s.run_dir / "hf")
        return final
    finally:
        s.logger.close()
        if s.generation is not s.policy:
            s.generation.shutdown()
        s.policy.shutdown()
        for c in (s.gen_cluster, s.cluster):
            if c is not None:
                c.shutdown()
