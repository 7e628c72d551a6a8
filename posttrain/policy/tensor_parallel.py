"""Tensor parallelism of the policy's decoder layers (`policy.dtensor_cfg.tensor_parallel_size`).

Megatron-style: in each decoder layer the attention's q/k/v and the MLP's gate/up projections
are split by output features over the `tp` ranks of a group (column parallel), o and down by
input features (row parallel, their outputs summed over the group), so each rank holds 1/tp of
the heads and of the MLP width and the activations between layers stay whole. Embeddings,
norms and the LM head are replicated. The plan is the model's own (transformers'
`config.base_model_tp_plan`), applied with `torch.distributed.tensor.parallel`; FSDP2 then shards
over the data-parallel dimension of the (dp, tp) mesh.

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


def apply_tensor_parallel(model: Any, decoder_layers: list, tp_mesh) -> None:
    """Split `decoder_layers` of `model` over `tp_mesh` by the model's plan (in place)."""
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    plan = _plan(model.config)
    for layer in decoder_layers:
        try:
            for name in plan:
                layer.get_submodule(name)
        except AttributeError as e:
            raise InputError(f"tensor parallelism: decoder layer {type(layer).__name__} lacks a module its "
                             f"config's plan names: {e}") from None
        parallelize_module(layer, tp_mesh, {name: styles[style]() for name, style in plan.items()})
