"""The FSDP2 Policy on real Ray workers: equivalence with a plain transformers model,
1 vs 2 workers, micro-batch size, DCP checkpoints, HF export, bad input, dead workers.

Tolerances (fp32 everywhere): logprobs 2e-5 absolute; loss and grad norm 1e-5 relative;
parameters after one SGD step (lr 0.5) 2e-6 absolute (reduction-order noise only).
"""

import os
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from policy_oracle import LENGTHS, full_state, make_batch, one_and_two_workers, reference_logprobs, sgd_step_reference
from posttrain.cli import main as cli_main
from posttrain.config import InputError
from posttrain.convert.dcp_to_hf import convert as dcp_to_hf
from posttrain.data.batch import BatchedDataDict
from posttrain.distributed.worker_group import WorkerError
from posttrain.losses import ClippedPGLoss
from posttrain.losses.nll import NLLLoss
from posttrain.policy.lm_policy import NonFiniteGradients
from posttrain.schemas import PolicyConfig

LR = 0.5


def _cfg(**kw) -> PolicyConfig:
    base = dict(model_name="embedded:tiny", precision="float32", train_global_batch_size=4, train_micro_batch_size=1,
                logprob_batch_size=3, max_total_sequence_length=32, max_grad_norm=None,
                optimizer={"name": "sgd", "kwargs": {"lr": LR, "momentum": 0.9}},
                generation={"max_new_tokens": 6}, max_consecutive_skipped_steps=2)
    base.update(kw)
    return PolicyConfig(**base)


@pytest.fixture(scope="module")
def hf_model(tiny_model_path):
    return AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def policies(ray_session):
    """A 1-worker policy with micro-batches of 1 and a 2-worker policy with micro-batches of 2."""
    with one_and_two_workers(lambda workers: _cfg(train_micro_batch_size=workers), "policy") as pair:
        yield pair


def test_logprobs_match_plain_forward(policies, hf_model):
    batch = make_batch()
    expected = reference_logprobs(hf_model, batch)
    for policy in policies:
        got = policy.get_logprobs(batch)["logprobs"]
        assert got.shape == batch["input_ids"].shape
        torch.testing.assert_close(got, expected, atol=2e-5, rtol=0)
        assert (got[:, 0] == 0).all() and got[1, 9:].abs().sum() == 0  # position 0 and padding are 0
    # 5 rows: not a multiple of 2 workers nor of logprob_batch_size=3
    batch5 = make_batch(lengths=[16, 9, 12, 5, 7], seed=1)
    torch.testing.assert_close(policies[1].get_logprobs(batch5)["logprobs"],
                               reference_logprobs(hf_model, batch5), atol=2e-5, rtol=0)


def test_colocated_generation_samples_each_shard_with_its_own_seed(policies):
    """The n samples of one prompt split over two ranks: each rank samples its own stream, so
    rank 1's rows are no copy of rank 0's. Before the tests that train: trained with lr 0.5, the
    tiny model samples the same tokens whatever the seed."""
    policy = policies[1]
    ids = torch.tensor([[10, 11, 12, 13]] * 4)
    out = policy.generate(BatchedDataDict(input_ids=ids, input_lengths=torch.full((4,), 4)))
    rows = out["output_ids"].tolist()
    assert rows[:2] != rows[2:]  # rows 0-1 on rank 0, rows 2-3 on rank 1


def test_train_step_same_for_1_and_2_workers_and_microbatch_sizes(policies, tiny_model_path):
    batch = make_batch()
    loss, grad_norm, expected_state = sgd_step_reference(tiny_model_path, batch, LR)
    for policy in policies:
        m = policy.train(batch, NLLLoss())
        assert m["loss"] == pytest.approx(loss, rel=1e-5)
        assert m["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
        assert m["lr"] == LR and m["global_valid_toks"] == float(batch["token_mask"].sum())
        assert m["num_valid_tokens"] == m["global_valid_toks"]  # loss metrics summed over mbs and workers
        assert m["num_tokens"] == sum(LENGTHS)  # every micro-batch's rows (it counted the last one's)
        state = full_state(policy)
        for k, v in expected_state.items():
            torch.testing.assert_close(state[k], v, atol=2e-6, rtol=0, msg=lambda s, k=k: f"{k}: {s}")


def test_reference_stays_frozen(policies, hf_model):
    batch = make_batch(seed=2)
    expected = reference_logprobs(hf_model, batch)
    policies[1].train(batch, NLLLoss())  # the policy moves (whatever ran before); its reference must not
    ref = policies[1].get_reference_logprobs(batch)["reference_logprobs"]
    torch.testing.assert_close(ref, expected, atol=2e-5, rtol=0)
    assert (policies[1].get_logprobs(batch)["logprobs"] - expected).abs().max() > 1e-3  # trained


def test_dcp_checkpoint_restores_weights_and_optimizer(policies, tmp_path):
    policy = policies[1]
    batch = make_batch(seed=3)
    policy.save_checkpoint(tmp_path / "ckpt")
    saved = full_state(policy)
    policy.train(batch, NLLLoss())
    after_one_more = full_state(policy)
    policy.load_checkpoint(tmp_path / "ckpt")
    restored = full_state(policy)
    for k in saved:
        assert torch.equal(restored[k], saved[k]), k
    # Same step again: identical only if the momentum buffers were restored as well.
    policy.train(batch, NLLLoss())
    for k, v in full_state(policy).items():
        assert torch.equal(v, after_one_more[k]), k


def test_hf_export_reloads_with_identical_logits(policies, tmp_path, caplog):
    policy = policies[1]
    # An earlier export's file that this one would not overwrite (a shard index, say) goes with it.
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors.index.json").write_text("{}")
    policy.export_hf(tmp_path / "hf")
    assert not (tmp_path / "hf" / "model.safetensors.index.json").exists()
    # `posttrain convert dcp-to-hf` of a saved checkpoint writes the same weights.
    policy.save_checkpoint(tmp_path / "step_1" / "policy")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("keep me")
    with pytest.raises(InputError, match="not a model folder"):  # it would replace the whole folder
        dcp_to_hf(tmp_path / "step_1", tmp_path / "notes")
    (tmp_path / "notes" / "config.json").write_text('{"name": "my app"}')  # an app's, not a model's config
    with pytest.raises(InputError, match="not a model folder"):
        dcp_to_hf(tmp_path / "step_1", tmp_path / "notes")
    assert (tmp_path / "notes" / "todo.txt").read_text() == "keep me"
    # Another model's run config for a checkpoint without its hf_config/: named as such, not as a save cut short.
    shutil.copytree(tmp_path / "step_1", tmp_path / "foreign")
    shutil.rmtree(tmp_path / "foreign" / "policy" / "hf_config")
    (tmp_path / "other.yaml").write_text("policy:\n  model_name: embedded:small\n")
    with pytest.raises(InputError, match=r"does not fit the model of embedded:small .*pass the run's own config"):
        dcp_to_hf(tmp_path / "foreign", tmp_path / "converted", str(tmp_path / "other.yaml"))
    (tmp_path / "broken.yaml").write_text("policy: [\n")  # the checkpoint's own hf_config/: not read, and said
    dcp_to_hf(tmp_path / "step_1", tmp_path / "converted", str(tmp_path / "broken.yaml"))
    assert f"--config {tmp_path / 'broken.yaml'} is not read: the checkpoint carries its model's config" in caplog.text
    with pytest.raises(SystemExit) as done:
        cli_main(["convert", "dcp-to-hf", "--checkpoint", str(tmp_path / "step_1"),
                  "--output", str(tmp_path / "converted")])
    assert done.value.code == 0
    # A checkpoint cut short is an input error naming it (it was an AssertionError traceback).
    shutil.copytree(tmp_path / "step_1", tmp_path / "step_2")
    (tmp_path / "step_2" / "policy" / ".metadata").write_bytes(b"")
    with pytest.raises(InputError, match=r"cannot read the checkpoint in .*step_2"):
        dcp_to_hf(tmp_path / "step_2", tmp_path / "converted")
    assert "metadata is not found" not in caplog.text  # dcp's fallbacks, each logged with a traceback
    assert (tmp_path / "converted" / "config.json").is_file()  # the earlier conversion is intact
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "converted").state_dict()
    for k, v in AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict().items():
        assert torch.equal(converted[k], v), k
    assert (tmp_path / "hf" / "model.safetensors").is_file() and (tmp_path / "hf" / "tokenizer.json").is_file()
    # Its chat template writes the BOS that data.add_bos puts in front (tests/unit/test_hf_export.py),
    # and so does the converted checkpoint's.
    for folder in ("hf", "converted"):
        tok = AutoTokenizer.from_pretrained(tmp_path / folder)
        rendered = tok.apply_chat_template([{"role": "user", "content": "1+1="}], tokenize=True, return_dict=False)
        assert rendered[0] == tok.bos_token_id and rendered[1] != tok.bos_token_id
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    batch = make_batch(seed=4)
    ids = batch["input_ids"][:, :9]  # rows 0, 2 and the prefix of 1 are all valid tokens
    live = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    live.load_state_dict(full_state(policy))
    with torch.no_grad():
        assert torch.equal(reloaded(ids).logits, live(ids).logits)
    torch.testing.assert_close(policy.get_logprobs(batch)["logprobs"], reference_logprobs(reloaded, batch),
                               atol=2e-5, rtol=0)


def test_colocated_generation_follows_training(policies):
    from posttrain.generation import build_generation

    policy = policies[1]
    prompts = make_batch(lengths=[5, 3, 4], seq=5, seed=5)
    prompts = type(prompts)(input_ids=prompts["input_ids"], input_lengths=prompts["input_lengths"])

    def expected(state):
        model = AutoModelForCausalLM.from_pretrained(policy_path(policy)).eval()
        model.load_state_dict(state)
        engine = build_generation("torch", model=model, tokenizer=_tokenizer(), cfg=policy.cfg.generation,
                                  max_total_sequence_length=policy.cfg.max_total_sequence_length)
        return engine.generate(prompts, greedy=True)["output_ids"]

    first = policy.generate(prompts, greedy=True)
    assert first["output_ids"].shape[0] == 3 and (first["generation_lengths"] > 0).all()
    assert torch.equal(first["output_ids"], expected(full_state(policy)))
    policy.train(make_batch(seed=6), NLLLoss())  # weights change: the next generate must refit
    second = policy.generate(prompts, greedy=True)
    assert torch.equal(second["output_ids"], expected(full_state(policy)))
    assert policy.prepare_for_generation()["refit_s"] == 0  # generate refit: the copy holds these weights
    policy.train(make_batch(seed=7), NLLLoss())
    assert policy.prepare_for_generation()["refit_s"] > 0


def policy_path(policy) -> str:
    from posttrain.embedded import resolve_model_path

    return resolve_model_path(policy.cfg.model_name)


def _tokenizer():
    from transformers import AutoTokenizer

    from posttrain.embedded import resolve_model_path

    return AutoTokenizer.from_pretrained(resolve_model_path("embedded:tiny"))


def test_batch_longer_than_context_is_rejected(policies):
    batch = make_batch(lengths=[40, 3, 3, 3], seq=40)
    with pytest.raises(ValueError, match="row 0 has 40 tokens.*max_total_sequence_length=32"):
        policies[0].train(batch, NLLLoss())
    with pytest.raises(ValueError, match="multiple of policy.train_global_batch_size=4"):
        policies[0].train(make_batch(lengths=[5, 5, 5]), NLLLoss())


def _pg_batch(seed: int, nan_advantage: bool):
    """A policy-gradient batch; `nan_advantage`: one trained token's advantage is NaN (as a
    broken reward or a zero-variance normalisation would make it), so loss and gradient are NaN."""
    batch = make_batch(seed=seed)
    zeros = torch.zeros_like(batch["token_mask"])
    batch.update(prev_logprobs=zeros, generation_logprobs=zeros,
                 advantages=torch.randn(zeros.shape, generator=torch.Generator().manual_seed(seed)))
    if nan_advantage:
        batch["advantages"][1, 4] = float("nan")
    return batch


def test_non_finite_gradient_skips_the_update(policies, tmp_path):
    loss_fn = ClippedPGLoss({})
    for i, policy in enumerate(policies):
        policy.save_checkpoint(tmp_path / f"ckpt{i}")
        before = full_state(policy)
        m = policy.train(_pg_batch(10, nan_advantage=True), loss_fn)
        assert m["skipped_steps"] == 1 and m["grad_norm"] != m["grad_norm"]  # NaN
        for k, v in full_state(policy).items():
            assert torch.equal(v, before[k]), k
        # The skip left the optimizer's momentum and step count alone: the next finite step is
        # the one the saved state takes without the NaN batch in between.
        m = policy.train(_pg_batch(11, nan_advantage=False), loss_fn)
        assert m["skipped_steps"] == 0 and m["grad_norm"] > 0
        after_skip = full_state(policy)
        policy.load_checkpoint(tmp_path / f"ckpt{i}")
        policy.train(_pg_batch(11, nan_advantage=False), loss_fn)
        for k, v in full_state(policy).items():
            assert torch.equal(v, after_skip[k]), k
            assert not torch.equal(v, before[k]) or "norm" in k, k  # the finite step did train
        # policy.max_consecutive_skipped_steps=2 (this module's config): the second skip in a row stops.
        policy.train(_pg_batch(12, nan_advantage=True), loss_fn)
        with pytest.raises(NonFiniteGradients, match=r"last 2 optimizer steps .*max_consecutive_skipped_steps=2"):
            policy.train(_pg_batch(13, nan_advantage=True), loss_fn)  # a RunStopped: the CLI prints it alone
        for k, v in full_state(policy).items():
            assert torch.equal(v, after_skip[k]), k


def test_reference_sync_after_a_reference_pass_over_two_ranks(policies):
    # The reference's logprob pass left FSDP2's root module gathered (a full embedding beside the
    # policy's shards): the sync then failed ("size of tensor a (104) must match ... (52)").
    policy = policies[1]
    batch = make_batch()
    policy.get_reference_logprobs(batch)
    policy.workers.get(policy.workers.run_all("sync_reference", 1.0))  # alpha 1: the reference becomes the policy
    torch.testing.assert_close(policy.get_reference_logprobs(batch)["reference_logprobs"],
                               policy.get_logprobs(batch)["logprobs"], atol=1e-6, rtol=0)


def test_train_takes_the_logprobs_temperature_for_one_call(policies, tiny_model_path):
    # GRPO's warm-up SFT trains at temperature 1 in a policy whose logprobs are of the sampling
    # temperature: it fitted logits / T to the demonstrations (a model 1/T too flat or sharp).
    policy = policies[0]
    batch = make_batch(seed=5)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    model.load_state_dict(full_state(policy))
    mask = batch["token_mask"]
    with torch.no_grad():
        logits = torch.stack([model(input_ids=batch["input_ids"][r : r + 1]).logits[0] for r in range(batch.size)])

    def nll(temperature):
        lp = torch.log_softmax(logits[:, :-1].float() / temperature, -1).gather(-1, batch["input_ids"][:, 1:, None])[..., 0]
        return float(-(lp * mask[:, 1:]).sum() / mask.sum())

    assert nll(0.5) != pytest.approx(nll(1.0), rel=1e-3)
    # lr 0: the weights stay, so each call measures the same model
    assert policy.train(batch, NLLLoss(), lr=0.0, temperature=0.5)["loss"] == pytest.approx(nll(0.5), rel=1e-5)
    assert policy.train(batch, NLLLoss(), lr=0.0)["loss"] == pytest.approx(nll(1.0), rel=1e-5)  # the policy's own again


def test_killed_worker_is_named(policies):
    policy = policies[1]  # last test of the module: this policy is broken afterwards
    victim = policy.worker_info[1]
    os.kill(victim["pid"], 9)
    with pytest.raises(WorkerError, match=rf"(?s)rank 1 \(pid {victim['pid']}.*last lines of its log"):
        policy.get_logprobs(make_batch())
