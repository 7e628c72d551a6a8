"""Separate placement: GenerationWorkerGroup (Ray actors) generates like the in-process engine,
is refit through Ray's object store by version, and refuses to mix versions."""

from __future__ import annotations

import copy

import pytest
import torch
from test_generation_helpers import (
    forward_logprobs,
    generated_mask,
    make_batch,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    perturb_,
    perturbed_tiny,
    token_mult_prob_error,
)

from posttrain.distributed.weight_sync import put_state_dict
from posttrain.generation import build_generation
from posttrain.schemas import ClusterConfig, GenerationConfig

CTX = 128


@pytest.fixture(scope="module")
def setup(ray_session, tiny_model_path, tmp_path_factory):
    from posttrain.distributed.cluster import RayVirtualCluster
    from posttrain.generation.workers import GenerationWorkerGroup

    model, tok = perturbed_tiny(tiny_model_path)
    # The weights alone, the tokenizer in a folder of its own (policy.tokenizer.name): the workers
    # must take it from there, as the policy does.
    path, tok_path = tmp_path_factory.mktemp("gen_model"), tmp_path_factory.mktemp("gen_tokenizer")
    model.save_pretrained(path)
    tok.save_pretrained(tok_path)
    cfg = GenerationConfig(max_new_tokens=16)
    cluster = RayVirtualCluster(ClusterConfig(workers_per_node=2, cpus_per_worker=1), name="gen-test")
    group = GenerationWorkerGroup(cluster, backend="torch", model_path=str(path), cfg=cfg,
                                  max_total_sequence_length=CTX, tokenizer_path=str(tok_path))
    yield model, tok, cfg, group
    group.shutdown()
    cluster.shutdown()


def test_sharded_generation_equals_in_process(setup):
    model, tok, cfg, group = setup
    batch = make_batch(tok)  # 6 rows over 2 workers; 7 rows would split 4 + 3
    local = build_generation("torch", model=model, tokenizer=tok, cfg=cfg, max_total_sequence_length=CTX)
    for b in (batch, make_batch(tok, ["odd one out"] + ["hello"] * 6)):
        out = group.generate(b, greedy=True)
        ref = local.generate(b, greedy=True)
        assert out["output_ids"].tolist() == ref["output_ids"].tolist()
        torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=1e-5, rtol=0)


def test_refit_by_version_through_object_store(setup):
    model, tok, cfg, group = setup
    batch = make_batch(tok, repeat=2)
    before = group.generate(batch)
    assert token_mult_prob_error(batch, before, forward_logprobs(model, before)) < 1.01

    trained = copy.deepcopy(model)
    perturb_(trained, std=0.3, seed=11)
    stats = group.update_weights(put_state_dict(trained), version=1)
    assert group.version == 1 and stats["refit_s"] > 0 and 0 < stats["refit_load_s"] <= stats["refit_s"]
    after = group.generate(batch)
    m = generated_mask(batch, before)
    assert float((forward_logprobs(trained, before) - before["logprobs"]).abs()[m].mean()) > 0.1
    assert token_mult_prob_error(batch, after, forward_logprobs(trained, after)) < 1.01

    # A plain state dict works too (the group puts it in the object store once).
    group.update_weights(model.state_dict(), version=2)
    again = group.generate(batch, greedy=True)
    assert token_mult_prob_error(batch, again, forward_logprobs(model, again)) < 1.01


def test_mixed_versions_fail_loudly(setup):
    model, tok, cfg, group = setup
    # Refit only worker 0, as if the update of worker 1 had been lost.
    group.workers.get([group.workers.actors[0].call.remote("update_weights", model.state_dict(), 99)])
    from posttrain.generation.workers import WeightVersionError

    with pytest.raises(WeightVersionError, match="holds weights version 99"):
        group.generate(make_batch(tok))
    group.update_weights(model.state_dict(), version=100)  # every worker agrees again
    assert group.generate(make_batch(tok), greedy=True)["output_ids"].shape[0] == 6


def test_a_float32_engine_of_a_bfloat16_policy_generates_with_the_float32_weights(setup, tiny_model_path):
    # The worker loaded its copy in policy.precision: each refit's float32 weights were rounded
    # to bfloat16 before the float32 engine widened them back (token_mult_prob_error 1.02).
    from posttrain.generation.workers import GenerationWorker

    model, tok, _, _ = setup
    cfg = GenerationConfig(max_new_tokens=16, torch_cfg={"precision": "float32"})
    worker = GenerationWorker("torch", tiny_model_path, tiny_model_path, cfg, CTX, "bfloat16", "cpu", "auto")
    worker.update_weights(model.state_dict(), version=1)
    batch = make_batch(tok, repeat=2)
    out = worker.generate(batch, greedy=False, expected_version=1)
    assert token_mult_prob_error(batch, out, forward_logprobs(model, out)) < 1.001
