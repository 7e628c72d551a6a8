"""Token-aligned logprobs from logits, how loss metrics combine over micro-batches, and the
attention kernel the policy picks, and the dropout it turns off."""

import pytest
import torch

from posttrain.policy.fsdp_worker import _accumulate, _over_steps, token_logprobs


def test_token_logprobs_alignment_and_chunking():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g, dtype=torch.bfloat16)
    ids = torch.randint(0, 11, (2, 7), generator=g)
    full = token_logprobs(logits, ids)
    assert full.dtype == torch.float32 and full.shape == (2, 7)
    assert (full[:, 0] == 0).all()
    # position t holds log p(token_t | <t), from the logits at t-1, computed in float32
    expected = torch.log_softmax(logits[0, 3].float(), -1)[ids[0, 4]]
    assert torch.allclose(full[0, 4], expected, atol=1e-6)
    for chunk in (1, 2, 4, 6, 100):
        assert torch.allclose(token_logprobs(logits, ids, chunk_size=chunk), full, atol=1e-6)


def test_metrics_sum_except_max_min():
    out: dict[str, float] = {}
    _accumulate(out, {"loss": torch.tensor(0.25), "ratio_max": 1.5, "ratio_min": 0.5})
    _accumulate(out, {"loss": 0.5, "ratio_max": 1.2, "ratio_min": 0.1})
    assert out == {"loss": 0.75, "ratio_max": 1.5, "ratio_min": 0.1}


def test_optimizer_steps_combine_to_their_extremes_and_means():
    # Two optimizer steps of one GRPO step: the first's ratio is 1 by construction, the second's
    # ranges over [0.5, 1.6]. A mean of the extremes said [0.75, 1.3]; a step without a valid
    # token (masked_min's +inf, no per-token mean) measured nothing.
    steps = [{"loss": 0.2, "probs_ratio": 1.0, "probs_ratio_min": 1.0, "probs_ratio_max": 1.0},
             {"loss": 0.4, "probs_ratio": 0.9, "probs_ratio_min": 0.5, "probs_ratio_max": 1.6},
             {"loss": 0.0, "probs_ratio_min": float("inf"), "probs_ratio_max": float("-inf")}]
    out = _over_steps(steps)
    assert out == pytest.approx({"loss": 0.2, "probs_ratio": 0.95, "probs_ratio_min": 0.5, "probs_ratio_max": 1.6})
    assert _over_steps(steps[2:]) == {"loss": 0.0}


def test_token_logprobs_temperature_scales_the_logits():
    torch.manual_seed(1)
    logits = torch.randn(2, 5, 7)
    ids = torch.randint(0, 7, (2, 5))
    got = token_logprobs(logits, ids, temperature=0.5)
    expected = torch.log_softmax(logits[:, :-1] * 2.0, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    assert torch.allclose(got[:, 1:], expected, atol=1e-6)
    assert torch.equal(got[:, 0], torch.zeros(2))


def test_auto_attention_kernel_is_eager_for_short_cpu_sequences_only():
    from posttrain.policy.hf_io import attention_kernel
    from posttrain.schemas import PolicyConfig

    def kernel(device, **kw):
        cfg = PolicyConfig(model_name="embedded:tiny", **kw)
        return attention_kernel(cfg.attn_implementation, cfg.max_total_sequence_length, device)

    assert kernel("cpu", max_total_sequence_length=256) == "eager"
    assert kernel("cpu", max_total_sequence_length=257) == "sdpa"  # eager's length^2 scores cost more
    assert kernel("cuda", max_total_sequence_length=64) == "sdpa"
    assert kernel("cpu", max_total_sequence_length=4096, attn_implementation="eager") == "eager"
    # Never sdpa for a class without it: Gemma 2's set-up failed where from_pretrained loads it.
    from transformers import Gemma2Config, LlamaConfig

    assert attention_kernel("auto", 4096, "cpu", Gemma2Config()) == "eager"
    assert attention_kernel("auto", 4096, "cuda", LlamaConfig()) == "sdpa"


def test_disable_dropout_zeroes_layers_and_attention_rates_but_not_the_config():
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    from posttrain.policy.hf_io import disable_dropout

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=32))
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, vocab_size=50, attention_dropout=0.2))
    ids = torch.arange(1, 9)[None]
    for model, n in ((gpt2, 4), (llama, 1)):  # GPT-2: embeddings, attention, its output, MLP output
        model.train()
        assert not torch.equal(model(ids).logits, model(ids).logits)  # masks drawn: the test can fail
        assert disable_dropout(model) == n
        assert torch.equal(model(ids).logits, model(ids).logits)  # training mode, no mask drawn
    assert gpt2.config.attn_pdrop == 0.1 and llama.config.attention_dropout == 0.2  # an export keeps them


def test_token_entropies_alignment_temperature_and_chunking():
    """token_logprobs(entropy=True): the entropies come from the logprobs' own pass, aligned as they are."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 7, 11, generator=g, dtype=torch.bfloat16, requires_grad=True)
    ids = torch.randint(0, 11, (2, 7), generator=g)
    lp, full = token_logprobs(logits, ids, temperature=0.7, entropy=True)
    assert full.shape == (2, 7) and not full.requires_grad and (full[:, 0] == 0).all()
    assert lp.requires_grad and torch.equal(lp, token_logprobs(logits, ids, temperature=0.7))
    # position t: the entropy of the distribution that scores token t, from the logits at t-1
    p = torch.softmax(logits[1, 4].float() / 0.7, -1)
    assert torch.allclose(full[1, 5], -(p * p.log()).sum(), atol=1e-5)
    for chunk in (1, 3, 100):
        got = token_logprobs(logits, ids, chunk_size=chunk, temperature=0.7, entropy=True)[1]
        assert torch.allclose(got, full, atol=1e-5)
    lp3, h3 = token_logprobs(logits[:, 3:], ids, offset=3, entropy=True)
    assert (h3[:, :4] == 0).all() and (lp3[:, :4] == 0).all()
    assert torch.allclose(h3[:, 4:], token_logprobs(logits, ids, entropy=True)[1][:, 4:], atol=1e-5)
