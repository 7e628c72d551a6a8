"""Sampling: the distribution is right (chi-square against the model), top-k/top-p/min-p never emit an
excluded token, the kept sets are the documented ones, and stop detection is exact."""

from __future__ import annotations

import pytest
import torch
from scipy import stats

from posttrain.data.batch import BatchedDataDict
from posttrain.generation import build_generation, load_model_and_tokenizer
from posttrain.generation.sampling import SamplingSettings, StopChecker, inverse_cdf_pick, sample, sampling_logprobs
from posttrain.schemas import GenerationConfig


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """A second thread only adds scheduling waits for these tiny ops on a busy machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square p-value, pooling the categories expected fewer than 5 times into one bin."""
    n = counts.sum()
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum()[None]]).double()
    exp = torch.cat([expected[big], expected[~big].sum()[None]]).double()
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    return float(stats.chisquare(obs.numpy(), exp.numpy() * (obs.sum() / exp.sum()).item()).pvalue)


@pytest.fixture(scope="module")
def sharp_model(tiny_model_path):
    """The tiny model with larger weights, so its next-token distribution is far from uniform."""
    model, tok = load_model_and_tokenizer(tiny_model_path)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    return model, tok


def _next_token_counts(model, tok, temperature: float, n: int = 3000):
    prompt = tok.encode("2+2=", add_special_tokens=False)
    batch = BatchedDataDict(input_ids=torch.tensor([prompt] * n), input_lengths=torch.full((n,), len(prompt)))
    cfg = GenerationConfig(max_new_tokens=1, temperature=temperature, seed=1234, ignore_eos=True)
    out = build_generation("torch", model=model, tokenizer=tok, cfg=cfg, max_total_sequence_length=64).generate(batch)
    tokens = out["output_ids"][:, len(prompt)]
    with torch.no_grad():
        probs = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].float(), dim=-1)
    return torch.bincount(tokens, minlength=probs.numel()).float(), probs


def test_temperature_one_frequencies_match_model(sharp_model):
    counts, probs = _next_token_counts(*sharp_model, temperature=1.0)
    assert _chi2_pvalue(counts, probs) > 1e-3
    assert float(probs.max()) > 3 / probs.numel()  # a non-uniform target, so the test has teeth


def test_chi_square_detects_the_wrong_distribution(sharp_model):
    """Negative control: samples at temperature 0.5 are rejected as draws from the T=1 distribution."""
    counts, probs = _next_token_counts(*sharp_model, temperature=0.5)
    assert _chi2_pvalue(counts, probs) < 1e-6


@pytest.mark.parametrize("top_k,top_p,min_p", [(3, 1.0, 0.0), (None, 0.5, 0.0), (10, 0.8, 0.0), (None, 1.0, 0.2),
                                               (10, 0.8, 0.05)])
def test_top_k_top_p_min_p_never_emit_excluded_tokens(top_k, top_p, min_p):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 2
    s = SamplingSettings(temperature=0.9, top_p=top_p, top_k=top_k, min_p=min_p)
    lp = sampling_logprobs(logits, s)
    allowed = torch.isfinite(lp)
    for _ in range(50):
        tokens, tok_lp = sample(logits, s, g)
        assert bool(allowed.gather(1, tokens[:, None]).all())
        torch.testing.assert_close(tok_lp, lp.gather(1, tokens[:, None]).squeeze(1))
    scaled = logits / 0.9
    if min_p:
        # Min-p first (vLLM's order): the tokens at least min_p times as likely as the most likely one.
        probs = torch.softmax(scaled, dim=-1)
        kept_by_min_p = probs >= min_p * probs.max(dim=-1, keepdim=True).values
        assert bool((allowed <= kept_by_min_p).all())
        if top_k is None and top_p == 1.0:
            assert torch.equal(allowed, kept_by_min_p) and 1 < allowed.sum(dim=-1).float().mean() < 50
        scaled = scaled.masked_fill(~kept_by_min_p, float("-inf"))
    order = scaled.argsort(dim=-1, descending=True)
    if top_k is not None:
        # Exactly the k largest are kept when top-p does not cut further.
        kept_by_k = torch.zeros_like(allowed).scatter(1, order[:, :top_k], True)
        assert bool((allowed <= kept_by_k).all())
    if top_p < 1.0:
        # Nucleus: the kept set is the shortest sorted prefix whose mass reaches top_p.
        base = scaled if top_k is None else scaled.masked_fill(~kept_by_k, float("-inf"))
        p_sorted = torch.softmax(base, dim=-1).gather(1, order)
        need = (torch.cumsum(p_sorted, dim=-1) < top_p).sum(dim=-1) + 1
        assert allowed.sum(dim=-1).tolist() == need.tolist()
    torch.testing.assert_close(lp.exp().sum(dim=-1), torch.ones(64))


def test_top_p_keeps_the_shortest_prefix_that_reaches_it_exactly():
    # Four equal tokens, top_p 0.5: two reach it exactly (vLLM's rule); a third was kept too.
    assert torch.isfinite(sampling_logprobs(torch.zeros(1, 4), SamplingSettings(top_p=0.5))).sum().item() == 2


def test_inverse_cdf_pick_maps_u_to_the_token_whose_interval_holds_it():
    # Unnormalised masses 0, 0.2, 0, 0.3, 0.5, 0 (total 1.0): intervals [0, .2) [.2, .5) [.5, 1.0).
    probs = torch.tensor([[0.0, 0.2, 0.0, 0.3, 0.5, 0.0]]).repeat(7, 1)
    u = torch.tensor([0.0, 0.1999, 0.2, 0.4999, 0.5, 0.9999, 1.0 - 2**-24])[:, None]
    assert inverse_cdf_pick(probs, u).tolist() == [1, 1, 3, 3, 4, 4, 4]
    # Any total: the same row scaled by 3 picks the same tokens.
    assert inverse_cdf_pick(probs * 3, u).tolist() == [1, 1, 3, 3, 4, 4, 4]
    # u * total rounding up to the total itself still lands on the last token with mass.
    assert inverse_cdf_pick(torch.tensor([[0.25, 0.75, 0.0, 0.0]]), torch.tensor([[1.0]])).tolist() == [1]


def test_non_finite_distribution_is_an_error_naming_the_row():
    logits = torch.zeros(3, 5)
    logits[2, 1] = float("nan")
    with pytest.raises(FloatingPointError, match=r"row\(s\) \[2\]"):
        sample(logits, SamplingSettings(), torch.Generator().manual_seed(0))


def test_greedy_reports_temperature_one_logprob():
    logits = torch.tensor([[1.0, 3.0, 2.0]])
    tokens, lp = sample(logits, SamplingSettings(temperature=0.3, greedy=True), None)
    assert tokens.tolist() == [1]
    torch.testing.assert_close(lp, torch.log_softmax(logits, -1)[:, 1])


def test_stop_checker_matches_only_in_the_last_token():
    from posttrain.embedded import build_tokenizer

    tok = build_tokenizer()
    sc = StopChecker(tok, [tok.eos_token_id])
    ids = tok.encode("ab<>cd", add_special_tokens=False)
    assert sc.ends_with_stop_string(ids[:4], ["<>"])
    assert not sc.ends_with_stop_string(ids[:5], ["<>"])  # completed one token earlier
    assert not sc.ends_with_stop_string(ids[:3], ["<>"])
    cand = sc.candidates({"<>"}, len(tok) + 3)  # the model's embedding padded past the tokenizer
    assert bool(cand[tok.convert_tokens_to_ids(">")]) and not bool(cand[tok.convert_tokens_to_ids("<")])
    assert cand.shape == (len(tok) + 3,) and not bool(cand[len(tok) :].any())


def test_a_stop_string_of_byte_fallback_tokens_is_found_when_the_tail_starts_inside_a_character():
    # Sentencepiece's byte fallback (Llama, Mistral, stories260K) decodes a run of byte tokens that is
    # not valid UTF-8 as one U+FFFD per byte: a tail cut inside "😀" (4 bytes) hid the "語" its last
    # token completed, and the row ran on to max_new_tokens.
    from tokenizers import Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "\u2581": 2, "x": 3, "y": 4,
             **{f"<0x{b:02X}>": 5 + b for b in range(256)}}
    backend = Tokenizer(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.normalizer = normalizers.Replace(" ", "\u2581")
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", eos_token="</s>")
    ids = tok.encode("x\U0001F600\ud55c\u8a9e y\U0001F600\ud55c\u8a9e", add_special_tokens=False)
    assert len(ids) == 23 and tok.decode(ids[3:]) != tok.decode(ids)[1:]  # cut inside the emoji: all lost
    sc = StopChecker(tok, [1])
    assert [n for n in range(1, len(ids) + 1) if sc.ends_with_stop_string(ids[:n], ["\u8a9e"])] == [11, 23]
    assert [n for n in range(1, len(ids) + 1) if sc.ends_with_stop_string(ids[:n], ["\ud55c\u8a9e y"])] == [13]
    # The byte token that completes "語" decodes alone to U+FFFD, no character of the stop string:
    # it is a candidate all the same (it was not, and the row ran on to max_new_tokens).
    cand = StopChecker(tok, [1]).candidates({"\u8a9e"}, len(tok))
    assert bool(cand[tok.convert_tokens_to_ids("<0x9E>")]) and not bool(cand[tok.convert_tokens_to_ids("x")])


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens():
    # Hand-computed: logits [2, -1, 0.5, -2], tokens 0 and 1 seen, penalty 2, temperature 0.5:
    # z = [1, -2, 0.5, -2] -> l = z / 0.5 = [2, -4, 1, -4].
    logits = torch.tensor([[2.0, -1.0, 0.5, -2.0]])
    seen = torch.tensor([[True, True, False, False]])
    s = SamplingSettings(temperature=0.5, repetition_penalty=2.0)
    torch.testing.assert_close(sampling_logprobs(logits, s, seen), torch.log_softmax(torch.tensor([[2.0, -4.0, 1.0, -4.0]]), -1))
    # Greedy takes the penalised argmax: 2/2 = 1 < 1.5 would flip it with a token at 1.5.
    g = SamplingSettings(greedy=True, repetition_penalty=2.0)
    tokens, lp = sample(torch.tensor([[2.0, 1.5]]), g, None, torch.tensor([[True, False]]))
    assert tokens.tolist() == [1] and float(lp) == pytest.approx(float(torch.log_softmax(torch.tensor([1.0, 1.5]), 0)[1]))
    assert torch.equal(sampling_logprobs(logits, SamplingSettings(temperature=0.5), seen),
                       torch.log_softmax(logits / 0.5, -1))  # 1 = off: seen is not read
    with pytest.raises(ValueError, match="seen tokens"):
        sampling_logprobs(logits, s)


def test_seen_tokens_marks_each_rows_valid_tokens_only():
    from posttrain.generation.sampling import seen_tokens

    ids = torch.tensor([[3, 1, 0], [2, 2, 5]])
    valid = torch.tensor([[True, True, False], [True, True, True]])  # row 0's last position is padding (0)
    assert seen_tokens(ids, valid, 6).tolist() == [[False, True, False, True, False, False],
                                                   [False, False, True, False, False, True]]
