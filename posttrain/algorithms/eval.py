"""Evaluation: pass@k and cons@k of a model over a dataset, scored by the task's environment.

`run(cfg)` = `setup(cfg)` + `evaluate(setup)`:
1. rows of `data.dataset_name` (GSM8K, MATH-500, the embedded arithmetic task or any local
   .jsonl/.json/.parquet file), split `eval.split`, the first `eval.max_samples` of them;
2. `eval.num_tests_per_prompt` samples per prompt, greedy or sampled (`eval.greedy`), from the
   generation backend `policy.generation.backend` loaded from `policy.model_name`, in batches
   of `policy.generation_batch_size` samples, through the same rollout code as GRPO;
3. each sample scored by the environment its row names (`task_name`: "math", "arithmetic",
   ...), which also extracts the final answer that cons@k votes over and judges it correct
   or not (`CORRECT_KEY`; samples it does not judge are left out of the metrics);
4. `results.json` (pass@k and cons@k for every k <= n, counts, timing, the config),
   `samples.jsonl` (one line per sample) and `pass_at_k.png` (the curves, when
   `logger.plots_enabled`) in `eval.save_path`, else `logger.log_dir`; the files of an earlier
   run there are moved into its `previous-<time>/` folder first, never overwritten.

Metrics are defined in `posttrain.evals` (the unbiased pass@k estimator of Chen et al. 2021
and majority-vote cons@k).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from posttrain.config import InputError
from posttrain.data.formats import is_preference, row_name
from posttrain.environments.interfaces import LOG_EXTRA_KEY, TOOL_CALLS_KEY
from posttrain.evals import accuracy, aggregate
from posttrain.schemas import EvalMasterConfig

# The generation backend runs in this process (no policy workers): the CLI leaves its torch threads alone.
COMPUTES_IN_DRIVER = True
# Metadata key under which each sample's extracted answer travels through the rollout.
ANSWER_KEY = "eval_extracted_answer"
# What a run writes in its folder beside the logger's files: all are moved aside
# (previous-<time>/) by the next run there.
RESULT_FILES = ("results.json", "samples.jsonl", "pass_at_k.png")


class _AnswerRecorder:
    """Wraps an environment so that each sample's extracted answer (`EnvironmentReturn.answers`)
    is kept in its metadata: the rollout loop keeps a conversation's metadata, and cons@k
    votes over these answers, as text: an environment of the user's that answers with a number
    (StepResult(answer=42)) crashed the vote after the whole generation. A blank answer (the
    `arithmetic` environment's for an empty response) is no answer: it casts no vote, so it is
    counted in `num_no_answer` too."""

    def __init__(self, env: Any) -> None:
        self.env = env

    def step(self, message_logs: list[list[dict]], metadata: list[dict]):
        ret = self.env.step(message_logs, metadata)
        for k, answer in enumerate(ret.answers):
            base = ret.metadata[k] if ret.metadata[k] is not None else metadata[k]
            text = None if answer is None else str(answer)
            ret.metadata[k] = {**base, ANSWER_KEY: text if text and text.strip() else None}
        return ret


@dataclass
class EvalSetup:
    cfg: EvalMasterConfig
    save_dir: Path
    tokenizer: Any
    generation: Any  # GenerationInterface
    envs: dict[str, Any]  # task name -> environment (wrapped in _AnswerRecorder)
    rows: list[dict]
    greedy: bool
    logger: Any  # posttrain.logging.Logger


def load_eval_rows(cfg: EvalMasterConfig) -> list[dict]:
    """The rows to evaluate: split `eval.split` of `data.dataset_name`, capped at `eval.max_samples`.

    A local file, a folder or a hub dataset without a split for validation is evaluated whole
    (no rows are held out of it), so `data.dataset_name=my_problems.jsonl` scores every row.
    """
    from posttrain.data.datasets import load_rows

    name = cfg.data.dataset_name
    rows = load_rows(cfg.data, cfg.eval.split, whole=True)
    rows = rows[: cfg.eval.max_samples] if cfg.eval.max_samples else rows
    # Whether a row needs a reference `answer` is its environment's to say (`resolve_task_envs`):
    # code rows are scored by their tests.
    for i, row in enumerate(rows):
        if "messages" not in row:
            where = row_name(row, f"row {i + 1} of {name!r}")
            if is_preference(row):  # every row of the file is one: set no format, name the data's kind
                raise InputError(f"eval: {name!r} holds preference pairs (`chosen`/`rejected`; first: {where}), "
                                 "which DPO and RM train on; evaluation needs prompts with reference answers "
                                 "(e.g. gsm8k, math500) or a data.task_name whose environment scores them")
            if "text" in row:
                raise InputError(f"eval: {name!r} holds plain text (`text`; first: {where}), which SFT trains on as "
                                 "written; evaluation needs prompts with reference answers (e.g. gsm8k, math500) or a "
                                 "data.task_name whose environment scores them")
            raise InputError(f"eval: {where} has keys {sorted(row)}; evaluation needs prompt `messages` (set "
                             "data.format, e.g. data.format=math)")
    return rows


def _check_prompt_lengths(rows: list[dict], tokenizer, cfg: EvalMasterConfig) -> None:
    """Fail at setup, naming the dataset row, when a prompt leaves no room to answer (unless
    `policy.generation.overlong_prompt=truncate`), rather than after hours of generation."""
    from posttrain.rollouts import render_prompt

    if cfg.policy.generation.overlong_prompt == "truncate":
        return
    limit = cfg.policy.max_total_sequence_length
    lengths = [len(render_prompt(tokenizer, row["messages"], cfg.data.add_bos,
                                 add_generation_prompt=cfg.data.add_generation_prompt, tools=row.get("tools")))
               for row in rows]
    overlong = [i for i, n in enumerate(lengths) if n >= limit]
    if overlong:
        i = overlong[0]
        raise InputError(
            f"eval: {len(overlong)} of {len(rows)} prompts of {cfg.data.source()} leave no room to answer "
            f"within policy.max_total_sequence_length={limit} (first: {row_name(rows[i], f'row {i + 1}')}, "
            f"{lengths[i]} tokens); raise it or set policy.generation.overlong_prompt=truncate"
        )


def setup(cfg: EvalMasterConfig) -> EvalSetup:
    from posttrain.data.processors import load_policy_tokenizer, note_dropped_system
    from posttrain.distributed.cluster import init_ray
    from posttrain.environments import create_env, resolve_task_envs, with_tool_schemas
    from posttrain.generation import build_generation, check_backend_installed
    from posttrain.generation.sampling import SamplingSettings
    from posttrain.logging import Logger
    from posttrain.policy.hf_io import attention_kernel, check_language_model, load_model_config
    from posttrain.rollouts import check_tool_turns
    from posttrain.runtime import keep_freed_memory, resolve_device

    save_dir = Path(cfg.eval.save_path or cfg.logger.log_dir)
    torch.manual_seed(cfg.eval.seed)
    check_backend_installed(cfg.policy.generation, in_process=True)

    rows = load_eval_rows(cfg)
    # A bad environment, or a row without the answer its environment needs, fails before the model loads.
    task_names = resolve_task_envs(rows, cfg.env, require_answers=True)
    rows = with_tool_schemas(rows, cfg.env)
    tokenizer = load_policy_tokenizer(cfg.policy)
    note_dropped_system(tokenizer, rows)

    _check_prompt_lengths(rows, tokenizer, cfg)
    if cfg.eval.max_rollout_turns > 1:  # as GRPO: a template that cannot show a tool result fails here,
        # not at the first tool call, after the generation of every batch before it
        check_tool_turns(tokenizer, rows, cfg.data.add_bos, add_generation_prompt=cfg.data.add_generation_prompt)
    # The model's config (for a LoRA adapter folder: its base's), read once for both checks below.
    model_config = load_model_config(cfg.policy.model_name)[1]
    check_language_model(model_config, "policy.model_name", cfg.policy.model_name)
    gen_cfg = cfg.policy.generation.model_copy(update={"seed": cfg.eval.seed})
    device = resolve_device(cfg.policy.device)
    if device.type == "cpu":
        keep_freed_memory()  # this process generates: each batch reuses the memory of the last
    # The policy's attention kernel, as GRPO's validation loads it: transformers' default (sdpa)
    # rounded one greedy answer of the quickstart's 200 otherwise (0.225 against its 0.23).
    generation = build_generation(
        gen_cfg.backend, model_path=cfg.policy.model_name, tokenizer=tokenizer, cfg=gen_cfg,
        max_total_sequence_length=cfg.policy.max_total_sequence_length, precision=cfg.policy.precision,
        device=device, attn_implementation=attention_kernel(
            cfg.policy.attn_implementation, cfg.policy.max_total_sequence_length, device.type, model_config),
    )
    # Environments last: nothing after them can fail and leave their actors running.
    init_ray(cfg.cluster)
    envs = {name: _AnswerRecorder(create_env(name, cfg.env.get_worker_cfg(name))) for name in task_names}
    greedy = cfg.eval.greedy if cfg.eval.greedy is not None else cfg.eval.num_tests_per_prompt == 1
    # policy.generation.temperature=0 decodes greedily whatever eval.greedy says: report what ran.
    greedy = SamplingSettings.from_config(gen_cfg, greedy).greedy
    # The same config run on another model writes to the same folder: the earlier results are
    # moved aside with its logs, once nothing can fail any more before this run writes its own.
    # Locked as a training run's logs are: a training run writing there had its logs moved aside.
    logger = Logger(cfg.logger, save_dir, hparams=cfg.model_dump(mode="json"), fresh=True, also_move=RESULT_FILES,
                    exclusive="eval.save_path" if cfg.eval.save_path else "logger.log_dir")
    return EvalSetup(cfg=cfg, save_dir=save_dir, tokenizer=tokenizer, generation=generation, envs=envs,
                     rows=rows, greedy=greedy, logger=logger)


def _sample_record(prompt_index: int, sample_index: int, row: dict, conv) -> dict[str, Any]:
    return {
        "prompt_index": prompt_index,
        "sample_index": sample_index,
        "prompt": row["messages"],
        "response": conv.response,
        "extracted_answer": conv.metadata.get(ANSWER_KEY),
        "reference_answer": row.get("answer"),  # None for rows scored by tests (code)
        "reward": conv.reward,
        "correct": conv.correct,  # the environment's verdict; None: not judged (left out of the metrics)
        "truncated": conv.truncated,
        "stop_reason": conv.stop_reason,  # posttrain.rollouts.Conversation.stop_reason
        "prompt_truncated": conv.prompt_truncated,  # cut from the left (overlong_prompt=truncate)
        "response_tokens": conv.response_tokens,
        "env_error": conv.env_error,  # its text; null when the environment did not fail
        "task_name": conv.task_name,
        # With tools: the turns that called them, and the whole exchange (calls, results, answer);
        # also after one turn whose call's result found no room left in the context.
        **({"tool_calls": conv.metadata.get(TOOL_CALLS_KEY, 0)} if conv.tools else {}),
        **({"conversation": conv.exchange} if conv.turns > 1 or any("tool_calls" in m for m in conv.exchange)
           else {}),
        **({"extra": conv.metadata[LOG_EXTRA_KEY]} if LOG_EXTRA_KEY in conv.metadata else {}),  # log_extra
    }


def sample_counts(records: list[dict[str, Any]]) -> dict[str, float]:
    """The results' counts and means over the sample records (`_sample_record`)."""
    n = len(records)
    return {
        "num_correct": sum(r["correct"] is True for r in records),
        "num_truncated": sum(r["truncated"] for r in records),
        "num_prompt_truncated": sum(r["prompt_truncated"] for r in records),
        "num_no_answer": sum(r["extracted_answer"] is None for r in records),
        "num_env_errors": sum(bool(r["env_error"]) for r in records),
        "mean_reward": sum(r["reward"] for r in records) / n,
        "mean_response_tokens": sum(r["response_tokens"] for r in records) / n,
        # Over every sample, a row without tools counting 0 calls (as GRPO's tool_calls_mean): with
        # tools in one environment only, the samples of the others have no count (a KeyError here
        # lost the results of the whole evaluation).
        **({"mean_tool_calls": sum(r.get("tool_calls", 0) for r in records) / n}
           if any("tool_calls" in r for r in records) else {}),
    }


def per_task_metrics(records: list[dict[str, Any]], n: int, metric: str) -> dict[str, dict[str, Any]]:
    """The results' metrics (`metric`'s score, `aggregate`'s, `sample_counts`') over each task's
    prompts, by `task_name`, when the records (prompt-major, `n` per prompt) are of more than one
    task; {} otherwise (the overall metrics are the task's)."""
    prompts = [records[p : p + n] for p in range(0, len(records), n)]
    tasks = sorted({group[0]["task_name"] for group in prompts})
    if len(tasks) < 2:
        return {}
    out = {}
    for task in tasks:
        groups = [g for g in prompts if g[0]["task_name"] == task]
        metrics = aggregate([[r["extracted_answer"] for r in g] for g in groups],
                            [[r["correct"] for r in g] for g in groups])
        out[task] = {"score": metrics[metric], **metrics, **sample_counts([r for g in groups for r in g])}
    return out


def evaluate(s: EvalSetup) -> dict[str, Any]:
    """Generate, score and aggregate; write results.json and samples.jsonl; return the results."""
    from posttrain.rollouts import run_rollouts

    cfg, n = s.cfg, s.cfg.eval.num_tests_per_prompt
    # Prompt-major: samples of prompt p are rows [p*n, (p+1)*n).
    samples = [(p, j, row) for p, row in enumerate(s.rows) for j in range(n)]
    bs = cfg.policy.generation_batch_size
    num_batches = math.ceil(len(samples) / bs)
    records: list[dict[str, Any]] = []
    generated_tokens = 0.0
    s.logger.start_progress(num_batches)
    start = time.monotonic()
    s.generation.prepare_for_generation()
    # Each batch's samples are written as it finishes: an eval stopped part-way (Ctrl-C, a crash)
    # keeps the samples it generated; results.json is written only once all are in.
    with open(s.save_dir / "samples.jsonl", "w") as samples_file:
        for b in range(num_batches):
            chunk = samples[b * bs : (b + 1) * bs]
            out = run_rollouts(
                s.generation, [row for _, _, row in chunk], s.envs, s.tokenizer,
                max_turns=cfg.eval.max_rollout_turns, max_seq_len=cfg.policy.max_total_sequence_length,
                greedy=s.greedy, add_bos=cfg.data.add_bos, add_generation_prompt=cfg.data.add_generation_prompt,
            )
            generated_tokens += out.metrics["generated_tokens"]
            batch = [_sample_record(p, j, row, conv) for (p, j, row), conv in zip(chunk, out.conversations)]
            records += batch
            samples_file.writelines(json.dumps(r, default=str) + "\n" for r in batch)
            samples_file.flush()
            s.logger.log_metrics(  # an accuracy of None (nothing judged yet) is not logged
                {"accuracy_so_far": accuracy([r["correct"] for r in records]), "samples": len(records)},
                step=b + 1, prefix="eval",
            )
    s.generation.finish_generation()
    elapsed = time.monotonic() - start

    answers = [[r["extracted_answer"] for r in records[p * n : (p + 1) * n]] for p in range(len(s.rows))]
    correct = [[r["correct"] for r in records[p * n : (p + 1) * n]] for p in range(len(s.rows))]
    metrics = aggregate(answers, correct)
    metric = f"{cfg.eval.metric.split('@')[0]}@{cfg.eval.k_value}"
    results: dict[str, Any] = {
        "score": metrics[metric],
        "metric": metric,
        **metrics,
        # A file of several tasks: each one's metrics (the overall ones mixed a task the model
        # solves with one it cannot).
        **({"per_task": per_task} if (per_task := per_task_metrics(records, n, metric)) else {}),
        "num_tests_per_prompt": n,
        "greedy": s.greedy,
        **sample_counts(records),
        "generated_tokens": generated_tokens,
        "elapsed_s": elapsed,
        "tokens_per_s": generated_tokens / max(elapsed, 1e-9),
        "dataset": "+".join(cfg.data.dataset_names()),
        "model": cfg.policy.model_name,
        "config": cfg.model_dump(mode="json"),
    }
    if metrics["num_judged"] < len(records):
        s.logger.console(f"{len(records) - metrics['num_judged']} of {len(records)} samples have no verdict from their "
                         "environment (one without a notion of correct, or a failed verification): they are left out "
                         "of accuracy, pass@k and cons@k (null when no prompt has enough judged samples)")
    (s.save_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    if cfg.logger.plots_enabled:
        from posttrain.logging.plots import plot_pass_at_k

        plot_pass_at_k(results, s.save_dir / "pass_at_k.png")
    s.logger.log_metrics({**{key: v for key, v in results.items() if key not in ("config", "per_task")},
                          **{f"task_accuracy/{t}": m["accuracy"] for t, m in per_task.items()}},
                         step=num_batches, prefix="eval")
    s.logger.print_samples(
        [{"prompt": r["prompt"][-1]["content"], "response": r["response"], "answer": r["extracted_answer"],
          "reference": r["reference_answer"], "reward": r["reward"]} for r in records]
    )
    return results


def run(cfg: EvalMasterConfig) -> dict[str, Any]:
    """Evaluate `policy.model_name` per `cfg`; returns the results (also in <save_dir>/results.json)."""
    import ray

    started_ray = not ray.is_initialized()
    try:
        s = setup(cfg)
        try:
            results = evaluate(s)
        finally:
            s.logger.close()
            for env in s.envs.values():
                env.env.shutdown()
    finally:
        # A Ray this run started is stopped; one the caller started (a cluster, tests) is kept.
        if started_ray and ray.is_initialized():
            ray.shutdown()
    summary = {key: v for key, v in results.items() if key != "config"}
    summary["results_path"] = str(s.save_dir / "results.json")
    return summary
