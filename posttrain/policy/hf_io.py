"""Hugging Face model I/O for the policy workers: config loading with clear errors, the
memory check that runs BEFORE any weights are loaded, model construction, and export."""

from __future__ import annotations

import copy
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, NamedTuple, Sequence

import torch

from posttrain.config import InputError
from posttrain.convert.output import writing_folder
from posttrain.embedded import model_load_error, resolve_model_path

if TYPE_CHECKING:
    from posttrain.schemas import PolicyConfig

log = logging.getLogger(__name__)

# The torch dtype of each `Precision` (schemas.py).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Bytes of training state per parameter, in units of the master-weight size: fp32 weights,
# fp32 grads, and Adam's two fp32 moments.
TRAIN_STATE_COPIES = 4
# The memory check's other constants (`estimate_memory`), calibrated against the peak RSS of CPU
# policy workers (benchmarks/results/memory_check.md). Copies of a micro-batch's [T, V] float32
# logits alive at once at the peak of its forward + backward (measured 2.7; made are the logits,
# logsumexp's exp, and the gradients of the gathered logprobs, a scatter into zeros, and of the logits).
LOGITS_COPIES = 3
# Elements a decoder layer saves per token for its backward: ~10 of the hidden size (norms, q/k/v,
# rotary, attention output, residuals), 4 of the MLP size (gate, up, SiLU, their product), and
# under eager attention one per head and key position (the softmax's output).
ACT_PER_HIDDEN, ACT_PER_MLP, ACT_PER_SCORE = 10, 4, 1
# A policy worker's resident memory before its model loads: Python, torch, transformers, Ray, gloo.
WORKER_RUNTIME_BYTES = 0.5 * 2**30
# What a CPU worker's heap holds beyond its live peak, freed but kept for reuse by
# runtime.keep_freed_memory: 0.5-0.9 GiB more than with glibc's defaults in the measured runs.
ALLOCATOR_SLACK_BYTES = 0.5 * 2**30


def load_hf_config(model_name: str, key: str = "policy.model_name"):
    """`AutoConfig` of a folder, hub id or `embedded:<name>`, failing with the config `key` and the
    name on error."""
    from transformers import AutoConfig

    path = resolve_model_path(model_name)
    try:
        return path, AutoConfig.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise model_load_error(key, model_name, path, "a model config", e) from None


def adapter_base(model_name: str) -> str | None:
    """The base model named by a folder that holds a LoRA adapter alone (peft's
    adapter_config.json, no config.json: a `policy.lora.export=adapter` export), else None.
    transformers' from_pretrained loads such a folder as base + adapter; AutoConfig cannot."""
    path = os.path.expanduser(resolve_model_path(model_name))
    adapter = os.path.join(path, "adapter_config.json")
    if not os.path.isfile(adapter) or os.path.isfile(os.path.join(path, "config.json")):
        return None
    with open(adapter) as f:
        return json.load(f).get("base_model_name_or_path")


def load_model_config(model_name: str, key: str = "policy.model_name"):
    """`load_hf_config` of `model_name`, or of the base model a LoRA adapter folder names (its errors
    then name the adapter's adapter_config.json, not a base the user never wrote as `key`)."""
    base = adapter_base(model_name)
    if base is None:
        return load_hf_config(model_name, key)
    return load_hf_config(base, key=f"{key}={model_name!r} (a LoRA adapter): its adapter_config.json's "
                                    "base_model_name_or_path")


def check_language_model(config, key: str, model_name: str) -> None:
    """Refuse a reward model's export (a sequence-classification architecture) where a language
    model must be: transformers loads it as one, the unexpected score head dropped with a log line
    and, with tied embeddings (Llama 3.2, Qwen2.5), nothing missing: a policy, DPO reference or
    eval model that had never been trained to write (a reference's margin -5.0 at step 0)."""
    archs = getattr(config, "architectures", None) or []
    if archs and all(a.endswith("ForSequenceClassification") for a in archs):
        raise InputError(f"{key}={model_name!r} is a reward model ({archs[0]}: a score head, not a language "
                         "model's); name the language model it was trained from, or a causal LM's export")


# Architectures whose positions index a learned table of max_position_embeddings rows: a longer
# sequence fails inside torch.embedding ("index out of range in self") at its first forward, after
# the rollouts of a step. Rotary and ALiBi models run past theirs (lm_policy warns).
_POSITION_TABLES = frozenset({"gpt2", "gpt_bigcode", "gpt_neo", "opt", "biogpt", "openai-gpt", "ctrl", "bert",
                              "roberta", "bert-generation"})


# Where a reward model's adapter export (policy.lora.export=adapter) records the BOS/EOS its rows
# had, which a merged export records in config.json (`posttrain_row_tokens`): an adapter folder
# has no config.json of its own, and the reward_model environment scored it with both.
ROW_TOKENS_FILE = "posttrain_row_tokens.json"


def recorded_row_tokens(path: str | os.PathLike, config) -> dict[str, bool]:
    """The {"add_bos", "add_eos"} a reward model at `path` (with `config` loaded) was trained with,
    as its export recorded them; {} where none did."""
    recorded = getattr(config, "posttrain_row_tokens", None)
    if recorded:
        return dict(recorded)
    file = Path(path) / ROW_TOKENS_FILE
    return json.loads(file.read_text(encoding="utf-8")) if file.is_file() else {}


def check_positions(config, key: str, model_name: str, length: int) -> None:
    """Refuse a model with a table of positions shorter than `length` (policy.max_total_sequence_length)."""
    positions = getattr(config, "max_position_embeddings", None)
    if getattr(config, "model_type", None) in _POSITION_TABLES and positions and length > positions:
        raise InputError(f"{key}={model_name!r} ({config.model_type}) has {positions} positions "
                         "(max_position_embeddings, a learned table no later position indexes), fewer than "
                         f"policy.max_total_sequence_length={length}: set it to at most {positions}")


def load_model_configs(cfg, *, with_reference: bool, model_kind: str = "causal_lm",
                       check_files: bool = False) -> tuple[tuple[str, Any], tuple[str, Any] | None]:
    """(folder, config) of `cfg.model_name` and, when `with_reference`, of the reference model
    (`cfg.reference_model_name`, else the policy itself); None for no reference. The drivers call it
    before starting Ray (`check_files`: and `check_weight_files` on local folders), so a wrong name
    or folder fails in seconds; the workers call it again to load.
    A reference scores the policy's tokens, so its vocabulary must be the policy's; both must
    split over `policy.dtensor_cfg.tensor_parallel_size`; `policy.lora` must fit the model."""
    from posttrain.policy.tensor_parallel import check_tensor_parallel

    tp = cfg.dtensor_cfg.tensor_parallel_size
    path, config = load_hf_config(cfg.model_name)
    if model_kind == "causal_lm":  # (a reward model starts from either)
        check_language_model(config, "policy.model_name", cfg.model_name)
    check_tensor_parallel(config, tp)
    check_positions(config, "policy.model_name", cfg.model_name, cfg.max_total_sequence_length)
    if cfg.lora.enabled:
        check_lora(config, cfg.lora, model_kind)
    if check_files:
        check_weight_files(path, config, model_kind, "policy.model_name")
    if not with_reference:
        return (path, config), None
    name = cfg.reference_model_name
    if name is None:
        return (path, config), (path, config)
    ref_path, ref_config = load_hf_config(name, key="policy.reference_model_name")
    check_language_model(ref_config, "policy.reference_model_name", name)
    check_tensor_parallel(ref_config, tp, key="policy.reference_model_name")
    check_positions(ref_config, "policy.reference_model_name", name, cfg.max_total_sequence_length)
    check_reference_vocabulary(cfg, config, ref_path, ref_config, check_template=check_files)
    if check_files:
        check_weight_files(ref_path, ref_config, "causal_lm", "policy.reference_model_name")
    return (path, config), (ref_path, ref_config)


_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")


def check_weight_files(path: str, config, model_kind: str, key: str) -> None:
    """A local model folder (not a hub id, which transformers fetches) must hold weights that load:
    a weights file, every shard its index names, safetensors headers that read (a cut-off copy
    does not), and tensors of the shapes config.json makes (an edited hidden_size does not).
    Found in the workers, each of these was a traceback from inside transformers after Ray and
    the workers had started."""
    folder = Path(path)
    if not folder.is_dir():
        return
    present = [f for f in _WEIGHT_FILES if (folder / f).is_file()]
    if not present:
        held = ", ".join(sorted(p.name for p in folder.iterdir())) or "nothing"
        raise InputError(f"{key}: the model folder {path} has no weights ({' / '.join(_WEIGHT_FILES)}); it holds {held}")
    if not present[0].startswith("model.safetensors"):
        return
    files = [folder / present[0]]
    if present[0].endswith(".json"):
        import json

        index = folder / present[0]
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError) as e:
            raise InputError(f"{key}: cannot read the weights index {index}: {e}") from None
        missing = [f for f in shards if not (folder / f).is_file()]
        if missing:
            raise InputError(f"{key}: the weights index {index} names shards the folder lacks: {', '.join(missing[:4])}")
        files = [folder / f for f in shards]
    from safetensors import safe_open

    shapes = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as handle:
                shapes.update({k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()})
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for a bad header
            raise InputError(f"{key}: cannot read the weights file {f} ({type(e).__name__}: {e}); a cut-off or "
                             "corrupt copy? Copy or export it again") from None
    try:
        expected = {k: tuple(v.shape) for k, v in _meta_model(config, model_kind).state_dict().items()}
    except Exception:  # noqa: BLE001 - a model transformers cannot build says so when it loads
        return
    wrong = [(k, shapes[k], expected[k]) for k in shapes if k in expected and shapes[k] != expected[k]]
    if wrong:
        listed = "; ".join(f"{k} is {list(a)}, the config makes it {list(b)}" for k, a, b in wrong[:3])
        raise InputError(f"{key}: the weights in {path} do not fit its config.json ({len(wrong)} tensor(s): {listed})")


def resolve_tokenizer_path(cfg) -> str:
    """The folder or hub id of the policy's tokenizer (`policy.tokenizer.name`, else the model's own)."""
    return resolve_model_path(cfg.tokenizer_name)


def check_reference_vocabulary(cfg, config, ref_path: str, ref_config, check_template: bool = True) -> None:
    """The reference model scores the token ids the policy samples: each must be a row of its
    embedding and mean the same token to it. Its vocabulary may be larger, as one tokenizer's
    models pad their embeddings to different sizes (Qwen2.5-1.5B 151936 rows, Qwen2.5-7B 152064),
    never smaller; and two tokenizers of the same size can differ (Llama 2 and Mistral 7B, 32000
    each), so when the reference folder has a tokenizer, every token of the policy's must have
    the same id in it. `check_template`: warn when the reference has a chat template of its own
    that differs from the policy's (the driver's check; the workers' would repeat it)."""
    from transformers import AutoTokenizer

    name = cfg.reference_model_name
    if ref_config.vocab_size < config.vocab_size:
        raise InputError(f"policy.reference_model_name={name!r} has a vocabulary of {ref_config.vocab_size} "
                         f"tokens, the policy ({cfg.model_name!r}) {config.vocab_size}: the reference "
                         "scores the policy's tokens, so both need the same tokenizer")
    try:
        ref_tokenizer = AutoTokenizer.from_pretrained(ref_path)
    except (OSError, ValueError):  # no tokenizer saved with the reference: the sizes are all there is
        if ref_config.vocab_size != config.vocab_size:
            log.warning("policy.reference_model_name=%r has no tokenizer, and a vocabulary of %d tokens where the "
                        "policy has %d: only the sizes could be checked; it must share the policy's tokenizer "
                        "(a larger embedding of the same one)", name, ref_config.vocab_size, config.vocab_size)
        return
    tokenizer = AutoTokenizer.from_pretrained(resolve_tokenizer_path(cfg))
    vocab, ref_vocab = tokenizer.get_vocab(), ref_tokenizer.get_vocab()
    differ = sorted((i, t) for t, i in vocab.items() if ref_vocab.get(t) != i)
    if differ:
        raise InputError(f"policy.reference_model_name={name!r}: {len(differ)} of the {len(vocab)} tokens of the "
                         f"policy's tokenizer have another id (or none) in the reference's, e.g. "
                         f"{', '.join(f'{t!r} (id {i})' for i, t in differ[:3])}: the reference scores the "
                         "policy's token ids, so both need the same tokenizer")
    # A teacher (or reference) trained on another layout of the conversation scores the policy's
    # prompts off its own distribution: the same tokens, with nothing to say so.
    template = cfg.tokenizer.chat_template if cfg.tokenizer.chat_template is not None else tokenizer.chat_template
    ref_template = ref_tokenizer.chat_template
    if (check_template and isinstance(template, str) and isinstance(ref_template, str)
            and not written_by_export(ref_template, template)):
        log.warning("policy.reference_model_name=%r has a chat template of its own that differs from the one the "
                    "policy's conversations are rendered with (%s): it scores them laid out unlike its training "
                    "data; give both one template (policy.tokenizer.chat_template sets the policy's)", name,
                    "policy.tokenizer.chat_template" if cfg.tokenizer.chat_template is not None
                    else f"{cfg.tokenizer_name}'s")


# policy.attn_implementation=auto: eager attention on CPU up to this policy.max_total_sequence_length.
_CPU_EAGER_MAX_TOKENS = 256


def attention_kernel(setting: str, max_total_sequence_length: int, device_type: str, config: Any = None) -> str:
    """The transformers attention implementation of `policy.attn_implementation` = `setting` on
    `device_type` ("auto": see the key's comment in schemas.py for the measurements) for the
    model of `config`. The policy workers load their model with it, and the torch generation
    engine's model copy too (its prefill then computes as the policy's forward does). "auto" never
    picks sdpa for a model class that lacks it (Gemma 2, GPT-Neo, Bloom): their set-up failed with
    transformers' "does not support scaled_dot_product_attention", where from_pretrained loads them."""
    if setting != "auto":
        return setting
    if device_type == "cpu" and max_total_sequence_length <= _CPU_EAGER_MAX_TOKENS:
        return "eager"
    return "sdpa" if config is None or _supports_sdpa(config) else "eager"


def named_model_attention_kernel(setting: str, max_total_sequence_length: int, device_type: str,
                                 model_name: str) -> str:
    """`attention_kernel` for the model `model_name` names (for a LoRA adapter folder: its base),
    whose config is read only when `setting` is "auto"."""
    if setting != "auto":
        return setting
    config = load_model_config(model_name)[1]
    return attention_kernel(setting, max_total_sequence_length, device_type, config)


def _supports_sdpa(config: Any) -> bool:
    """Whether transformers' causal LM class of `config` runs sdpa (unknown classes: assumed so)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return bool(getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(config)], "_supports_sdpa", True))
    except KeyError:
        return True


def model_class(model_kind: str):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    kinds = {"causal_lm": AutoModelForCausalLM, "sequence_classification": AutoModelForSequenceClassification}
    if model_kind not in kinds:
        raise ValueError(f"unknown model_kind {model_kind!r}; valid: {', '.join(kinds)}")
    return kinds[model_kind]


def load_pretrained(model_kind: str, path: str, key: str, name: str, *, new_head: bool = False, **kwargs):
    """`from_pretrained` of `model_kind` from `path` (config `key` = `name`), failing when the folder
    lacks weights of the model: transformers initialises those randomly and only logs it, so a
    reward model's folder loaded as a causal LM (its LM head not tied to the embedding), or a
    causal LM's as a reward model to score with, would compute noise. `new_head`: a sequence
    classifier's head may be missing (`posttrain rm` starts it from a causal LM)."""
    from posttrain.policy.lora import SCORE_HEADS, merge_loaded_adapter

    # transformers warns of a missing score head with a table ("LOAD REPORT ... MISSING ...
    # Consider training on your downstream task") on every `posttrain rm` start, which is how
    # the run begins, and when a reward model's LoRA adapter folder loads its base (the adapter
    # then brings the trained head); held back here, it is still shown when it reports anything else.
    hf_log = logging.getLogger("transformers.modeling_utils")
    held = _HeldLoadReport()
    if new_head or adapter_base(path) is not None:
        hf_log.addFilter(held)
    try:
        model, info = model_class(model_kind).from_pretrained(path, output_loading_info=True, **kwargs)
    except Exception:
        held.release(hf_log)
        raise
    finally:
        hf_log.removeFilter(held)
    if (any(k.split(".")[0] not in SCORE_HEADS for k in info["missing_keys"])
            or any(k.split(".")[0] != "lm_head" for k in info["unexpected_keys"]) or info["mismatched_keys"]):
        held.release(hf_log)  # more than the new head (a causal LM's LM head is left out of a reward model)
    model = merge_loaded_adapter(model)  # a LoRA adapter's folder: its base + adapter, as plain weights
    missing = sorted(k for k in info["missing_keys"] if not (new_head and k.split(".")[0] in SCORE_HEADS))
    if missing:
        raise InputError(f"{key}={name!r}: {path} has no weights for {', '.join(missing[:3])}"
                         f"{', ...' if len(missing) > 3 else ''} of {type(model).__name__} (a reward model's folder "
                         "holds no LM head, a causal LM's no trained score head)")
    return model


class _HeldLoadReport(logging.Filter):
    """Holds back the records of transformers' state-dict load report, to be dropped or `release`d."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if "LOAD REPORT" in str(record.msg):
            self.records.append(record)
            return False
        return True

    def release(self, logger: logging.Logger) -> None:
        logger.removeFilter(self)
        for record in self.records:
            logger.handle(record)
        self.records = []


def cast_parameters(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast `module`'s parameters to `dtype` in place; buffers (rotary frequencies) stay float32,
    as under FSDP2's MixedPrecisionPolicy (`module.to(dtype)` would cast them too)."""
    for p in module.parameters():
        p.data = p.data.to(dtype)


def disable_dropout(model: torch.nn.Module) -> int:
    """Set every dropout of `model` to 0 in place, its `nn.Dropout` layers and the rates its
    attention modules keep as floats (Llama-like `attention_dropout`, passed to the attention
    kernel in training mode), leaving the config (and so an export) as it was. Returns how many
    were non-zero."""
    changed = 0
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            changed += module.p > 0
            module.p = 0.0
        for name, value in vars(module).items():
            if "dropout" in name and isinstance(value, float):
                changed += value > 0
                setattr(module, name, 0.0)
    return changed


def config_for_kind(config, model_kind: str):
    """`config` for `model_kind`: a reward model has one label. transformers 5's `from_config`
    takes no config kwargs (num_labels=1 there is a TypeError), so the label goes on a copy."""
    if model_kind != "sequence_classification":
        return config
    config = copy.deepcopy(config)
    config.num_labels = 1
    return config


def _meta_model(config, model_kind: str, lora=None) -> torch.nn.Module:
    """The model `config` describes on the meta device (no memory), its tied weights tied (built
    empty, an LM head tied to the embedding was a second matrix), with `lora`'s adapters if enabled."""
    from accelerate import init_empty_weights

    from posttrain.policy.lora import maybe_apply_lora

    with init_empty_weights():
        model = model_class(model_kind).from_config(config_for_kind(config, model_kind))
    model.tie_weights()  # (inside init_empty_weights it does not tie)
    with init_empty_weights():
        return maybe_apply_lora(model, lora) if lora is not None else model


def count_parameters(config, model_kind: str, lora=None) -> tuple[int, int]:
    """(parameters, trainable ones) of the model `config` describes, with `lora`'s adapters."""
    params = list(_meta_model(config, model_kind, lora).parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)


def check_lora(config, lora, model_kind: str) -> None:
    """Apply `lora` to the model `config` describes, on the meta device, so a target module the
    model lacks fails before any worker starts, naming the key."""
    _meta_model(config, model_kind, lora)


class InsufficientMemoryError(InputError, MemoryError):
    """The memory check's refusal: bad input for this machine (a model, batch or sequence length
    too large, or policy.max_memory_fraction), so the CLI prints the message alone (exit 2) even
    when a Ray worker raises it; a MemoryError for code that catches those."""


def available_memory_bytes(device: torch.device) -> int:
    """Free memory of `device`: the GPU's own (each policy worker has one), or the host's RAM."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    import psutil

    return psutil.virtual_memory().available


def mlp_size(text_config: Any) -> int:
    """The MLP width of a (text) model config: named n_inner (GPT-2; None there means 4 x hidden)
    or ffn_dim (OPT) by some, left unset by others (GPT-Neo), for the usual 4 x hidden."""
    c = text_config
    return (getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or getattr(c, "ffn_dim", None)
            or 4 * c.hidden_size)


class MemoryEstimate(NamedTuple):
    """`estimate_memory`'s answer: one worker's bytes by what holds them, what each term is, and
    the parameter count."""

    terms: dict[str, float]
    labels: dict[str, str]
    parameters: int

    def total(self, names: Sequence[str]) -> float:
        return sum(self.terms[name] for name in names)

    def describe(self, names: Sequence[str]) -> str:
        return ", ".join(f"{self.labels[k]} {self.terms[k] / 2**30:,.2f}" for k in names if self.terms[k]) + " GiB"


def estimate_memory(config, cfg: PolicyConfig, *, model_kind: str, device_type: str, world_size: int,
                    reference_config: Any) -> MemoryEstimate:
    """One policy worker's memory in bytes, by term (`check_fits_in_memory` adds them up).

    With n parameters (t trained; with `cfg.lora`, the adapters), n_ref those of `reference_config`
    (None: no reference), W = `world_size` workers, T tokens in a training micro-batch
    (policy.train_micro_batch_size x policy.max_total_sequence_length, or the packing or dynamic
    batching budget), b bytes per element in the compute precision, and the model's vocabulary V,
    L layers, hidden size h, MLP size i and H attention heads:

        state       = 4 (n + 3 t + n_ref) / W     fp32 weights, grads and 2 Adam moments, reference weights
        load        = 4 max(n, n_ref)             the full fp32 copy a worker loads before sharding
                                                  (one CPU worker keeps it as its state: 0 then)
        twin        = b (n + t + s n_ref)         one worker in bf16/fp16: its low-precision weights + grads,
                                                  and the reference's (s = 1 with policy.reference_sync)
        logits      = LOGITS_COPIES 4 T V         float32 logits, log-softmax and their gradients
        activations = b T L (A_h h + A_i i + A_s H S)   saved for the backward, A_* = ACT_PER_*; S: the
                                                  sequence length under eager attention, else 0. With
                                                  activation checkpointing: b T L h (layer inputs) + one layer
        runtime     = WORKER_RUNTIME_BYTES        Python, torch, transformers, Ray and gloo (on the CPU
                                                  + ALLOCATOR_SLACK_BYTES: freed memory malloc keeps)
    """
    n, trained = count_parameters(config, model_kind, cfg.lora)
    n_ref = count_parameters(reference_config, model_kind)[0] if reference_config is not None else 0
    c = getattr(config, "text_config", config)
    b = DTYPES[cfg.precision].itemsize  # the masters stay fp32 (FSDP2's mixed precision, LowPrecisionTwin)
    single = world_size == 1 and not cfg.dtensor_cfg.cpu_offload  # the plain module (fsdp_worker)
    batching = next((s for s in (cfg.sequence_packing, cfg.dynamic_batching) if s.enabled), None)
    tokens = batching.train_mb_tokens if batching else cfg.train_micro_batch_size * cfg.max_total_sequence_length
    eager = attention_kernel(cfg.attn_implementation, cfg.max_total_sequence_length, device_type, config) == "eager"
    heads = getattr(c, "num_attention_heads", None) or 0  # none: Mamba
    scores = heads * min(cfg.max_total_sequence_length, tokens) if eager else 0
    layer = b * tokens * (ACT_PER_HIDDEN * c.hidden_size + ACT_PER_MLP * mlp_size(c) + ACT_PER_SCORE * scores)
    layers = c.num_hidden_layers
    terms = {
        "state": 4 * (n + (TRAIN_STATE_COPIES - 1) * trained + n_ref) / world_size,
        "load": 0 if single and device_type == "cpu" else 4 * max(n, n_ref),
        "twin": b * (n + trained + (n_ref if cfg.reference_sync.enabled else 0)) if single and b < 4 else 0,
        "logits": LOGITS_COPIES * 4 * tokens * c.vocab_size if model_kind == "causal_lm" else 0,
        "activations": b * tokens * c.hidden_size * layers + layer if cfg.dtensor_cfg.activation_checkpointing
        else layer * layers,
        "runtime": WORKER_RUNTIME_BYTES + (ALLOCATOR_SLACK_BYTES if device_type == "cpu" else 0),
    }
    labels = {
        "state": "fp32 weights + grads + 2 Adam states"
        + (f" of {trained / 1e6:,.1f}M trained" if trained < n else "")
        + (f" + a {n_ref / 1e6:,.1f}M-parameter reference" if n_ref else "")
        + (f" (sharded over {world_size} workers)" if world_size > 1 else ""),
        "load": "a full fp32 copy while loading",
        "twin": f"{cfg.precision} weights + grads",
        "logits": f"logits of a {tokens:,}-token micro-batch",
        "activations": "activations",
        "runtime": "worker runtime" + (" + freed memory malloc keeps" if device_type == "cpu" else ""),
    }
    return MemoryEstimate(terms, labels, n)


def check_fits_in_memory(model_name: str, config, cfg: PolicyConfig, *, model_kind: str, device: torch.device,
                         world_size: int, local_workers: int, reference_config: Any) -> int:
    """Raise InsufficientMemoryError before loading when a policy worker's peak cannot fit in
    policy.max_memory_fraction of the memory available now; returns the parameter count.

    With the terms of `estimate_memory`: on the CPU the node's `local_workers` workers share its
    RAM, and the load copy is freed before training (the logits and activations reuse its memory):

        local_workers x (runtime + state + twin + max(load, logits + activations))  <=  RAM

    On a GPU each worker has its own; every worker first loads the full fp32 model on the host,
    shards it, then moves its shard to the GPU (with policy.dtensor_cfg.cpu_offload the shard stays
    on the host):

        state + twin + logits + activations      <=  the worker's GPU  (no state with cpu_offload)
        local_workers x (runtime + load)         <=  RAM               (+ state with cpu_offload)

    The constants are calibrated against measured peaks (benchmarks/results/memory_check.md).
    Colocated generation's copy of the weights is checked when it is made (`check_generation_fits`).
    """
    est = estimate_memory(config, cfg, model_kind=model_kind, device_type=device.type, world_size=world_size,
                          reference_config=reference_config)
    t, offload = est.terms, cfg.dtensor_cfg.cpu_offload
    if device.type == "cuda":
        _refuse_unless_fits(model_name, est, ("twin", "logits", "activations", *(() if offload else ("state",))),
                            device, 1, cfg)
        _refuse_unless_fits(model_name, est, ("runtime", "load", *(("state",) if offload else ())),
                            torch.device("cpu"), local_workers, cfg)
    else:
        transient = ("load",) if t["load"] > t["logits"] + t["activations"] else ("logits", "activations")
        _refuse_unless_fits(model_name, est, ("runtime", "state", "twin", *transient), device, local_workers, cfg)
    return est.parameters


def check_generation_fits(model_name: str, config, cfg: PolicyConfig, *, device: torch.device, world_size: int,
                          local_workers: int) -> None:
    """Raise InsufficientMemoryError before a policy worker makes its colocated generation copy
    (at the first `generate`) when the copy cannot fit beside the training: a second fp32 model
    loaded from the folder (4 n), the torch engine's decode weights (fused QKV and gate/up
    matrices, or all of them in a bf16 engine: at most n elements of its precision), and the full
    state dict gathered for every refit when the weights are sharded (4 n); plus what the
    training's estimated peak (`check_fits_in_memory`'s) needs beyond what the worker holds now
    (before its first step: the logits and activations; after a warm-up, nothing). The KV cache
    is bounded by policy.generation.torch_cfg.max_tokens_in_flight and not counted."""
    est = estimate_memory(config, cfg, model_kind="causal_lm", device_type=device.type, world_size=world_size,
                          reference_config=None)
    t, n, gen = est.terms, est.parameters, cfg.generation
    engine = DTYPES[gen.torch_cfg.precision or cfg.precision].itemsize if gen.backend == "torch" else 0
    if device.type == "cuda":
        peak, held = est.total(("state", "twin", "logits", "activations")), torch.cuda.memory_reserved(device)
    else:
        import psutil

        peak = est.total(("runtime", "state", "twin")) + max(t["load"], t["logits"] + t["activations"])
        held = psutil.Process().memory_info().rss
    t.update(generation=(4 + engine) * n, gathered=4 * n if t["load"] else 0, training=max(0, peak - held))
    est.labels.update(generation=f"the generation copy of the weights ({gen.backend} backend)",
                      gathered="the gathered full state dict",
                      training=f"the rest of the training's peak ({peak / 2**30:,.2f} GiB, "
                               f"{held / 2**30:,.2f} held now)")
    _refuse_unless_fits(model_name, est, ("generation", "gathered", "training"), device,
                        1 if device.type == "cuda" else local_workers, cfg)


def _refuse_unless_fits(model_name: str, est: MemoryEstimate, names: Sequence[str], device: torch.device,
                        workers: int, cfg: PolicyConfig) -> None:
    per_worker = est.total(names)
    need = workers * per_worker
    avail = available_memory_bytes(device)
    budget = avail * cfg.max_memory_fraction
    if need <= budget:
        return
    gib = 2**30
    where = "the worker's own GPU" if device.type == "cuda" else "this node's RAM"
    each = f"{workers} workers on this node x {per_worker / gib:,.2f} GiB: " if workers > 1 else ""
    fixes = []
    if {"logits", "activations", "training"} & set(names):
        fixes.append("a smaller policy.train_micro_batch_size or policy.max_total_sequence_length")
        if not cfg.dtensor_cfg.activation_checkpointing:
            fixes.append("policy.dtensor_cfg.activation_checkpointing=true")
    if device.type == "cuda" and "state" in names:
        fixes.append("more GPUs (the state is sharded over them) or policy.dtensor_cfg.cpu_offload=true")
    if workers > 1:
        # More workers on one node would not help: each adds its own copy while loading.
        holds = " and holds its own logits and activations" if "logits" in names else ""
        fixes.append(f"fewer workers on this node (cluster.workers_per_node: each loads its own full copy{holds}) "
                     "or more nodes")
    fixes.append("a smaller model" if cfg.lora.enabled else "a smaller model or LoRA (policy.lora.enabled=true)")
    raise InsufficientMemoryError(
        f"model {model_name!r} ({est.parameters / 1e6:,.1f}M parameters) needs about {need / gib:,.1f} GiB of "
        f"{where} ({each}{est.describe(names)}), but only {budget / gib:,.1f} GiB is allowed "
        f"({avail / gib:,.1f} GiB available x policy.max_memory_fraction={cfg.max_memory_fraction}). To fit: "
        f"{'; '.join(fixes)}; or, if the estimate is too cautious for this run, raise policy.max_memory_fraction "
        "(at most 1)"
    )


# After a conversation that ends with an assistant turn (what data.add_eos ends): after a prompt
# without a generation prompt it broke the prompt's render extending the conversation's, which a
# reward model environment with add_generation_prompt=false reads it by, and failed every sample.
_EOS_AFTER = ("{% if not add_generation_prompt and messages and messages[-1]['role'] == 'assistant' %}"
              "{{ eos_token }}{% endif %}")
# What a template may put BOS in front with, as (before, after) the template: a SentencePiece
# tokenizer (Llama 2's, stories260K's) reads text after a special token without its leading-space
# marker, so "<s>Once" is not BOS + the ids of "Once"; "<s> Once" is. A template whose text starts
# with a space for one prompt and not for another (SQuAD's "Context: ..." and " Question: ...")
# gets the space only where its text lacks one: rendered into a variable first.
_BOS_FRONTS = (("{{ bos_token }}", ""), ("{{ bos_token }} ", ""),
               ("{% set posttrain_text %}",
                "{% endset %}{{ bos_token }}{% if not posttrain_text.startswith(' ') %} {% endif %}{{ posttrain_text }}"))
# The conversation an exported template is checked on, and a prompt with a system turn (a template
# may start it otherwise: SQuAD's "Context: ..." against " Question: ...").
_PROBE_PROMPT = [{"role": "user", "content": "Once upon a time"}]
_PROBE = [*_PROBE_PROMPT, {"role": "assistant", "content": "there was a cat."}]
_PROBE_SYSTEM = [{"role": "system", "content": "Be brief."}, *_PROBE_PROMPT]


def exported_chat_template(tokenizer, *, bos: bool, eos: bool) -> Any:
    """The tokenizer's chat template as an export writes it, so that plain transformers'
    `apply_chat_template` gives the ids posttrain trained on: the BOS that `with_bos` put in front
    of the rendered text when `bos` (data.add_bos), and the EOS after a conversation when `eos`
    (a reward model scores its rows at the EOS data.add_eos appended); each only where the template
    does not already write it, and only as checked on a probe conversation to give posttrain's
    ids (else the template stays and a warning says what is missing). posttrain reads such a
    template back to the same ids (`with_bos` and `add_eos` skip a BOS or EOS that is there).
    A dict of named templates is adjusted name by name."""
    template = tokenizer.chat_template
    if isinstance(template, dict):
        return {name: _with_special_tokens(tokenizer, t, bos, eos) for name, t in template.items()}
    return _with_special_tokens(tokenizer, template, bos, eos) if isinstance(template, str) else template


def _with_special_tokens(tokenizer, template: str, bos: bool, eos: bool) -> str:
    from posttrain.rollouts import render_prompt

    def ids(t: str, messages: list[dict], prompt: bool) -> list[int]:
        return tokenizer.apply_chat_template(messages, chat_template=t, add_generation_prompt=prompt, tokenize=True,
                                             return_dict=False)

    given, original = template, tokenizer.chat_template
    try:
        tokenizer.chat_template = template
        text = tokenizer.apply_chat_template(_PROBE, tokenize=False)
        trained_prompt = render_prompt(tokenizer, _PROBE_PROMPT, True)
        missing = []
        if bos and tokenizer.bos_token and not text.startswith(tokenizer.bos_token):
            fits = [before + template + after for before, after in _BOS_FRONTS
                    if ids(before + template + after, _PROBE_PROMPT, True) == trained_prompt]
            with_system = [t for t in fits if _same_ids(lambda: ids(t, _PROBE_SYSTEM, True),
                                                        lambda: render_prompt(tokenizer, _PROBE_SYSTEM, True))]
            template = (with_system or fits or [template])[0]
            if not fits:
                missing.append("the BOS that data.add_bos put in front")
            elif not with_system:
                missing.append("the BOS that data.add_bos put in front of a prompt that starts with a system turn")
        if eos and tokenizer.eos_token and not text.rstrip().endswith(tokenizer.eos_token):
            if ids(template + _EOS_AFTER, _PROBE, False) == [*ids(template, _PROBE, False), tokenizer.eos_token_id]:
                template += _EOS_AFTER
            else:
                missing.append("the EOS that data.add_eos appended")
    except Exception:  # noqa: BLE001 - a template that needs more (a system turn): left as it is
        return given
    finally:
        tokenizer.chat_template = original
    if missing:
        log.warning("the exported chat template does not write %s (it would not tokenize as training did); "
                    "with plain transformers, add it to the ids yourself", " nor ".join(missing))
    return template


def written_by_export(loaded: Any, template: str) -> bool:
    """Whether `loaded`, a model folder's chat template, is `template` as an export writes it
    (`exported_chat_template`: a BOS in front, an EOS after, or neither): a run of the same
    config on its own export replaces it with the one it came from, and no warning is due."""
    return isinstance(loaded, str) and any(loaded == before + template + after + end
                                           for before, after in (("", ""), *_BOS_FRONTS) for end in ("", _EOS_AFTER))


def _same_ids(exported: Callable[[], list[int]], trained: Callable[[], list[int]]) -> bool:
    """Whether the two renders give the same ids; True where the template refuses the conversation
    (a system turn, in Gemma's): there is nothing to get wrong."""
    try:
        return exported() == trained()
    except Exception:  # noqa: BLE001 - the template's own refusal (jinja's TemplateError, an InputError)
        return True


def load_generation_config(path: str):
    """The `generation_config.json` of a model folder or hub id, or None when it has none. It can
    hold stop ids that config.json lacks (Qwen2.5-Instruct: <|endoftext|> beside <|im_end|>),
    which the generation backends stop on, and sampling defaults: an export must keep it."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(path)
    except OSError:
        return None


def save_hf(state_dict: Mapping[str, torch.Tensor], config, tokenizer, path: str | os.PathLike, model_kind: str,
            generation_config=None) -> None:
    """Write `state_dict` (full, CPU) as a transformers checkpoint: safetensors + config + tokenizer,
    and `generation_config` (the base model's; None: transformers derives one from `config`).

    The model is built on the meta device and takes the given tensors by assignment, so no
    extra copy is made and transformers handles tied weights and shard files itself.
    """
    with torch.device("meta"):
        model = model_class(model_kind).from_config(config_for_kind(config, model_kind),
                                                    dtype=next(iter(state_dict.values())).dtype)
    if generation_config is not None and model.can_generate():
        model.generation_config = generation_config
    missing, unexpected = model.load_state_dict(dict(state_dict), strict=False, assign=True)
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise KeyError(f"export_hf: state dict does not match {type(model).__name__}: missing {missing[:5]}, "
                       f"unexpected {unexpected[:5]}")
    model.tie_weights()
    with writing_folder(Path(path)) as tmp:
        model.save_pretrained(tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
