"""Blockwise attention over shared-prefix rows equals the plain rows: logprobs and gradients."""

import pytest
import torch

from posttrain.data.packing import BLOCKWISE_MIN_SCORES, share_prefixes
from posttrain.embedded import build_model
from posttrain.policy.blockwise_attention import (
    PrefixBlocks,
    base_implementation,
    enable_blockwise,
    is_blockwise,
)
from posttrain.policy.fsdp_worker import logprobs_at, token_logprobs


def _groups():
    """Three prompts of different lengths (6, 4, 5 tokens) with 4, 3 and 2 completions of
    different lengths, one of them empty (a row that ends with its prompt)."""
    torch.manual_seed(0)
    lengths = torch.tensor([14, 9, 12, 6, 10, 13, 4, 15, 8])
    prefix = torch.tensor([6, 6, 6, 6, 4, 4, 4, 5, 5])
    ids = torch.randint(8, 60, (9, 15))
    for rows in ([0, 1, 2, 3], [4, 5, 6], [7, 8]):
        ids[rows[1:], : int(prefix[rows[0]])] = ids[rows[0], : int(prefix[rows[0]])]
    return ids, lengths, prefix


def test_blocks_index_the_suffixes_and_mask_the_prefix():
    ids, lengths, prefix = _groups()
    s = share_prefixes(ids, lengths, prefix, pad_id=0, max_row_tokens=64)
    b = PrefixBlocks.from_layout(s)
    assert s.prefix_lengths.tolist() == [6, 4, 5]
    assert s.suffix_lengths.tolist() == [[8, 3, 6, 0], [6, 9, 0, 0], [10, 3, 0, 0]]
    assert b.prefix_width == 6 and b.own_allowed.shape == (3, 1, 4, 10, 10)
    # Packed row 1, slot 0 is row 4's suffix, right after the 4-token prompt (rows flattened: 1 * L + position).
    length = s.input_ids.shape[1]
    gather, scatter = b.gather_rows.view(3, 4, 10), b.scatter_rows.view(3, 4, 10)
    assert gather[1, 0, :6].tolist() == [length + p for p in range(4, 10)] == scatter[1, 0, :6].tolist()
    assert gather[1, 0, 6:].tolist() == [length] * 4  # slot padding reads its row's first position
    assert scatter[1, 0, 6:].tolist() == [3 * length] * 4  # and writes to the dropped extra row
    assert b.prefix_keys[1, 0, 0, 0].tolist() == [True] * 4 + [False] * 2
    assert b.own_allowed[0, 0, 1, 2].tolist() == [True] * 3 + [False] * 7  # 3rd token of a 3-token suffix
    assert b.own_allowed[0, 0, 3].diagonal().all()  # the empty slot's queries see themselves: no NaN


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blockwise_logprobs_and_gradients_equal_the_plain_rows(attn, dtype):
    torch.manual_seed(0)
    model = build_model("tiny").to(dtype)  # grouped-query attention: 4 query heads on 2 kv heads
    model.config._attn_implementation = attn
    assert model.config.num_key_value_heads < model.config.num_attention_heads
    assert enable_blockwise(model) and is_blockwise(model) and base_implementation(model) == attn
    ids, lengths, prefix = _groups()
    s = share_prefixes(ids, lengths, prefix, pad_id=0, max_row_tokens=64)
    placeholder = torch.ones(s.input_ids.shape[0], 1, 1, 1, dtype=torch.bool)
    shared = logprobs_at(model(input_ids=s.input_ids, position_ids=s.position_ids, attention_mask=placeholder,
                               prefix_blocks=PrefixBlocks.from_layout(s)).logits,
                         s.row, s.index[:, :-1], ids[:, 1:])
    # Without prefix_blocks the model runs its own attention: the plain rows as before.
    plain = token_logprobs(model(input_ids=ids).logits, ids)[:, 1:]
    valid = torch.arange(1, ids.shape[1])[None] < lengths[:, None]
    tol = {torch.float32: (2e-5, 5e-5), torch.bfloat16: (0.05, 0.05)}[dtype]
    torch.testing.assert_close(shared * valid, plain * valid, atol=tol[0], rtol=0)
    params = [p for p in model.parameters()]
    g_shared = torch.autograd.grad((shared * valid).sum(), params)
    g_plain = torch.autograd.grad((plain * valid).sum(), params)
    for a, c in zip(g_shared, g_plain):
        if dtype == torch.float32:
            torch.testing.assert_close(a, c, atol=1e-4, rtol=1e-4)
        else:  # bf16 rounding: compare the directions
            assert torch.nn.functional.cosine_similarity(a.float().flatten(), c.float().flatten(), dim=0) > 0.99


def test_share_prefixes_marks_long_rows_blockwise_and_prices_them_so():
    torch.manual_seed(0)
    # 16 groups of 8 completions of 64 tokens after a 20-token prompt (a 30M run's batch shape).
    ids = torch.randint(8, 60, (128, 84))
    ids[:, :20] = ids[::8, :20].repeat_interleave(8, 0)
    lengths, prefix = torch.full((128,), 84), torch.full((128,), 20)
    # Packed: 16 rows of 532 tokens; plain: 128 rows of 84. Per score cost c, dense packing
    # costs 8,512 + 4.53M c against the plain rows' 10,752 + 0.45M c (worth it for c < 5.5e-4),
    # blockwise packing 8,512 + 0.69M c (for c < 9.2e-3).
    assert 16 * 532 ** 2 >= BLOCKWISE_MIN_SCORES
    dense = share_prefixes(ids, lengths, prefix, 0, 2048, score_cost=1e-4)
    assert dense is not None and not dense.blockwise
    assert share_prefixes(ids, lengths, prefix, 0, 2048, score_cost=6e-4) is None
    s = share_prefixes(ids, lengths, prefix, 0, 2048, score_cost=6e-4, blockwise=True)
    assert s is not None and s.blockwise
    assert share_prefixes(ids, lengths, prefix, 0, 2048, score_cost=1e-2, blockwise=True) is None
    # Short rows stay dense even when blockwise attention is available.
    assert not share_prefixes(ids[:16, :30], torch.full((16,), 30), prefix[:16], 0, 2048, blockwise=True).blockwise


def test_models_outside_the_llama_family_keep_their_attention():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64))
    model.config._attn_implementation = "eager"
    assert not enable_blockwise(model) and model.config._attn_implementation == "eager"


@pytest.mark.parametrize("setting,device,expected", [("auto", "cpu", True), ("auto", "cuda", False),
                                                     ("on", "cuda", True), ("off", "cpu", False)])
def test_blockwise_attention_setting_per_device(setting, device, expected):
    from posttrain.policy.fsdp_worker import FSDPPolicyWorker
    from posttrain.schemas import PolicyConfig

    worker = object.__new__(FSDPPolicyWorker)  # the decision only, without loading a model
    worker.cfg = PolicyConfig(prefix_sharing={"blockwise_attention": setting})
    worker.model_kind, worker.device = "causal_lm", torch.device(device)
    assert worker._wants_blockwise() is expected
    worker.model_kind = "sequence_classification"
    assert worker._wants_blockwise() is False


def test_the_window_that_keeps_a_row_from_sharing_its_prompt_is_found_where_each_model_keeps_it():
    # Gemma 3 4B loads as the multimodal class, its window in text_config; Llama 4 attends in
    # chunks; GPT-Neo's local layers mask by the position in the packed row (0: never shared).
    # Missed, they gave rows longer than the window full attention.
    from transformers import Gemma3Config, GPTNeoConfig, Llama4TextConfig, LlamaConfig, MistralConfig, Qwen2Config

    from posttrain.policy.blockwise_attention import sliding_window

    assert sliding_window(LlamaConfig()) is None
    assert sliding_window(MistralConfig(sliding_window=4096)) == 4096
    assert sliding_window(Qwen2Config(sliding_window=4096, use_sliding_window=False)) is None
    # Qwen2 slides only from layer max_window_layers on (the torch engine refused it with none).
    qwen = dict(sliding_window=16, use_sliding_window=True, num_hidden_layers=4)
    assert sliding_window(Qwen2Config(**qwen, max_window_layers=4)) is None
    assert sliding_window(Qwen2Config(**qwen, max_window_layers=2)) == 16
    assert sliding_window(Gemma3Config(text_config={"sliding_window": 512})) == 512
    assert sliding_window(Llama4TextConfig(attention_chunk_size=64)) == 64
    assert sliding_window(GPTNeoConfig(window_size=256, attention_types=[[["global", "local"], 1]], num_layers=2)) == 0
    assert sliding_window(GPTNeoConfig(window_size=256, attention_types=[[["global"], 2]], num_layers=2)) is None


def test_another_familys_config_is_told_unsupported_before_its_attributes_are_read():
    # A Mamba or multimodal Gemma 3 config has no max_position_embeddings: reading it first
    # raised AttributeError out of the policy's set-up instead of "not supported".
    from types import SimpleNamespace

    from posttrain.generation.torch_engine import UnsupportedModelError, check_supported

    with pytest.raises(UnsupportedModelError, match="model_type 'mamba' is not one of"):
        check_supported(SimpleNamespace(config=SimpleNamespace(model_type="mamba")))
