"""Tensor parallelism (`policy.dtensor_cfg.tensor_parallel_size`) on real Ray workers over gloo:
two workers holding half of every decoder layer's heads and MLP width each, against a plain
single-process transformers model; the same with sequence parallelism (each also holding half
of the positions through the norms and residual adds).

Tolerances (fp32): logprobs 2e-5 absolute; loss and grad norm 1e-5 relative; parameters after one
SGD step (lr 0.5) 5e-6 absolute (the row-parallel sums add in another order).
"""

import math
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from policy_oracle import full_state, make_batch, reference_logprobs, sgd_step_reference
from transformers import AutoModelForCausalLM

from posttrain.config import InputError
from posttrain.losses.nll import NLLLoss
from posttrain.policy.hf_io import load_model_configs
from posttrain.policy.lm_policy import Policy
from posttrain.schemas import PolicyConfig

LR = 0.5


def _cfg(**kw) -> PolicyConfig:
    base = dict(model_name="embedded:tiny", precision="float32", train_global_batch_size=4, train_micro_batch_size=2,
                logprob_batch_size=3, max_total_sequence_length=512, max_grad_norm=None,
                optimizer={"name": "sgd", "kwargs": {"lr": LR}}, generation={"max_new_tokens": 6},
                dtensor_cfg={"tensor_parallel_size": 2})
    base.update(kw)
    return PolicyConfig(**base)


@contextmanager
def _policy(workers: int, name: str, **cfg):
    from posttrain.distributed.cluster import RayVirtualCluster
    from posttrain.schemas import ClusterConfig

    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=workers, cpus_per_worker=1), name=name)
    policy = Policy(cluster, _cfg(**cfg), name_prefix=name)
    try:
        yield policy
    finally:
        policy.shutdown()
        cluster.shutdown()


def _assert_matches_plain_model(policy, tiny_model_path, logprob_batch, train_batch) -> None:
    """Logprobs of `logprob_batch` and one SGD step on `train_batch` as a plain model's."""
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    torch.testing.assert_close(policy.get_logprobs(logprob_batch)["logprobs"], reference_logprobs(plain, logprob_batch),
                               atol=2e-5, rtol=0)
    loss, grad_norm, expected = sgd_step_reference(tiny_model_path, train_batch, LR)
    m = policy.train(train_batch, NLLLoss())
    # Counted once, not once per tensor-parallel rank:
    assert m["global_valid_toks"] == float(train_batch["token_mask"].sum()) == m["num_valid_tokens"]
    assert m["num_tokens"] == float(train_batch["input_lengths"].sum())
    assert m["loss"] == pytest.approx(loss, rel=1e-5) and m["grad_norm"] == pytest.approx(grad_norm, rel=1e-5)
    state = full_state(policy)
    assert state.keys() == expected.keys()
    for k, v in expected.items():
        torch.testing.assert_close(state[k], v, atol=5e-6, rtol=0, msg=lambda s, k=k: f"{k}: {s}")


@pytest.mark.extended  # TP: test_logprobs_and_one_training_step_match_the_plain_model; DP: test_policy.py
def test_data_and_tensor_parallel_together(ray_session, tiny_model_path):
    # First in the module: the 2-worker fixture below must not hold CPUs yet (the test cluster has 4).
    # Four workers as a 2 x 2 mesh: FSDP2 shards over two data-parallel groups, each of which
    # splits the layers over two ranks. (Four single-threaded workers on this 2-core machine:
    # slow, but the same collectives as on four devices.)
    with _policy(4, "dptp", train_micro_batch_size=1) as policy:
        assert (policy.dp, policy.tp) == (2, 2)
        # 6 logprob rows: 3 per data-parallel group
        _assert_matches_plain_model(policy, tiny_model_path, make_batch(lengths=[16, 9, 12, 5, 7, 11], seed=9),
                                    make_batch(seed=10))


def _sequence_parallel_rank(rank: int, model_path: str) -> tuple:
    """Rank `rank` of two policy workers (`run_local_ranks`) under sequence parallelism: the
    hidden states a middle decoder layer receives, the logprobs of make_batch(), and DTensor's
    warnings in a training step."""
    import logging

    from torch.distributed.tensor import DTensor, Replicate

    from posttrain.policy.fsdp_worker import FSDPPolicyWorker, _decoder_layers

    worker = FSDPPolicyWorker(_cfg(model_name=model_path, make_sequence_length_divisible_by=2,
                                   dtensor_cfg={"tensor_parallel_size": 2, "sequence_parallel": True}),
                              init_reference=False)
    worker.setup()
    layer = _decoder_layers(worker.model)[1]
    norm = layer.input_layernorm.weight
    seen = []
    hook = layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(tuple(args[0].shape)),
                                           with_kwargs=True)
    logprobs = worker.get_logprobs(make_batch())["logprobs"]
    hook.remove()
    warned = []
    handler = logging.Handler()
    handler.emit = lambda record: warned.append(record.getMessage())
    logging.getLogger("torch.distributed.tensor._redistribute").addHandler(handler)
    worker.train(make_batch(), NLLLoss(), 4)  # the gradient norm reduces over the (dp, tp) mesh
    # As a list: a tensor would go as a shared-memory handle that dies with this process.
    return rank, seen, isinstance(norm, DTensor) and Replicate() in norm.placements, logprobs.tolist(), warned


def test_sequence_parallel_layers_hold_half_of_the_positions(tiny_model_path):
    # The worker class itself in two processes (Ray's actors hide their modules): a decoder layer
    # receives its rank's half of each row's positions, with the norms' weights replicated over
    # the group as DTensors, and the logprobs are the plain model's. make_batch() in logprob
    # micro-batches of 3: rows of 16, 9, 12 tokens (16 positions, 8 per rank), then one of 5
    # (rounded up to 6: 3 per rank).
    from posttrain.distributed.local_ranks import run_local_ranks

    got = run_local_ranks(_sequence_parallel_rank, 2, tiny_model_path, timeout_s=300)
    hidden = AutoModelForCausalLM.from_pretrained(tiny_model_path).config.hidden_size
    expected = reference_logprobs(AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval(),
                                  make_batch())
    for rank, seen, norm_replicated, logprobs, warned in got:
        assert seen == [(3, 8, hidden), (1, 3, hidden)], rank
        # One all-reduce over the flattened (dp, tp) group, not "2 sequential all_reduce operations".
        assert not [w for w in warned if "sequential" in w], (rank, warned)
        assert norm_replicated, rank
        torch.testing.assert_close(torch.tensor(logprobs), expected, atol=2e-5, rtol=0)


def _gemma2_rank(rank: int, model_path: str) -> tuple:
    """Rank `rank` of two policy workers under sequence parallelism: one SGD step on make_batch()
    of a Gemma2 model, then the full values of every decoder layer's norm weights."""
    from posttrain.policy.fsdp_worker import FSDPPolicyWorker, _decoder_layers

    worker = FSDPPolicyWorker(_cfg(model_name=model_path, attn_implementation="eager",
                                   make_sequence_length_divisible_by=2,
                                   dtensor_cfg={"tensor_parallel_size": 2, "sequence_parallel": True}),
                              init_reference=False)
    worker.setup()
    worker.train(make_batch(), NLLLoss(), 4)
    norms = {f"model.layers.{i}.{name}": p.full_tensor().tolist()
             for i, layer in enumerate(_decoder_layers(worker.model))
             for name, p in layer.named_parameters() if "norm" in name}
    return rank, norms


def test_sequence_parallel_trains_every_norm_of_the_layer(tmp_path, tiny_model_path):
    # Gemma2's decoder layer has four norms on the residual stream, not Llama's two: the two
    # left plain saw their rank's positions only, and each rank's copy went its own way.
    import shutil

    from transformers import Gemma2Config

    from posttrain.distributed.local_ranks import run_local_ranks

    torch.manual_seed(0)
    model_path = tmp_path / "gemma2"
    AutoModelForCausalLM.from_config(Gemma2Config(
        vocab_size=104, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, bos_token_id=1, eos_token_id=7, pad_token_id=0)).save_pretrained(model_path)
    for f in Path(tiny_model_path).iterdir():
        if "token" in f.name or f.suffix == ".jinja":
            shutil.copy(f, model_path)
    _, _, expected = sgd_step_reference(str(model_path), make_batch(), LR)
    got = run_local_ranks(_gemma2_rank, 2, str(model_path), timeout_s=300)
    for rank, norms in got:
        assert len(norms) == 8 and any("pre_feedforward_layernorm" in k for k in norms)
        for k, v in norms.items():
            torch.testing.assert_close(torch.tensor(v), expected[k], atol=5e-6, rtol=0, msg=lambda s, k=k: f"{k}: {s}")


@pytest.mark.extended  # a tensor-parallel checkpoint and export: test_grpo.py::test_tensor_parallel_grpo
def test_a_checkpoint_resumes_under_another_tensor_parallel_size(ray_session, tmp_path):
    # Before the module's 2-worker fixture starts (3 of the test cluster's 4 CPUs here). AdamW,
    # so the step after a resume depends on the moments resharded along with the weights. The
    # split side runs sequence parallel too, whose norms are DTensors replicated over the group.
    adamw = {"name": "torch.optim.AdamW", "kwargs": {"lr": 1e-2}}
    with _policy(2, "tp2", optimizer=adamw, make_sequence_length_divisible_by=2,
                 dtensor_cfg={"tensor_parallel_size": 2, "sequence_parallel": True}) as split, \
            _policy(1, "tp1", optimizer=adamw, dtensor_cfg={"tensor_parallel_size": 1}) as whole:
        split.train(make_batch(seed=1), NLLLoss())
        split.save_checkpoint(tmp_path / "tp2")
        split.train(make_batch(seed=2), NLLLoss())
        whole.load_checkpoint(tmp_path / "tp2")  # tensor parallel 2 -> 1
        whole.train(make_batch(seed=2), NLLLoss())
        expected = full_state(split)
        for k, v in full_state(whole).items():
            torch.testing.assert_close(v, expected[k], atol=5e-6, rtol=0, msg=lambda s, k=k: f"{k}: {s}")
        whole.train(make_batch(seed=3), NLLLoss())
        whole.save_checkpoint(tmp_path / "tp1")
        whole.train(make_batch(seed=4), NLLLoss())
        split.load_checkpoint(tmp_path / "tp1")  # 1 -> 2
        split.train(make_batch(seed=4), NLLLoss())
        expected = full_state(whole)
        for k, v in full_state(split).items():
            torch.testing.assert_close(v, expected[k], atol=5e-6, rtol=0, msg=lambda s, k=k: f"{k}: {s}")


@pytest.fixture(scope="module", params=[False, True], ids=["tp", "tp+sp"])
def tp_policy(request, ray_session):
    # With sequence parallelism each rank also keeps half the positions between the projections;
    # rows round up to even lengths (the 5-token logprob micro-batch of make_batch() runs as 6).
    sp = {"dtensor_cfg": {"tensor_parallel_size": 2, "sequence_parallel": True},
          "make_sequence_length_divisible_by": 2} if request.param else {}
    with _policy(2, "tpsp" if request.param else "tp", **sp) as policy:
        yield policy


def test_logprobs_and_one_training_step_match_the_plain_model(tp_policy, tiny_model_path):
    assert (tp_policy.dp, tp_policy.tp) == (1, 2)
    _assert_matches_plain_model(tp_policy, tiny_model_path, make_batch(), make_batch())


def test_shared_prompt_rows_in_blockwise_attention_on_the_local_heads(tp_policy, tiny_model_path):
    # Completions of one 440-token prompt, packed over one copy of it in each micro-batch of 3
    # (logprob_batch_size): rows long enough for blockwise attention, which then runs per block
    # on each rank's two heads.
    from posttrain.data.packing import share_prefixes
    from posttrain.policy.fsdp_worker import _attention_score_cost

    g = torch.Generator().manual_seed(8)
    prompt = torch.randint(8, 60, (440,), generator=g)
    ids = torch.stack([torch.cat([prompt, torch.randint(8, 60, (30,), generator=g)]) for _ in range(4)])
    lengths, mask = torch.full((4,), 470), torch.zeros(4, 470)
    mask[:, 440:] = 1.0
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    layout = share_prefixes(ids[:3], lengths[:3], torch.full((3,), 440), 0, 2048,
                            score_cost=_attention_score_cost(plain.config), blockwise=True)
    assert layout is not None and layout.blockwise  # the path the workers take for the first micro-batch
    batch = type(make_batch())(input_ids=ids, input_lengths=lengths, token_mask=mask, sample_mask=torch.ones(4))
    plain.load_state_dict(full_state(tp_policy))
    torch.testing.assert_close(tp_policy.get_logprobs(batch)["logprobs"], reference_logprobs(plain.eval(), batch),
                               atol=5e-5, rtol=0)


def test_checkpoint_restores_the_sharded_weights(tp_policy, tmp_path):
    tp_policy.save_checkpoint(tmp_path / "ckpt")
    saved = full_state(tp_policy)
    tp_policy.train(make_batch(seed=3), NLLLoss())
    assert any(not torch.equal(v, saved[k]) for k, v in full_state(tp_policy).items())
    tp_policy.load_checkpoint(tmp_path / "ckpt")
    for k, v in full_state(tp_policy).items():
        assert torch.equal(v, saved[k]), k


def test_colocated_generation_agrees_with_the_trained_policy(tp_policy):
    # Each rank generates on the full weights gathered from the shards; its logprobs are the
    # policy's own after training (the refit followed the update).
    tp_policy.train(make_batch(seed=6), NLLLoss())
    prompts = make_batch(lengths=[5, 3, 4, 5], seq=5, seed=5)
    out = tp_policy.generate(type(prompts)(input_ids=prompts["input_ids"], input_lengths=prompts["input_lengths"]))
    n, lengths = out["output_ids"].shape[0], out["generation_lengths"]
    assert n == 4 and (lengths > 0).all()
    total = prompts["input_lengths"] + lengths
    mask = (torch.arange(out["output_ids"].shape[1])[None] >= prompts["input_lengths"][:, None]) & \
        (torch.arange(out["output_ids"].shape[1])[None] < total[:, None])
    batch = type(prompts)(input_ids=out["output_ids"], input_lengths=total, token_mask=mask.float(),
                          sample_mask=torch.ones(n))
    policy_lp = tp_policy.get_logprobs(batch)["logprobs"]
    err = torch.exp((out["logprobs"] - policy_lp).abs())[mask].mean().item()
    assert math.isfinite(err) and err < 1.01


def test_sizes_that_do_not_split_fail_before_any_worker_starts():
    with pytest.raises(InputError, match=r"tensor_parallel_size=4 must divide the model's num_key_value_heads=2"):
        load_model_configs(_cfg(dtensor_cfg={"tensor_parallel_size": 4}), with_reference=False)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=2 does not divide the 3 policy workers"):
        Policy(SimpleNamespace(world_size=3), _cfg())
    with pytest.raises(ValueError, match=r"tensor_parallel_size > 1 does not combine with policy.lora.enabled"):
        _cfg(lora={"enabled": True})
