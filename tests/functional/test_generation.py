"""The torch and hf generation backends on a tiny model: equality with HF greedy, logprob
agreement with a plain forward, refit, seeding, continuous batching and bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from test_generation_helpers import (
    PROMPTS,
    forward_logprobs,
    generated_mask,
    make_batch,
    one_torch_thread,  # noqa: F401  (autouse fixture)
    perturb_,
    perturbed_tiny,
    token_mult_prob_error,
)

from posttrain.config import ConfigError, InputError
from posttrain.data.batch import BatchedDataDict
from posttrain.generation import build_generation
from posttrain.policy.hf_io import DTYPES
from posttrain.schemas import GenerationConfig

CTX = 128


@pytest.fixture(scope="module")
def model_tok(tiny_model_path):
    return perturbed_tiny(tiny_model_path)


def engine(backend, model, tok, **cfg_kw):
    torch_cfg = cfg_kw.pop("torch_cfg", {})
    cfg = GenerationConfig(**cfg_kw)
    for k, v in torch_cfg.items():
        setattr(cfg.torch_cfg, k, v)
    precision = "bfloat16" if next(model.parameters()).dtype == torch.bfloat16 else "float32"
    return build_generation(backend, model=model, tokenizer=tok, cfg=cfg, max_total_sequence_length=CTX,
                            precision=precision)


def test_unknown_backend_lists_valid(model_tok):
    model, tok = model_tok
    with pytest.raises(ValueError, match="valid: torch, hf, vllm"):
        build_generation("tensorrt", model=model, tokenizer=tok, cfg=GenerationConfig(), max_total_sequence_length=CTX)


def test_greedy_torch_equals_hf_with_stop_strings(model_tok):
    model, tok = model_tok
    batch = make_batch(tok)
    free = engine("hf", model, tok, max_new_tokens=24).generate(batch, greedy=True)
    # A stop string that row 0 produces mid-way (per-row), and a global one never produced.
    a = int(batch["input_lengths"][0])
    row0 = tok.decode(free["output_ids"][0, a + 6 : a + 8])
    batch["stop_strings"] = [[row0]] + [None] * (batch.size - 1)
    kw = dict(max_new_tokens=24, stop_strings=["@@never@@"])
    ref = engine("hf", model, tok, **kw).generate(batch, greedy=True)
    out = engine("torch", model, tok, **kw).generate(batch, greedy=True)
    assert out["output_ids"].tolist() == ref["output_ids"].tolist()
    assert out["generation_lengths"].tolist() == ref["generation_lengths"].tolist()
    assert out["truncated"].tolist() == ref["truncated"].tolist()
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=1e-4, rtol=0)
    # Row 0 stopped on its stop string, which stays in the output (at most 8 tokens: 6 + 2).
    g0 = int(out["generation_lengths"][0])
    assert g0 <= 8 and not out["truncated"][0]
    assert tok.decode(out["output_ids"][0, a : a + g0]).endswith(row0)
    # The mix has both EOS-stopped and length-truncated rows, so both paths are compared.
    assert bool(out["truncated"].any())


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_stop_string_completed_by_the_last_allowed_token_is_a_stop(model_tok, backend):
    """A row whose stop string ends exactly at max_new_tokens stopped: it is not truncated."""
    model, tok = model_tok
    batch = make_batch(tok)
    free = engine("hf", model, tok, max_new_tokens=8, ignore_eos=True).generate(batch, greedy=True)
    a = int(batch["input_lengths"][0])
    gen0 = free["output_ids"][0, a : a + 8]
    stop = tok.decode(gen0[6:8])
    assert stop not in tok.decode(gen0[:7])  # completed by the 8th token, not before
    batch["stop_strings"] = [[stop]] + [None] * (batch.size - 1)
    out = engine(backend, model, tok, max_new_tokens=8, ignore_eos=True).generate(batch, greedy=True)
    assert out["generation_lengths"].tolist() == [8] * batch.size
    assert out["truncated"].tolist() == [False] + [True] * (batch.size - 1)


def _stories_greedy(stories260k, backend: str, text: str, **gen_cfg):
    """stories260K's greedy continuation of `text` by `backend`: (tokenizer, generated ids, output batch)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(stories260k).eval()
    tok = AutoTokenizer.from_pretrained(stories260k)
    prompt = [tok.bos_token_id] + tok.encode(text, add_special_tokens=False)
    batch = BatchedDataDict(input_ids=torch.tensor([prompt]), input_lengths=torch.tensor([len(prompt)]))
    out = engine(backend, model, tok, **gen_cfg).generate(batch, greedy=True)
    return tok, out["output_ids"][0, len(prompt) : int(out["unpadded_sequence_lengths"][0])].tolist(), out


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_stop_string_ending_in_a_space_with_a_sentencepiece_tokenizer(stories260k, backend):
    """stories260K's sentencepiece tokens carry their leading space ("\u2581a"), which they lose
    when decoded alone: the stop string "was " is completed by the token after "was"."""
    tok, gen, out = _stories_greedy(stories260k, backend, "Once upon a", max_new_tokens=20, stop_strings=["was "])
    assert tok.decode(gen) == "time, there was a"  # the documented story, cut after "was "
    assert out["truncated"].tolist() == [False]


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_stop_string_beginning_with_a_space_at_the_first_generated_token(stories260k, backend):
    """The generated text reads as it follows the prompt: "\u2581a" as the first generated token is
    " a" (decoded alone, "a"), so " a little" ends the row there as it would anywhere later (it
    was never matched, and the row ran to max_new_tokens)."""
    tok, gen, out = _stories_greedy(stories260k, backend, "Once upon a time, there was", max_new_tokens=8,
                                    stop_strings=[" a little"])
    assert tok.convert_ids_to_tokens(gen) == ["\u2581a", "\u2581little"]
    assert out["truncated"].tolist() == [False]


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_stop_string_begun_in_the_prompt_is_not_matched(model_tok, backend):
    """Only generated text is searched: a stop string whose first token ends the prompt does not
    end the row at the next token."""
    model, tok = model_tok
    batch = make_batch(tok)
    free = engine("hf", model, tok, max_new_tokens=8, ignore_eos=True).generate(batch, greedy=True)
    a = int(batch["input_lengths"][0])
    prompt = free["output_ids"][0, : a + 6]  # row 0's prompt and its first 6 greedy tokens
    stop = tok.decode(free["output_ids"][0, a + 5 : a + 7])  # spans the new prompt's end
    assert stop not in tok.decode(free["output_ids"][0, a + 6 : a + 8])
    longer = BatchedDataDict(input_ids=prompt[None], input_lengths=torch.tensor([a + 6]))
    out = engine(backend, model, tok, max_new_tokens=2, ignore_eos=True, stop_strings=[stop]).generate(
        longer, greedy=True)
    assert out["output_ids"][0].tolist() == free["output_ids"][0, : a + 8].tolist()
    assert out["truncated"].tolist() == [True]


def test_continuous_batching_equals_one_batch(model_tok):
    """2 slots for 12 rows: slots are refilled and the cache compacted; greedy results are unchanged."""
    model, tok = model_tok
    batch = make_batch(tok, repeat=2)
    batch["stop_strings"] = [["e"] if i % 3 == 0 else None for i in range(batch.size)]
    full = engine("torch", model, tok, max_new_tokens=20).generate(batch, greedy=True)
    small = engine("torch", model, tok, max_new_tokens=20, torch_cfg={"max_batch_size": 2}).generate(batch, greedy=True)
    assert small["output_ids"].tolist() == full["output_ids"].tolist()
    torch.testing.assert_close(small["logprobs"], full["logprobs"], atol=1e-4, rtol=0)
    budget = engine("torch", model, tok, max_new_tokens=20, torch_cfg={"max_tokens_in_flight": 80})
    assert budget.generate(batch, greedy=True)["output_ids"].tolist() == full["output_ids"].tolist()


def test_identical_prompts_are_prefilled_once(model_tok, monkeypatch):
    """The n samples of a GRPO prompt: one prefill per distinct prompt, the KV cache copied to the
    other slots; greedy rows equal the single prompt's, sampled rows are drawn independently."""
    import posttrain.generation.torch_engine as te

    model, tok = model_tok
    prefilled = []
    real_prefill = te.prefill
    monkeypatch.setattr(te, "prefill", lambda w, cache, tokens, *a: prefilled.append(len(tokens))
                        or real_prefill(w, cache, tokens, *a))
    once = make_batch(tok)
    single = engine("torch", model, tok, max_new_tokens=12).generate(once, greedy=True)
    prefilled.clear()
    repeated = engine("torch", model, tok, max_new_tokens=12).generate(make_batch(tok, repeat=3), greedy=True)
    assert sum(prefilled) == once.size
    assert repeated["output_ids"].tolist() == single["output_ids"].tolist() * 3
    sampled = engine("torch", model, tok, max_new_tokens=12, temperature=1.0).generate(make_batch(tok, repeat=3))
    n = once.size
    rows = sampled["output_ids"].tolist()
    assert any(rows[i] != rows[i + n] for i in range(n))


def test_cache_grows_in_place_and_output_equals_hf(model_tok, monkeypatch):
    """The KV cache starts just past the longest prompt and grows (rows re-laid out in place)
    as sequences lengthen; outputs and logprobs stay those of HF greedy."""
    import posttrain.generation.torch_engine as te

    model, tok = model_tok
    lengths = []
    real_decode = te.decode
    monkeypatch.setattr(te, "decode", lambda w, cache, *a: lengths.append(cache.length) or real_decode(w, cache, *a))
    batch = make_batch(tok, repeat=2)
    kw = dict(max_new_tokens=60, ignore_eos=True)
    ref = engine("hf", model, tok, **kw).generate(batch, greedy=True)
    out = engine("torch", model, tok, torch_cfg={"max_batch_size": 5}, **kw).generate(batch, greedy=True)
    assert out["output_ids"].tolist() == ref["output_ids"].tolist()
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=1e-4, rtol=0)
    longest = int(batch["input_lengths"].max())
    assert lengths[0] < longest + 60 and len(set(lengths)) >= 3
    assert lengths == sorted(lengths) and max(lengths) <= longest + 60


@pytest.mark.parametrize("rows,old,new", [(2048, 80 * 64, 100 * 64), (7, 3, 4), (1, 5, 9), (100, 10, 11), (5, 4, 40)])
def test_spread_rows_moves_every_row_in_place(rows, old, new):
    from posttrain.generation.torch_engine import _spread_rows

    flat = torch.arange(rows * new, dtype=torch.float32)
    before = flat[: rows * old].clone().view(rows, old)
    _spread_rows(flat, rows, old, new)
    assert torch.equal(flat.view(rows, new)[:, :old], before)


def test_token_budget_smaller_than_a_sequence_fails(model_tok):
    model, tok = model_tok
    e = engine("torch", model, tok, max_new_tokens=20, torch_cfg={"max_tokens_in_flight": 10})
    # A config error, which the CLI prints without a traceback (it printed one).
    with pytest.raises(ConfigError, match="max_tokens_in_flight=10"):
        e.generate(make_batch(tok))


@pytest.mark.parametrize("dtype,bound", [(torch.float32, 1.01), (torch.bfloat16, 1.05)])
def test_sampled_logprobs_match_forward(tiny_model_path, dtype, bound):
    model, tok = perturbed_tiny(tiny_model_path, dtype=dtype)
    batch = make_batch(tok, repeat=4)
    out = engine("torch", model, tok, max_new_tokens=32, temperature=1.0).generate(batch)
    train = forward_logprobs(model, out)
    err = token_mult_prob_error(batch, out, train)
    assert 1.0 <= err < bound
    assert int(generated_mask(batch, out).sum()) > 100
    # Logprobs sit exactly on the generated tokens (token-aligned, 0 on the prompt and padding).
    assert bool((out["logprobs"][~generated_mask(batch, out)] == 0).all())
    assert bool((out["logprobs"][generated_mask(batch, out)] < 0).all())


def test_hf_backend_in_bf16_computes_as_the_policys_bf16_forward(tiny_model_path):
    # The policy hands the hf backend its float32 model; the backend computes in bfloat16 on a
    # copy whose parameters alone it casts, as the policy's own low-precision forward does. A
    # Module.to() cast rounded the rotary frequencies too, an error growing with the position
    # (mean exp|diff| to the policy's logprobs 1.022 on stories260K, past GRPO's 1.005 check).
    from posttrain.policy.hf_io import cast_parameters

    model, tok = perturbed_tiny(tiny_model_path)
    model.config._attn_implementation = "eager"
    e = build_generation("hf", model=model, tokenizer=tok, cfg=GenerationConfig(max_new_tokens=100),
                         max_total_sequence_length=CTX, precision="bfloat16")
    assert next(e.model.parameters()).dtype == torch.bfloat16
    assert next(model.parameters()).dtype == torch.float32  # the caller's model is not cast
    assert e.model.model.rotary_emb.inv_freq.dtype == torch.float32
    batch = make_batch(tok, repeat=2)
    out = e.generate(batch)
    policy_bf16 = copy.deepcopy(model)
    cast_parameters(policy_bf16, torch.bfloat16)
    assert int(generated_mask(batch, out).sum()) > 300
    assert token_mult_prob_error(batch, out, forward_logprobs(policy_bf16, out)) < 1.004


@pytest.mark.parametrize("kv_heads", [None, 4], ids=["grouped", "one_kv_head_per_head"])
def test_bf16_logprobs_are_the_eager_forwards_own(tiny_model_path, kv_heads):
    # Against a model with transformers' eager attention (the policy's on a CPU), the engine rounds
    # as its forward does: rotary in the dtype (each product, then the sum), scores rounded before
    # the scale, an eager prefill. Rotating in float32, SDPA's prefill and a fused baddbmm put these
    # bf16 logprobs off the forward's (mean exp|diff| 1.045, 99% of the tokens differing; 1.0098 on
    # the quickstart's warm start, where GRPO's prev_logprobs_from_generation check then recomputed
    # them at every step). What differs now is the matmul kernels' float32 summation order at other
    # shapes, which flips a bf16 rounding now and then in decoding. With one kv head per query head
    # (tiny has 2 of 4) the engine's decode scores take the keys-times-query product instead.
    model, tok = perturbed_tiny(tiny_model_path)
    if kv_heads:
        model = mha_twin(model, kv_heads)
    model.config._attn_implementation = "eager"
    model = model.to(torch.bfloat16)
    batch = make_batch(tok, repeat=4)
    out = engine("torch", model, tok, max_new_tokens=32, temperature=1.0).generate(batch)
    m = generated_mask(batch, out)
    forward = forward_logprobs(model, out)
    diff = (out["logprobs"] - forward)[m]
    assert int(m.sum()) > 100
    first = out["unpadded_sequence_lengths"] - out["generation_lengths"]
    rows = torch.arange(batch.size)
    assert torch.equal(out["logprobs"][rows, first], forward[rows, first])  # prefill: to the bit
    assert float((diff == 0).float().mean()) > 0.98
    assert float(torch.exp(diff.abs()).mean()) < 1.001


def mha_twin(model, heads: int):
    """`model`'s architecture with `heads` kv heads (one per query head), its weights redrawn as
    perturbed_tiny draws them."""
    from transformers import LlamaForCausalLM

    config = copy.deepcopy(model.config)
    config.num_key_value_heads = heads
    torch.manual_seed(0)
    twin = LlamaForCausalLM(config)
    perturb_(twin, std=0.3, seed=1)
    return twin.eval()


def _next_token_logits(model, out) -> torch.Tensor:
    """Float32 logits `[B, S' - 1, V]` of one forward over `out`'s sequences: position t scores token t + 1."""
    ids = out["output_ids"]
    mask = (torch.arange(ids.shape[1])[None] < out["unpadded_sequence_lengths"][:, None]).long()
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()


def _at_tokens(out, lp: torch.Tensor) -> torch.Tensor:
    """`lp [B, S' - 1, V]` at `out`'s tokens, aligned as `out["logprobs"]` (position 0: 0)."""
    ids = out["output_ids"]
    return torch.cat([torch.zeros(ids.shape[0], 1), lp.gather(-1, ids[:, 1:, None]).squeeze(-1)], dim=1)


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_logprobs_are_of_the_sampling_distribution(model_tok, backend):
    """temperature 0.7, min_p 0.02, top_k 5, top_p 0.8, in vLLM's order (min-p, top-k, then top-p
    over what is left): logprobs are log_softmax(logits / T) renormalised over the kept tokens, and
    only those are sampled, by both backends (transformers' own warpers apply min-p last)."""
    model, tok = model_tok
    batch = make_batch(tok)
    out = engine(backend, model, tok, max_new_tokens=16, temperature=0.7, top_k=5, top_p=0.8, min_p=0.02,
                 seed=5).generate(batch)
    logits = _next_token_logits(model, out) / 0.7
    probs = torch.softmax(logits, dim=-1)
    logits = logits.masked_fill(probs < 0.02 * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    logits = logits.masked_fill(logits < logits.topk(5, dim=-1).values[..., -1:], float("-inf"))
    sorted_p, order = torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
    cut = torch.zeros_like(sorted_p, dtype=torch.bool).scatter(-1, order, sorted_p.cumsum(-1) - sorted_p >= 0.8)
    lp = torch.log_softmax(logits.masked_fill(cut, float("-inf")), dim=-1)
    expected = _at_tokens(out, lp)
    m = generated_mask(batch, out)
    assert bool(torch.isfinite(expected[m]).all()), "a token outside the kept set was sampled"
    kept = torch.isfinite(lp).sum(-1).float()
    assert 1 < float(kept.mean()) < 5  # every rule cut something: top-p within the top 5
    torch.testing.assert_close(out["logprobs"][m], expected[m], atol=1e-4, rtol=0)


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_min_p_samples_and_reports_the_min_p_distribution(model_tok, backend):
    """temperature 0.7 + min_p 0.2: only tokens at least 0.2 times as likely as the most likely one are
    sampled, and their logprobs are renormalised over those."""
    model, tok = model_tok
    batch = make_batch(tok)
    out = engine(backend, model, tok, max_new_tokens=16, temperature=0.7, min_p=0.2, seed=3).generate(batch)
    logits = _next_token_logits(model, out) / 0.7
    probs = torch.softmax(logits, dim=-1)
    kept = probs >= 0.2 * probs.max(dim=-1, keepdim=True).values
    expected = _at_tokens(out, torch.log_softmax(logits.masked_fill(~kept, float("-inf")), dim=-1))
    m = generated_mask(batch, out)
    assert bool(torch.isfinite(expected[m]).all()), "a token below min_p was sampled"
    assert float(kept.sum(-1).float().mean()) < probs.shape[-1] / 2  # min_p cut most of the vocabulary
    torch.testing.assert_close(out["logprobs"][m], expected[m], atol=1e-4, rtol=0)


def _assert_penalised_logprobs(model, batch, out, penalty: float, temperature: float) -> None:
    """`out`'s logprobs are of the forward's logits with the tokens before each position (prompt
    and response so far) penalised, then divided by the temperature; the penalty changed them."""
    logits = _next_token_logits(model, out)
    seen = torch.nn.functional.one_hot(out["output_ids"], logits.shape[-1]).cumsum(1)[:, :-1] > 0  # tokens before t + 1
    penalised = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    expected = _at_tokens(out, torch.log_softmax(penalised / temperature, dim=-1))
    m = generated_mask(batch, out)
    torch.testing.assert_close(out["logprobs"][m], expected[m], atol=1e-4, rtol=0)
    unpenalised = _at_tokens(out, torch.log_softmax(logits / temperature, dim=-1))
    assert float((expected - unpenalised).abs()[m].max()) > 0.1


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_repetition_penalty_samples_and_reports_the_penalised_distribution(model_tok, backend):
    """repetition_penalty 1.8, temperature 0.7: the logits of the tokens already in the sequence
    (prompt and the response so far) are divided by 1.8 where positive and multiplied where negative
    before the temperature, and the logprobs are of that distribution; several rows of one prompt
    (the torch engine prefills it once and copies the slot) each penalise their own response."""
    model, tok = model_tok
    batch = make_batch(tok, repeat=2)
    out = engine(backend, model, tok, max_new_tokens=16, temperature=0.7, repetition_penalty=1.8,
                 ignore_eos=True, seed=3).generate(batch)
    _assert_penalised_logprobs(model, batch, out, 1.8, 0.7)
    if backend == "torch":
        # Three slots for the rows, ending at their own EOS: slots refilled with new prompts and
        # compacted keep each row's own seen tokens.
        small = engine("torch", model, tok, max_new_tokens=16, temperature=0.7, repetition_penalty=1.8, seed=4,
                       torch_cfg={"max_batch_size": 3}).generate(batch)
        assert len(set(small["generation_lengths"].tolist())) > 1
        _assert_penalised_logprobs(model, batch, small, 1.8, 0.7)
    # Greedy with the penalty: both backends pick the same tokens (one rule, sampling_logprobs).
    greedy = {b: engine(b, model, tok, max_new_tokens=16, repetition_penalty=1.8, ignore_eos=True).generate(
        batch, greedy=True)["output_ids"] for b in ("torch", "hf")}
    assert torch.equal(greedy["torch"], greedy["hf"])


def test_refit_in_process(tiny_model_path):
    """After update_weights the engine uses the new weights (no rebuild): logprobs change and agree again."""
    model, tok = perturbed_tiny(tiny_model_path)
    e = engine("torch", model, tok, max_new_tokens=16)
    batch = make_batch(tok)
    before = e.generate(batch, greedy=True)
    assert token_mult_prob_error(batch, before, forward_logprobs(model, before)) < 1.01

    trained = copy.deepcopy(model)
    perturb_(trained, std=0.3, seed=2)
    seconds = e.update_weights(trained.state_dict(), version=7)
    assert e.weight_version == 7 and seconds >= 0
    assert e.model is model  # copied into the existing model, not rebuilt
    after = e.generate(batch, greedy=True)
    replay = forward_logprobs(trained, before)  # the old sequences under the new weights
    m = generated_mask(batch, before)
    assert float((replay - before["logprobs"]).abs()[m].mean()) > 0.1
    assert token_mult_prob_error(batch, after, forward_logprobs(trained, after)) < 1.01
    assert after["output_ids"].tolist() == engine("torch", trained, tok, max_new_tokens=16).generate(
        batch, greedy=True)["output_ids"].tolist()


@pytest.mark.parametrize("backend,precision", [("torch", "float32"), ("hf", "float32"), ("hf", "bfloat16")])
def test_prepare_for_generation_follows_in_place_training(tiny_model_path, backend, precision):
    """Colocated use: the policy trains the model in place; prepare_for_generation re-reads it
    (the hf backend in another precision than the model's: into the cast copy it generates with,
    which kept the old weights)."""
    from posttrain.policy.hf_io import cast_parameters

    model, tok = perturbed_tiny(tiny_model_path)
    model.config._attn_implementation = "eager"
    e = build_generation(backend, model=model, tokenizer=tok, cfg=GenerationConfig(max_new_tokens=12),
                         max_total_sequence_length=CTX, precision=precision)
    batch = make_batch(tok)
    perturb_(model, std=0.3, seed=3)
    e.prepare_for_generation()
    out = e.generate(batch, greedy=True)
    trained = copy.deepcopy(model)
    cast_parameters(trained, DTYPES[precision])
    assert token_mult_prob_error(batch, out, forward_logprobs(trained, out)) < 1.01


def test_seeded_and_reproducible(model_tok):
    model, tok = model_tok
    batch = make_batch(tok, repeat=2)
    a = engine("torch", model, tok, max_new_tokens=16, seed=5).generate(batch)
    b = engine("torch", model, tok, max_new_tokens=16, seed=5).generate(batch)
    c = engine("torch", model, tok, max_new_tokens=16, seed=6).generate(batch)
    assert a["output_ids"].tolist() == b["output_ids"].tolist()
    assert a["output_ids"].tolist() != c["output_ids"].tolist()


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_sampling_after_a_refit_depends_on_the_weights_version_alone(model_tok, backend):
    # A resumed run's engine starts at the checkpoint's version: it must sample what the engine
    # of the run it continues sampled there, whatever that engine had generated before.
    model, tok = model_tok
    batch = make_batch(tok, repeat=2)
    weights = model.state_dict()
    ran = engine(backend, model, tok, max_new_tokens=16, seed=5)
    ran.generate(batch)
    ran.update_weights(weights, version=3)
    fresh = engine(backend, model, tok, max_new_tokens=16, seed=5)
    fresh.update_weights(weights, version=3)
    assert ran.generate(batch)["output_ids"].tolist() == fresh.generate(batch)["output_ids"].tolist()
    other = engine(backend, model, tok, max_new_tokens=16, seed=5)
    other.update_weights(weights, version=4)
    assert other.generate(batch)["output_ids"].tolist() != fresh.generate(batch)["output_ids"].tolist()


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_engines_of_neighbouring_seeds_sample_apart(model_tok, backend):
    """Worker ranks r and r + 1 (seeds s + r): the hf backend seeded each call with seed + calls
    made, so rank 1's first call sampled what rank 0's second did (a batch sharded over two
    workers after rank 0 alone took a smaller one repeated its samples)."""
    model, tok = model_tok
    batch = make_batch(tok, repeat=2)
    rank0 = engine(backend, model, tok, max_new_tokens=16, seed=0)
    rank0.generate(batch)
    rank1 = engine(backend, model, tok, max_new_tokens=16, seed=1)
    assert rank0.generate(batch)["output_ids"].tolist() != rank1.generate(batch)["output_ids"].tolist()


def test_hf_backend_ignores_logits_processors_of_the_generation_config(model_tok):
    """A checkpoint's generation_config.json may ask for a repetition penalty and more: the hf
    backend still samples the documented distribution (its greedy output is the torch engine's)."""
    model, tok = model_tok
    model = copy.deepcopy(model)
    extras = dict(repetition_penalty=3.0, min_new_tokens=5, no_repeat_ngram_size=1)
    for k, v in extras.items():
        setattr(model.generation_config, k, v)
    batch = make_batch(tok)
    out = engine("hf", model, tok, max_new_tokens=16).generate(batch, greedy=True)
    ref = engine("torch", model, tok, max_new_tokens=16).generate(batch, greedy=True)
    assert out["output_ids"].tolist() == ref["output_ids"].tolist()
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=1e-4, rtol=0)
    assert {k: getattr(model.generation_config, k) for k in extras} == extras  # the model's own is kept


def test_hf_backend_sampling_is_seeded_and_matches_forward(model_tok):
    model, tok = model_tok
    batch = make_batch(tok)
    a = engine("hf", model, tok, max_new_tokens=16, seed=3).generate(batch)
    b = engine("hf", model, tok, max_new_tokens=16, seed=3).generate(batch)
    assert a["output_ids"].tolist() == b["output_ids"].tolist()
    assert token_mult_prob_error(batch, a, forward_logprobs(model, a)) < 1.01


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_empty_prompt_is_an_error(model_tok, backend):
    model, tok = model_tok
    batch = make_batch(tok)
    batch["input_lengths"][2] = 0
    with pytest.raises(ValueError, match=r"empty prompt .* row\(s\) \[2\]"):
        engine(backend, model, tok).generate(batch)
    with pytest.raises(ValueError, match=r"no prompts \(0 rows\)"):
        engine(backend, model, tok).generate(BatchedDataDict(input_ids=torch.zeros(0, 3, dtype=torch.long),
                                                             input_lengths=torch.zeros(0, dtype=torch.long)))


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_a_rows_stop_strings_that_are_not_a_list_of_strings_are_an_error(model_tok, backend):
    # A bare string (an environment's next_stop_strings entry "</answer>") made each of its
    # characters a stop string: the row ended at the first "<", "/", "a", ... it generated.
    model, tok = model_tok
    batch = make_batch(tok)
    batch["stop_strings"] = [None, "</answer>"] + [None] * (batch.size - 2)
    with pytest.raises(ValueError, match=r"stop strings of row 1 must be a list of strings .* got '</answer>'"):
        engine(backend, model, tok).generate(batch)
    batch["stop_strings"] = [None, ["</answer>", 7]] + [None] * (batch.size - 2)
    with pytest.raises(ValueError, match="stop strings of row 1 must be a list of strings"):
        engine(backend, model, tok).generate(batch)
    # One list per row: a short list was an IndexError, a long one was cut without a word.
    size = batch.size
    for n in (1, size + 1):
        batch["stop_strings"] = [["."]] * n
        with pytest.raises(ValueError, match=rf"stop_strings holds {n} lists for its {size} rows"):
            engine(backend, model, tok).generate(batch)


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_overlong_prompt_error_and_truncate(model_tok, backend):
    model, tok = model_tok
    # Distinct neighbours, so that the kept tokens show which end was cut.
    long = ("abcdefghijklmnopqrstuvwxyz" * 6)[: CTX + 5]
    batch = make_batch(tok, PROMPTS[:2] + [long])
    with pytest.raises(InputError, match="prompt at row 2 has 133 tokens"):
        engine(backend, model, tok, max_new_tokens=8).generate(batch)
    e = engine(backend, model, tok, max_new_tokens=8, overlong_prompt="truncate")
    out = e.generate(batch, greedy=True)
    assert out["prompt_truncated"].tolist() == [False, False, True]
    kept = int(out["unpadded_sequence_lengths"][2] - out["generation_lengths"][2])
    assert kept == CTX - 8
    assert int(out["unpadded_sequence_lengths"][2]) <= CTX
    assert tok.decode(out["output_ids"][2, :kept]) == long[-kept:]  # the left was cut
    for i in (0, 1):  # the rows that fit keep their whole prompt
        n = int(batch["input_lengths"][i])
        assert out["output_ids"][i, :n].tolist() == batch["input_ids"][i, :n].tolist()


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_stop_string_never_produced_runs_to_max_new_tokens(tiny_model_path, backend):
    # The unperturbed tiny model repeats the prompt's last character: "zz" never appears.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    tok = AutoTokenizer.from_pretrained(tiny_model_path)
    batch = make_batch(tok, ["aaa", "bb"])
    out = engine(backend, model, tok, max_new_tokens=10, stop_strings=["zz"]).generate(batch, greedy=True)
    assert out["generation_lengths"].tolist() == [10, 10]
    assert out["truncated"].tolist() == [True, True]


def test_context_caps_generation(model_tok):
    """A prompt close to the context generates only up to the context and is marked truncated."""
    model, tok = model_tok
    batch = make_batch(tok, ["y" * (CTX - 3)])
    out = engine("torch", model, tok, max_new_tokens=20, ignore_eos=True).generate(batch, greedy=True)
    assert out["generation_lengths"].tolist() == [3]
    assert out["truncated"].tolist() == [True]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_other_llama_family_models_match_hf(arch):
    """Biased QKV (Qwen2), per-head q/k norms (Qwen3), GQA with 4 query heads per kv head."""
    import transformers

    from posttrain.embedded import build_tokenizer

    tok = build_tokenizer()
    kinds = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
             "mistral": ("MistralConfig", "MistralForCausalLM")}
    config_cls, model_cls = (getattr(transformers, n) for n in kinds[arch])
    config = config_cls(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=8, num_key_value_heads=2, head_dim=16, max_position_embeddings=CTX,
                        sliding_window=None, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = model_cls(config).eval()
    perturb_(model, std=0.3, seed=4)
    if arch == "qwen2":  # biases start at 0: make them matter (and permuted with q/k rows)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    batch = make_batch(tok)
    ref = engine("hf", model, tok, max_new_tokens=12).generate(batch, greedy=True)
    out = engine("torch", model, tok, max_new_tokens=12).generate(batch, greedy=True)
    assert out["output_ids"].tolist() == ref["output_ids"].tolist()
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=1e-4, rtol=0)


def test_a_sliding_window_no_shorter_than_the_context_is_full_attention():
    """Mistral 7B v0.1 (window 4,096 of 32,768 positions) at a shorter context: the window never
    slides, so the torch engine runs it (it refused any window under max_position_embeddings)."""
    from transformers import MistralConfig, MistralForCausalLM

    from posttrain.embedded import build_tokenizer

    tok = build_tokenizer()
    config = MistralConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8 * CTX,
                           sliding_window=CTX, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    perturb_(model, std=0.3, seed=4)
    batch = make_batch(tok)
    ref = engine("hf", model, tok, max_new_tokens=12).generate(batch, greedy=True)
    out = engine("torch", model, tok, max_new_tokens=12).generate(batch, greedy=True)
    assert out["output_ids"].tolist() == ref["output_ids"].tolist()
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=1e-4, rtol=0)
    model.config.sliding_window = CTX - 1  # slides within the context
    with pytest.raises(ConfigError, match=f"window {CTX - 1}, shorter than the {CTX}-token context"):
        engine("torch", model, tok)


def config_llama(extra_vocab: int = 0):
    """A perturbed 2-layer GQA Llama built from its config, with the embedded tokenizer; its
    embedding has `extra_vocab` rows past the tokenizer's vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.embedded import build_tokenizer

    tok = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tok) + extra_vocab, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=CTX, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    perturb_(model, std=0.3, seed=4)
    return model, tok


def test_dynamic_rope_scaling_with_a_context_past_the_models_matches_hf():
    """Dynamic NTK scaling is off for a sequence within max_position_embeddings (32 here): the
    engine's rotary table, computed for the whole context (128), had it on at every position."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from posttrain.embedded import build_tokenizer

    tok = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         rope_scaling={"rope_type": "dynamic", "factor": 2.0}, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id)
    torch.manual_seed(0)
    model = LlamaForCausalLM(config).eval()
    perturb_(model, std=0.3, seed=4)
    batch = make_batch(tok)  # the longest prompt (19 tokens) + 12 stays within 32 positions
    ref = engine("hf", model, tok, max_new_tokens=12).generate(batch, greedy=True)
    out = engine("torch", model, tok, max_new_tokens=12).generate(batch, greedy=True)
    assert out["output_ids"].tolist() == ref["output_ids"].tolist()
    torch.testing.assert_close(out["logprobs"], ref["logprobs"], atol=1e-4, rtol=0)


def test_model_vocabulary_padded_past_the_tokenizer_with_stop_strings():
    """Embeddings padded to a round size (Qwen2.5: 151,936 rows for 151,665 tokens): a sampled id
    the tokenizer does not know is an ordinary token, also for the stop-string check."""
    model, tok = config_llama(extra_vocab=24)
    batch = make_batch(tok)
    out = engine("torch", model, tok, max_new_tokens=30, stop_strings=["zz"]).generate(batch)
    assert int((out["output_ids"] >= len(tok)).sum()) > 0  # such ids were sampled
    assert token_mult_prob_error(batch, out, forward_logprobs(model, out)) < 1.01


@pytest.mark.parametrize("backend", ["torch", "hf"])
def test_eos_ids_of_the_generation_config_end_a_row(backend):
    """A chat model's end-of-turn id listed only in generation_config.json (Llama 3 Instruct's
    <|eot_id|>) ends a row where HF `generate` ends it."""
    model, tok = config_llama()
    batch = make_batch(tok)
    a = int(batch["input_lengths"][0])
    free = engine(backend, model, tok, max_new_tokens=12).generate(batch, greedy=True)["output_ids"][0, a : a + 3]
    end_of_turn = int(free[2])  # row 0's third token
    assert end_of_turn not in free[:2].tolist() + [tok.eos_token_id]
    model.generation_config.eos_token_id = [tok.eos_token_id, end_of_turn]
    out = engine(backend, model, tok, max_new_tokens=12).generate(batch, greedy=True)
    assert int(out["generation_lengths"][0]) == 3 and not bool(out["truncated"][0])
    for i, n in enumerate(batch["input_lengths"].tolist()):
        ids = batch["input_ids"][i : i + 1, :n]
        ref = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=12)
        assert out["output_ids"][i, : int(out["unpadded_sequence_lengths"][i])].tolist() == ref[0].tolist()


def gpt2():
    """A GPT-2 (learned position embeddings for CTX positions) with the embedded tokenizer."""
    from transformers import GPT2Config, GPT2LMHeadModel

    from posttrain.embedded import build_tokenizer

    tok = build_tokenizer()
    return GPT2LMHeadModel(GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=2, n_positions=CTX)), tok


def test_unsupported_architecture_points_to_hf():
    model, tok = gpt2()
    with pytest.raises(ConfigError, match="backend=hf"):  # printed alone by the CLI
        engine("torch", model, tok)
    out = engine("hf", model, tok, max_new_tokens=4).generate(make_batch(tok), greedy=True)
    assert out["output_ids"].shape[0] == len(PROMPTS)


def test_hf_backend_keeps_a_prompt_near_the_context_within_the_position_embeddings():
    """A batch holding a prompt 4 tokens short of the context and a short one: generate ran both
    for the short one's 30 tokens, past GPT-2's last position embedding (IndexError)."""
    model, tok = gpt2()
    batch = make_batch(tok, ["y" * (CTX - 4), "ab"])
    out = engine("hf", model.eval(), tok, max_new_tokens=30, ignore_eos=True).generate(batch)
    assert out["generation_lengths"].tolist() == [4, 30]
    assert token_mult_prob_error(batch, out, forward_logprobs(model, out)) < 1.01


@pytest.mark.parametrize("greedy,torch_cfg", [(False, {}), (False, {"max_batch_size": 2}), (True, {})])
def test_a_non_finite_distribution_is_an_error_naming_its_batch_row(greedy, torch_cfg):
    # Token 50's embedding is NaN and only row 3 holds it. With 2 slots the error named the row's
    # slot (1), not its batch row; greedy decoding returned NaN logprobs without an error.
    model, tok = config_llama()
    with torch.no_grad():
        model.model.embed_tokens.weight[50] = float("nan")
    rows = [[10, 11, 12], [13, 14], [15, 16, 17], [18, 50, 19], [20, 21]]
    ids = torch.full((len(rows), 3), tok.pad_token_id)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.tensor(r)
    batch = BatchedDataDict(input_ids=ids, input_lengths=torch.tensor([len(r) for r in rows]))
    with pytest.raises(FloatingPointError, match=r"batch row\(s\) \[3\] is not finite"):
        engine("torch", model, tok, max_new_tokens=5, torch_cfg=torch_cfg).generate(batch, greedy=greedy)
    if not torch_cfg:  # the hf backend alike (greedy went on with NaN logprobs; sampling named no row)
        with pytest.raises(FloatingPointError, match=r"batch row\(s\) \[3\] is not finite"):
            engine("hf", model, tok, max_new_tokens=5).generate(batch, greedy=greedy)
