"""The documented offline examples (sft, sft_alpaca, dpo, rm on stories260K and the shared
data) get past their data stage as the README runs them: from the project root, every split
keeps rows, training has at least one batch and validation at least one row. Only the data
stage runs (no workers): a config whose rows all drop at the model's length would otherwise
fail only when a user runs it."""

from pathlib import Path

import pytest

from posttrain.algorithms.offline import offline_data
from posttrain.config import load_config
from posttrain.data.processors import (
    collate,
    collate_pairs,
    process_preference_rows,
    process_sft_rows,
)

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = {
    "sft.yaml": ("sft", process_sft_rows, collate),
    "sft_alpaca.yaml": ("sft", process_sft_rows, collate),
    "dpo.yaml": ("dpo", process_preference_rows, collate_pairs),
    "rm.yaml": ("rm", process_preference_rows, collate_pairs),
}


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_example_keeps_rows_in_every_split(name, stories260k, monkeypatch):
    algorithm, process_rows, collate_fn = EXAMPLES[name]
    monkeypatch.chdir(ROOT)  # data paths in the examples are relative to the project root
    cfg = load_config(algorithm, ROOT / "examples" / "configs" / name, [f"policy.model_name={stories260k}"])
    path = Path(cfg.data.dataset_name)
    if path.suffix and not path.exists():
        pytest.skip(f"{name}: {path} is not beside the project (../shared/data elsewhere?)")
    data = offline_data(cfg, algorithm, process_rows, collate_fn)
    for split, counts in data.stats.items():
        assert counts["kept"] > 0, (split, counts)
    assert data.val_batches and data.val_batches[0].size > 0
