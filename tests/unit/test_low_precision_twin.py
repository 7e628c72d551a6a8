"""`LowPrecisionTwin`: one rank's bf16 compute copy of a float32 master module."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from posttrain.policy.fsdp_worker import LowPrecisionTwin


def _model(tied: bool) -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg)


def test_parameters_cast_buffers_stay_float32_ties_kept():
    master = _model(tied=True)
    twin = LowPrecisionTwin(master, torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in twin.module.parameters())
    assert all(p.dtype == torch.float32 for p in master.parameters())
    buffers = dict(twin.module.named_buffers())
    assert buffers and all(b.dtype == torch.float32 for b in buffers.values())  # rotary inv_freq
    assert twin.module.lm_head.weight is twin.module.model.embed_tokens.weight


def test_sync_follows_the_master_version():
    master = _model(tied=False)
    twin = LowPrecisionTwin(master, torch.bfloat16)
    module = twin.sync(0)
    with torch.no_grad():
        master.lm_head.weight.add_(1.0)
    assert not torch.equal(module.lm_head.weight, master.lm_head.weight.bfloat16())  # same version: no copy
    twin.sync(1)
    for (name, p), q in zip(master.named_parameters(), module.parameters()):
        assert torch.equal(q, p.detach().bfloat16()), name


def test_gradients_accumulate_in_float32_on_the_master():
    master = _model(tied=False)
    twin = LowPrecisionTwin(master, torch.bfloat16)
    module = twin.sync(0)
    ids = torch.randint(0, 32, (2, 5), generator=torch.Generator().manual_seed(1))
    expected = {}
    for _ in range(2):  # two micro-batches
        module(input_ids=ids).logits.float().square().mean().backward()
        for name, p in module.named_parameters():
            expected[name] = expected.get(name, 0) + p.grad.float()
        twin.accumulate_grads()
        assert all(p.grad is None for p in module.parameters())  # moved, not left to add up in bf16
    for name, p in master.named_parameters():
        assert p.grad.dtype == torch.float32
        torch.testing.assert_close(p.grad, expected[name], atol=0, rtol=0, msg=name)
