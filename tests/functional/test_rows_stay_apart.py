"""Prefix sharing and sequence packing put several sequences in one row, kept apart by the
attention mask and restarting positions alone. Models that mix positions elsewhere (LFM2's
short convolutions) or build their mask without position ids (OPT) got other logprobs and
gradients without a word: the policy checks each layout against the plain rows at set-up,
turns prefix sharing (on by default) off for them and refuses packing (asked for)."""

import logging
import shutil
from pathlib import Path

import pytest
import torch
from policy_oracle import prompt_batch, reference_logprobs
from transformers import AutoModelForCausalLM, Lfm2Config, OPTConfig

from posttrain.config import ConfigError
from posttrain.policy.fsdp_worker import FSDPPolicyWorker
from posttrain.schemas import PolicyConfig

PACKING = {"enabled": True, "train_mb_tokens": 64, "logprob_mb_tokens": 64}


def _model(tmp_path: Path, tiny_model_path: str, name: str, config) -> str:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # weights large enough that what mixes shows
        for p in model.parameters():
            p.normal_(0, 0.3)
    model.save_pretrained(tmp_path / name)
    for f in Path(tiny_model_path).iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            shutil.copy(f, tmp_path / name)
    return str(tmp_path / name)


def _worker(path: str, **policy) -> FSDPPolicyWorker:
    worker = FSDPPolicyWorker(PolicyConfig(model_name=path, precision="float32", max_total_sequence_length=64,
                                           logprob_batch_size=8, attn_implementation="eager", **policy),
                              init_reference="reference_model_name" in policy)
    worker.setup()
    return worker


def test_a_model_that_mixes_positions_outside_attention_runs_each_row_on_its_own(
        tmp_path, tiny_model_path, single_rank_worker_env, caplog):
    common = dict(vocab_size=104, pad_token_id=0, bos_token_id=1, eos_token_id=7)
    lfm2 = _model(tmp_path, tiny_model_path, "lfm2", Lfm2Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, layer_types=["conv", "full_attention"], conv_L_cache=3,
        block_auto_adjust_ff_dim=False, **common))
    with caplog.at_level(logging.WARNING, logger="posttrain.policy.fsdp_worker"):
        worker = _worker(lfm2)
    assert not worker._shares_prefixes
    assert ("policy.prefix_sharing: off for Lfm2 models (policy.model_name), which mix the completions packed after "
            "a shared prompt") in caplog.text
    batch = prompt_batch([6] * 4, [16, 12, 14, 10], shared=True)  # 4 samples of one prompt (GRPO)
    plain = reference_logprobs(AutoModelForCausalLM.from_pretrained(lfm2, dtype=torch.float32).eval(), batch)
    trained = batch["token_mask"] > 0
    torch.testing.assert_close(worker.get_logprobs(batch)["logprobs"][trained], plain[trained], atol=2e-5, rtol=0)
    # Packing, asked for, is refused by name; so for OPT, whose mask ignores the position ids.
    opt = _model(tmp_path, tiny_model_path, "opt", OPTConfig(
        hidden_size=32, num_hidden_layers=2, num_attention_heads=4, ffn_dim=64, max_position_embeddings=128,
        word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0, **common))
    for path, name in ((lfm2, "Lfm2"), (opt, "OPT")):
        with pytest.raises(ConfigError, match=rf"policy.sequence_packing.enabled=true: {name} models "
                                              r"\(policy.model_name\) mix the sequences packed in one row"):
            _worker(path, prefix_sharing={"enabled": False}, sequence_packing=PACKING)
    # A teacher (or KL reference) of such a kind takes the same paths: its logprobs were the wrong ones.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="posttrain.policy.fsdp_worker"):
        worker = _worker(tiny_model_path, reference_model_name=lfm2)
    assert not worker._shares_prefixes
    assert "off for Lfm2 models (policy.reference_model_name)" in caplog.text
    torch.testing.assert_close(worker.get_logprobs(batch, reference=True)["reference_logprobs"][trained],
                               plain[trained], atol=2e-5, rtol=0)


def test_a_model_whose_rows_stay_apart_keeps_both(tiny_model_path, single_rank_worker_env):
    assert _worker(tiny_model_path, sequence_packing=PACKING)._shares_prefixes
