"""What the SFT, DPO and KTO functional test files share: a test run's config under the example's
Alpaca-style template (stories260K has no chat template of its own)."""

from pathlib import Path

from posttrain.config import load_config

SFT_ALPACA = Path(__file__).resolve().parents[2] / "examples" / "configs" / "sft_alpaca.yaml"
ALPACA_TEMPLATE = load_config("sft", SFT_ALPACA).policy.tokenizer.chat_template


def offline_cfg(command: str, tmp_path, model: str, *overrides: str):
    """`posttrain <command>`'s config for a test run of `model` in float32 (exact comparisons need
    float32 compute; the default is bfloat16), logs under `tmp_path` (metrics.jsonl alone: no
    TensorBoard, no plots, ~2 s of each run's CPU; tests/unit/test_logging.py writes those), no
    console, no checkpoints, the Alpaca template; `overrides` (data, batches, ...) come after and win."""
    cfg = load_config(command, None, [
        f"policy.model_name={model}", "policy.precision=float32", f"logger.log_dir={tmp_path}/logs",
        "logger.console_enabled=false", "logger.tensorboard_enabled=false", "logger.plots_enabled=false",
        "checkpointing.enabled=false", *overrides,
    ])
    cfg.policy.tokenizer.chat_template = ALPACA_TEMPLATE
    return cfg
