"""`BatchedDataDict`: the one batch container passed between the driver and the workers.

Values are tensors with the batch on dim 0 (e.g. `input_ids  # [B, S]`) or Python lists of
length B (strings, message logs, metadata dicts). Every operation keeps all values aligned
on the batch dimension, so a row never loses its mask, advantages or metadata.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch


class BatchedDataDict(dict):
    """A dict of batch-aligned values: tensors `[B, ...]` or lists of length B."""

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_batches(
        cls, batches: Sequence[dict[str, Any]], pad_value_dict: dict[str, Any] | None = None
    ) -> "BatchedDataDict":
        """Concatenate `batches` along dim 0.

        Tensors with 2+ dims are right-padded along dim 1 to the longest batch with
        `pad_value_dict[key]` (default 0), so `input_ids` can be padded with the pad id while
        masks and logprobs get 0. Lists are concatenated. Every batch must have the same keys.
        """
        if not batches:
            raise ValueError("BatchedDataDict.from_batches needs at least one batch")
        pad_value_dict = pad_value_dict or {}
        keys = list(batches[0].keys())
        for i, b in enumerate(batches[1:], start=1):
            if set(b.keys()) != set(keys):
                raise ValueError(
                    f"batch {i} has keys {sorted(b.keys())}, batch 0 has {sorted(keys)}; all must match"
                )
        out = cls()
        for k in keys:
            vals = [b[k] for b in batches]
            if isinstance(vals[0], torch.Tensor):
                if vals[0].dim() >= 2:
                    longest = max(v.shape[1] for v in vals)
                    pad = pad_value_dict.get(k, 0)
                    vals = [_pad_dim1(v, longest, pad) for v in vals]
                out[k] = torch.cat(vals, dim=0)
            else:
                out[k] = [x for v in vals for x in v]
        return out

    # ------------------------------------------------------------------ size and checks

    @property
    def size(self) -> int:
        """B, the batch size (0 for an empty dict); raises if the values disagree."""
        sizes = {k: (v.shape[0] if isinstance(v, torch.Tensor) else len(v)) for k, v in self.items()}
        distinct = set(sizes.values())
        if len(distinct) > 1:
            raise ValueError(f"BatchedDataDict values disagree on the batch size: {sizes}")
        return distinct.pop() if distinct else 0

    # ------------------------------------------------------------------ selection

    def select_indices(self, indices: Sequence[int] | torch.Tensor) -> "BatchedDataDict":
        """A new batch holding rows `indices` (in that order; repeats allowed)."""
        idx = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        out = type(self)()
        for k, v in self.items():
            if isinstance(v, torch.Tensor):
                out[k] = v[idx.to(v.device)]
            else:
                out[k] = [v[i] for i in idx.tolist()]
        return out

    def slice(self, start: int, end: int) -> "BatchedDataDict":
        """Rows `start:end` (views of the tensors, copies of the lists)."""
        out = type(self)()
        for k, v in self.items():
            out[k] = v[start:end]
        return out

    # ------------------------------------------------------------------ splitting

    def shard_by_batch_size(self, shards: int, batch_size: int | None = None) -> list["BatchedDataDict"]:
        """Split into `shards` equal data-parallel shards.

        Without `batch_size` the rows are split into `shards` contiguous blocks. With
        `batch_size`, the batch is first cut into consecutive global batches of `batch_size`
        rows and each global batch is split into `shards` contiguous blocks; shard i then
        holds block i of every global batch (in order), so each worker sees its part of
        every optimizer step.
        """
        n = self.size
        if shards < 1:
            raise ValueError(f"shards must be >= 1, got {shards}")
        batch_size = n if batch_size is None else batch_size
        if batch_size < 1 or n % batch_size:
            raise ValueError(f"batch size {n} is not a multiple of the global batch size {batch_size}")
        if batch_size % shards:
            raise ValueError(f"global batch size {batch_size} does not split into {shards} equal shards")
        per = batch_size // shards
        parts: list[list[int]] = [[] for _ in range(shards)]
        for start in range(0, n, batch_size):
            for s in range(shards):
                parts[s].extend(range(start + s * per, start + (s + 1) * per))
        return [self.select_indices(p) for p in parts]

    # ------------------------------------------------------------------ devices

    def to(self, device: str | torch.device) -> "BatchedDataDict":
        """Tensors moved to `device` (lists unchanged); returns a new batch."""
        out = type(self)()
        for k, v in self.items():
            out[k] = v.to(device) if isinstance(v, torch.Tensor) else v
        return out

    def copy(self) -> "BatchedDataDict":  # dict.copy would return a plain dict
        return type(self)(self)


def _pad_dim1(t: torch.Tensor, length: int, value: Any) -> torch.Tensor:
    if t.shape[1] == length:
        return t
    shape = list(t.shape)
    shape[1] = length - t.shape[1]
    return torch.cat([t, torch.full(shape, value, dtype=t.dtype, device=t.device)], dim=1)
