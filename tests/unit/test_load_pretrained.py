"""`load_pretrained`: a reward model started from a causal LM (`posttrain rm`) loads without
transformers' warning table about its new score head; a load that reports more still shows it."""

import logging
import shutil

import pytest
import safetensors.torch
import torch

from posttrain.config import InputError
from posttrain.policy.hf_io import load_pretrained


@pytest.fixture
def hf_reports():
    """The messages transformers' model loading logs (its handler writes to the stream of its import)."""
    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addHandler(handler)
    yield messages
    logger.removeHandler(handler)


def test_a_new_score_head_loads_without_transformers_load_report(tiny_model_path, hf_reports):
    model = load_pretrained("sequence_classification", tiny_model_path, "policy.model_name", "embedded:tiny",
                            new_head=True, num_labels=1)
    assert model.score.weight.shape[0] == 1
    assert not [m for m in hf_reports if "LOAD REPORT" in m]
    # Without new_head the missing head is posttrain's error, and transformers' table is shown too.
    with pytest.raises(InputError, match="has no weights for score.weight"):
        load_pretrained("sequence_classification", tiny_model_path, "env.reward_model.cfg.model_name", "x",
                        num_labels=1)
    assert any("LOAD REPORT" in m and "score.weight" in m for m in hf_reports)


def test_a_load_report_of_more_than_the_new_head_is_shown(tiny_model_path, tmp_path, hf_reports):
    folder = tmp_path / "extra"
    folder.mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{tiny_model_path}/{f}", folder / f)
    weights = safetensors.torch.load_file(f"{tiny_model_path}/model.safetensors")
    weights["stray.weight"] = weights["model.norm.weight"].clone()  # a key no Llama has
    safetensors.torch.save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    load_pretrained("sequence_classification", str(folder), "policy.model_name", str(folder), new_head=True,
                    num_labels=1)
    assert any("LOAD REPORT" in m and "stray.weight" in m and "score.weight" in m for m in hf_reports), hf_reports
    assert not logging.getLogger("transformers.modeling_utils").filters  # the hold is removed


def test_a_reward_models_adapter_folder_loads_without_a_load_report_of_its_head(tiny_model_path, tmp_path,
                                                                                  hf_reports):
    # The base loads first, without a trained head, and transformers printed its "newly initialized:
    # train it" table; the adapter then brings the head, so the folder scores as trained.
    from transformers import AutoModelForSequenceClassification

    from posttrain.policy.lora import maybe_apply_lora, save_adapter
    from posttrain.schemas import LoraConfig

    lora = LoraConfig(enabled=True, rank=2, alpha=4.0)
    base = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    base.config.pad_token_id = 0
    model = maybe_apply_lora(base, lora)
    with torch.no_grad():
        model.base_model.model.score.modules_to_save["default"].weight.fill_(0.5)  # the trained head
    save_adapter(model.state_dict(), lora, tmp_path / "rm-adapter", base_model_name_or_path=tiny_model_path,
                 model=model)
    hf_reports.clear()
    loaded = load_pretrained("sequence_classification", str(tmp_path / "rm-adapter"), "env.reward_model.cfg.model_name",
                             "rm-adapter", num_labels=1)
    assert torch.all(loaded.score.weight == 0.5)
    assert not [m for m in hf_reports if "LOAD REPORT" in m]
