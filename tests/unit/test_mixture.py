"""data.mixture: several datasets read as one, each under its own keys, training rows weighted."""

import json
from collections import Counter

import pytest

from posttrain.config import ConfigError, MissingInputError, load_config
from posttrain.data.datasets import load_rows
from posttrain.schemas import DataConfig


def _write(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return str(path)


@pytest.fixture
def files(tmp_path):
    """A math set (question/answer) and a prompt/completion set, each with a validation file."""
    math = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(10)]
    chat = [{"prompt": f"say {i}", "completion": f"{i}"} for i in range(8)]
    return {
        "math": _write(tmp_path / "math.jsonl", math), "math_val": _write(tmp_path / "math_val.jsonl", math[:3]),
        "chat": _write(tmp_path / "chat.jsonl", chat), "chat_val": _write(tmp_path / "chat_val.jsonl", chat[:2]),
    }


def _mixture(files, math_weight, chat_weight, **data):
    return DataConfig(mixture=[
        {"dataset_name": files["math"], "val_data_path": files["math_val"], "weight": math_weight,
         "task_name": "arithmetic"},
        {"dataset_name": files["chat"], "val_data_path": files["chat_val"], "weight": chat_weight},
    ], **data)


def _text(row):
    return row["messages"][0]["content"]


def test_training_rows_are_weighted_and_validation_rows_are_not(files):
    cfg = _mixture(files, 2, 0.5)
    train = load_rows(cfg, "train")
    counts = Counter(_text(r) for r in train)
    # Every math row twice, a seeded half of the chat rows once: 20 + 4 rows.
    assert len(train) == 24 and all(counts[f"{i}+1="] == 2 for i in range(10))
    chat = [t for t in counts if t.startswith("say")]
    assert len(chat) == 4 and all(counts[t] == 1 for t in chat)
    assert [_text(r) for r in load_rows(cfg, "train")] == [_text(r) for r in train]  # seeded
    other_seed = [_text(r) for r in load_rows(_mixture(files, 2, 0.5, seed=7), "train")]
    assert sorted(t for t in other_seed if t.startswith("say")) != sorted(chat)
    # Each dataset under its own keys: the math rows go to the arithmetic environment, the
    # prompt/completion rows stay SFT conversations.
    assert {r.get("task_name") for r in train if _text(r).endswith("=")} == {"arithmetic"}
    assert all("task_name" not in r for r in train if _text(r).startswith("say"))
    val = load_rows(cfg, "validation")
    # The entries in turn: entry after entry, grpo.max_val_samples=2 validated the math rows alone.
    assert [_text(r) for r in val] == ["0+1=", "say 0", "1+1=", "say 1", "2+1="]


def test_a_fractional_weight_above_one_adds_a_share_of_the_rows_once_more(files):
    train = load_rows(_mixture(files, 1.5, 1), "train")
    counts = Counter(_text(r) for r in train)
    assert sorted(counts[f"{i}+1="] for i in range(10)) == [1] * 5 + [2] * 5
    assert len(train) == 15 + 8


def test_errors_name_the_entry_and_the_config_refuses_two_sources(files, tmp_path):
    cfg = DataConfig(mixture=[{"dataset_name": files["math"]}, {"dataset_name": str(tmp_path / "missing.jsonl")}])
    with pytest.raises(MissingInputError, match=r"data.mixture\[1\] \(.*missing.jsonl\): .*missing.jsonl"):
        load_rows(cfg, "train")
    with pytest.raises(ConfigError, match=r"data.dataset_name='gsm8k' and data.mixture both name the data.*"
                                          r"~data.dataset_name"):
        load_config("sft", None, ["data.dataset_name=gsm8k", f"data.mixture=[{{dataset_name: {files['math']}}}]"])
    # A resolved config (config.yaml, --print-config) writes the default dataset_name beside the
    # mixture: it loads back; a file inheriting a dataset_name unsets it with null.
    from posttrain.config import to_yaml

    mixed = load_config("sft", None, [f"data.mixture=[{{dataset_name: {files['math']}}}]"])
    (tmp_path / "resolved.yaml").write_text(to_yaml(mixed))
    assert load_config("sft", str(tmp_path / "resolved.yaml"), []).data == mixed.data
    (tmp_path / "parent.yaml").write_text("data: {dataset_name: gsm8k}\n")
    (tmp_path / "child.yaml").write_text(f"defaults: parent.yaml\ndata:\n  dataset_name: null\n"
                                         f"  mixture: [{{dataset_name: {files['math']}}}]\n")
    assert load_config("sft", str(tmp_path / "child.yaml"), []).data.mixture[0].dataset_name == files["math"]
    with pytest.raises(ConfigError, match=r"data.mixture\[0\].weight: got 0, expected greater than 0"):
        load_config("sft", None, [f"data.mixture=[{{dataset_name: {files['math']}, weight: 0}}]"])


def test_validation_rows_that_are_training_rows_are_noted(files):
    # MATH-500 (a test set) is both splits of `math500`; the same file as both splits too: the
    # held-out numbers then measured fit, and nothing said so.
    from posttrain.data.datasets import shared_rows_note

    same = DataConfig(dataset_name="local", train_data_path=files["math"], val_data_path=files["math_val"])
    assert shared_rows_note(load_rows(same, "train"), load_rows(same, "val")) == (
        "3 of the 3 validation rows are training rows too: the validation metrics measure fit to the training "
        "data, not generalization (set data.val_data_path to held-out rows)")
    held_out = DataConfig(dataset_name=files["math"])  # val_split_fraction of the file, out of the training rows
    assert shared_rows_note(load_rows(held_out, "train"), load_rows(held_out, "val")) is None
