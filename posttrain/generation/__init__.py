"""Generation backends behind one interface (`GenerationInterface`), chosen by name.

```python
engine = build_generation("torch", model=hf_model, tokenizer=tok, cfg=policy_cfg.generation,
                          max_total_sequence_length=policy_cfg.max_total_sequence_length)
out = engine.generate(BatchedDataDict(input_ids=..., input_lengths=...))
engine.update_weights(new_state_dict, version=step)
```
See docs/generation.md for the backends, their settings and the vllm-cpu setup.
"""

from __future__ import annotations

from typing import Callable

from posttrain.generation.interfaces import GenerationInterface


def _torch(**kw):
    from posttrain.generation.torch_engine import TorchGeneration

    return TorchGeneration(**kw)


def _hf(**kw):
    from posttrain.generation.hf_backend import HFGeneration

    return HFGeneration(**kw)


def _vllm(**kw):
    from posttrain.generation.vllm_backend import VllmGeneration

    return VllmGeneration(**kw)


# name -> constructor(model, tokenizer, cfg, max_total_sequence_length, precision, device)
BACKENDS: dict[str, Callable[..., GenerationInterface]] = {"torch": _torch, "hf": _hf, "vllm": _vllm}


def load_model_and_tokenizer(model_path: str, precision: str = "float32", tokenizer=None,
                             attn_implementation: str | None = None):
    """Load a causal LM (and its tokenizer unless given) from a folder, hub id or `embedded:<name>`;
    `attn_implementation`: transformers' attention kernel (None: its default)."""
    from transformers import AutoTokenizer

    from posttrain.embedded import resolve_model_path
    from posttrain.policy.hf_io import DTYPES, load_pretrained

    path = resolve_model_path(model_path)
    kernel = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = load_pretrained("causal_lm", path, "policy.model_name", model_path, dtype=DTYPES[precision], **kernel)
    if tokenizer is None:
        tokenizer = AutoTokenizer.from_pretrained(path)
    return model, tokenizer


def check_backend_installed(cfg, *, in_process: bool = False) -> None:
    """Fail at setup, before Ray or a model starts, when `cfg.backend` (policy.generation) needs a
    package this environment lacks: vllm, unless its workers run another venv's Python
    (`vllm_cfg.python`, which must then run and hold vllm and this driver's ray). `in_process`:
    the caller generates in its own process (eval), where no other venv's Python can take over."""
    import importlib.util

    from posttrain.config import InputError
    from posttrain.distributed.worker_group import check_python_executable

    elsewhere = cfg.vllm_cfg.python is not None and not in_process
    if cfg.backend == "vllm" and elsewhere:
        try:
            check_python_executable(cfg.vllm_cfg.python, "policy.generation.vllm_cfg.python", needs=("vllm",),
                                    hint=" (scripts/setup_vllm_cpu.sh VENV makes a venv with vllm for this driver)")
        except ValueError as e:
            raise InputError(str(e)) from None
    if cfg.backend == "vllm" and not elsewhere and importlib.util.find_spec("vllm") is None:
        cpu = ("run this command with that venv's posttrain (VENV/bin/posttrain; eval generates in its own process, "
               "so policy.generation.vllm_cfg.python does not apply)" if in_process else
               "policy.generation.vllm_cfg.python=VENV/bin/python with policy.generation.colocated.enabled=false")
        raise InputError(
            "policy.generation.backend=vllm, but vllm is not installed in this environment: install it "
            f"(GPU: pip install 'posttrain[vllm]'; CPU: scripts/setup_vllm_cpu.sh VENV makes a venv with it: {cpu}), "
            "or set policy.generation.backend=torch (posttrain's own engine, CPU or GPU)"
        )


def build_generation(backend: str, *, model=None, model_path: str | None = None, tokenizer=None, cfg,
                     max_total_sequence_length: int, precision: str = "float32",
                     device="cpu", rank: int = 0, attn_implementation: str | None = None) -> GenerationInterface:
    """Build generation backend `backend` ("torch", "hf", "vllm").

    `model`: an in-memory transformers causal LM (colocated: the policy worker's own copy,
    updated in place by `update_weights`). `model_path`: load it here (separate workers; the
    vllm backend always loads from a folder). `tokenizer` is loaded from `model_path` if None.
    `rank`: the engine's place among the workers that generate shards of one batch; it samples
    with seed `cfg.seed + rank`, so that the shards do not replay one random stream (the same
    prompt in two shards would get the same samples). `attn_implementation`: the attention kernel
    of a model loaded from `model_path`, the policy's (`policy.hf_io.attention_kernel`), so that
    the torch engine's prefill computes as the policy's forward does.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown generation backend {backend!r}; valid: {', '.join(BACKENDS)}")
    cfg = cfg.model_copy(update={"seed": cfg.seed + rank})
    if (model is None) == (model_path is None) and backend != "vllm":
        raise ValueError("build_generation needs exactly one of `model` (in memory) or `model_path`")
    if backend == "vllm":
        if model_path is None:
            raise ValueError("the vllm backend loads its own model: pass model_path (a folder or embedded:<name>)")
        return BACKENDS[backend](model_path=model_path, tokenizer=tokenizer, cfg=cfg,
                                 max_total_sequence_length=max_total_sequence_length, precision=precision,
                                 device=device)
    if model is None:
        model, tokenizer = load_model_and_tokenizer(model_path, precision, tokenizer, attn_implementation)
        if backend == "hf":
            # model.generate runs where the model is (loaded on the CPU); the torch engine copies
            # the weights it needs to `device` itself, so its source model stays where it is.
            model = model.to(device)
    if tokenizer is None:
        raise ValueError("build_generation(model=...) needs the tokenizer too")
    return BACKENDS[backend](model=model, tokenizer=tokenizer, cfg=cfg,
                             max_total_sequence_length=max_total_sequence_length, precision=precision,
                             device=device)


__all__ = ["BACKENDS", "GenerationInterface", "build_generation", "check_backend_installed",
           "load_model_and_tokenizer"]
