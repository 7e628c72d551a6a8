"""LoRA through peft (`policy.lora`), and its export: merged weights or the adapter alone.

`maybe_apply_lora(model, cfg)` wraps a model in a peft `PeftModel` when `policy.lora.enabled`;
the worker applies it before sharding, so only the adapter (and, for reward models, the
score head) trains. The export helpers work on a FULL state dict of the wrapped model (what
a worker gathers from its FSDP shards), so they need no live peft module:

- `merge_lora_state_dict(sd, cfg)`: the base model's state dict with every adapted linear
  weight replaced by W + (alpha / r) * B @ A (LoRA, https://arxiv.org/abs/2106.09685, eq. 3);
  loadable by the base architecture's `from_pretrained`, and what generation engines get.
- `adapter_state_dict(sd)` / `save_adapter(...)`: the adapter alone in peft's on-disk layout
  (`adapter_model.safetensors` + `adapter_config.json`), loadable by
  `peft.PeftModel.from_pretrained(base_model, path)`.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from posttrain.config import InputError
from posttrain.schemas import LoraConfig

_PEFT_PREFIX = "base_model.model."
_ADAPTER = "default"  # peft's name for the one adapter maybe_apply_lora adds


# A sequence classifier's head: freshly initialised, trained in full (peft's modules_to_save), never adapted.
SCORE_HEADS = ("score", "classifier")


def _is_classifier(model: Any) -> bool:
    return type(model).__name__.endswith("ForSequenceClassification")


def _peft_config(cfg: LoraConfig, model: Any):
    from peft import LoraConfig as PeftLoraConfig
    from peft import TaskType

    # Sequence classification: peft also trains (and saves) the freshly initialised score head.
    is_cls = _is_classifier(model)
    return PeftLoraConfig(
        r=cfg.rank,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=cfg.target_modules,
        task_type=TaskType.SEQ_CLS if is_cls else TaskType.CAUSAL_LM,
    )


def maybe_apply_lora(model: Any, cfg: LoraConfig) -> Any:
    """`model` wrapped with trainable LoRA adapters when `cfg.enabled`, else `model` itself.

    Base weights are frozen (requires_grad False); lora_A is initialised randomly and lora_B
    to zero, so the wrapped model starts out computing exactly the base model. Only
    torch.nn.Linear layers can be adapted, and every name in a list of target modules must be
    one. A module whose weight is tied to another's (the LM head of tied embeddings) cannot be
    adapted: the merged weights would differ between the two, and the tied architecture that
    the HF export and the generation refit load keeps only one of them. Errors are InputErrors
    naming policy.lora.target_modules.
    """
    if not cfg.enabled:
        return model
    from peft import get_peft_model
    from peft.utils.error import NoMatchingPeftModuleError

    tied = {key.rsplit(".", 1)[0] for pair in (getattr(model, "all_tied_weights_keys", None) or {}).items()
            for key in pair}
    head = set(SCORE_HEADS) if _is_classifier(model) else set()
    linear = [name for name, module in model.named_modules()
              if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] not in head]

    def targets_error(what: str) -> InputError:
        return InputError(f"policy.lora.target_modules={cfg.target_modules!r}: {what} in {type(model).__name__}; "
                          f"its linear layers are {', '.join(sorted({n.rsplit('.', 1)[-1] for n in linear}))} "
                          "(a list of these names, \"all-linear\", or a regular expression that whole module "
                          "names such as model.layers.0.self_attn.q_proj match)")

    if isinstance(cfg.target_modules, list):
        # peft fails only when no name matches (a misspelt one beside a valid one would silently
        # adapt less), and with a module's whole repr for one it cannot adapt (self_attn).
        # The score head named beside layers is harmless (trained in full either way); alone, nothing is adapted.
        layers = [t for t in cfg.target_modules if t not in head]
        if cfg.target_modules and not layers:
            raise targets_error(f"names only the score head ({', '.join(cfg.target_modules)}), which is trained in "
                                "full, not adapted: name the layers to adapt")
        unknown = [t for t in layers if not any(n == t or n.endswith("." + t) for n in linear)]
        if unknown or not cfg.target_modules:
            raise targets_error(f"no linear layer named {', '.join(unknown) or '(an empty list)'}")
    try:
        wrapped = get_peft_model(model, _peft_config(cfg, model))
    except NoMatchingPeftModuleError:
        raise targets_error("matches no module") from None
    except ValueError as e:  # a regular expression matching a module peft cannot adapt (self_attn, mlp)
        if "is not supported" not in str(e):
            raise
        matched = str(e).split("Target module ", 1)[-1].split("(", 1)[0].strip() or "a module"
        raise targets_error(f"matches a {matched}, not a linear layer") from None
    adapted = [name.removeprefix(_PEFT_PREFIX) for name, module in wrapped.named_modules() if hasattr(module, "lora_A")]
    # The merge (export, generation refit) computes W + scale * B @ A for torch Linear weights
    # [out, in]: an embedding, or transformers' Conv1D (GPT-2; weight [in, out]) would fail there
    # or, square, merge transposed without an error.
    other = sorted(name for name in adapted if name not in linear)
    if other:
        raise targets_error(f"adapts {', '.join(other[:4])}, which are not torch.nn.Linear layers (LoRA here "
                            "adapts and merges those only)")
    tied_adapted = sorted(name for name in adapted if name in tied)
    if tied_adapted:
        raise InputError(f"policy.lora.target_modules={cfg.target_modules!r} adapts {', '.join(tied_adapted)}, whose "
                         "weight is tied to the input embedding (tie_word_embeddings): the merged export and "
                         "the generation weights would drop its adapter; leave it out of target_modules")
    return wrapped


def merge_loaded_adapter(model: Any) -> Any:
    """`model` with the LoRA adapter that transformers' `from_pretrained` loaded beside it (a folder
    of `policy.lora.export=adapter`, naming its base) merged into plain Linear layers.

    transformers computes base + adapter in its forward, but leaves peft layers whose `.weight`
    is the base weight alone: the torch generation engine and the policy's state dicts read
    weights, so they would silently run or train from the base model without the adapter.
    Merged, every reader sees the one model the folder describes. A model without a loaded
    adapter is returned as it is.
    """
    if not getattr(model, "_hf_peft_config_loaded", False):
        return model
    from peft.tuners.tuners_utils import BaseTunerLayer

    with torch.no_grad():
        for name, module in list(model.named_modules()):
            if isinstance(module, BaseTunerLayer):
                module.merge()
                model.set_submodule(name, module.get_base_layer())
    model._hf_peft_config_loaded = False
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model


def is_lora_state_dict(sd: dict[str, Any]) -> bool:
    return any(".lora_A." in k for k in sd)


def merge_lora_state_dict(sd: dict[str, torch.Tensor], cfg: LoraConfig) -> dict[str, torch.Tensor]:
    """A base-model state dict from a full peft state dict: W + (alpha / r) * B @ A.

    Keys lose peft's `base_model.model.` prefix and `.base_layer`; a modules-to-save copy
    (the reward model's trained score head) replaces its original.
    """
    if not is_lora_state_dict(sd):
        raise ValueError("merge_lora_state_dict: the state dict holds no LoRA weights (policy.lora.enabled false?)")
    if any("lora_embedding_" in k for k in sd):
        raise ValueError("merge_lora_state_dict: LoRA on embeddings is not supported; target linear layers only")
    scale = cfg.alpha / cfg.rank
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if ".lora_A." in key or ".lora_B." in key or ".original_module." in key:
            continue
        name = key.removeprefix(_PEFT_PREFIX)
        if ".base_layer." in name:
            module = key.split(".base_layer.")[0]
            name = name.replace(".base_layer.", ".")
            if key.endswith(".weight"):
                a = sd[f"{module}.lora_A.{_ADAPTER}.weight"]  # [r, in]
                b = sd[f"{module}.lora_B.{_ADAPTER}.weight"]  # [out, r]
                value = (value.float() + scale * (b.float() @ a.float())).to(value.dtype)
        elif f".modules_to_save.{_ADAPTER}." in name:
            name = name.replace(f".modules_to_save.{_ADAPTER}.", ".")
        out[name] = value
    return out


def adapter_state_dict(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter weights (and modules-to-save) of a full peft state dict, in peft's saved
    key layout (the adapter name dropped)."""
    out = {}
    for key, value in sd.items():
        if ".lora_A." in key or ".lora_B." in key:
            out[key.replace(f".{_ADAPTER}.", ".")] = value
        elif f".modules_to_save.{_ADAPTER}." in key:
            out[key.replace(f".modules_to_save.{_ADAPTER}.", ".")] = value
    if not out:
        raise ValueError("adapter_state_dict: the state dict holds no LoRA weights (policy.lora.enabled false?)")
    return out


def save_adapter(
    sd: dict[str, torch.Tensor],
    cfg: LoraConfig,
    path: str | os.PathLike,
    base_model_name_or_path: str,
    model: Any = None,
) -> None:
    """Write the adapter of a full peft state dict as `adapter_model.safetensors` +
    `adapter_config.json` (peft's layout). `model` (the base or wrapped model, any rank's
    copy) picks the task type; None means a causal LM. `base_model_name_or_path` (a config's
    model name) is saved as the absolute folder it names, so that peft and transformers'
    `from_pretrained(path)` find the base from anywhere ("embedded:<name>" or a relative folder
    they could not); a hub id stays as it is."""
    from safetensors.torch import save_file

    from posttrain.embedded import resolve_model_path

    os.makedirs(path, exist_ok=True)
    peft_cfg = _peft_config(cfg, model)
    base = os.path.expanduser(resolve_model_path(base_model_name_or_path))
    peft_cfg.base_model_name_or_path = os.path.abspath(base) if os.path.isdir(base) else base_model_name_or_path
    peft_cfg.save_pretrained(str(path))
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in adapter_state_dict(sd).items()}
    save_file(tensors, os.path.join(str(path), "adapter_model.safetensors"), metadata={"format": "pt"})
