"""Moving policy weights to generation engines (refit).

Two paths (docs/generation.md):
- in process (colocated): `load_state_dict_inplace(model, state_dict)` copies into the
  existing parameters, so nothing is rebuilt and the engine keeps its buffers;
- across processes (separate generation workers): the trainer puts one full CPU state dict
  in Ray's object store with `put_state_dict`, and every generation worker resolves the same
  ref (`resolve_state_dict`); Ray shares the object between processes on a node instead of
  copying it per worker. Fine for small and medium models; a torch.distributed broadcast
  group is the path for multi-GB models on GPUs.
"""

from __future__ import annotations

import time
from typing import Any, Mapping

import torch


def cpu_state_dict(model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A detached, contiguous CPU copy of a module's (or a mapping's) tensors, keys unchanged."""
    sd = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, torch.nn.Module) else model_or_state_dict
    return {k: v.detach().to("cpu", copy=True).contiguous() for k, v in sd.items()}


def put_state_dict(model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor]):
    """Put a full CPU state dict in Ray's object store; returns the `ray.ObjectRef`."""
    import ray

    return ray.put(cpu_state_dict(model_or_state_dict))


def resolve_state_dict(state_dict_or_ref: Any) -> Mapping[str, torch.Tensor]:
    """A state dict from either a mapping or a `ray.ObjectRef` to one."""
    if isinstance(state_dict_or_ref, Mapping):
        return state_dict_or_ref
    import ray

    if isinstance(state_dict_or_ref, ray.ObjectRef):
        return ray.get(state_dict_or_ref)
    raise TypeError(
        f"update_weights takes a state dict or a ray.ObjectRef to one, got {type(state_dict_or_ref).__name__}"
    )


@torch.no_grad()
def load_state_dict_inplace(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> float:
    """Copy `state_dict` into `model`'s existing tensors (cast to their dtype/device); returns seconds.

    Every parameter and persistent buffer of the model must be present (tied weights may appear
    under one of their names); unknown keys are errors, so a mismatched checkpoint fails loudly
    instead of leaving stale weights behind.
    """
    t0 = time.perf_counter()
    own = model.state_dict(keep_vars=True)
    unknown = sorted(set(state_dict) - set(own))
    if unknown:
        raise KeyError(f"update_weights: {len(unknown)} key(s) not in the generation model, e.g. {unknown[:5]}")
    # Everything checked before the first copy: a refit that fails half way would leave a mix of
    # two versions' weights behind.
    covered = {id(own[name]) for name in state_dict}
    missing = [n for n, t in own.items() if id(t) not in covered]
    if missing:
        raise KeyError(f"update_weights: {len(missing)} weight(s) missing from the state dict, e.g. {missing[:5]}")
    wrong = [f"{n} {list(state_dict[n].shape)} for {list(own[n].shape)}" for n in state_dict
             if state_dict[n].shape != own[n].shape]
    if wrong:
        raise ValueError(f"update_weights: {len(wrong)} weight(s) of another shape, e.g. {'; '.join(wrong[:3])}")
    for name, tensor in own.items():
        if name in state_dict:
            tensor.copy_(state_dict[name])
    return time.perf_counter() - t0
