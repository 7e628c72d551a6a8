"""Policy variants: LoRA on a causal LM, and a reward model (sequence classification) trained
with a pair loss on 2 workers (bf16 compute: test_policy_precision.py). Tolerances: fp32
logprobs/scores 2e-5 absolute."""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from policy_oracle import full_state, make_batch, reference_logprobs
from posttrain.convert.dcp_to_hf import convert as dcp_to_hf
from posttrain.distributed.cluster import RayVirtualCluster
from posttrain.losses.nll import NLLLoss
from posttrain.losses.preference import BradleyTerryLoss
from posttrain.policy.lm_policy import Policy
from posttrain.schemas import ClusterConfig, PolicyConfig

BASE = dict(model_name="embedded:tiny", precision="float32", train_global_batch_size=4, train_micro_batch_size=2,
            max_total_sequence_length=32, optimizer={"name": "adamw", "kwargs": {"lr": 1e-2}})


@pytest.fixture(scope="module")
def no_pad_model_path(tiny_model_path, tmp_path_factory):
    """The tiny model with `pad_token_id: null` in its config, as many base models ship (Llama 3,
    Qwen2.5); the tokenizer still has a pad token."""
    path = tmp_path_factory.mktemp("no_pad") / "model"
    shutil.copytree(tiny_model_path, path)
    config = json.loads((path / "config.json").read_text())
    config["pad_token_id"] = None
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@pytest.fixture(scope="module")
def two_eos_model_path(tiny_model_path, tmp_path_factory):
    """The tiny model whose generation_config.json stops on one more id than its config.json, as
    Qwen2.5-Instruct's (<|im_end|> in both, <|endoftext|> only in the generation config)."""
    path = tmp_path_factory.mktemp("two_eos") / "model"
    shutil.copytree(tiny_model_path, path)
    generation = json.loads((path / "generation_config.json").read_text())
    generation["eos_token_id"] = [generation["eos_token_id"], 9]
    (path / "generation_config.json").write_text(json.dumps(generation))
    return str(path)


@pytest.fixture(scope="module")
def policies(ray_session, no_pad_model_path, two_eos_model_path):
    def build(kind: str):
        workers = 2 if kind == "rm" else 1
        cluster = RayVirtualCluster(ClusterConfig(workers_per_node=workers, cpus_per_worker=1), name=kind)
        if kind == "lora":
            # Dropout on the adapters' input: training draws random masks (eval-mode logprobs do not).
            cfg = PolicyConfig(**{**BASE, "model_name": two_eos_model_path},
                               lora={"enabled": True, "rank": 4, "alpha": 8, "dropout": 0.5})
            return cluster, Policy(cluster, cfg, name_prefix="lora")  # its reference: the base, adapters off
        cfg = PolicyConfig(**{**BASE, "model_name": no_pad_model_path})
        return cluster, Policy(cluster, cfg, init_reference=False, model_kind="sequence_classification",
                               name_prefix="rm")

    kinds = ("lora", "rm")
    with ThreadPoolExecutor(len(kinds)) as pool:
        made = dict(zip(kinds, pool.map(build, kinds)))
    yield {k: v[1] for k, v in made.items()}
    for cluster, policy in made.values():
        policy.shutdown()
        cluster.shutdown()


def test_lora_trains_adapters_and_exports_merged(policies, tiny_model_path, tmp_path):
    policy = policies["lora"]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    batch = make_batch()
    # lora_B starts at zero: the wrapped model computes exactly the base model.
    torch.testing.assert_close(policy.get_logprobs(batch)["logprobs"], reference_logprobs(base, batch),
                               atol=2e-5, rtol=0)
    before = base.state_dict()
    policy.train(batch, NLLLoss())
    # The reference is the base: the policy's forward with the adapters off (no second copy loaded).
    reference = policy.get_reference_logprobs(batch)["reference_logprobs"]
    torch.testing.assert_close(reference, reference_logprobs(base, batch), atol=2e-5, rtol=0)
    assert (policy.get_logprobs(batch)["logprobs"] - reference).abs().max() > 1e-3  # the adapters are back on
    merged = ray.get(policy.full_state_dict_ref())
    assert set(merged) == set(before)  # base-model keys: adapters merged in
    assert torch.equal(merged["model.embed_tokens.weight"], before["model.embed_tokens.weight"])  # frozen
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"],
                           before["model.layers.0.self_attn.q_proj.weight"])
    policy.export_hf(tmp_path / "merged")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    torch.testing.assert_close(policy.get_logprobs(batch)["logprobs"], reference_logprobs(reloaded, batch),
                               atol=2e-5, rtol=0)
    # The base's generation config, with the stop id config.json lacks, goes with the export and,
    # through the checkpoint, with `posttrain convert dcp-to-hf` (both wrote one derived from config.json).
    policy.save_checkpoint(tmp_path / "step_1" / "policy")
    dcp_to_hf(tmp_path / "step_1", tmp_path / "converted")
    for folder in ("merged", "converted"):
        assert AutoModelForCausalLM.from_pretrained(tmp_path / folder).generation_config.eos_token_id == [7, 9]
    # Without its policy_meta.json the LoRA settings come from the run's config (it failed as
    # "another model's", naming neither), and a checkpoint with neither says what is missing.
    from posttrain.config import InputError
    from posttrain.convert.dcp_to_hf import META_FILE

    (tmp_path / "step_1" / "policy" / META_FILE).unlink()
    with pytest.raises(InputError, match=rf"{META_FILE} \(model kind, LoRA settings\) is missing, and no run config"):
        dcp_to_hf(tmp_path / "step_1", tmp_path / "no_meta")
    (tmp_path / "step_1" / "config.yaml").write_text("policy: {lora: {enabled: true, rank: 4, alpha: 8}}\n")
    dcp_to_hf(tmp_path / "step_1", tmp_path / "from_config")
    torch.testing.assert_close(AutoModelForCausalLM.from_pretrained(tmp_path / "from_config").state_dict(),
                               reloaded.state_dict())


def test_a_step_with_dropout_after_loading_a_checkpoint_repeats_the_step_after_saving_it(policies, tmp_path):
    # The workers' RNG states are not in a checkpoint: a resumed run draws the dropout masks the
    # uninterrupted one drew only because they follow the weights' version.
    policy, batch = policies["lora"], make_batch(seed=5)
    policy.save_checkpoint(tmp_path / "ckpt")
    first = policy.train(batch, NLLLoss())
    after = full_state(policy)
    policy.load_checkpoint(tmp_path / "ckpt")
    again = policy.train(batch, NLLLoss())
    assert again["loss"] == first["loss"]
    for k, v in full_state(policy).items():
        assert torch.equal(v, after[k]), k


def test_reward_model_scores_and_pair_training(policies, tiny_model_path):
    policy = policies["rm"]
    batch = make_batch()
    # The untrained score head is seeded identically in the workers and here.
    torch.manual_seed(0)
    oracle = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1).eval()
    with torch.no_grad():
        expected = torch.stack([oracle(input_ids=batch["input_ids"][r : r + 1, : int(n)]).logits[0, 0]
                                for r, n in enumerate(batch["input_lengths"])])
    scores = policy.get_scores(batch)["scores"]
    torch.testing.assert_close(scores, expected, atol=2e-5, rtol=0)
    with pytest.raises(ValueError, match="sequence_classification"):
        Policy.get_scores(type("P", (), {"model_kind": "causal_lm"})(), batch)
    # Rows (0,1) and (2,3) are chosen/rejected pairs, one pair per worker.
    losses = [policy.train(batch, BradleyTerryLoss())["loss"] for _ in range(3)]
    assert losses[0] == pytest.approx(
        float(-torch.nn.functional.logsigmoid(expected[0::2] - expected[1::2]).mean()), rel=1e-5)
    assert losses[-1] < losses[0]


def test_reward_model_export_scores_padded_batches_in_transformers(policies, tmp_path):
    # The base config names no pad token: the export must, or transformers cannot find each
    # row's last token in a padded batch ("Cannot handle batch sizes > 1 if no padding token").
    policy = policies["rm"]
    batch = make_batch()
    policy.export_hf(tmp_path / "rm")
    reloaded = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm").eval()
    assert reloaded.config.pad_token_id == 0  # the tokenizer's <pad>
    with torch.no_grad():
        padded = reloaded(input_ids=batch["input_ids"]).logits[:, 0]  # right-padded rows, as collate makes them
    torch.testing.assert_close(padded, policy.get_scores(batch)["scores"], atol=2e-5, rtol=0)


def test_reward_model_checkpoint_converts_to_the_exported_model(policies, tmp_path):
    from posttrain.cli import main as cli_main

    policy = policies["rm"]
    policy.export_hf(tmp_path / "hf")
    policy.save_checkpoint(tmp_path / "step_1" / "policy")
    with pytest.raises(SystemExit) as done:
        cli_main(["convert", "dcp-to-hf", "--checkpoint", str(tmp_path / "step_1"), "--output", str(tmp_path / "conv")])
    assert done.value.code == 0
    converted = AutoModelForSequenceClassification.from_pretrained(tmp_path / "conv")
    exported = AutoModelForSequenceClassification.from_pretrained(tmp_path / "hf")
    assert converted.config.num_labels == 1 and converted.config.pad_token_id == exported.config.pad_token_id
    expected = exported.state_dict()
    assert set(converted.state_dict()) == set(expected)
    for k, v in converted.state_dict().items():
        assert torch.equal(v, expected[k]), k
