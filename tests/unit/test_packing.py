"""Bin packing, dynamic micro-batches and packed-row layout on hand-made lengths."""

import pytest
import torch

from posttrain.data.packing import (PACKING_ALGORITHMS, dynamic_microbatches, pack_bins, pack_rows,
                                    packed_microbatches, unpack_token_values)


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
