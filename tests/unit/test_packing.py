"""Bin packing, dynamic micro-batches and packed-row layout on hand-made lengths."""

import pytest
import torch

from posttrain.data.packing import (PACKING_ALGORITHMS, dynamic_microbatches, pack_bins, pack_rows,
                                    packed_microbatches, share_prefixes, unpack_token_values)
from posttrain.embedded import build_model
from posttrain.policy.fsdp_worker import logprobs_at, token_logprobs


@pytest.mark.parametrize("algorithm", PACKING_ALGORITHMS)
def test_bins_respect_capacity_and_cover_all(algorithm):
    sizes = [7, 2, 5, 3, 4, 1, 6, 2]
    bins = pack_bins(sizes, 10, algorithm)
    assert sorted(i for b in bins for i in b) == list(range(len(sizes)))
    assert all(sum(sizes[i] for i in b) <= 10 for b in bins)
    assert len(bins) == 3  # 30 tokens in bins of 10: all three algorithms find the optimum here


def test_first_fit_keeps_order_and_ffd_sorts():
    assert pack_bins([3, 8, 3], 10, "first_fit") == [[0, 2], [1]]
    assert pack_bins([2, 6, 4, 8], 10, "first_fit_decreasing") == [[0, 3], [1, 2]]


def test_mffd_pairs_large_with_medium():
    # C=12: 7 and 6.5-ish items; FFD pairs largest with what fits first, MFFD with the largest medium.
    assert pack_bins([7, 5, 4, 4, 4], 12, "modified_first_fit_decreasing") == [[0, 1], [2, 3, 4]]


def test_bad_inputs():
    with pytest.raises(ValueError, match="item 1 has 11 tokens"):
        pack_bins([1, 11], 10)
    with pytest.raises(ValueError, match="valid: modified_first_fit_decreasing"):
        pack_bins([1], 10, "best_fit")
    with pytest.raises(ValueError, match="groups of 2"):
        packed_microbatches([1, 2, 3], 10, "first_fit", group=2)


def test_packed_microbatches_rows_and_pairs():
    lengths = [4, 3, 5, 5, 2, 2]
    # Rows as long as the longest sequence (5); budget 10 = two rows per micro-batch.
    assert packed_microbatches(lengths, 10, "first_fit_decreasing") == [[[2], [3]], [[0], [1, 4]], [[5]]]
    # Pairs (0,1)=7, (2,3)=10, (4,5)=4 tokens stay whole: rows of 10, two per micro-batch.
    mbs = packed_microbatches(lengths, 20, "first_fit_decreasing", group=2)
    assert mbs == [[[2, 3], [0, 1]], [[4, 5]]]
    with pytest.raises(ValueError, match="pair of sequences has 10 tokens"):
        packed_microbatches(lengths, 8, "first_fit", group=2)
    with pytest.raises(ValueError, match=r"more than the micro-batch token budget 4; raise "
                                         r"policy.sequence_packing.train_mb_tokens$"):
        packed_microbatches(lengths, 4, "first_fit", budget_key="policy.sequence_packing.train_mb_tokens")


def test_packed_rows_take_sequences_into_the_room_their_rounding_leaves():
    # pack_rows pads every row to the rounded width anyway: bins as long as the longest sequence
    # (5) left the 3 tokens a width of 8 has room for empty.
    assert packed_microbatches([5, 3, 2], 32, "first_fit_decreasing") == [[[0], [1, 2]]]
    assert packed_microbatches([5, 3, 2], 32, "first_fit_decreasing", round_to=8) == [[[0, 1], [2]]]
    assert packed_microbatches([5, 3, 2], 8, "first_fit_decreasing", round_to=8) == [[[0, 1]], [[2]]]


def test_dynamic_microbatches_budget():
    lengths = [10, 3, 9, 2, 4]
    mbs = dynamic_microbatches(lengths, token_budget=20, round_to=1)
    # sorted longest first: [10, 9] -> 2x10=20; [4, 3, 2] -> 3x4=12
    assert mbs == [[0, 2], [1, 3, 4]]
    rounded = dynamic_microbatches(lengths, token_budget=20, round_to=8)
    # 9 rounds to 16: one row per batch; 4 rounds to 8: two rows (16 <= 20), not three (24)
    assert rounded == [[0], [2], [1, 4], [3]]


def test_pack_and_unpack_roundtrip():
    ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [1, 2, 3, 4]])
    packed = pack_rows(ids, torch.tensor([3, 2, 4]), rows=[2, 1], pad_id=0, round_to=4)
    assert packed.input_ids.tolist() == [[5, 6, 7, 8, 9, 0, 0, 0], [1, 2, 3, 4, 0, 0, 0, 0]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 2, 3, 0, 1, 2, 3]]
    assert (packed.row, packed.start) == ([0, 0, 1], [0, 3, 0])
    vals = torch.arange(16.0).reshape(2, 8)
    out = unpack_token_values(vals, packed, seq_len=4)
    # position 0 of each row is 0; beyond the row's length is 0
    assert out.tolist() == [[0, 1, 2, 0], [0, 4, 0, 0], [0, 9, 10, 11]]
    with pytest.raises(ValueError, match="do not cover"):
        pack_rows(ids, torch.tensor([3, 2, 4]), rows=[2], pad_id=0)


def _grouped_rows():
    # Rows 0, 1, 3 share the prompt [5, 6, 7]; row 2 has its own; lengths 5, 6, 4, 3.
    ids = torch.tensor([[5, 6, 7, 10, 11, 0], [5, 6, 7, 12, 13, 14], [9, 6, 7, 15, 0, 0], [5, 6, 7, 0, 0, 0]])
    return ids, torch.tensor([5, 6, 4, 3]), torch.tensor([3, 3, 3, 3])


def test_share_prefixes_layout():
    ids, lengths, prefix = _grouped_rows()
    s = share_prefixes(ids, lengths, prefix, pad_id=0, max_row_tokens=100)
    # Packed row 0: prompt, then the suffixes of rows 0, 1 and 3 (empty); packed row 1: row 2 as it is.
    assert s.input_ids.tolist() == [[5, 6, 7, 10, 11, 12, 13, 14], [9, 6, 7, 15, 0, 0, 0, 0]]
    assert s.position_ids.tolist() == [[0, 1, 2, 3, 4, 3, 4, 5], [0, 1, 2, 3, 0, 0, 0, 0]]
    assert s.segments.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 1, -1, -1, -1, -1]]
    assert s.row.tolist() == [0, 0, 1, 0]
    assert s.index[1].tolist() == [0, 1, 2, 5, 6, 7]
    assert s.index[0, :5].tolist() == [0, 1, 2, 3, 4] and s.index[3, :3].tolist() == [0, 1, 2]
    allowed = s.attention_mask()[0, 0]
    assert allowed[6].tolist() == [True, True, True, False, False, True, True, False]  # row 1's 2nd token
    assert allowed[4].tolist() == [True] * 5 + [False] * 3  # row 0's 2nd token: prompt + itself
    assert s.attention_mask()[1, 0, 5].tolist() == [False] * 5 + [True, False, False]  # padding: itself only
    additive = s.attention_mask(torch.float32)
    assert additive[0, 0, 6, 3] == torch.finfo(torch.float32).min and additive[0, 0, 6, 5] == 0


def test_share_prefixes_splits_long_groups_and_declines_when_it_does_not_pay():
    ids, lengths, prefix = _grouped_rows()
    s = share_prefixes(ids, lengths, prefix, pad_id=0, max_row_tokens=6)
    # Suffixes of 2 and 3 tokens after a 3-token prompt exceed 6: row 1 starts a second packed row.
    assert s.row.tolist() == [0, 1, 2, 1] and s.input_ids[1, :6].tolist() == [5, 6, 7, 12, 13, 14]
    assert share_prefixes(ids[[0, 2]], lengths[[0, 2]], prefix[:2], 0, 100) is None  # nothing shared
    # Attention dominating the cost: one 8-token row costs more than four plain rows of <= 6.
    assert share_prefixes(ids, lengths, prefix, 0, 100, score_cost=10.0) is None


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_shared_prefix_logprobs_and_gradients_equal_the_plain_rows(attn):
    torch.manual_seed(0)
    model = build_model("tiny")
    model.config._attn_implementation = attn
    b, seq = 10, 14
    ids = torch.randint(8, 60, (b, seq))
    ids[1:4, :6] = ids[0, :6]  # rows 0-3 share 6 tokens, rows 4-6 share 5, rows 7-9 are alone
    ids[5:7, :5] = ids[4, :5]
    lengths = torch.tensor([14, 9, 12, 7, 10, 13, 6, 14, 8, 11])
    prefix = torch.tensor([6, 6, 6, 6, 5, 5, 5, 4, 4, 4])
    s = share_prefixes(ids, lengths, prefix, pad_id=0, max_row_tokens=64)
    assert s.input_ids.numel() < b * seq
    mask = s.attention_mask(None if attn == "sdpa" else torch.float32)
    shared = logprobs_at(model(input_ids=s.input_ids, position_ids=s.position_ids, attention_mask=mask).logits,
                         s.row, s.index[:, :-1], ids[:, 1:], chunk_size=5)
    plain = token_logprobs(model(input_ids=ids).logits, ids)[:, 1:]
    valid = torch.arange(1, seq)[None] < lengths[:, None]
    torch.testing.assert_close(shared * valid, plain * valid, atol=2e-6, rtol=0)
    params = list(model.parameters())
    g_shared = torch.autograd.grad((shared * valid).sum(), params)
    g_plain = torch.autograd.grad((plain * valid).sum(), params)
    for a, c in zip(g_shared, g_plain):
        torch.testing.assert_close(a, c, atol=5e-5, rtol=1e-4)


def test_share_prefixes_splits_an_outsized_group_instead_of_padding_every_row_to_it():
    # 8 prompts with 4 completions each, one prompt drawn twice (8 completions): packing every
    # group whole makes 8 rows as wide as the doubled group; capping rows at the common width
    # splits that group in two and keeps every row narrow.
    torch.manual_seed(0)
    prompts = torch.randint(8, 60, (8, 4))
    ids = torch.randint(8, 60, (36, 12))
    ids[:, :4] = prompts[torch.tensor([0] * 8 + [g for g in range(1, 8) for _ in range(4)])]
    lengths = torch.full((36,), 12)
    s = share_prefixes(ids, lengths, torch.full((36,), 4), pad_id=0, max_row_tokens=1000)
    assert s.input_ids.shape == (9, 4 + 4 * 8)  # not 8 rows of 4 + 8 * 8 = 68
    assert s.row[:8].tolist() == [0] * 4 + [1] * 4 and s.input_ids[1, :4].tolist() == prompts[0].tolist()
    for r in range(36):  # every source row is still found where the index points
        assert s.input_ids[s.row[r], s.index[r]].tolist() == ids[r].tolist()
