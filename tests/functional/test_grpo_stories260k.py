"""The stories260K GRPO demo (examples/configs/grpo_stories260k.yaml): the real entrypoint on
the converted real model with the `story` reward; held-out reward rises within a few steps."""

from pathlib import Path

import pytest

from posttrain.config import load_config

CONFIG = Path(__file__).resolve().parents[2] / "examples" / "configs" / "grpo_stories260k.yaml"


@pytest.mark.slow
def test_grpo_stories260k_reward_rises(ray_session, stories260k, tmp_path):
    from posttrain.algorithms.grpo import run
    from posttrain.logging.jsonl import read_metrics

    cfg = load_config("grpo", CONFIG, [
        f"policy.model_name={stories260k}", "grpo.max_num_steps=6", "grpo.val_period=6",
        f"logger.log_dir={tmp_path / 'logs'}", "logger.num_val_samples_to_print=0", "checkpointing.enabled=false",
        "checkpointing.export_hf_at_end=false",
    ])
    final = run(cfg)
    val = {r["step"]: r for r in read_metrics(tmp_path / "logs" / "metrics.jsonl") if r["prefix"] == "val"}
    assert set(val) == {0, 6}
    assert val[0]["reward"] < 0.35  # the base model keeps the animal in about one story in three
    assert val[6]["reward"] > val[0]["reward"] + 0.3
    assert final["val/reward"] == pytest.approx(val[6]["reward"])
