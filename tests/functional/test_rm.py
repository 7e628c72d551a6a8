"""Reward-model training end to end (`posttrain.algorithms.rm.run`) on a synthetic preference
set whose preferred answer is verifiable (the correct sum of two digits against a wrong
one), then the trained RM scoring rollouts through the `reward_model` environment."""

import json
import random

import pytest
import torch
from docs_helpers import undocumented_metrics

from posttrain.algorithms import rm
from posttrain.config import load_config
from posttrain.environments import create_env


def _pairs(n: int, seed: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b = rng.randrange(10), rng.randrange(10)
        wrong = rng.choice([x for x in range(19) if x != a + b])
        rows.append({"prompt": f"{a}+{b}=", "chosen": str(a + b), "rejected": str(wrong)})
    return rows


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_reward_model_type_picks_model_kind_and_loss():
    from typing import get_args

    from posttrain.losses import BradleyTerryLoss
    from posttrain.schemas import RewardModelCfg

    # Every type the schema accepts has an implementation, and `posttrain rm` reads the keys.
    assert set(rm.REWARD_MODEL_TYPES) == set(get_args(RewardModelCfg.model_fields["reward_model_type"].annotation))
    cfg = load_config("rm", None, ["policy.reward_model_cfg.reward_model_type=bradley_terry"])
    assert rm.reward_model_kind(cfg.policy) == ("sequence_classification", BradleyTerryLoss)
    # A policy config that is not a reward model's (e.g. built by hand) is refused.
    with pytest.raises(ValueError, match="policy.reward_model_cfg.enabled=true"):
        rm.reward_model_kind(load_config("sft").policy)


def test_sequence_packing_is_refused_at_load():
    # The workers never pack a reward model's rows: the run went on without packing (or the
    # token-budget micro-batches asked for), and nothing said so.
    from posttrain.config import ConfigError

    packing = ["policy.sequence_packing.enabled=true", "policy.sequence_packing.train_mb_tokens=1024",
               "policy.sequence_packing.logprob_mb_tokens=1024"]
    with pytest.raises(ConfigError, match=r"policy.sequence_packing.enabled=true: a reward model is not trained on "
                                          r"packed rows .* use policy.dynamic_batching"):
        load_config("rm", None, packing)
    assert load_config("sft", None, packing).policy.sequence_packing.enabled  # causal LMs pack


@pytest.mark.slow
def test_rm_learns_verifiable_preferences_and_scores_rollouts(ray_session, tmp_path):
    train = _write(tmp_path / "train.jsonl", _pairs(4800, seed=0))
    val = _write(tmp_path / "val.jsonl", _pairs(200, seed=1))
    cfg = load_config("rm", None, [
        "policy.model_name=embedded:tiny", "data.dataset_name=local", f"data.train_data_path={train}",
        f"data.val_data_path={val}", "policy.train_global_batch_size=32", "policy.train_micro_batch_size=32",
        "policy.logprob_batch_size=64", "policy.max_total_sequence_length=32",
        "policy.optimizer.kwargs={lr: 1.0e-3, weight_decay: 0.0}", "rm.max_num_steps=300", "rm.max_num_epochs=2",
        "rm.val_period=100", "rm.val_global_batch_size=200", f"logger.log_dir={tmp_path}/logs",
        "logger.console_enabled=false", f"checkpointing.checkpoint_dir={tmp_path}/ckpt",
        "checkpointing.save_period=1000", "checkpointing.export_hf_at_end=true",
    ])
    result = rm.run(cfg)
    val_records = [r for r in map(json.loads, open(tmp_path / "logs" / "metrics.jsonl")) if r["prefix"] == "val"]
    assert val_records[0]["step"] == 0 and abs(val_records[0]["accuracy"] - 0.5) < 0.15  # untrained: chance
    # 200 held-out pairs: chance is 0.5 +- 0.035; the trained RM prefers the correct sum.
    assert result["val/accuracy"] >= 0.7, val_records
    assert result["val/rewards_chosen_mean"] > result["val/rewards_rejected_mean"]
    assert result["val/loss"] < 0.65
    assert not undocumented_metrics(tmp_path / "logs")

    # The exported RM as the `reward_model` environment (a Ray actor), scoring rollouts.
    env = create_env("reward_model", {"cfg": {"model_name": str(tmp_path / "logs" / "hf")}})
    try:
        probs = _pairs(200, seed=2)
        convs = [[{"role": "user", "content": p["prompt"]}, {"role": "assistant", "content": p[side]}]
                 for p in probs for side in ("chosen", "rejected")]
        convs.append([{"role": "user", "content": "1+1="}])  # nothing to score: 0 and an error
        out = env.step(convs, [{} for _ in convs])
    finally:
        env.shutdown()
    r = torch.tensor(out.rewards[:-1]).view(-1, 2)
    # 200 fresh pairs: chance is 0.5 +- 0.035; the RM's validation accuracy above is >= 0.7.
    env_accuracy = float((r[:, 0] > r[:, 1]).float().mean())
    assert env_accuracy >= 0.65, env_accuracy
    assert out.rewards[-1] == 0 and "no assistant message" in out.metadata[-1]["env_error"]
    assert all(out.terminateds) and out.answers[0] == probs[0]["chosen"]


@pytest.mark.parametrize("config_pad", [None, 0], ids=["no-pad-token", "config-pad-not-the-tokenizers"])
def test_scores_of_padded_rows_match_the_exported_model_on_each_row_alone(ray_session, stories260k, tmp_path,
                                                                           config_pad):
    # A tokenizer without a pad token (GPT-2's, Llama's): batches are padded with EOS. The RM must
    # pool at each row's last token under that padding, in training and in the export alike, not
    # at the end of the batch's longest row.
    import shutil

    import torch
    from transformers import AutoModelForSequenceClassification

    model = tmp_path / "nopad"
    shutil.copytree(stories260k, model)
    for name, key, value in (("config.json", "pad_token_id", config_pad), ("tokenizer_config.json", "pad_token", None)):
        cfg_file = model / name
        data = {k: v for k, v in json.loads(cfg_file.read_text()).items() if k != key}
        cfg_file.write_text(json.dumps({**data, **({key: value} if value is not None else {})}))
    rows = [{"prompt": "Once upon a time", "chosen": "there was a cat" * n, "rejected": "a dog"} for n in (1, 3, 5, 7)]
    data_file = _write(tmp_path / "pairs.jsonl", rows)
    cfg = load_config("rm", None, [
        f"policy.model_name={model}", "data.dataset_name=local", f"data.train_data_path={data_file}",
        f"data.val_data_path={data_file}", "policy.train_global_batch_size=4", "policy.train_micro_batch_size=4",
        "policy.logprob_batch_size=4", "policy.max_total_sequence_length=128", "policy.precision=float32",
        # Validated once, at the end: a run that never validates reads no validation rows.
        "rm.max_num_steps=1", "rm.val_at_start=false", "rm.val_period=0", "rm.val_at_end=true",
        f"logger.log_dir={tmp_path}/logs", "logger.console_enabled=false", "checkpointing.enabled=false",
    ])
    cfg.policy.tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    s = rm.setup(cfg)
    try:
        trained = rm.rm_train(s)
        batch = s.val_batches[0]
        scores = s.run.policy.get_scores(batch)["scores"]
        s.run.policy.export_hf(tmp_path / "hf")
    finally:
        s.run.shutdown()
    assert len(set(batch["input_lengths"].tolist())) > 2  # rows of several lengths, padded
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    with torch.no_grad():
        alone = torch.stack([exported(input_ids=batch["input_ids"][i : i + 1, :n]).logits[0, 0]
                             for i, n in enumerate(batch["input_lengths"].tolist())])
        padded = exported(input_ids=batch["input_ids"]).logits[:, 0]
    torch.testing.assert_close(scores, alone, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(padded, alone, atol=1e-5, rtol=1e-5)  # the export pads as training did
    # Plain transformers renders a conversation with the BOS and the scored EOS that data.add_bos /
    # add_eos put around the template's text (without them the export scored other ids: -0.16
    # against +0.19 in an audit), its prompt as training tokenized it (tests/unit/test_hf_export.py).
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    prompt = tok.apply_chat_template([{"role": "user", "content": rows[0]["prompt"]}], tokenize=True,
                                     add_generation_prompt=True, return_dict=False)
    assert all(batch["input_ids"][i, : len(prompt)].tolist() == prompt for i in range(batch.size))
    whole = tok.apply_chat_template([{"role": "user", "content": rows[0]["prompt"]},
                                     {"role": "assistant", "content": "a dog"}], tokenize=True, return_dict=False)
    assert whole[0] == tok.bos_token_id and whole[-1] == tok.eos_token_id and whole[-2] != tok.eos_token_id
    # The reward_model environment adds them as the run did, by the export's record (its default
    # of both scored an RM trained without the EOS on other ids); a setting of its own wins.
    from posttrain.environments.reward_model import RewardModelEnvironment
    from posttrain.schemas import EnvWorkerConfig

    assert exported.config.posttrain_row_tokens == {"add_bos": True, "add_eos": True}
    config_file = tmp_path / "hf" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()),
                                       "posttrain_row_tokens": {"add_bos": True, "add_eos": False}}))
    for given, expected in (({}, (True, False)), ({"add_eos": True, "add_bos": False}, (False, True))):
        env = RewardModelEnvironment(EnvWorkerConfig(cfg={"model_name": str(tmp_path / "hf"), **given}))
        assert (env.add_bos, env.add_eos) == expected
    # Positions through the model: the padded rows, not 0 (the score forward went uncounted).
    assert trained["train/model_tokens"] >= trained["train/num_tokens"] > 0


def test_an_adapter_export_records_the_rows_bos_and_eos_for_the_reward_model_environment(ray_session, tmp_path):
    # policy.lora.export=adapter writes no config.json: the environment found no record and scored an
    # RM trained without the EOS with one (-2.96 against +0.97 on the same conversation, in an audit).
    from posttrain.environments.reward_model import RewardModelEnvironment
    from posttrain.policy.hf_io import ROW_TOKENS_FILE
    from posttrain.schemas import EnvWorkerConfig

    train = _write(tmp_path / "train.jsonl", _pairs(8, seed=0))
    cfg = load_config("rm", None, [
        "policy.model_name=embedded:tiny", "data.dataset_name=local", f"data.train_data_path={train}",
        "data.add_eos=false", "policy.lora.enabled=true", "policy.lora.export=adapter",
        "policy.train_global_batch_size=8", "policy.train_micro_batch_size=8", "policy.logprob_batch_size=8",
        "policy.max_total_sequence_length=32", "rm.max_num_steps=1", "rm.val_at_start=false", "rm.val_period=0",
        "rm.val_at_end=false", f"logger.log_dir={tmp_path}/logs", "logger.console_enabled=false",
        "checkpointing.enabled=false", "checkpointing.export_hf_at_end=true",
    ])
    rm.run(cfg)
    adapter = tmp_path / "logs" / "hf"
    assert (adapter / "adapter_config.json").is_file() and not (adapter / "config.json").exists()
    assert json.loads((adapter / ROW_TOKENS_FILE).read_text()) == {"add_bos": True, "add_eos": False}
    env = RewardModelEnvironment(EnvWorkerConfig(cfg={"model_name": str(adapter)}))
    assert (env.add_bos, env.add_eos) == (True, False)
