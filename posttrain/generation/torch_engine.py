"""The built-in `torch` generation engine: continuous batching with a slot KV cache.

Why it is faster than HF `generate`: HF pays, every step, for mask construction, a cache
that grows by concatenation, logits processors and stopping criteria written for generality.
This engine runs its own decode step over the model's
weights (fused QKV and gate/up projections, one pre-allocated KV cache, a handful of kernels
per layer), keeps all bookkeeping vectorized, and decodes prompts of any length together:
each slot of the batch has its own position, so prompts need no left padding and a finished
sequence's slot is refilled by a waiting prompt (continuous batching) while the others go on.

Supported architectures: the Llama family as laid out by transformers (`model_type` in
`SUPPORTED_MODEL_TYPES`: Llama, Mistral and Qwen2 without a sliding window shorter than the
context, Qwen3). For any other causal LM use the `hf` backend (the error says so).

KV-cache memory is bounded by `torch_cfg.max_tokens_in_flight`: the engine runs at most
`max_tokens_in_flight // slot_length` slots, where a slot holds the longest prompt plus
`max_new_tokens` (capped at the context).
"""

from __future__ import annotations

import functools
import time
from collections import deque

import torch
import torch.nn.functional as F

from posttrain.config import ConfigError
from posttrain.data.batch import BatchedDataDict
from posttrain.data.packing import round_up
from posttrain.distributed.weight_sync import load_state_dict_inplace, resolve_state_dict
from posttrain.generation.interfaces import (
    assemble_padded,
    pad_token_id,
    prepare_prompts,
)
from posttrain.generation.sampling import SamplingSettings, StopChecker, sample, seen_tokens, version_seed
from posttrain.policy.blockwise_attention import base_implementation, sliding_window
from posttrain.policy.hf_io import DTYPES

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# Prompts prefilled in one forward are capped at this many (padded) tokens (vLLM's chunked
# prefill budget is of this order too). Small chunks keep each layer's intermediates in the
# CPU caches and out of fresh page-faulted allocations: prefilling 256 prompts of 16-64 tokens
# into the 30m model took 6.4 s in chunks of 16384 tokens and 2.8 s in chunks of 2048 (measured).
_PREFILL_CHUNK_TOKENS = 2048
# A free slot is refilled once this fraction of the slots is free (or none is running):
# a prefill forward costs about as much as a decode step, so refilling one slot at a time
# would double the forwards in a long tail of short sequences.
_REFILL_FRACTION = 0.125
# The KV cache grows by this factor when the longest sequence reaches its end (see _SlotCache),
# its length kept a multiple of _CACHE_ROUND positions.
_CACHE_GROWTH = 1.25
_CACHE_ROUND = 16
# When no prompt is waiting and at most this fraction of slots is still running, the cache
# is compacted to the running slots so the tail does not pay for finished ones.
_COMPACT_FRACTION = 0.5

class UnsupportedModelError(ConfigError, NotImplementedError):
    """The torch engine cannot run this architecture: a choice of policy.generation.backend, so the
    CLI prints the message alone (it printed a traceback into the engine)."""


def check_supported(model, context: int | None = None) -> None:
    """Raise a clear error when `model` is not a Llama-family causal LM this engine can run on
    sequences of up to `context` tokens (None: the model's max_position_embeddings): its config
    (`check_supported_config`) and its module layout."""
    check_supported_config(model.config, context)
    if not hasattr(model, "model") or not hasattr(model.model, "layers") or not hasattr(model, "lm_head"):
        raise _unsupported("the model does not have the `model.layers` / `lm_head` layout")


def check_supported_config(config, context: int | None = None) -> None:
    """What `check_supported` can tell from the HF config alone; GRPO's driver asks it before Ray
    and the workers start (the workers' error came 8-10 s in).

    A sliding window at least as long as the context never slides (each position sees all
    earlier ones), as Mistral 7B v0.1's 4,096 does at the usual RL contexts."""
    mt = getattr(config, "model_type", None)
    if mt not in SUPPORTED_MODEL_TYPES:  # first: another family's config may lack what is read below
        raise _unsupported(f"model_type {mt!r} is not one of {SUPPORTED_MODEL_TYPES}")
    if (window := sliding_window(config)) is not None:
        context = context or config.max_position_embeddings
        if window < context:
            raise _unsupported(f"sliding-window attention (window {window}, shorter than the {context}-token context) "
                               "is not supported")


def _unsupported(problem: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"the torch generation engine cannot run this model: {problem}; use "
                                 "policy.generation.backend=hf (any causal LM) or vllm")


class _Weights:
    """The decode-time copy of the model's weights: fused, in the engine's dtype.

    In float32 the unfused tensors are views of the live parameters; the fused QKV and
    gate/up matrices are copies, which `refresh()` rebuilds after the model's weights change.
    In bf16 on a CPU where `_packing_ok()`, the matrices of the linear layers are held in oneDNN's
    prepacked layout instead.
    """

    def __init__(self, model, dtype: torch.dtype, device: torch.device, max_positions: int):
        check_supported(model, max_positions)
        self.model = model
        self.dtype = dtype
        self.device = device
        c = model.config
        self.n_heads = c.num_attention_heads
        self.n_kv = c.num_key_value_heads
        self.head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        self.eps = c.rms_norm_eps
        self.n_layers = len(model.model.layers)
        self.vocab_size = model.lm_head.weight.shape[0]
        self.pack = dtype == torch.bfloat16 and device.type == "cpu" and _packing_ok()
        from transformers.activations import ACT2FN

        self.act = ACT2FN[c.hidden_act]
        # Rotary embedding: cos and sin for every position, computed once by the model's own
        # rotary module (so any rope scaling applies).
        # Dynamic (NTK) scaling depends on the sequence length and is off within the model's
        # original context: those positions come from a call over that span alone (exact for every
        # sequence that fits it), the positions past it from a call over all of them (scaled for
        # the whole context; no one table matches a forward whose scaling follows its own length).
        # One call over all positions scaled them all: another model than the policy's.
        rot = model.model.rotary_emb
        zero = torch.zeros(1, dtype=torch.float32, device=rot.inv_freq.device)
        pos = torch.arange(max_positions, device=zero.device)[None]
        short = min(max_positions, getattr(rot, "original_max_seq_len", max_positions))
        cos, sin = rot(zero, pos[:, :short])
        if short < max_positions:
            cos_long, sin_long = rot(zero, pos)
            cos, sin = torch.cat([cos, cos_long[:, short:]], dim=1), torch.cat([sin, sin_long[:, short:]], dim=1)
        # In the engine's dtype, as transformers casts them to the activations' dtype. The sine's
        # first half negated: q*cos + rotate_half(q)*sin = q*cos + swap_halves(q)*signed_sin, the
        # same roundings (negation is exact) with one kernel fewer.
        half = self.head_dim // 2
        self.cos = cos[0].to(device=device, dtype=dtype)  # [P, d]
        self.sin = torch.cat([-sin[0, :, :half], sin[0, :, half:]], dim=-1).to(device=device, dtype=dtype)
        # Prefill attention computed as the policy's forward computes it: transformers' eager
        # arithmetic for a model loaded with eager attention (posttrain's CPU default), else SDPA.
        self.eager = base_implementation(model) == "eager"  # also under posttrain's blockwise wrapper
        self.refresh()

    def _t(self, t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.detach().to(device=self.device, dtype=self.dtype)

    def _matrix(self, t: torch.Tensor) -> torch.Tensor:
        """A linear layer's weight for `linear`: prepacked by oneDNN when `self.pack`."""
        t = self._t(t)
        return torch.ops.mkldnn._reorder_linear_weight(t, _PACK_ROWS) if self.pack else t

    @torch.no_grad()
    def refresh(self) -> None:
        """Re-read every weight from the model (after training or a state-dict load)."""
        m = self.model
        self.embed = self._t(m.model.embed_tokens.weight)
        self.norm = self._t(m.model.norm.weight)
        self.lm_head = self._matrix(m.lm_head.weight)
        self.layers = []
        for layer in m.model.layers:
            a, mlp = layer.self_attn, layer.mlp
            qkv_bias = None
            if a.q_proj.bias is not None:
                qkv_bias = self._t(torch.cat([a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]))
            self.layers.append(
                dict(
                    ln1=self._t(layer.input_layernorm.weight),
                    ln2=self._t(layer.post_attention_layernorm.weight),
                    qkv=self._matrix(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight])),
                    qkv_bias=qkv_bias,
                    o=self._matrix(a.o_proj.weight),
                    o_bias=self._t(a.o_proj.bias),
                    gate_up=self._matrix(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                    gate_up_bias=None
                    if mlp.gate_proj.bias is None
                    else self._t(torch.cat([mlp.gate_proj.bias, mlp.up_proj.bias])),
                    down=self._matrix(mlp.down_proj.weight),
                    down_bias=self._t(mlp.down_proj.bias),
                    q_norm=self._t(a.q_norm.weight) if hasattr(a, "q_norm") else None,
                    k_norm=self._t(a.k_norm.weight) if hasattr(a, "k_norm") else None,
                )
            )

    def rms(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """RMSNorm as transformers' Llama computes it (statistics in float32), op for op: the
        same roundings, so the engine's logprobs are the policy's own (in float32 too:
        `F.rms_norm` rounds otherwise)."""
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * xf.to(x.dtype)


class _SlotCache:
    """KV cache `[slots, kv_heads, length, head_dim]` per layer; each slot has its own sequence length.

    Decode attention reads the whole cache `length` (masked per slot), never a slice
    `[:, :, :span]` of a longer one: CPU batched matmuls over such a slice ran 2-3x slower than
    over a contiguous cache of the same span (measured at 1280 x 128 x 32: 2.8 vs 1.2 ms), as the
    memory stream breaks at every row. So the cache starts a little longer than the longest
    prompt and grows by `_CACHE_GROWTH` when the longest sequence reaches its end, up to
    `max_length`. Each layer's cache is a contiguous prefix view of one buffer allocated for
    `max_length` up front, and growing re-lays the rows out in place: fresh allocations of this
    size cost more in page faults than the copy (measured: 74 ms per 58 MB tensor).
    """

    def __init__(self, w: _Weights, slots: int, length: int, max_length: int):
        # The cache is in the engine's dtype: half the memory in bf16, and over this contiguous
        # cache CPU decode attention in bf16 was 2-4x faster than in float32 at head_dim 128,
        # 1-2.5x at 64 and within +-25% either way at 32 (5 runs each; the VM's memory bandwidth
        # drifts). Over a slice of a longer cache, as before _SlotCache was contiguous, bf16 was
        # the slower one.
        self.dtype = w.dtype
        self.slots, self.n_kv, self.head_dim = slots, w.n_kv, w.head_dim
        self.length, self.max_length = min(length, max_length), max_length
        # Zeros, not empty: masked positions get weight 0, and 0 * NaN from uninitialised memory is NaN.
        numel = slots * w.n_kv * max_length * w.head_dim
        self._k = [torch.zeros(numel, dtype=self.dtype, device=w.device) for _ in range(w.n_layers)]
        self._v = [torch.zeros(numel, dtype=self.dtype, device=w.device) for _ in range(w.n_layers)]
        self._views()

    def _views(self) -> None:
        shape = (self.slots, self.n_kv, self.length, self.head_dim)
        numel = self.slots * self.n_kv * self.length * self.head_dim
        self.k = [b[:numel].view(shape) for b in self._k]
        self.v = [b[:numel].view(shape) for b in self._v]

    def ensure(self, span: int) -> None:
        """Grow so that positions `[0, span)` fit; the cached rows keep their contents."""
        if span <= self.length:
            return
        new = min(self.max_length, max(span, round_up(int(self.length * _CACHE_GROWTH), _CACHE_ROUND)))
        for b in self._k + self._v:
            _spread_rows(b, self.slots * self.n_kv, self.length * self.head_dim, new * self.head_dim)
        self.length = new
        self._views()

    def keep(self, idx: torch.Tensor) -> None:
        """Keep only slots `idx` (ascending), renumbered 0..len(idx)-1."""
        kept = [t[idx] for t in self.k + self.v]
        self.slots = len(idx)
        self._views()
        for dst, src in zip(self.k + self.v, kept):
            dst.copy_(src)


def _spread_rows(flat: torch.Tensor, rows: int, old: int, new: int) -> None:
    """In place: `rows` rows of `old` elements stored back to back in `flat` move to a row stride `new > old`.

    Row r moves from r*old to r*new. Going from the last rows down, a block of rows [a, b) whose
    destination starts at or after the end of its source (a*new >= b*old) is one copy; the few
    first rows that overlap their own destination go through a temporary.
    """
    b = rows
    while b > 1:
        a = -(-b * old // new)
        if a >= b:  # the row overlaps its own destination
            a = b - 1
            flat[a * new : a * new + old] = flat[a * old : b * old].clone()
        else:
            flat[a * new : b * new].view(b - a, new)[:, :old] = flat[a * old : b * old].view(b - a, old)
        b = a


# The row count oneDNN lays a prepacked weight out for; any other count runs on it too.
_PACK_ROWS = 128


@functools.cache
def _packing_ok() -> bool:
    """Whether this CPU's oneDNN runs bf16 linears on prepacked weights with `F.linear`'s results.

    Prepacked, the matrix is reordered once per refit instead of at every call: decode-shaped
    linears (16-512 rows, 160-3072 features) ran 1.0-2.1x faster on a Xeon with AMX, 1 or 2
    threads (one shape 0.75x), and about equal at 2,048 rows; the 30m model's 128 x 64-token
    rollout 12% faster (in-process alternation). Checked once on random data, with a bias,
    because the engine's logprobs must stay the policy's; off wherever oneDNN lacks the ops or
    differs. (At some row counts the packed and the plain kernel split their float32 sums
    differently, as the plain kernel does between shapes: a bf16 rounding step here and there.)"""
    try:
        g = torch.Generator().manual_seed(0)
        w, x, b = (torch.randn(shape, generator=g).to(torch.bfloat16) for shape in ((96, 64), (5, 3, 64), (96,)))
        got = torch.ops.mkldnn._linear_pointwise(x, torch.ops.mkldnn._reorder_linear_weight(w, _PACK_ROWS), b,
                                                 "none", [], "")
        return torch.equal(got, F.linear(x, w, b))
    except (AttributeError, RuntimeError, NotImplementedError):
        return False


def linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` over a plain or a prepacked (`_Weights._matrix`) weight."""
    if w.is_mkldnn:
        return torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
    return F.linear(x, w, b)


def _layer_qkv(w: _Weights, p: dict, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """h [B, S, H] -> q [B, nh, S, d], k/v [B, nkv, S, d], rotary applied; cos/sin [B, S, 1, d]."""
    b, s, _ = h.shape
    nh, nkv, d = w.n_heads, w.n_kv, w.head_dim
    qkv = linear(w.rms(h, p["ln1"]), p["qkv"], p["qkv_bias"])
    qk = qkv[..., : (nh + nkv) * d].view(b, s, nh + nkv, d)
    if p["q_norm"] is not None:
        qk = torch.cat([w.rms(qk[:, :, :nh], p["q_norm"]), w.rms(qk[:, :, nh:], p["k_norm"])], dim=2)
    # q and k rotated together, in the engine's dtype with transformers' roundings (each product,
    # then the sum). Rotating in float32 and rounding once, as a complex multiply did, moved bf16
    # logprobs off the policy's (quickstart, Xeon with AMX: mean exp|diff| 1.0098 against 1.0000
    # now, with the prefill and score roundings below).
    swapped = torch.cat([qk[..., d // 2 :], qk[..., : d // 2]], dim=-1)
    qk = qk * cos + swapped * sin
    v = qkv[..., (nh + nkv) * d :].view(b, s, nkv, d).transpose(1, 2)
    return qk[:, :, :nh].transpose(1, 2), qk[:, :, nh:].transpose(1, 2), v


def _layer_out(w: _Weights, p: dict, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
    """Residual + output projection + MLP; attn [B, nh, S, d], x [B, S, H]."""
    b, _, s, _ = attn.shape
    x = x + linear(attn.transpose(1, 2).reshape(b, s, -1), p["o"], p["o_bias"])
    gu = linear(w.rms(x, p["ln2"]), p["gate_up"], p["gate_up_bias"])
    g, u = gu.chunk(2, dim=-1)
    return x + linear(w.act(g) * u, p["down"], p["down_bias"])


def _logits(w: _Weights, x: torch.Tensor) -> torch.Tensor:
    return linear(w.rms(x, w.norm), w.lm_head)


# Eager prefill attention holds at most this many scores at once (float32 for the softmax:
# 64 MB); longer prompts run in blocks of query rows.
_EAGER_SCORES = 1 << 24


def _eager_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal attention `q [b, nh, s, d]`, `k/v [b, nkv, s, d]` with transformers' eager
    arithmetic: scores rounded to the dtype, then scaled, masked, softmax in float32 rounded back,
    times the values. SDPA's fused kernel rounds otherwise (the first token's bf16 logprob moved
    by mean exp|diff| 1.0025 from the eager policy's). In blocks of query rows for long prompts."""
    b, nh, s, d = q.shape
    group = nh // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    rows = max(1, min(s, _EAGER_SCORES // max(1, b * nh * s)))
    keys = torch.arange(s, device=q.device)
    out = []
    for start in range(0, s, rows):
        scores = torch.matmul(q[:, :, start:start + rows], k.transpose(2, 3)) * d**-0.5
        future = keys[None] > torch.arange(start, min(start + rows, s), device=q.device)[:, None]
        scores = scores.masked_fill(future, float("-inf"))
        out.append(torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v))
    return out[0] if len(out) == 1 else torch.cat(out, dim=2)


def prefill(w: _Weights, cache: _SlotCache, tokens: torch.Tensor, lengths: torch.Tensor, slots: torch.Tensor):
    """Run right-padded prompts `tokens [b, S]` into cache `slots [b]`; returns next-token logits [b, V].

    Right padding needs no mask: with causal attention a real token only sees earlier real
    tokens, and the padded positions' keys are overwritten by decoding before they are read.
    """
    b, s = tokens.shape
    x = w.embed[tokens]
    cos, sin = w.cos[:s][None, :, None], w.sin[:s][None, :, None]
    gqa = w.n_heads != w.n_kv
    for li, p in enumerate(w.layers):
        q, k, v = _layer_qkv(w, p, x, cos, sin)
        cache.k[li][slots, :, :s] = k
        cache.v[li][slots, :, :s] = v
        if w.eager:
            attn = _eager_causal_attention(q, k, v)
        else:
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
        x = _layer_out(w, p, x, attn)
    last = x[torch.arange(b, device=x.device), lengths - 1]
    return _logits(w, last)


def decode(w: _Weights, cache: _SlotCache, tokens: torch.Tensor, positions: torch.Tensor):
    """One token per slot: `tokens [N]` at `positions [N]` (all slots); returns logits [N, V].

    Attention reads the whole cache, masked per slot to its own length (see _SlotCache).
    """
    n = tokens.shape[0]
    x = w.embed[tokens][:, None]  # [N, 1, H]
    cos, sin = w.cos[positions][:, None, None], w.sin[positions][:, None, None]
    length = cache.length
    # Row of (slot, kv head) at its position in the cache viewed as [N * n_kv * length, d]:
    # one index_copy_ per tensor is several times cheaper than advanced-index assignment.
    flat = ((torch.arange(n, device=tokens.device) * w.n_kv)[:, None] + torch.arange(w.n_kv, device=tokens.device))
    flat = (flat * length + positions[:, None]).reshape(-1)
    # Attention as two batched matmuls over (slot, kv head), the query heads of a group stacked
    # as rows: fewer, larger kernels than SDPA's CPU path for one query, and GQA needs no repeat.
    nkv, group, d = w.n_kv, w.n_heads // w.n_kv, w.head_dim
    visible = torch.arange(length, device=tokens.device)[None] <= positions[:, None]  # [N, length]
    cdt = cache.dtype
    bias = torch.zeros(n, length, dtype=cdt, device=tokens.device).masked_fill_(~visible, float("-inf"))
    bias = bias.repeat_interleave(nkv, dim=0)[:, None]  # [N * nkv, 1, length]
    scale = d**-0.5
    # One bf16 query per (slot, head): keys times the query (a matrix-vector product per pair) gives
    # the same values as the query times the transposed keys and read the cache 1.1-2.3x faster on
    # 2 threads (Xeon with AMX; 80-2048 pairs of 32-320 positions, head_dim 32-128), 0.9-2.1x on one.
    # In float32 it was 2x slower, and with grouped queries mixed.
    keys_first = group == 1 and cdt == torch.bfloat16
    for li, p in enumerate(w.layers):
        q, k, v = _layer_qkv(w, p, x, cos, sin)
        kc, vc = cache.k[li], cache.v[li]
        kc.view(-1, d).index_copy_(0, flat, k.reshape(-1, d))
        vc.view(-1, d).index_copy_(0, flat, v.reshape(-1, d))
        # Rounded, scaled, then masked, as transformers' eager attention (which the training
        # forward runs) computes them: one baddbmm rounds once, and the logprobs drift off the
        # policy's wherever the scale is not a power of two.
        if keys_first:
            scores = torch.bmm(kc.view(n * nkv, -1, d), q.reshape(n * nkv, d, 1)).view(n * nkv, 1, -1)
        else:
            scores = torch.bmm(q.reshape(n * nkv, group, d), kc.view(n * nkv, -1, d).transpose(1, 2))
        scores = scores.mul_(scale).add_(bias)
        # Softmax in float32, as transformers' eager attention.
        attn = torch.bmm(torch.softmax(scores, dim=-1, dtype=torch.float32).to(cdt), vc.view(n * nkv, -1, d))
        x = _layer_out(w, p, x, attn.view(n, w.n_heads, 1, d))
    return _logits(w, x[:, 0])


def stop_token_ids(tokenizer, cfg, *configs) -> list[int]:
    """`cfg.stop_token_ids` plus, unless `cfg.ignore_eos`, the EOS ids of the tokenizer and of
    `configs`: the model's config and its generation config, whose EOS ids HF `generate` and vLLM
    stop on (chat models often list their end-of-turn token there only, e.g. Llama 3 Instruct's)."""
    ids = set(cfg.stop_token_ids or [])
    if cfg.ignore_eos:
        return sorted(ids)
    for e in (tokenizer.eos_token_id, *(getattr(c, "eos_token_id", None) for c in configs)):
        if isinstance(e, int):
            ids.add(e)
        elif e:
            ids.update(e)
    return sorted(ids)


class TorchGeneration:
    """The `torch` backend (see the module docstring); implements `GenerationInterface`."""

    def __init__(self, model, tokenizer, cfg, max_total_sequence_length: int, precision: str = "float32",
                 device: str | torch.device = "cpu"):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.model = model.eval()
        self.context = max_total_sequence_length
        self.device = torch.device(device)
        dtype = DTYPES[cfg.torch_cfg.precision or precision]
        self.weights = _Weights(self.model, dtype, self.device, max_total_sequence_length)
        self.stop = StopChecker(tokenizer, stop_token_ids(tokenizer, cfg, model.config, model.generation_config))
        self.pad_id = pad_token_id(tokenizer)
        self.generator = torch.Generator(self.device).manual_seed(cfg.seed)
        self.weight_version = 0

    # ------------------------------------------------------------------ interface

    def prepare_for_generation(self) -> None:
        # Colocated: the policy trained the model in place; the fused copies must follow.
        self.weights.refresh()

    def finish_generation(self) -> None:
        # The KV cache lives only inside generate(); nothing else is held between calls.
        return None

    def update_weights(self, state_dict_or_ref, version: int) -> float:
        """Copy new weights into the existing model (no rebuild); returns the refit seconds."""
        t0 = time.perf_counter()
        load_state_dict_inplace(self.model, resolve_state_dict(state_dict_or_ref))
        self.weights.refresh()
        self.weight_version = version
        self.generator.manual_seed(version_seed(self.cfg.seed, version))
        return time.perf_counter() - t0

    @torch.inference_mode()
    def generate(self, batch: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        cfg = self.cfg
        # One right-padded tensor of the prompts: the loop below gathers rows from it instead of
        # touching hundreds of per-row tensors (bookkeeping was ~20% of a 512-row GRPO rollout).
        padded, plen, stops, prompt_truncated = prepare_prompts(batch, cfg, self.context, self.pad_id)
        settings = SamplingSettings.from_config(cfg, greedy)
        out = assemble_padded(padded, plen, *self._run(padded, plen, stops, settings), prompt_truncated, self.pad_id)
        return out

    # ------------------------------------------------------------------ the decode loop

    def _num_slots(self, n: int, slot_len: int) -> int:
        tc = self.cfg.torch_cfg
        slots = min(tc.max_batch_size, n)
        if tc.max_tokens_in_flight is not None:
            if tc.max_tokens_in_flight < slot_len:
                # A config error (the CLI prints it alone), even when a Ray worker finds it.
                raise ConfigError(
                    f"policy.generation.torch_cfg.max_tokens_in_flight={tc.max_tokens_in_flight} is smaller "
                    f"than one sequence ({slot_len} tokens = longest prompt + max_new_tokens); raise it"
                )
            slots = min(slots, tc.max_tokens_in_flight // slot_len)
        return slots

    def _run(self, prompts: torch.Tensor, plen: torch.Tensor, stops: list[list[str]], settings: SamplingSettings):
        """Generate for right-padded `prompts [n, P]` of lengths `plen`; returns generated tokens and
        their logprobs `[n, G]`, generation lengths `[n]` and whether each ran out of room `[n]`."""
        w, dev, n = self.weights, self.device, prompts.shape[0]
        max_new = torch.clamp(self.context - plen, max=self.cfg.max_new_tokens)
        slot_len = int((plen + max_new).max())
        cap = int(max_new.max())
        num = self._num_slots(n, slot_len)
        cache = _SlotCache(w, num, round_up(int(plen.max()) + 16, _CACHE_ROUND), slot_len)
        stop_ids = self.stop.stop_id_tensor(dev)
        all_stops = {s for row in stops for s in row}
        cand_table = self.stop.candidates(all_stops, w.vocab_size).to(dev) if all_stops else None

        req = torch.full((num,), -1, dtype=torch.long)  # request in each slot, -1 = free
        active = torch.zeros(num, dtype=torch.bool, device=dev)
        seq_len = torch.zeros(num, dtype=torch.long, device=dev)  # tokens in the cache
        n_gen = torch.zeros(num, dtype=torch.long, device=dev)
        limit = torch.ones(num, dtype=torch.long, device=dev)
        last = torch.zeros(num, dtype=torch.long, device=dev)
        gen_buf = torch.zeros(num, cap, dtype=torch.long, device=dev)
        lp_buf = torch.zeros(num, cap, dtype=torch.float32, device=dev)
        has_stop_str = torch.zeros(num, dtype=torch.bool, device=dev)
        # The tokens already in each slot's sequence, for the repetition penalty (none without one).
        seen = torch.zeros(num, w.vocab_size, dtype=torch.bool, device=dev) if settings.penalises_repeats else None

        # Per request: its tokens, logprobs and count once it finishes, and whether it hit no stop.
        out_tok = torch.zeros(n, cap, dtype=torch.long)
        out_lp = torch.zeros(n, cap, dtype=torch.float32)
        out_len = torch.zeros(n, dtype=torch.long)
        out_trunc = torch.zeros(n, dtype=torch.bool)
        waiting = deque(range(n))
        refill_min = max(1, int(num * _REFILL_FRACTION))

        def record(tok, lp, rows):
            """Append sampled tokens of `rows` and finish the rows that stop."""
            gen_buf[rows, n_gen[rows]] = tok
            lp_buf[rows, n_gen[rows]] = lp
            n_gen[rows] += 1
            if seen is not None:
                seen[rows, tok] = True
            hit_id = torch.isin(tok, stop_ids)
            done = hit_id | (n_gen[rows] >= limit[rows])
            if cand_table is not None:
                # Rows at their token limit are checked too: a stop string completed by the last
                # allowed token is a stop, not a truncation.
                maybe = (cand_table[tok] & has_stop_str[rows] & ~hit_id).nonzero().flatten().tolist()
                for j in maybe:
                    s = int(rows[j])
                    r = int(req[s])
                    if self.stop.ends_with_stop_string(gen_buf[s, : int(n_gen[s])].tolist(), stops[r]):
                        done[j] = True
                        hit_id[j] = True
            done_at = done.nonzero().flatten()
            if len(done_at):
                slots = rows[done_at]
                cpu_slots = slots.cpu()
                at = req[cpu_slots]
                out_tok[at], out_lp[at] = gen_buf[slots].cpu(), lp_buf[slots].cpu()
                out_len[at], out_trunc[at] = n_gen[slots].cpu(), ~hit_id[done_at].cpu()
                req[cpu_slots] = -1
                active[slots] = False

        while waiting or bool(active.any()):
            free = (req < 0).nonzero().flatten()
            if waiting and len(free) and (len(free) >= refill_min or not bool(active.any())):
                take = free[: len(waiting)].tolist()
                reqs = [waiting.popleft() for _ in take]
                self._refill(cache, prompts, reqs, take, plen, max_new, stops, settings, req, active, seq_len,
                             n_gen, limit, last, has_stop_str, seen, record)
            if not bool(active.any()):
                continue
            if not waiting and int(active.sum()) <= num * _COMPACT_FRACTION and num > 1:
                idx = active.nonzero().flatten()
                cache.keep(idx)
                req = req[idx.cpu()]  # req stays on the CPU (a CPU tensor takes no CUDA index)
                active, seq_len, n_gen, limit, last = (t[idx] for t in (active, seq_len, n_gen, limit, last))
                gen_buf, lp_buf, has_stop_str = gen_buf[idx], lp_buf[idx], has_stop_str[idx]
                seen = None if seen is None else seen[idx]
                num = len(idx)
            cache.ensure(int(seq_len.max()) + 1)
            logits = decode(w, cache, last, seq_len)
            tok, lp = sample(logits, settings, self.generator, seen, rows=req)  # free slots: -1, not checked
            act = active.nonzero().flatten()
            seq_len += active.long()
            last = torch.where(active, tok, last)
            record(tok[act], lp[act], act)
        return out_tok, out_lp, out_len, out_trunc

    def _refill(self, cache, prompts, reqs, slots, plen, max_new, stops, settings, req, active, seq_len, n_gen,
                limit, last, has_stop_str, seen, record):
        """Prefill waiting prompts `reqs` into free `slots` and sample their first token (`seen`, the
        slots' seen tokens for the repetition penalty or None, starts as their prompts).

        Identical prompts (the n samples of one GRPO prompt) are prefilled once: the other
        slots get a copy of its KV cache and its next-token logits, then sample on their own."""
        dev = self.device
        lengths = plen[reqs].tolist()
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault((n, *row[:n]), j)
                  for j, (n, row) in enumerate(zip(lengths, prompts[reqs].tolist()))]
        # First occurrences, shortest first: chunks of similar lengths waste little on padding.
        unique = sorted(first.values(), key=lambda j: lengths[j])
        chunk_logits, row_of = [], {}  # row_of: unique prompt j -> its row in the stacked logits
        start = 0
        while start < len(unique):
            # Grow the chunk while its padded size stays under the prefill budget.
            end, longest = start, 0
            while end < len(unique):
                longest_next = max(longest, lengths[unique[end]])
                if end > start and longest_next * (end - start + 1) > _PREFILL_CHUNK_TOKENS:
                    break
                longest, end = longest_next, end + 1
            js = unique[start:end]
            tokens = prompts[[reqs[j] for j in js], :longest].to(dev)
            ss = torch.tensor([slots[j] for j in js], dtype=torch.long, device=dev)
            chunk_logits.append(prefill(self.weights, cache, tokens, plen[[reqs[j] for j in js]].to(dev), ss))
            base = len(row_of)
            row_of.update({j: base + i for i, j in enumerate(js)})
            start = end
        copies = [j for j, src in enumerate(source) if src != j]
        if copies:
            dst = torch.tensor([slots[j] for j in copies], dtype=torch.long, device=dev)
            src = torch.tensor([slots[source[j]] for j in copies], dtype=torch.long, device=dev)
            width = max(lengths[j] for j in copies)
            for kc, vc in zip(cache.k, cache.v):
                kc[dst, :, :width] = kc[src, :, :width]
                vc[dst, :, :width] = vc[src, :, :width]
        ss = torch.tensor(slots, dtype=torch.long, device=dev)
        lens = plen[reqs].to(dev)
        logits = torch.cat(chunk_logits)[torch.tensor([row_of[src] for src in source], device=dev)]
        if seen is not None:
            rows = prompts[reqs].to(dev)  # right-padded
            seen[ss] = seen_tokens(rows, torch.arange(rows.shape[1], device=dev)[None] < lens[:, None], seen.shape[1])
        tok, lp = sample(logits, settings, self.generator, None if seen is None else seen[ss], rows=reqs)
        req[ss.cpu()] = torch.tensor(reqs, dtype=torch.long)
        active[ss] = True
        seq_len[ss] = lens
        n_gen[ss] = 0
        limit[ss] = max_new[reqs].to(dev)
        last[ss] = tok
        has_stop_str[ss] = torch.tensor([bool(stops[r]) for r in reqs], device=dev)
        record(tok, lp, ss)
