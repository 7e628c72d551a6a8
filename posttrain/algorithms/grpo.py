"""GRPO and its variants (DAPO, GSPO, Dr.GRPO, RLOO, REINFORCE++), single- and multi-turn.

`run(cfg)` = `setup(cfg)` + `grpo_train(setup)`. The loop in `grpo_train` reads top to
bottom, one phase per block, each timed: data, generation (rollouts and rewards),
advantages, logprobs (prev and reference), training, refit, validation, checkpoint, logging.
Variants are config choices of the same loop: the loss (`loss_fn.*`, posttrain.losses),
the advantage estimator (`grpo.adv_estimator`), reward shaping/scaling, overlong filtering
and dynamic sampling (`grpo.*`). On-policy distillation is the same loop with token-level
advantages from a teacher's logprobs (`grpo.adv_estimator=on_policy_distillation`, the
teacher in `policy.reference_model_name`), computed after the logprob phase. Async GRPO
(`grpo.async_grpo`) changes only where a step's rollouts come from: generated while earlier
steps trained (`_RolloutPipeline`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from array import array
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posttrain.advantages import (
    apply_overlong_reward_shaping,
    compute_advantages,
    dynamic_sampling_keep,
    on_policy_distillation_advantages,
    overlong_filter_mask,
    scale_rewards,
)
from posttrain.algorithms.offline import log_data_stats, made_up_validation, resume, resume_point, training_logger
from posttrain.checkpoint import (
    CheckpointManager,
    MetricNameError,
    final_export_dir,
    stop_message,
    train_then_export,
    unless_complete,
)
from posttrain.config import InputError, RunStopped, to_yaml
from posttrain.data.batch import BatchedDataDict
from posttrain.data.datasets import run_rows, shared_rows_note
from posttrain.data.formats import row_name, with_fields
from posttrain.data.loader import RowLoader
from posttrain.data.processors import (collate, load_policy_tokenizer, naming_row, note_dropped_system,
                                       process_sft_rows, shortened)
from posttrain.distributed.cluster import Bundles, RayVirtualCluster, reserve
from posttrain.distributed.worker_group import WorkerError
from posttrain.environments import EnvironmentFailure, create_env, resolve_task_envs, with_tool_schemas
from posttrain.environments.interfaces import LOG_EXTRA_KEY
from posttrain.evals import mean_pass_at_k
from posttrain.generation import check_backend_installed
from posttrain.logging import Logger, Timer
from posttrain.losses import ClippedPGLoss, NLLLoss, generation_mismatch, masked_mean
from posttrain.policy.fsdp_worker import check_compile_backend
from posttrain.policy.hf_io import load_model_configs
from posttrain.policy.lm_policy import Policy
from posttrain.policy.optim import check_optimizer
from posttrain.rollouts import (PROMPT_IDS_KEY, Conversation, RolloutResult, check_tool_turns, render_prompt,
                                run_rollouts, summarize_rollouts)
from posttrain.runtime import freeze_setup_objects
from posttrain.schemas import GRPOMasterConfig

log = logging.getLogger(__name__)


@dataclass
class GRPOSetup:
    cfg: GRPOMasterConfig
    run_dir: Path
    tokenizer: Any
    clusters: list[RayVirtualCluster]
    policy: Policy
    generation: Any  # GenerationInterface: the policy itself when colocated
    envs: dict[str, Any]
    loader: RowLoader
    val_rows: list[dict]
    loss_fn: ClippedPGLoss
    logger: Logger
    checkpointer: CheckpointManager
    start_step: int
    # The resumed checkpoint's consumed_samples and the prompts served by then (the loader's
    # count): samples since are counted with this run's grpo.num_generations_per_prompt.
    consumed_at_start: tuple[int, int] = (0, 0)

    def shutdown(self) -> None:
        for env in self.envs.values():
            env.shutdown()
        if self.generation is not self.policy:
            self.generation.shutdown()
        self.policy.shutdown()
        for cluster in self.clusters:
            cluster.shutdown()
        self.logger.close()


def _fit_prompts(rows: list[dict], tokenizer, cfg: GRPOMasterConfig, split: str) -> tuple[list[dict], int]:
    """Drop (and count) or reject rows whose prompt leaves no room to answer, or is longer than
    `data.max_input_seq_length` (NeMo RL's prompt limit), per `data.truncation`. The kept rows carry
    their rendered prompt (`PROMPT_IDS_KEY`), so no step renders it again."""
    limit = cfg.policy.max_total_sequence_length - 1
    bound = f"policy.max_total_sequence_length - 1 ({limit}) leaves room for"
    if cfg.data.max_input_seq_length is not None and cfg.data.max_input_seq_length < limit:
        limit = cfg.data.max_input_seq_length
        bound = f"data.max_input_seq_length={limit} allows"
    kept, dropped = [], 0
    for i, row in enumerate(rows, start=1):
        name = row_name(row, f"{split} row {i}")
        with naming_row(name, row["messages"]):
            ids = render_prompt(tokenizer, row["messages"], cfg.data.add_bos,
                                add_generation_prompt=cfg.data.add_generation_prompt, tools=row.get("tools"))
        n = len(ids)
        if n <= limit:
            kept.append(with_fields(row, **{PROMPT_IDS_KEY: array("i", ids)}))  # 4 bytes a token, not a list's 8+
        elif cfg.data.truncation == "drop":
            dropped += 1
        else:
            raise InputError(
                f"{name}: the prompt is {n} tokens, more than {bound}; set data.truncation=drop to drop "
                "such rows (they are counted)"
            )
    if rows and not kept:  # no rows at all: the validation of a run that never validates
        raise InputError(
            f"no {split} rows left: all {len(rows)} prompts are more tokens than {bound}"
        )
    return kept, dropped


def cramped_prompts_note(rows: list[dict], cfg: GRPOMasterConfig) -> str | None:
    """A note when some kept training prompts leave less than policy.generation.max_new_tokens to
    answer in the context: their answers are cut there, which only truncation_rate showed."""
    room = cfg.policy.max_total_sequence_length - cfg.policy.generation.max_new_tokens
    lengths = [len(r[PROMPT_IDS_KEY]) for r in rows]
    cramped = sum(n > room for n in lengths)
    if not cramped:
        return None
    return (f"{cramped} of {len(rows)} training prompts leave fewer than policy.generation.max_new_tokens="
            f"{cfg.policy.generation.max_new_tokens} tokens to answer within policy.max_total_sequence_length="
            f"{cfg.policy.max_total_sequence_length} (the longest prompt: {max(lengths)} tokens): their answers are "
            "cut at the context (counted in truncation_rate)")


def off_policy_reinforce_note(cfg: GRPOMasterConfig) -> str | None:
    """A note when loss_fn.disable_ppo_ratio (REINFORCE) meets several optimizer steps per GRPO
    step: the later ones train on an older policy's samples with neither a ratio nor a clip.
    NeMo RL allows it, so it runs; force_on_policy_ratio, the same gradient, is refused there."""
    updates = cfg.updates_per_step()
    if not cfg.loss_fn.disable_ppo_ratio or updates == 1:
        return None
    return (f"loss_fn.disable_ppo_ratio=true (REINFORCE) with {updates} optimizer steps per step "
            "(policy.train_global_batch_size below the step's samples, or grpo.num_iterations > 1): every one "
            "after the first trains on samples of an earlier policy, uncorrected (no ratio, no clip). For "
            "on-policy REINFORCE set policy.train_global_batch_size to grpo.num_prompts_per_step * "
            "grpo.num_generations_per_prompt and grpo.num_iterations=1; for several updates, the clipped ratio")


def untruncated_sequence_weights_note(cfg: GRPOMasterConfig) -> str | None:
    """A note when GSPO's sequence-level ratios meet an untruncated importance-sampling correction:
    the correction weighs a sequence by the product of its tokens' pi_prev/pi_gen, which GSPO's
    length-normalised ratio was made to avoid. NeMo RL allows it (no truncation is its default)."""
    lf = cfg.loss_fn
    if not (lf.sequence_level_importance_ratios and lf.use_importance_sampling_correction
            and lf.truncated_importance_sampling_ratio is None):
        return None
    return ("loss_fn.use_importance_sampling_correction=true with loss_fn.sequence_level_importance_ratios (GSPO) "
            "weighs each sequence by the product over its tokens of pi_prev/pi_gen, untruncated (1.5 a token over "
            "40 tokens: 1.1e7); loss_fn.truncated_importance_sampling_ratio (e.g. 2, tis) clamps it")


def worker_bundles(cfg: GRPOMasterConfig) -> list[Bundles]:
    """The placement groups of a GRPO run: the policy workers' (`cluster`), then, with
    policy.generation.colocated.enabled=false, the separate generation workers' beside them (one
    worker per GPU of `colocated.resources`, or per node without GPUs)."""
    policy = Bundles(cfg.cluster)
    gen = cfg.generation_cluster()
    if gen is None:
        return [policy]
    res = cfg.policy.generation.colocated.resources
    nodes_set, gpus_set = ("null" if v is None else v for v in (res.num_nodes, res.gpus_per_node))
    return [policy, Bundles(
        gen, name="generation",
        asked=(f"the separate generation workers of policy.generation.colocated.enabled=false, beside the policy "
               f"workers' own: policy.generation.colocated.resources.num_nodes={nodes_set} (null: 1), "
               f"gpus_per_node={gpus_set} (null: cluster.gpus_per_node={cfg.cluster.gpus_per_node}), "
               f"one worker per {'GPU' if gen.gpus_per_node else 'node'} with cluster.cpus_per_worker="
               f"{cfg.cluster.cpus_per_worker:g} CPUs"),
    )]


def _generation_backend(cfg: GRPOMasterConfig, policy: Policy, cluster: RayVirtualCluster | None) -> Any:
    """The policy itself when colocated; else generation workers on `cluster`, their own bundles."""
    if cluster is None:
        return policy
    from posttrain.generation.workers import GenerationWorkerGroup

    return GenerationWorkerGroup(
        cluster, backend=cfg.policy.generation.backend, model_path=cfg.policy.model_name,
        cfg=cfg.policy.generation, max_total_sequence_length=cfg.policy.max_total_sequence_length,
        precision=cfg.policy.precision, tokenizer_path=cfg.policy.tokenizer_name, device=cfg.policy.device,
        attn_implementation=cfg.policy.attn_implementation,
    )


def setup(cfg: GRPOMasterConfig) -> GRPOSetup:
    g = cfg.grpo
    torch.manual_seed(g.seed)
    tokenizer = load_policy_tokenizer(cfg.policy)
    # A wrong name or model folder fails before Ray starts, as does a model the torch engine cannot run.
    (_, hf_config), _ = load_model_configs(cfg.policy, with_reference=cfg.needs_reference(), check_files=True)
    if cfg.policy.generation.backend == "torch":
        from posttrain.generation.torch_engine import check_supported_config

        check_supported_config(hf_config, cfg.policy.max_total_sequence_length)
    check_optimizer(cfg.policy)
    check_compile_backend(cfg.policy.compile)
    check_backend_installed(cfg.policy.generation)
    train_rows, val_rows = run_rows(cfg.data, g)
    note_dropped_system(tokenizer, train_rows + val_rows)
    task_names = resolve_task_envs(train_rows + val_rows, cfg.env)  # a bad environment fails before Ray starts
    train_rows, dropped = _fit_prompts(with_tool_schemas(train_rows, cfg.env), tokenizer, cfg, "train")
    val_rows, val_dropped = _fit_prompts(with_tool_schemas(val_rows, cfg.env), tokenizer, cfg, "validation")
    first = train_rows[0][PROMPT_IDS_KEY]
    log.info("first training prompt as the model reads it: %s", shortened(tokenizer.decode(first), 400, len(first)))
    if g.max_rollout_turns > 1:  # a tool's result is shown only in a later turn
        check_tool_turns(tokenizer, train_rows + val_rows, cfg.data.add_bos,
                         add_generation_prompt=cfg.data.add_generation_prompt)
    loader = RowLoader(train_rows, g.num_prompts_per_step * g.batch_multiplier, shuffle=cfg.data.shuffle,
                       seed=g.seed, max_epochs=g.max_num_epochs,
                       batch_key="grpo.num_prompts_per_step (times grpo.batch_multiplier)", section="grpo")
    checkpointer = CheckpointManager(cfg.checkpointing, {"algorithm": "grpo", "model_name": cfg.policy.model_name},
                                     cfg.policy)
    point = resume_point(cfg, checkpointer, loader, g.max_num_steps)  # before any worker starts
    warmup = _warmup_examples(cfg, tokenizer, train_rows) if point is None and g.warmup_sft_steps else None

    run_dir = Path(cfg.logger.log_dir)
    logger = training_logger(cfg, checkpointer, point)
    # What starts below is stopped again if a later part of the setup fails (a bad teacher, an
    # environment that cannot start, a warm-up interrupted), so an in-process caller can go on.
    with contextlib.ExitStack() as undo:
        undo.callback(logger.close)
        if dropped or val_dropped:  # validation accuracy over fewer prompts than the data holds says so
            logger.console(f"dropped {dropped} training and {val_dropped} validation prompts longer than the "
                           "context or data.max_input_seq_length (data.truncation=drop)")
            logger.log_metrics({"prompts_dropped_overlong": dropped, "val_prompts_dropped_overlong": val_dropped},
                               step=0, prefix="data")
        for note in (shared_rows_note(train_rows, val_rows), cramped_prompts_note(train_rows, cfg),
                     off_policy_reinforce_note(cfg), untruncated_sequence_weights_note(cfg)):
            if note is not None:
                logger.console(note)
        # Every placement group before any worker starts: separate generation workers that do not fit
        # failed only after the policy workers had loaded the model.
        clusters = reserve(worker_bundles(cfg))
        for cluster in clusters:
            undo.callback(cluster.shutdown)
        envs = {}
        for name in task_names:
            # Started first and awaited after the policy: their imports run beside the policy
            # workers' (~1.7 s of a run's start on 2 cores).
            envs[name] = create_env(name, cfg.env.get_worker_cfg(name), wait=False)
            undo.callback(envs[name].shutdown)
        policy = Policy(clusters[0], cfg.policy, init_reference=cfg.needs_reference(), export_bos=cfg.data.add_bos)
        undo.callback(policy.shutdown)
        generation = _generation_backend(cfg, policy, clusters[1] if len(clusters) > 1 else None)
        if generation is not policy:
            undo.callback(generation.shutdown)
        for env in envs.values():
            env.wait_ready()
        freeze_setup_objects()  # before the warm-up SFT, whose steps would walk them in full collections

        start_step, consumed_at_start = 0, (0, 0)
        if point is not None:
            consumed_at_start = (int(point.info.get("consumed_samples", 0)), loader.served)
            start_step = resume(point, policy, checkpointer, logger, cfg, loader, g.max_num_steps)
        elif warmup is not None:
            _warmup_sft(cfg, policy, tokenizer, warmup, logger, checkpointer)
        if generation is not policy and (point is not None or g.warmup_sft_steps):
            # Separate generation workers loaded the weights on disk; the first rollout must use
            # the resumed or warmed-up ones.
            generation.update_weights(policy.full_state_dict_ref(), version=start_step)
        undo.pop_all()  # set up: GRPOSetup.shutdown stops them from now on
    return GRPOSetup(
        cfg=cfg, run_dir=run_dir, tokenizer=tokenizer, clusters=clusters, policy=policy, generation=generation,
        envs=envs, loader=loader, val_rows=val_rows[: g.max_val_samples], loss_fn=ClippedPGLoss(cfg.loss_fn),
        logger=logger, checkpointer=checkpointer, start_step=start_step, consumed_at_start=consumed_at_start,
    )


def warmup_overrun(cfg: GRPOMasterConfig, step: int, elapsed_s: float, step_s: float | None,
                   left_s: float | None) -> str | None:
    """Why the warm-up SFT must stop at `step` (of grpo.warmup_sft_steps, `elapsed_s` in) with
    `left_s` until checkpointing.checkpoint_must_save_by, or None. It saves no checkpoint, so a
    warm-up that ends after that limit gets no save in before it: a scheduler's kill there lost it,
    and the restart ran it again. Projected by `step_s`, the mean step after the first ten (None
    before there are ten of them): the first ones' start-up costs projected 609 s for a 27 s warm-up."""
    total = cfg.grpo.warmup_sft_steps
    if left_s is None or step >= total:
        return None
    projected = (step_s if step_s is not None else elapsed_s / step) * (total - step)
    if left_s > 0 and (step_s is None or projected <= left_s):
        return None
    return (f"checkpointing.checkpoint_must_save_by={cfg.checkpointing.checkpoint_must_save_by}: the warm-up SFT "
            f"(grpo.warmup_sft_steps={total}), which saves no checkpoint, would end after it (step {step} after "
            f"{elapsed_s:.0f} s, ~{max(projected, 0):.0f} s to go, {max(left_s, 0):.0f} s left): raise the limit, lower "
            "grpo.warmup_sft_steps, or warm up in a `posttrain sft` run of its own and start from its export")


def _warmup_examples(cfg: GRPOMasterConfig, tokenizer, rows: list[dict]) -> tuple[list, dict[str, int]]:
    """The warm-up SFT's examples (each training prompt with its demonstration, else its answer)
    and their counts; made in the setup, before Ray starts, so that rows it cannot use fail in
    seconds, named as the warm-up's (they failed after the workers had started, as "no rows left
    after applying data.truncation", whose hint `truncate` GRPO's prompts refuse)."""
    key = f"grpo.warmup_sft_steps={cfg.grpo.warmup_sft_steps}"
    if any(r.get("answer") is None and r.get("demonstration") is None for r in rows):
        raise InputError(f"{key} needs an `answer` (or a `demonstration`) in every training row to imitate; "
                         "set grpo.warmup_sft_steps=0 to start RL from the model as it is")
    # Every row is tokenized once, before the steps (the quickstart's 20,000 rows: 3.4 s). Rendering
    # each batch's chat templates at every step kept the policy worker waiting on the driver:
    # the quickstart's 1,000 steps took 73 s that way, 61 s now (measured).
    try:
        return process_sft_rows(rows, tokenizer, cfg.data, cfg.policy.max_total_sequence_length)
    except InputError as e:
        raise InputError(f"{key}: the warm-up SFT's demonstrations (each training prompt with its answer): {e}; "
                         "or set grpo.warmup_sft_steps=0") from None


def _warmup_sft(cfg: GRPOMasterConfig, policy: Policy, tokenizer, warmup: tuple[list, dict[str, int]],
                logger: Logger, checkpointer: CheckpointManager) -> None:
    """SFT on `warmup` (`_warmup_examples`) with the policy's optimizer (see `grpo.warmup_sft_steps`)."""
    started = time.monotonic()
    examples, stats = warmup
    log_data_stats(logger, {"warmup_sft": stats})
    loader = RowLoader(examples, cfg.policy.train_global_batch_size, seed=cfg.grpo.seed + 1,
                       batch_key="policy.train_global_batch_size")
    nll = NLLLoss()
    logger.start_progress(cfg.grpo.warmup_sft_steps, 0)
    first_step = time.monotonic()
    steady = None  # when the 10th step ended: the ones before it carry the start-up costs
    for step in range(1, cfg.grpo.warmup_sft_steps + 1):
        batch = collate(next(loader), tokenizer.pad_token_id)
        # at temperature 1: the demonstrations fit the model itself, as an SFT checkpoint would
        metrics = policy.train(batch, nll, lr=cfg.grpo.warmup_sft_lr, temperature=1.0)
        if step % 10 == 0 or step == cfg.grpo.warmup_sft_steps:  # a console line per 10 steps is plenty
            logger.log_metrics({"loss": metrics["loss"]}, step=step, prefix="warmup_sft")
        logger.update_progress(step, {"warmup_sft_loss": metrics["loss"]})
        now = time.monotonic()
        steady = now if step == 10 else steady
        step_s = (now - steady) / (step - 10) if steady is not None and step >= 20 else None
        if (overrun := warmup_overrun(cfg, step, now - first_step, step_s, checkpointer.time_left_s())) is not None:
            raise RunStopped(overrun)
    # RL starts with fresh Adam moments, as it would from an SFT checkpoint: the warm-up's are
    # scaled for dense imitation gradients and make a useful RL rate unstable.
    policy.reset_optimizer()
    logger.console(f"warm-up SFT: {cfg.grpo.warmup_sft_steps} steps in {time.monotonic() - started:.0f} s, "
                   f"final loss {metrics['loss']:.3f}")


def validate(s: GRPOSetup, step: int) -> dict[str, float]:
    """Accuracy (share of the judged held-out samples their environment judged correct) and the
    mean reward, and both per environment when the rows have several (task_accuracy/<task>,
    task_reward/<task>); pass@k with several samples (over the prompts with k judged samples)."""
    g = s.cfg.grpo
    n = g.num_val_generations_per_prompt
    rows = [r for r in s.val_rows for _ in range(n)]
    rewards, convs = [], []
    colocated = s.generation is s.policy  # separate workers were refit after the last step
    if colocated:
        s.policy.prepare_for_generation()
    for i in range(0, len(rows), g.val_batch_size):
        out = run_rollouts(s.generation, rows[i : i + g.val_batch_size], s.envs, s.tokenizer,
                           max_turns=g.max_rollout_turns, max_seq_len=s.cfg.policy.max_total_sequence_length,
                           greedy=g.val_greedy, add_bos=s.cfg.data.add_bos,
                           add_generation_prompt=s.cfg.data.add_generation_prompt, global_step=step,
                           max_steps=g.max_num_steps)
        rewards.append(out.batch["rewards"])
        convs += out.conversations
    if colocated:
        s.policy.finish_generation()
    if not g.val_greedy:
        # Sampled validation drew from the engines' sampling streams, which restart only at a
        # refit: the next step's rollouts would go on from there, and a run resumed from this
        # step's checkpoint (its engines refit at the start) would sample otherwise. Refit again.
        if colocated:
            s.policy.prepare_for_generation(force=True)
        else:
            s.generation.update_weights(s.policy.full_state_dict_ref(), version=s.generation.version)
    if convs and all(c.env_errors for c in convs):
        # Every sample scored 0 by the failure, not by the model: a reward of 0 read as a collapse
        # in the curves, and ranked this step's checkpoint as measured.
        log.warning("validation at step %d: the environment failed on every one of its %d samples: no reward or "
                    "accuracy is recorded for it (env_errors says how many)", step, len(convs))
        return {"env_errors": float(sum(c.env_errors for c in convs))}
    # In float64, as accuracy (a ratio of counts): a float32 mean of 180 of 200 is 0.8999999762,
    # which misses a 0.9 threshold.
    metrics = {"reward": float(torch.cat(rewards).double().mean()),
               **{k: v for k, v in summarize_rollouts(convs).items()
                  if k.startswith(("reward/", "env/", "task_")) or k in ("accuracy", "tool_calls_mean", "env_errors")}}
    if n > 1:
        per_prompt = [[c.correct for c in convs[p : p + n]] for p in range(0, len(convs), n)]
        for k in sorted({1, n}):
            if (value := mean_pass_at_k(per_prompt, k)) is not None:
                metrics[f"pass@{k}"] = value
    s.logger.print_samples([
        {"prompt": c.question, "response": c.response, "reward": c.reward}
        for c in convs[: s.cfg.logger.num_val_samples_to_print]
    ], title=f"validation samples (step {step})")
    return metrics


def minibatch_permutation(n: int, seed: int, step: int) -> torch.Tensor:
    """The order in which step `step`'s `n` rollouts are cut into optimizer steps
    (`grpo.shuffle_minibatches`): a permutation seeded by the run's seed and the step only, so a
    resumed run repeats it."""
    return torch.randperm(n, generator=torch.Generator().manual_seed(seed * 1_000_003 + step))


def interleaved_order(group_ids: torch.Tensor) -> torch.Tensor:
    """The default order in which a step's rollouts are cut into optimizer steps: each group's
    samples dealt round-robin (the first sample of every group, then the second, ...), so every
    optimizer step holds a share of every prompt, as a random shuffle gives on average.

    A group's samples are exchangeable, so this is a stratified shuffle with the learning per
    step of a random one (quickstart, 5 seeds against TRL, which shuffles: val accuracy at step 8
    0.83-0.86 vs TRL's 0.77-0.88, both first >= 0.9 at step 10; whole groups in order: 0.49 and
    0.62 at step 8 on seeds 4 and 42), while each prompt's samples in an optimizer step still
    share one copy of it under prefix sharing, which a random order mostly breaks (quickstart
    optimizer step: 832 model positions interleaved, 592 whole groups, ~1,900 shuffled; 149 vs
    139 ms of training per GRPO step interleaved vs whole groups, ~1.5x that shuffled)."""
    seen: dict[int, int] = {}
    rank = []
    for g in group_ids.tolist():
        rank.append(seen.get(g, 0))
        seen[g] = rank[-1] + 1
    return torch.tensor(sorted(range(len(rank)), key=lambda i: (rank[i], i)), dtype=torch.long)


def _masks_env_errors(g) -> bool:
    """Whether samples whose environment failed leave the loss (grpo.mask_env_error_samples). Not
    under on-policy distillation: its reward is only logged, so a failed verification leaves the
    sample's training signal intact, and masking would drop good samples (those of a student whose
    nonsense times the verifier out the most)."""
    return g.mask_env_error_samples and g.adv_estimator != "on_policy_distillation"


def _scored(g, batch: BatchedDataDict) -> torch.Tensor | None:
    """1 for the samples that have a verdict (`[N]` float; None: all count): under
    grpo.mask_env_error_samples, those whose environment did not fail."""
    return (~batch["env_errors"]).float() if _masks_env_errors(g) else None


def _rewards_to_advantages(g, batch: BatchedDataDict, max_new_tokens: int) -> None:
    """Scaling, shaping, overlong filtering and advantages, written into `batch` in place."""
    rewards = batch["rewards"]
    # Scaling first (NeMo RL's order): it clamps to the environment's range, which would take the
    # shaping's penalty back off a reward already at source_min (a wrong overlong answer scored
    # the same as a wrong short one); the penalty is in the scaled rewards' units.
    if g.reward_scaling.enabled:
        rc = g.reward_scaling
        rewards = scale_rewards(rewards, rc.source_min, rc.source_max, rc.target_min, rc.target_max)
    if g.reward_shaping.enabled:
        rs = g.reward_shaping
        shaped = apply_overlong_reward_shaping(rewards, batch["response_lengths"], rs.max_response_length
                                               or max_new_tokens, rs.overlong_buffer_length,
                                               rs.overlong_buffer_penalty)
        # Logged as reward_shaping_penalty (`reward` is the environments' score, before it).
        batch["shaping_penalty"], rewards = rewards - shaped, shaped
    if g.reward_kl_penalty:
        # k1 of the policy that sampled (its logprobs before the update) to the reference, summed
        # over the sample's own tokens (a multi-turn sample's environment tokens are not its own).
        kl = ((batch["prev_logprobs"].float() - batch["reference_logprobs"].float()) * batch["token_mask"]).sum(-1)
        batch["reward_kl"], rewards = kl, rewards - g.reward_kl_penalty * kl
    # Overlong-filtered samples stay in their group's baseline (DAPO); only their loss is masked.
    batch["sample_mask"] = overlong_filter_mask(batch["truncated"]) if g.overlong_filtering else torch.ones_like(rewards)
    # A sample whose environment failed has no verdict: its placeholder 0 leaves the loss and the
    # baseline and std of its group, where it would push the others' advantages up (a 0/1
    # verifier) or, for an unbounded score such as a reward model's, anywhere.
    scored = _scored(g, batch)
    if scored is not None:
        batch["sample_mask"] = batch["sample_mask"] * scored
    if g.adv_estimator == "on_policy_distillation":
        return  # token-level, from the teacher's logprobs: after the logprob phase (_distillation_advantages)
    adv = compute_advantages(g.adv_estimator, rewards, batch["group_ids"], leave_one_out=g.use_leave_one_out_baseline,
                             normalize=g.normalize_rewards, valid_mask=scored)
    batch["advantages"] = adv.unsqueeze(1) * batch["token_mask"]  # [B, S]


def _advantages_then_cut(g, batch: BatchedDataDict, size: int, max_new_tokens: int) -> BatchedDataDict:
    """The first `size` rollouts of `batch`, the step's generation rounds' (dynamic sampling: kept)
    ones, with their advantages computed over all of them at once and before the cut, which may
    split a group: REINFORCE++ whitens over the samples it trains, not over each round beside the
    zero-variance groups dynamic sampling drops (their zeros shrank the std, scaling the advantages
    up by the share of dropped groups)."""
    _rewards_to_advantages(g, batch, max_new_tokens)
    return batch.slice(0, size)


def _no_sample_in_the_loss(g, batch: BatchedDataDict) -> str | None:
    """Why none of the step's samples is in the loss (the step then trains nothing), or None.
    Its metrics say so only as num_valid_samples 0: a run whose every response reaches
    max_new_tokens under grpo.overlong_filtering trained nothing for its whole length, silently."""
    if batch["sample_mask"].any():
        return None
    n = batch.size
    causes = []
    if g.overlong_filtering and batch["truncated"].any():
        causes.append(f"{int(batch['truncated'].sum())} truncated (grpo.overlong_filtering; a longer "
                      "policy.generation.max_new_tokens or policy.max_total_sequence_length keeps them)")
    if _masks_env_errors(g) and batch["env_errors"].any():
        causes.append(f"{int(batch['env_errors'].sum())} with an environment error (grpo.mask_env_error_samples)")
    return f"none of the {n} samples is in the loss, so this step trains nothing: {'; '.join(causes)}"


def _distillation_advantages(batch: BatchedDataDict) -> float:
    """On-policy distillation's per-token advantages, written into `batch`; returns the reverse KL
    of the student to the teacher: the mean over the trained tokens of log pi - log pi_teacher.

    The tokens come from the sampler, which is not the student whose KL this is when async GRPO
    generated them with older weights, or top-k/top-p renormalised its distribution (a plain mean
    then went negative). Each token is weighted by pi / pi_sampler (self-normalised importance
    sampling, as the loss corrects the gradient), which is 1 when they are the same."""
    adv = on_policy_distillation_advantages(batch["reference_logprobs"], batch["prev_logprobs"], batch["token_mask"])
    batch["advantages"] = adv
    weights = batch["token_mask"] * batch["sample_mask"][:, None]
    if "generation_logprobs" in batch:
        log_ratio = (batch["prev_logprobs"].float() - batch["generation_logprobs"].float()).clamp(-20.0, 20.0)
        weights = weights * torch.exp(log_ratio)
    return -float((adv * weights).sum() / weights.sum().clamp(min=1e-30))


@dataclass
class _QueuedRollouts:
    prompts: list[dict]
    future: Future  # -> (RolloutResult, the refit's metrics)
    version: int  # the weights version that generates them
    loader_state: dict  # the data loader's position before these prompts


class _RolloutPipeline:
    """grpo.async_grpo: the next steps' rollouts, queued on the separate generation workers and
    generated one batch after another by a driver thread while the policy trains.

    A batch queued at step t (t updates done) first refits the workers to a snapshot of those
    weights, unless the batch before it already did, and is trained on at step t + its place in
    the queue, so with at most `depth` (max_trajectory_age_steps) batches queued its trajectories
    are at most `depth` updates old. `loader_state` is the data position before the oldest queued
    prompts: a checkpoint saves that, so a resumed run generates them again instead of skipping
    them."""

    def __init__(self, depth: int, version: int) -> None:
        self.depth = depth
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="posttrain-rollouts")
        self._queue: deque[_QueuedRollouts] = deque()
        self.queued_version = version  # the workers' weights version once the queued batches ran

    def __len__(self) -> int:
        return len(self._queue)

    def submit(self, task, prompts: list[dict], version: int, loader_state: dict) -> None:
        self._queue.append(_QueuedRollouts(prompts, self._pool.submit(task), version, loader_state))
        self.queued_version = version

    def wait(self) -> None:
        """Until every queued batch is generated (they stay for `take`); raises what they raised."""
        for queued in self._queue:
            queued.future.result()

    def take(self) -> tuple[list[dict], RolloutResult, dict[str, float], int]:
        """The oldest queued prompts, their rollouts, the metrics of the refit before them and
        their seconds (`rollout_s`), and the weights version that generated them."""
        queued = self._queue.popleft()
        rollout, refit = queued.future.result()
        return queued.prompts, rollout, refit, queued.version

    @property
    def loader_state(self) -> dict | None:
        return self._queue[0].loader_state if self._queue else None

    def close(self, wait: bool = True) -> None:
        """Drop the batches not started; `wait` for the one in generation (else it is left to fail
        when the run shuts its workers down: after a stop or an error its rollouts are thrown
        away, and waiting for them took a whole batch's time past the checkpoint, or past a
        second signal's "stop at once")."""
        self._pool.shutdown(wait=wait, cancel_futures=True)


def _refit_generation(s: GRPOSetup, version: int) -> dict[str, float]:
    """Separate generation workers to the policy's current weights (`version` = updates so far)."""
    if s.generation.version == version:
        return {}
    start = time.perf_counter()
    weights = s.policy.full_state_dict_ref()  # the gather, as the colocated refit_s counts it
    gathered_s = time.perf_counter() - start
    metrics = s.generation.update_weights(weights, version=version)
    return {**metrics, "refit_s": metrics["refit_s"] + gathered_s}


def _validate_current(s: GRPOSetup, pipeline: _RolloutPipeline | None, step: int,
                      refit_metrics: dict[str, float] | None = None) -> dict[str, float]:
    """`validate` the weights after `step` updates (async: not the queued rollouts' older ones,
    refit to these first; the refit's seconds are added into `refit_metrics`, the step's: the
    next queued batch then needs none, and no step logged the refit)."""
    if pipeline is not None:
        pipeline.wait()
        for k, v in _refit_generation(s, step).items():
            if refit_metrics is not None:
                refit_metrics[k] = refit_metrics.get(k, 0.0) + v
        pipeline.queued_version = step
    return validate(s, step)


class DynamicSamplingExhausted(RunStopped):
    """Dynamic sampling kept less than one optimizer step of groups with reward variance in
    grpo.dynamic_sampling_max_gen_batches rounds: the run cannot go on (NeMo RL raises too), and
    ending it as if it were done would read as a finished run to whatever launched it."""


@dataclass
class _LastComplete:
    """The loop's last complete step: what a checkpoint of it holds (the data position of its
    next prompts, its metrics: `val` only when it validated, as only a step's own validation
    ranks its checkpoint), and the step last saved."""

    step: int
    saved_step: int
    loader_state: dict
    train: dict[str, float] = field(default_factory=dict)
    val: dict[str, float] = field(default_factory=dict)
    # The data position before the latest steps whose every sample failed in its environment (a
    # reward service down; None: the last step scored some): the position an environment failure's
    # save resumes from, so that those steps' prompts are trained on once it is mended.
    before_failed_steps: dict | None = None
    failed_steps: int = 0
    # The step's samples, and whether its train metrics and samples are still to be logged: a step
    # is logged before its checkpoint (docs/metrics.md), and a save of `_save_last_complete` may come
    # before the loop's logging (an environment that fails in the step's validation).
    samples: list[dict] = field(default_factory=list)
    unlogged: bool = False

    def log(self, logger: Logger) -> None:
        """Log the step's train metrics and samples, unless done."""
        if self.unlogged:
            self.unlogged = False  # first: a metric check that raises (MetricNameError) is not logged twice
            logger.log_metrics(self.train, step=self.step, prefix="train")
            logger.log_samples(self.samples, step=self.step)


def grpo_train(s: GRPOSetup) -> dict[str, float]:
    a = s.cfg.grpo.async_grpo
    pipeline = _RolloutPipeline(a.max_trajectory_age_steps, s.generation.version) if a.enabled else None
    last = _LastComplete(s.start_step, s.start_step, s.loader.state_dict())
    finished = False
    try:
        result = _grpo_loop(s, pipeline, last)
        finished = s.checkpointer.stop_signal is None and not s.checkpointer.time_limit_reached
        return result
    except EnvironmentFailure:
        # The policy is the last complete step's (an environment fails before an update, in the
        # rollouts or a validation): keep the steps since the last checkpoint for a resume once
        # the environment is mended, at the data position before the steps it failed in whole
        # (which trained on nothing): their prompts come again.
        note = ""
        if last.before_failed_steps is not None:
            last.loader_state = last.before_failed_steps
            note = (f"; its data position is before the last {last.failed_steps} step(s), in which every sample "
                    "failed: a resume trains on their prompts")
        _save_last_complete(s, last, "an environment failed", note)
        raise
    except MetricNameError:
        # Found at the first metrics of its kind, after the step that logged them: keep that step.
        _save_last_complete(s, last, "checkpointing.metric_name is no metric this run logs")
        raise
    except WorkerError as e:
        # A separate generation worker died (in a refit or the rollouts): the policy workers hold
        # the last complete step, which was lost with it when no save was due.
        if s.generation is not s.policy and e.group == s.generation.workers.name:
            _save_last_complete(s, last, "a generation worker died")
        raise
    finally:
        if pipeline is not None:
            pipeline.close(wait=finished)


def _save_last_complete(s: GRPOSetup, last: _LastComplete, why: str, note: str = "") -> None:
    """Save `last` (the last complete step) if no checkpoint holds it yet, saying `why` the run
    stops (and `note`, after)."""
    if last.step > last.saved_step and s.cfg.checkpointing.enabled:
        last.log(s.logger)  # the metrics known when it stopped (no step time, no validation)
        _save(s, last.step, last.train, last.val, loader_state=last.loader_state)
        last.saved_step = last.step
        s.logger.console(f"{why}: saved step {last.step}, the last complete one, before stopping{note}")


def _unless_stopped(s: GRPOSetup, val_metrics: dict[str, float]) -> dict[str, float] | None:
    """A validation's metrics, or None when a stop signal came while it ran: the environments'
    scoring still going then was cut short, their samples failed (a record of it misled, and
    ranked a checkpoint by it)."""
    return None if s.checkpointer.stop_signal is not None else val_metrics


def _grpo_loop(s: GRPOSetup, pipeline: _RolloutPipeline | None, last: _LastComplete) -> dict[str, float]:
    """The GRPO steps; `last` follows the last complete one (grpo_train saves it if an environment fails)."""
    cfg, g, policy, logger = s.cfg, s.cfg.grpo, s.policy, s.logger
    timer = Timer()
    val_metrics: dict[str, float] = {}
    val_step = 0  # the step val_metrics are of: a stop skips the validation due at its step
    train_metrics: dict[str, float] = {}
    logger.start_progress(g.max_num_steps, s.start_step)  # before step 0's validation line: "val step 0/<max>"
    if g.val_at_start and s.start_step == 0:
        val_metrics = _unless_stopped(s, validate(s, 0)) or {}
        if val_metrics:
            logger.log_metrics(val_metrics, step=0, prefix="val")
    # Unless the resumed config turned validation off: then nothing would be compared with it.
    if (g.val_period or g.val_at_end) and (pending := s.checkpointer.pending_validation(s.start_step)) is not None:
        val_metrics = made_up_validation(s.checkpointer, logger, pending, s.start_step,
                                         lambda: _unless_stopped(s, _validate_current(s, pipeline, s.start_step)))
        val_step = s.start_step
    gbs = cfg.policy.train_global_batch_size
    reuse_generation_logprobs = None if g.prev_logprobs_from_generation else False
    pad_id = s.tokenizer.pad_token_id
    step = s.start_step

    def rollouts_of(prompts: list[dict], version: int) -> RolloutResult:
        """`prompts`' rollouts, generated with the weights after `version` steps."""
        rows = [r for r in prompts for _ in range(g.num_generations_per_prompt)]
        return run_rollouts(s.generation, rows, s.envs, s.tokenizer, max_turns=g.max_rollout_turns,
                            max_seq_len=cfg.policy.max_total_sequence_length, add_bos=cfg.data.add_bos,
                            add_generation_prompt=cfg.data.add_generation_prompt, global_step=version,
                            max_steps=g.max_num_steps)

    def queue_rollouts(prompts: list[dict], loader_state: dict) -> None:
        """async: `prompts`' rollouts behind the queued ones, on the weights after `step` updates."""
        version = step
        snapshot = None if pipeline.queued_version == version else policy.full_state_dict_ref()

        def task() -> tuple[RolloutResult, dict[str, float]]:  # in the pipeline's thread: its own clock
            refit = {} if snapshot is None else s.generation.update_weights(snapshot, version=version)
            start = time.perf_counter()
            result = rollouts_of(prompts, version)
            return result, {**refit, "rollout_s": time.perf_counter() - start}

        pipeline.submit(task, prompts, version, loader_state)

    s.checkpointer.start_steps()
    while step < g.max_num_steps:
        timer.reset()
        step_start = time.monotonic()
        # ---- data, generation, rewards, advantages (dynamic sampling: more rounds until the batch is full)
        parts: list[BatchedDataDict] = []
        rollout_metrics: dict[str, float] = {}
        step_convs: list[Conversation] = []  # every round's conversations: the step's rollout metrics are over all
        target = g.num_prompts_per_step * g.num_generations_per_prompt
        groups_so_far = 0
        cut_short = None  # the stop signal that came while the step's rollouts were scored, and cut them short
        for _ in range(g.dynamic_sampling_max_gen_batches if g.use_dynamic_sampling else 1):
            if pipeline is not None:
                # This step trains on the oldest queued rollouts, generated while earlier steps
                # trained (the first step: generated now); then the queue is topped up with the
                # next steps' prompts, to be generated with the current weights while this step trains.
                with timer.time("generation"):
                    if not len(pipeline):
                        with timer.time("data"):
                            before = s.loader.state_dict()
                            prompts = next(s.loader, None)
                        if prompts is None:
                            break
                        queue_rollouts(prompts, before)
                    prompts, rollout, refit, generated_by = pipeline.take()
                    while len(pipeline) < pipeline.depth and step + len(pipeline) + 1 < g.max_num_steps:
                        with timer.time("data"):
                            before = s.loader.state_dict()
                            upcoming = next(s.loader, None)
                        if upcoming is None:
                            break
                        with timer.time("refit"):  # the snapshot; the workers load it in the pipeline's thread
                            queue_rollouts(upcoming, before)
                refit = {**refit, "trajectory_age_steps": float(step - generated_by)}
            else:
                with timer.time("data"):
                    prompts = next(s.loader, None)
                    if prompts is None:
                        break
                with timer.time("generation"):
                    refit = policy.prepare_for_generation() if s.generation is policy else {}
                    rollout = rollouts_of(prompts, step)
                    policy.finish_generation()
            step_convs += rollout.conversations
            rollout_metrics["generate_s"] = rollout_metrics.get("generate_s", 0.0) + rollout.generate_s
            for k, v in refit.items():  # seconds and counts add up over the rounds
                rollout_metrics[k] = rollout_metrics.get(k, 0.0) + v
            batch = rollout.batch
            # Unique over the step's generation rounds (dynamic sampling), for interleaved_order.
            batch["group_ids"] = torch.arange(groups_so_far, groups_so_far + len(prompts)).repeat_interleave(
                g.num_generations_per_prompt)
            groups_so_far += len(prompts)
            if g.use_dynamic_sampling:
                with timer.time("advantages"):
                    keep, ds_metrics = dynamic_sampling_keep(batch["rewards"], batch["group_ids"], _scored(g, batch))
                rollout_metrics.update(ds_metrics)
                batch = batch.select_indices(keep)
            parts.append(batch)
            # A stop signal ends the wait for environments still scoring (their samples fail) and
            # more rounds of dynamic sampling: the step is not trained, nor its prompts lost.
            if s.checkpointer.stop_signal is not None and (bool(rollout.batch["env_errors"].any())
                                                           or sum(b.size for b in parts) < target):
                cut_short = s.checkpointer.stop_signal
                break
            if sum(b.size for b in parts) >= target:
                break
        if cut_short is not None:
            _save_last_complete(s, last, f"{cut_short} received during step {step + 1}'s rollouts")
            logger.console(f"{cut_short} received during step {step + 1}'s rollouts: the step is not trained (a "
                           f"resume starts at its prompts); stopping at step {step}")
            break
        usable = sum(b.size for b in parts) // gbs * gbs
        if usable == 0:
            if prompts is None:
                reason = f"the training prompts ran out (grpo.max_num_epochs={g.max_num_epochs})"
            else:
                reason = (f"dynamic sampling kept {sum(b.size for b in parts)} samples in {len(parts)} generation "
                          f"rounds (grpo.dynamic_sampling_max_gen_batches), fewer than one optimizer step "
                          f"(policy.train_global_batch_size={gbs}): the other groups' rewards were all equal")
            logger.console(f"step {step + 1}: {reason}; stopping")
            # The run's last step, as step max_num_steps would have been: validated (grpo.val_at_end,
            # unless it was already) and checkpointed, keeping the steps since the last periodic save.
            # Only here is it known to be the last: the prompts ran out at the next step's draw.
            if (prompts is None and g.val_at_end and not last.val and step > s.start_step
                    and s.checkpointer.stop_signal is None):
                val_metrics = last.val = _validate_current(s, pipeline, step)
                val_step = step
                logger.log_metrics(val_metrics, step=step, prefix="val")
            if step > last.saved_step and s.checkpointer.should_save(step, last=True):
                # Dynamic sampling gave up on this step's prompts: a resume (with more rounds, as the
                # error advises) starts at them. Out of prompts: where the data ended.
                exhausted = pipeline.loader_state if pipeline is not None else None
                _save(s, step, last.train, last.val, loader_state=last.loader_state if prompts is not None else exhausted)
            if prompts is not None:
                raise DynamicSamplingExhausted(
                    f"step {step + 1}: {reason}. Raise grpo.dynamic_sampling_max_gen_batches or "
                    "grpo.num_generations_per_prompt, or train on prompts the model solves only sometimes")
            break
        rollout_metrics.update(summarize_rollouts(step_convs))
        if g.use_dynamic_sampling:
            rollout_metrics["dynamic_sampling/rounds"] = float(len(parts))
        size = min(usable, target)
        batch = BatchedDataDict.from_batches(parts, pad_value_dict={"input_ids": pad_id})
        # A KL penalty in the reward needs the logprobs first: the rounds' samples past the cut get
        # theirs too, as the advantages are over all of them (_advantages_then_cut).
        kl_in_reward = g.reward_kl_penalty > 0
        if not kl_in_reward:
            with timer.time("advantages"):
                batch = _advantages_then_cut(g, batch, size, cfg.policy.generation.max_new_tokens)

        # ---- logprobs before the update (the PPO ratio's denominator) and under the reference
        with timer.time("logprobs"):
            # With one optimizer step per batch the pre-update policy is the one the training
            # forward runs, so the loss takes prev = its own logprobs detached (the same loss and
            # gradient up to rounding) and this forward pass over the whole batch is skipped.
            # grpo.prev_logprobs_from_generation: None = not verified yet in this run.
            # On-policy distillation's advantages are the teacher's logprobs minus these, so it
            # needs them even then: the generation logprobs are the sampler's (top-k/top-p
            # renormalised, another engine's rounding, async's older weights), not the policy's.
            needs_prev = (batch.size > gbs or g.num_iterations > 1 or g.adv_estimator == "on_policy_distillation"
                          or kl_in_reward)
            measured_mismatch: dict[str, float] = {}
            if needs_prev and reuse_generation_logprobs is None:
                # Checked on one optimizer step's rows (a quarter of the quickstart's forward
                # pass): a mismatch is the engine's, in every row alike. All rows when those hold
                # no generated token, which would compare nothing.
                probe = batch.slice(0, gbs) if batch.size > gbs else batch
                probe = probe if float(probe["token_mask"].sum()) > 0 else batch
                with timer.time("prev"):
                    probe["prev_logprobs"] = policy.get_logprobs(probe)["logprobs"]
                measured_mismatch = _generation_mismatch(probe, cfg.loss_fn.reference_policy_kl_type)
                reuse_generation_logprobs = _generation_logprobs_match(measured_mismatch, logger, cfg.policy.precision)
            if needs_prev and reuse_generation_logprobs:
                batch["prev_logprobs"] = batch["generation_logprobs"]
            elif needs_prev and "prev_logprobs" not in batch:  # (the probe's were all rows')
                with timer.time("prev"):
                    batch["prev_logprobs"] = policy.get_logprobs(batch)["logprobs"]
            if cfg.needs_reference():
                with timer.time("reference"):
                    batch["reference_logprobs"] = policy.get_reference_logprobs(batch)["reference_logprobs"]
        if kl_in_reward:
            with timer.time("advantages"):
                batch = _advantages_then_cut(g, batch, size, cfg.policy.generation.max_new_tokens)
            rollout_metrics["reward_kl"] = float(batch.pop("reward_kl").mean())
        if "shaping_penalty" in batch:  # DAPO's overlong penalty, the mean over the step's samples
            rollout_metrics["reward_shaping_penalty"] = float(batch.pop("shaping_penalty").mean())
        groups = batch.pop("group_ids")
        untrained = _no_sample_in_the_loss(g, batch)
        if untrained:
            logger.console(f"step {step + 1}: {untrained}")
        if g.adv_estimator == "on_policy_distillation":
            rollout_metrics["teacher_reverse_kl"] = _distillation_advantages(batch)

        # ---- policy update
        with timer.time("training"):
            passes = []
            for i in range(g.num_iterations):  # each pass in an order of its own when shuffled
                order = (minibatch_permutation(batch.size, g.seed, step * g.num_iterations + i) if g.shuffle_minibatches
                         else interleaved_order(groups))
                passes.append(batch.select_indices(order) if batch.size > gbs else batch)
            # One call: the workers run every pass's optimizer steps back to back.
            train_metrics = policy.train(passes[0] if len(passes) == 1 else BatchedDataDict.from_batches(passes),
                                         s.loss_fn)
        if needs_prev and reuse_generation_logprobs:
            # The loss compared the generation logprobs with themselves (prev is theirs): 1 and 0
            # by construction, which hid the engine's real mismatch. The check's step logs what it
            # measured; later steps log none (probs_ratio, exp(policy - generation), shows a drift).
            for name in _MISMATCH_METRICS:
                train_metrics.pop(name, None)
            train_metrics.update(measured_mismatch)

        step += 1
        # The step is complete: its update is in the policy, which a failure of the generation
        # workers from here on leaves intact (grpo_train then saves it). The data position before
        # the next step's prompts (async: before the oldest queued ones).
        before = last.loader_state
        last.step, last.train, last.val = step, {**rollout_metrics, **train_metrics}, {}
        last.unlogged, last.samples = True, [
            {"step": step, "prompt": c.question, "response": c.response, "reward": c.reward, "truncated": c.truncated,
             "stop_reason": c.stop_reason, "env_error": c.env_error,
             **({"conversation": c.exchange} if c.turns > 1 else {}),  # a multi-turn sample in full
             **({"extra": c.metadata[LOG_EXTRA_KEY]} if LOG_EXTRA_KEY in c.metadata else {})}  # log_extra
            # Every round's (dynamic sampling): the ones the step's reward and accuracy are over.
            for c in step_convs[: cfg.logger.num_samples_to_dump]
        ]
        last.loader_state = (pipeline.loader_state if pipeline is not None else None) or s.loader.state_dict()
        if bool(batch["env_errors"].all()):
            last.before_failed_steps = last.before_failed_steps or before
            last.failed_steps += 1
        else:
            last.before_failed_steps, last.failed_steps = None, 0

        # ---- refit separate generation workers (colocated ones refit in prepare_for_generation;
        # async ones before each queued batch, in the pipeline's thread)
        if s.generation is not policy and pipeline is None:
            with timer.time("refit"):  # refit_s / refit_load_s in the step's metrics, as colocated and async runs log
                refit = _refit_generation(s, step)
            rollout_metrics.update(refit)
            last.train.update(refit)
        policy.sync_reference_if_due(step)  # policy.reference_sync (the KL reference)

        # ---- validation (not after a stop signal: the scheduler that sent it kills the job after a
        # grace period, which a long validation before the save would spend)
        due = (g.val_period and step % g.val_period == 0) or (g.val_at_end and step == g.max_num_steps)
        if due and s.checkpointer.stop_signal is None:
            with timer.time("validation"):
                validated = _unless_stopped(s, _validate_current(s, pipeline, step, refit_metrics=rollout_metrics))
            if validated is not None:  # (cut short: a resume makes it up, validation_pending)
                val_metrics, val_step = validated, step
                logger.log_metrics(val_metrics, step=step, prefix="val")
                last.val = val_metrics

        # ---- metrics (before the checkpoint: a run killed once it is saved resumes after this step,
        # which it would never log; the save's time is a record of its own, `Logger.timed_save`)
        step_time = time.monotonic() - step_start
        metrics = {
            **rollout_metrics,
            **train_metrics,
            # Over the engine's generate calls alone: timing/generation also holds the environments'
            # scoring and (colocated) the refit, and async's is the wait for rollouts made meanwhile.
            "generation_tokens_per_s": rollout_metrics["generated_tokens"] / max(rollout_metrics["generate_s"], 1e-9),
            "total_tokens_per_s": float(batch["input_lengths"].sum()) / step_time,
            "step_time_s": step_time,
        }
        # What ranks the checkpoint, as logged: checkpointing.metric_name may name any of it (train:step_time_s).
        last.train = {**metrics, **timer.metrics(prefix="timing/")}
        last.log(logger)

        # ---- checkpoint (on schedule, at the end, or when the job's time is up or it is told to stop)
        stop = s.checkpointer.stop_reason(last_step=step == g.max_num_steps)
        if s.checkpointer.should_save(step, last=step == g.max_num_steps or stop is not None):
            # The rollouts' metrics too: train:reward / train:accuracy rank checkpoints as
            # documented (policy.train's metrics alone lack them). During steps in which every sample
            # failed, the data position before them: they trained on nothing, and a run the
            # environment then stops keeps this checkpoint (a resume skipped their prompts).
            _save(s, step, last.train, last.val, loader_state=last.before_failed_steps or last.loader_state,
                  validation_pending=bool(due) and not last.val)
            last.saved_step = step
        logger.update_progress(step, {"reward": metrics["reward"], "loss": metrics["loss"],
                                      **({"val_acc": val_metrics["accuracy"]} if "accuracy" in val_metrics else {})})
        if stop:
            logger.console(stop_message(stop, step, cfg.checkpointing))
            break

    logger.plot()
    # The last complete step's metrics as logged (timing/ included), as the other algorithms' runs
    # return theirs and a complete run started again returns them from its metrics.jsonl.
    return {"step": step, **{f"train/{k}": v for k, v in last.train.items()},
            **{f"val/{k}": v for k, v in val_metrics.items()}, **({"val/step": val_step} if val_metrics else {})}


# grpo.prev_logprobs_from_generation: how far mean exp(|generation - policy|) may be from 1 for
# the generation logprobs to count as the policy's own. 16-bit: the bf16 forward alone rounds
# logprobs by ~1e-3 (8 mantissa bits); 5x float32's, as the engine's agreement bounds are
# (token_mult_prob_error < 1.05 in bf16, < 1.01 in float32; docs/generation.md).
_OWN_LOGPROBS_TOLERANCE = {"float32": 1.001, "bfloat16": 1.005, "float16": 1.005}


_MISMATCH_METRICS = ("token_mult_prob_error", "gen_kl_error")


def _generation_mismatch(batch: BatchedDataDict, kl_type: str) -> dict[str, float]:
    """The loss's generation-vs-policy metrics (`_MISMATCH_METRICS`) of `batch`'s generation and
    policy (`prev_logprobs`) logprobs, over every generated token, those of samples out of the
    loss too (overlong-filtered, environment errors): the engine sampled them all. Over the
    trained ones only, a first step whose samples were all masked compared nothing, and its mean
    of 0 passed grpo.prev_logprobs_from_generation's check for the whole run."""
    mask = batch["token_mask"]
    # Padding may hold -inf (a sampler's masked-out logprob), whose inf * 0 would be NaN.
    gen, prev = (torch.where(mask > 0, batch[k], 0.0) for k in ("generation_logprobs", "prev_logprobs"))
    mult_prob_error, gen_kl = generation_mismatch(gen, prev, kl_type)
    return {"token_mult_prob_error": float(masked_mean(mult_prob_error, mask)),
            "gen_kl_error": float(masked_mean(gen_kl, mask))}


def _generation_logprobs_match(mismatch: dict[str, float], logger: Logger, precision: str) -> bool:
    """Whether the rollouts' generation logprobs are the policy's own (grpo.prev_logprobs_from_generation):
    `mismatch`'s token_mult_prob_error, mean exp(|generation - policy|), within the precision's tolerance."""
    tolerance = _OWN_LOGPROBS_TOLERANCE[precision]
    err = mismatch["token_mult_prob_error"]
    if err > tolerance:
        logger.console(f"grpo.prev_logprobs_from_generation: the generation logprobs differ from the policy's "
                       f"(mean exp|diff| = {err:.4f} > {tolerance}); recomputing prev_logprobs every step instead")
        return False
    return True


def _save(s: GRPOSetup, step: int, train: dict[str, float], val: dict[str, float],
          loader_state: dict | None = None, validation_pending: bool = False) -> None:
    """A checkpoint after `step`, ranked by `train` and `val` metrics (checkpointing.metric_name
    "train:<name>" / "val:<name>"); `loader_state`: the data position to resume from when the
    loader has run ahead of the trained steps (async GRPO's in-flight prompts);
    `validation_pending`: a stop signal skipped the step's validation, which a resume makes up."""
    metrics = {**{f"train:{k}": v for k, v in train.items()}, **{f"val:{k}": v for k, v in val.items()}}
    loader_state = loader_state or s.loader.state_dict()
    info = {
        "epoch": loader_state["epoch"],
        # Samples generated from the prompts drawn so far (dynamic sampling draws more than it trains);
        # since a resume, at this run's samples per prompt (all prompts at it: a resume with fewer
        # counted back).
        "consumed_samples": s.consumed_at_start[0]
        + (loader_state["served"] - s.consumed_at_start[1]) * s.cfg.grpo.num_generations_per_prompt,
        "dataloader": loader_state,
    }
    with s.logger.timed_save(step):
        s.checkpointer.save(step, s.policy, info, to_yaml(s.cfg), metrics, validation_pending)
    s.logger.plot()


def run(cfg: GRPOMasterConfig) -> dict[str, float]:
    def setup_and_train() -> dict[str, float]:
        s = setup(cfg)
        return train_then_export(lambda: grpo_train(s), s.checkpointer, s.policy, final_export_dir(cfg),
                                 s.logger.console, s.shutdown)

    return unless_complete(setup_and_train)
