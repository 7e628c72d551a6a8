"""Tensor parallelism of the policy's decoder layers (`policy.dtensor_cfg.tensor_parallel_size`).

Megatron-style: in each decoder layer the attention's q/k/v and the MLP's gate/up projections
are split by output features over the `tp` ranks of a group (column parallel), o and down by
input features (row parallel, their outputs summed over the group), so each rank holds 1/tp of
the heads and of the MLP width and the activations between layers stay whole. Embeddings,
norms and the LM head are replicated. The plan is the model's own (transformers'
`config.base_model_tp_plan`), applied with `torch.distributed.tensor.parallel`; FSDP2 then shards
over the data-parallel dimension of the (dp, tp) mesh.

With `policy.dtensor_cfg.sequence_parallel` (Megatron's sequence parallelism), the activations
between the attention and MLP blocks are split too, by sequence position: each rank keeps 1/tp
of the positions through the norms (every one of the layer's, Gemma2's four too) and the residual adds of every layer; each block
all-gathers its input once and its row-parallel projection reduce-scatters its output (instead
of all-reducing it). The same bytes cross the group; the norms' saved activations and work
shrink by tp (benchmarks/results/sequence_parallel_memory.md). The first layer takes its rank's
positions of the embedding output and the final norm gathers them back, so the attention mask,
positions, LM head and loss see whole rows as without it. Rows must split evenly
(`policy.make_sequence_length_divisible_by` a multiple of tp, checked with the config).

Architectures whose plan has only "colwise"/"rowwise" entries under `layers.*` (Llama, Qwen2,
Mistral, ...) are supported; anything else fails at setup, naming what is not.
"""

from __future__ import annotations

from typing import Any

from posttrain.config import InputError

_LAYER_PREFIX = "layers.*."


def _plan(config) -> dict[str, str]:
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not plan:
        raise InputError(f"policy.dtensor_cfg.tensor_parallel_size > 1: {type(config).__name__} has no tensor "
                         "parallel plan (transformers' base_model_tp_plan); use tensor_parallel_size=1")
    unsupported = {k: v for k, v in plan.items() if not k.startswith(_LAYER_PREFIX) or v not in ("colwise", "rowwise")}
    if unsupported:
        raise InputError(f"policy.dtensor_cfg.tensor_parallel_size > 1: {type(config).__name__}'s tensor parallel plan "
                         f"has entries posttrain does not apply ({unsupported}); supported are 'colwise' and "
                         "'rowwise' projections of the decoder layers (Llama, Qwen2, Mistral)")
    return {k[len(_LAYER_PREFIX):]: v for k, v in plan.items()}


def check_tensor_parallel(config, tp: int, key: str = "policy.model_name") -> None:
    """Fail early when model `config` cannot be split over `tp` ranks (heads, KV heads and the MLP width)."""
    if tp == 1:
        return
    _plan(config)
    sizes = {"num_attention_heads": getattr(config, "num_attention_heads", None),
             "num_key_value_heads": getattr(config, "num_key_value_heads", None)
             or getattr(config, "num_attention_heads", None),
             "intermediate_size": getattr(config, "intermediate_size", None)}
    bad = {k: v for k, v in sizes.items() if v is None or v % tp}
    if bad:
        raise InputError(f"{key}: policy.dtensor_cfg.tensor_parallel_size={tp} must divide the model's "
                         + ", ".join(f"{k}={v}" for k, v in bad.items()))


def _sequence_norms(layer: Any, blocks: list[str]) -> list[str]:
    """The norms of decoder `layer` (its children with parameters besides the plan's `blocks`),
    which sequence parallelism runs on the rank's positions. Read from the layer, not a list of
    Llama's two names: Gemma2's pre/post-feedforward norms were left plain, so each rank's
    gradient of their weights covered its own positions only and the ranks' copies diverged.
    A child with parameters that is no norm may not work position by position: refused."""
    weighted = {name: type(child).__name__ for name, child in layer.named_children()
                if name not in blocks and next(child.parameters(), None) is not None}
    others = [f"{name} ({kind})" for name, kind in weighted.items() if "norm" not in kind.lower()]
    if others:
        raise InputError(f"policy.dtensor_cfg.sequence_parallel: decoder layer {type(layer).__name__} has modules with "
                         f"weights outside its attention and MLP that are not norms ({', '.join(others)}); "
                         "sequence parallelism splits only norms by position: set it to false")
    return list(weighted)


def apply_tensor_parallel(model: Any, decoder_layers: list, tp_mesh, sequence_parallel: bool = False) -> None:
    """Split `decoder_layers` of `model` over `tp_mesh` by the model's plan (in place); with
    `sequence_parallel`, their norms and residual stream by sequence position too."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    plan = _plan(model.config)
    # Sequence parallel: the row-parallel projections give the rank's positions (dim 1 of
    # [rows, positions, hidden]); the column-parallel ones take whole rows, gathered once per
    # attention and MLP block (`_reshard_positions_before`) rather than once per projection, which would
    # keep three copies of the gathered rows for the backward of q, k and v.
    styles = {"colwise": ColwiseParallel,
              "rowwise": (lambda: RowwiseParallel(output_layouts=Shard(1))) if sequence_parallel else RowwiseParallel}
    blocks = sorted({name.rpartition(".")[0] for name, style in plan.items() if style == "colwise"})
    for layer in decoder_layers:
        try:
            for name in plan:
                layer.get_submodule(name)
        except AttributeError as e:
            raise InputError(f"tensor parallelism: decoder layer {type(layer).__name__} lacks a module its "
                             f"config's plan names: {e}") from None
        layer_plan = {name: styles[style]() for name, style in plan.items()}
        if sequence_parallel:
            layer_plan.update({name: SequenceParallel(use_local_output=True) for name in _sequence_norms(layer, blocks)})
        parallelize_module(layer, tp_mesh, layer_plan)
        if sequence_parallel:
            for block in blocks:
                _reshard_positions_before(layer.get_submodule(block), tp_mesh, whole=True)
    if sequence_parallel:
        norm = getattr(model.base_model, "norm", None)
        if norm is None:
            raise InputError(f"policy.dtensor_cfg.sequence_parallel: {type(model).__name__} has no final norm "
                             "(base_model.norm) to gather the positions before its head")
        # The first layer takes its rank's share of the embedding output; the final norm, and so
        # the head and the loss, whole rows again.
        _reshard_positions_before(decoder_layers[0], tp_mesh, whole=False)
        _reshard_positions_before(norm, tp_mesh, whole=True)


def _reshard_positions_before(module: Any, tp_mesh, whole: bool) -> None:
    """Before `module` runs, turn its hidden states (first argument, or `hidden_states=`) from
    the rank's share of the positions into whole rows (`whole`: an all-gather over the group)
    or the other way (a slice); autograd's backward of each is the other."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    have, want = ([Shard(1)], [Replicate()]) if whole else ([Replicate()], [Shard(1)])

    def convert(mod, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        hidden = DTensor.from_local(hidden, tp_mesh, have, run_check=False).redistribute(tp_mesh, want).to_local()
        return ((hidden, *args[1:]), kwargs) if args else (args, {**kwargs, "hidden_states": hidden})

    module.register_forward_pre_hook(convert, with_kwargs=True)
