"""What the GRPO functional test files share: the tiny run's overrides and its metric records."""

from posttrain.logging.jsonl import read_metrics

QUICKSTART = "examples/configs/grpo_quickstart.yaml"


def records(log_dir, prefix):
    """The metric records of `log_dir` under `prefix` (train, val, warmup_sft, ...)."""
    return [r for r in read_metrics(log_dir / "metrics.jsonl") if r["prefix"] == prefix]


def tiny_overrides(tmp_path, *extra):
    """Overrides for a GRPO run of embedded:tiny in a few seconds, logs and checkpoints under `tmp_path`."""
    return [
        "policy.model_name=embedded:tiny",
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=4",
        "grpo.warmup_sft_steps=2",
        # A few steps of 4 prompts need few rows: the quickstart's 20,000 took ~7 s of every run to
        # render and tokenize (prompts, then warm-up examples) on a slow 2-core VM.
        "data.num_train=256",
        "grpo.max_val_samples=8",
        "grpo.val_batch_size=8",
        "grpo.val_period=2",
        "policy.train_global_batch_size=8",  # two optimizer steps per GRPO step: the 2nd sees ratio != 1
        "policy.train_micro_batch_size=4",
        "policy.logprob_batch_size=8",
        "policy.optimizer.kwargs.lr=1e-3",
        "logger.tensorboard_enabled=false",
        # ~1.6 s of each run's CPU at its first checkpoint (matplotlib and five PNGs), ~0.6 s at each
        # later one; test_checkpoints_and_plots_are_written draws them.
        "logger.plots_enabled=false",
        "logger.num_val_samples_to_print=0",
        # Every step's token_mult_prob_error measured against a policy forward (the quickstart reuses
        # the generation logprobs after step 1; tested on its own in test_grpo_variants.py).
        "grpo.prev_logprobs_from_generation=false",
        f"logger.log_dir={tmp_path / 'logs'}",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        "checkpointing.save_period=2",
        *extra,
    ]
