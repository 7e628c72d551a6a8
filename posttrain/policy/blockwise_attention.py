"""Blockwise attention for shared-prefix rows (`policy.prefix_sharing`).

A packed row `[prefix | suffix_1 | ... | suffix_K]` (`posttrain.data.packing.share_prefixes`)
lets every suffix attend to the prefix and, causally, to itself. Dense attention under that
mask computes L^2 scores per packed row, almost all of them masked: a 30M model's GRPO group
(a 22-token prompt and 8 completions of 64) is a 534-token row, 285k scores per head where
32k are needed. Blockwise attention computes only the needed blocks:

- the prefix attends to itself causally (P x P scores, P the longest prefix of the batch);
- every suffix, gathered into a slot of S positions (S the longest suffix), scores the prefix
  keys (S x P) and its own keys causally (S x S); one softmax runs over both blocks, so the
  result is the dense attention's up to rounding, and the gradients follow through the gathers.

Outputs are scattered back to the packed positions. The arithmetic follows transformers'
eager attention (scores in the compute dtype plus an additive mask, softmax in float32), so
logprobs match the dense path to rounding.

Transformers dispatches attention through `AttentionInterface`; `enable_blockwise` switches
a Llama-family model to an implementation registered here that runs blockwise when the forward
passes `prefix_blocks=PrefixBlocks(...)` and otherwise calls the model's own eager or sdpa
attention, so every other forward (plain rows, packing, the dense shared-prefix mask) is
unchanged.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from posttrain.data.packing import SharedPrefixRows

_PREFIX = "posttrain_blockwise_"
_BASES = ("eager", "sdpa")


@dataclass
class PrefixBlocks:
    """Index tensors and masks of one `SharedPrefixRows` layout, built once per forward and
    used by every layer. R packed rows of L positions, K suffix slots of S positions each."""

    prefix_width: int  # P: the longest prefix
    gather_index: torch.Tensor  # [R, 1, K*S, 1]: packed position of each slot position (0 for slot padding)
    scatter_index: torch.Tensor  # [R, 1, K*S, 1]: the same, L for slot padding (a dropped extra position)
    prefix_allowed: torch.Tensor  # [R, 1, P, P] bool: the prefix block's causal mask
    prefix_keys: torch.Tensor  # [R, 1, 1, 1, P] bool: keys inside the row's prefix
    own_allowed: torch.Tensor  # [R, 1, K, S, S] bool: a slot's causal mask over its own keys
    _additive: dict = field(default_factory=dict)

    @classmethod
    def from_layout(cls, layout: SharedPrefixRows) -> PrefixBlocks:
        length = layout.input_ids.shape[1]
        dev = layout.input_ids.device
        p_len, starts, sizes = layout.prefix_lengths, layout.suffix_starts, layout.suffix_lengths
        width, slot = int(p_len.max()), max(int(sizes.max()), 1)
        rows, slots = starts.shape
        s = torch.arange(slot, device=dev)
        valid = s[None, None, :] < sizes[:, :, None]  # [R, K, S]
        pos = torch.where(valid, starts[:, :, None] + s, 0).reshape(rows, 1, slots * slot, 1)
        dump = torch.where(valid.reshape(rows, 1, slots * slot, 1), pos, length)
        j = torch.arange(width, device=dev)
        causal = j[None, :] <= j[:, None]
        # The diagonal stays allowed everywhere, so no query row is fully masked (a NaN there
        # would reach the gradients even though padding outputs are dropped).
        prefix_allowed = (causal & (j[None, None, :] < p_len[:, None, None])) | torch.eye(width, dtype=torch.bool,
                                                                                          device=dev)
        own = (s[None, :] <= s[:, None])[None, None] & valid[:, :, None, :]  # key inside the suffix
        own |= torch.eye(slot, dtype=torch.bool, device=dev)
        return cls(prefix_width=width, gather_index=pos, scatter_index=dump,
                   prefix_allowed=prefix_allowed[:, None], prefix_keys=(j < p_len[:, None])[:, None, None, None],
                   own_allowed=own[:, None])

    def additive(self, name: str, dtype: torch.dtype) -> torch.Tensor:
        """The bool mask `name` as the 0 / dtype-min mask eager attention adds (cached per dtype)."""
        key = (name, dtype)
        if key not in self._additive:
            allowed = getattr(self, name)
            self._additive[key] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                ~allowed, torch.finfo(dtype).min)
        return self._additive[key]


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[R, H_kv, L, D] -> [R, H_kv * groups, L, D] (grouped-query attention's shared heads)."""
    if groups == 1:
        return x
    r, h, length, d = x.shape
    return x[:, :, None].expand(r, h, groups, length, d).reshape(r, h * groups, length, d)


def blockwise_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        blocks: PrefixBlocks, scaling: float, dropout: float = 0.0) -> torch.Tensor:
    """Attention of the packed rows `query/key/value [R, H(_kv), L, D]` -> `[R, L, H, D]`."""
    groups = query.shape[1] // key.shape[1]
    key, value = _repeat_kv(key, groups), _repeat_kv(value, groups)
    rows, heads, length, dim = query.shape
    width = blocks.prefix_width
    slots, slot = blocks.own_allowed.shape[2], blocks.own_allowed.shape[3]
    dt = query.dtype

    def probs(scores: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dt)
        return torch.nn.functional.dropout(p, p=dropout, training=module.training)

    k_pre, v_pre = key[:, :, :width], value[:, :, :width]
    scores = torch.matmul(query[:, :, :width], k_pre.transpose(2, 3)) * scaling
    out_pre = torch.matmul(probs(scores + blocks.additive("prefix_allowed", dt)), v_pre)  # [R, H, P, D]

    idx = blocks.gather_index.expand(rows, heads, slots * slot, dim)
    q_s, k_s, v_s = (x.gather(2, idx) for x in (query, key, value))  # [R, H, K*S, D]
    to_pre = (torch.matmul(q_s, k_pre.transpose(2, 3)) * scaling).view(rows, heads, slots, slot, width)
    q_s, k_s, v_s = (x.view(rows, heads, slots, slot, dim) for x in (q_s, k_s, v_s))
    to_own = torch.matmul(q_s, k_s.transpose(3, 4)) * scaling  # [R, H, K, S, S]
    p = probs(torch.cat([to_pre + blocks.additive("prefix_keys", dt),
                         to_own + blocks.additive("own_allowed", dt)], dim=-1))
    out_s = (torch.matmul(p[..., :width].reshape(rows, heads, slots * slot, width), v_pre)
             + torch.matmul(p[..., width:], v_s).view(rows, heads, slots * slot, dim))

    # Positions past the prefix block start at 0; slots land on their packed positions and
    # slot padding on the extra position L, which is cut off.
    out = torch.cat([out_pre, out_pre.new_zeros(rows, heads, length + 1 - width, dim)], dim=2)
    out = out.scatter(2, blocks.scatter_index.expand(rows, heads, slots * slot, dim), out_s)
    return out[:, :, :length].transpose(1, 2).contiguous()


def _delegate(base: str, module: torch.nn.Module) -> Callable:
    """The model's own attention function for `base` ("eager": the one in its modeling file)."""
    if base == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS[base]


def _make_attention(base: str) -> Callable:
    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, prefix_blocks=None,
                  **kwargs):
        if prefix_blocks is None:
            return _delegate(base, module)(module, query, key, value, attention_mask, scaling=scaling,
                                           dropout=dropout, **kwargs)
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        return blockwise_attention(module, query, key, value, prefix_blocks, scale, dropout), None

    return attention


def _register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import (
        ALL_MASK_ATTENTION_FUNCTIONS,
        AttentionMaskInterface,
    )

    for base in _BASES:
        AttentionInterface.register(_PREFIX + base, _make_attention(base))
        AttentionMaskInterface.register(_PREFIX + base, ALL_MASK_ATTENTION_FUNCTIONS[base])


def base_implementation(model: torch.nn.Module) -> str | None:
    """The model's attention implementation with the blockwise wrapper taken off."""
    attn = getattr(model.config, "_attn_implementation", None)
    return attn.removeprefix(_PREFIX) if attn else attn


def is_blockwise(model: torch.nn.Module) -> bool:
    return (getattr(model.config, "_attn_implementation", None) or "").startswith(_PREFIX)


def enable_blockwise(model: torch.nn.Module) -> bool:
    """Switch `model` to blockwise-capable attention; False (model unchanged) when its
    attention is not eager/sdpa or it is not a Llama-family model whose layers take the
    `AttentionInterface` (the layout blockwise attention was written and tested for)."""
    from posttrain.generation.torch_engine import check_supported

    base = getattr(model.config, "_attn_implementation", None)
    if base not in _BASES:
        return False
    try:
        check_supported(model)  # Llama family without a sliding window
    except NotImplementedError:
        return False
    _register()
    model.set_attn_implementation(_PREFIX + base)
    return is_blockwise(model)
