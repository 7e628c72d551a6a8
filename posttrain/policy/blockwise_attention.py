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
    # Rows of the packed positions flattened to [R*L]: r*L + position of each slot position,
    # [R*K*S]; slot padding reads position 0 of its row and writes to the extra row R*L (dropped).
    gather_rows: torch.Tensor
    scatter_rows: torch.Tensor
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
        rows = starts.shape[0]
        s = torch.arange(slot, device=dev)
        valid = s[None, None, :] < sizes[:, :, None]  # [R, K, S]
        row_start = torch.arange(rows, device=dev)[:, None, None] * length
        flat = row_start + starts[:, :, None] + s
        gather = torch.where(valid, flat, row_start).reshape(-1)
        scatter = torch.where(valid, flat, rows * length).reshape(-1)
        j = torch.arange(width, device=dev)
        causal = j[None, :] <= j[:, None]
        # The diagonal stays allowed everywhere, so no query row is fully masked (a NaN there
        # would reach the gradients even though padding outputs are dropped).
        prefix_allowed = (causal & (j[None, None, :] < p_len[:, None, None])) | torch.eye(width, dtype=torch.bool,
                                                                                          device=dev)
        own = (s[None, :] <= s[:, None])[None, None] & valid[:, :, None, :]  # key inside the suffix
        own |= torch.eye(slot, dtype=torch.bool, device=dev)
        return cls(prefix_width=width, gather_rows=gather, scatter_rows=scatter,
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
    """`[R, H_kv, ...]` -> `[R, H_kv * groups, ...]`: grouped-query attention's shared heads, each
    kv head repeated for its group of query heads (transformers' `repeat_kv` order)."""
    return x if groups == 1 else x.repeat_interleave(groups, dim=1)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """`[R, h, L, D]` -> `[R*L, h*D]`: one row per packed position (a view when `x` is the
    transposed `[R, L, h, D]` projection, as transformers' attention layers pass it)."""
    r, h, length, d = x.shape
    return x.transpose(1, 2).reshape(r * length, h * d)


def blockwise_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        blocks: PrefixBlocks, scaling: float, dropout: float = 0.0) -> torch.Tensor:
    """Attention of the packed rows `query/key/value [R, H(_kv), L, D]` -> `[R, L, H, D]`."""
    rows, heads, length, dim = query.shape
    kv_heads, groups = key.shape[1], heads // key.shape[1]
    width = blocks.prefix_width
    slots, slot = blocks.own_allowed.shape[2], blocks.own_allowed.shape[3]
    dt = query.dtype

    def probs(scores: torch.Tensor) -> torch.Tensor:
        p = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dt)
        return torch.nn.functional.dropout(p, p=dropout, training=module.training)

    def to_slots(x: torch.Tensor, h: int) -> torch.Tensor:
        """The slots' positions of `x`, whole rows at a time: `[R, h, K, S, D]`."""
        picked = _rows(x).index_select(0, blocks.gather_rows)
        return picked.view(rows, slots, slot, h, dim).permute(0, 3, 1, 2, 4)

    k_pre = _repeat_kv(key[:, :, :width], groups)
    v_pre = _repeat_kv(value[:, :, :width], groups)
    scores = torch.matmul(query[:, :, :width], k_pre.transpose(2, 3)) * scaling
    out_pre = torch.matmul(probs(scores + blocks.additive("prefix_allowed", dt)), v_pre)  # [R, H, P, D]

    q_s = to_slots(query, heads)
    k_s, v_s = (_repeat_kv(to_slots(x, kv_heads), groups) for x in (key, value))  # gathered before the repeat
    to_pre = torch.matmul(q_s.reshape(rows, heads, slots * slot, dim), k_pre.transpose(2, 3)) * scaling
    to_own = torch.matmul(q_s, k_s.transpose(3, 4)) * scaling  # [R, H, K, S, S]
    p = probs(torch.cat([to_pre.view(rows, heads, slots, slot, width) + blocks.additive("prefix_keys", dt),
                         to_own + blocks.additive("own_allowed", dt)], dim=-1))
    out_s = (torch.matmul(p[..., :width].reshape(rows, heads, slots * slot, width), v_pre).view(
        rows, heads, slots, slot, dim) + torch.matmul(p[..., width:], v_s))  # [R, H, K, S, D]

    # Rows past the prefix block start at 0; slot positions land on their packed rows and slot
    # padding on the extra row R*L, which is cut off.
    out = torch.cat([out_pre.transpose(1, 2), out_pre.new_zeros(rows, length - width, heads, dim)], dim=1)
    out = torch.cat([out.reshape(rows * length, heads * dim), out.new_zeros(1, heads * dim)])
    out = out.index_copy(0, blocks.scatter_rows, out_s.permute(0, 2, 3, 1, 4).reshape(-1, heads * dim))
    return out[: rows * length].view(rows, length, heads, dim)


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


def sliding_window(config) -> int | None:
    """The attention window of a model config that applies one (Mistral's `sliding_window`, Qwen2's
    with `use_sliding_window`, Gemma's sliding layers, Llama 4's `attention_chunk_size`), else
    None. A row no longer than it attends as under full causal attention; shared-prefix masks
    and blocks are full causal attention. Read from the text model's config: a multimodal
    model (Gemma 3 4B as AutoModelForCausalLM loads it) keeps its window there, and a window
    not seen gave rows longer than it full attention.

    GPT-Neo's local layers (`window_size`) mask by the position in the packed row, not in the
    sequence, so no packed row is safe from them: 0, which every row is longer than."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    if getattr(c, "window_size", None) and "local" in (getattr(c, "attention_layers", None) or ()):
        return 0
    # Layer by layer where the config says (transformers' layer_types): Qwen2 with
    # use_sliding_window and max_window_layers >= its layers slides in none of them.
    layer_types = getattr(c, "layer_types", None)
    if isinstance(layer_types, (list, tuple)) and layer_types and set(layer_types) == {"full_attention"}:
        return None
    window = getattr(c, "sliding_window", None)
    window = window if window and getattr(c, "use_sliding_window", True) else None
    return min((w for w in (window, getattr(c, "attention_chunk_size", None)) if w), default=None)


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
