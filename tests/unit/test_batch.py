"""BatchedDataDict on small hand-made batches."""

import pytest
import torch

from posttrain.data.batch import BatchedDataDict


def _batch(n: int, offset: int = 0) -> BatchedDataDict:
    return BatchedDataDict(
        input_ids=torch.arange(offset, offset + n).unsqueeze(1).repeat(1, 2),  # [n, 2]
        input_lengths=torch.full((n,), 2),
        tag=[f"r{offset + i}" for i in range(n)],
    )


def test_from_batches_pads_dim1_per_key():
    a = BatchedDataDict(input_ids=torch.tensor([[1, 2, 3]]), token_mask=torch.tensor([[0.0, 1, 1]]), s=["a"])
    b = BatchedDataDict(input_ids=torch.tensor([[4], [5]]), token_mask=torch.tensor([[1.0], [1.0]]), s=["b", "c"])
    out = BatchedDataDict.from_batches([a, b], pad_value_dict={"input_ids": 7})
    assert isinstance(out, BatchedDataDict)
    assert out["input_ids"].tolist() == [[1, 2, 3], [4, 7, 7], [5, 7, 7]]
    assert out["token_mask"].tolist() == [[0, 1, 1], [1, 0, 0], [1, 0, 0]]
    assert out["s"] == ["a", "b", "c"]
    assert out.size == 3


def test_from_batches_rejects_mismatched_keys():
    with pytest.raises(ValueError, match="keys"):
        BatchedDataDict.from_batches([_batch(1), BatchedDataDict(input_ids=torch.zeros(1, 2))])


def test_size_detects_misaligned_values():
    b = BatchedDataDict(x=torch.zeros(3), y=[1, 2])
    with pytest.raises(ValueError, match="disagree"):
        _ = b.size


def test_shard_contiguous_and_by_global_batch():
    b = _batch(8)
    shards = b.shard_by_batch_size(2)
    assert [s["tag"] for s in shards] == [["r0", "r1", "r2", "r3"], ["r4", "r5", "r6", "r7"]]
    # Two global batches of 4: shard i holds half i of each global batch.
    shards = b.shard_by_batch_size(2, batch_size=4)
    assert shards[0]["input_ids"][:, 0].tolist() == [0, 1, 4, 5]
    assert shards[1]["tag"] == ["r2", "r3", "r6", "r7"]
    with pytest.raises(ValueError, match="equal shards"):
        b.shard_by_batch_size(3)
    with pytest.raises(ValueError, match="multiple"):
        b.shard_by_batch_size(2, batch_size=3)


def test_select_and_slice():
    b = _batch(5)
    s = b.select_indices([4, 0, 4])  # in that order, repeats allowed
    assert s["tag"] == ["r4", "r0", "r4"] and s["input_ids"][:, 1].tolist() == [4, 0, 4]
    assert b.slice(1, 3)["tag"] == ["r1", "r2"]


def test_to_device_keeps_lists():
    b = _batch(2).to("cpu")
    assert b["input_ids"].device.type == "cpu" and b["tag"] == ["r0", "r1"]
    assert isinstance(b.copy(), BatchedDataDict)
