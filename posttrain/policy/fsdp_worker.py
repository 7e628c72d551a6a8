"""`FSDPPolicyWorker`: one rank of the policy, hosted by a `RayWorkerGroup` actor.

Every rank loads the model, shards it with FSDP2 (`fully_shard` per decoder layer, then the
root) over a 1-D data-parallel mesh of WORLD_SIZE ranks (gloo on CPU, nccl on CUDA; a single
rank keeps the plain module, where FSDP2 has nothing to shard, and does FSDP2's mixed-precision
cast itself with a `LowPrecisionTwin`), and serves train / logprob / checkpoint / export /
colocated-generation calls. All methods are collective: the driver calls them on every rank at
once (`Policy` does).

Loss normalization: the driver's loss function divides each micro-batch loss by the GLOBAL
number of valid tokens (or sequences) of the global batch, counted over all ranks
(all_reduce). Micro-batch losses are then summed (not averaged) and FSDP's gradient
reduction sums over ranks (divide factor 1), so gradients do not depend on the micro-batch
size or the number of workers.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import json
import logging
import math
import os
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from posttrain.checkpoint import TRAINER_STATE_FILE
from posttrain.config import ConfigError, InputError
from posttrain.convert.dcp_to_hf import HF_CONFIG_DIR, META_FILE
from posttrain.convert.output import writing_folder
from posttrain.data.batch import BatchedDataDict
from posttrain.data.packing import (dynamic_microbatches, pack_rows, packed_microbatches, round_up,
                                    share_prefixes, unpack_token_values)
from posttrain.generation.interfaces import pad_token_id
from posttrain.generation.sampling import version_seed
from posttrain.losses.utils import valid_counts
from posttrain.policy.blockwise_attention import (PrefixBlocks, base_implementation, enable_blockwise, is_blockwise,
                                                 sliding_window)
from posttrain.policy.hf_io import (DTYPES, ROW_TOKENS_FILE, attention_kernel, cast_parameters,
                                   check_fits_in_memory, check_generation_fits, disable_dropout, exported_chat_template,
                                   load_generation_config, load_model_configs, load_pretrained, mlp_size, model_class,
                                   resolve_tokenizer_path, save_hf)
from posttrain.policy.lora import maybe_apply_lora, merge_lora_state_dict, save_adapter
from posttrain.policy.optim import build_optimizer, build_scheduler, resumed_scheduler, run_hyperparameters
from posttrain.runtime import freeze_setup_objects, resolve_device
from posttrain.schemas import CompileConfig, PolicyConfig

log = logging.getLogger(__name__)

class LowPrecisionTwin:
    """FSDP2's mixed precision (`MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=float32)`)
    on one rank, without FSDP2: a copy of the float32 master module whose parameters are cast to
    `dtype` runs every forward and backward; after each backward its gradients are added to the
    master's in float32 (FSDP2 accumulates its reduced gradients in float32 too), and the
    optimizer steps the master. Buffers (rotary frequencies) stay float32, as under FSDP2.

    Why not FSDP2 with one rank: it has nothing to shard, yet its DTensor dispatch on every
    op and optimizer update cost more than the bf16 matmuls saved (quickstart, 4 optimizer
    steps: bf16 under FSDP2 141 ms, bf16 with this twin 122 ms, float32 151 ms)."""

    def __init__(self, master: torch.nn.Module, dtype: torch.dtype):
        self.module = copy.deepcopy(master)
        cast_parameters(self.module, dtype)
        self._masters, self._lows = list(master.parameters()), list(self.module.parameters())
        self.version: int | None = None  # master weights version the copy holds

    def sync(self, version: int) -> torch.nn.Module:
        """The low-precision module, holding the master's weights of `version`."""
        if self.version != version:
            with torch.no_grad():
                torch._foreach_copy_(self._lows, self._masters)  # one call, not one per parameter
            self.version = version
        return self.module

    def accumulate_grads(self) -> None:
        """Move the low-precision gradients of the last backward into the master's (float32)."""
        for master, low in zip(self._masters, self._lows):
            if low.grad is None:
                continue
            if master.grad is None:
                master.grad = low.grad.to(master.dtype)
            else:
                master.grad.add_(low.grad)
            low.grad = None


def token_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, chunk_size: int | None = None, temperature: float = 1.0,
    offset: int = 0, entropy: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Token-aligned log-probabilities, computed in float32.

        out[b, 0] = 0,   out[b, t] = log softmax(logits[b, t-1] / temperature)[input_ids[b, t]]  (t >= 1)

    logits `[b, L, V]`, input_ids `[b, L]` -> `[b, L]`. With `chunk_size`, the float32
    log-softmax is done `chunk_size` positions at a time to bound memory (vocab x positions).
    `temperature` is the sampling temperature of the rollouts, so that the policy's logprobs
    are of the distribution the tokens were drawn from (as NeMo RL does). With `offset`, the
    logits are those of positions `[offset, L)` only (`logits_to_keep`), and `out[b, t] = 0`
    for `t <= offset`. With `entropy`, `(logprobs, entropies)`: the entropy of each of those
    distributions, aligned and zeroed alike (`logprobs_at`).
    """
    b, kept, _ = logits.shape
    rows = torch.arange(b, device=logits.device)
    positions = torch.arange(kept - 1, device=logits.device).expand(b, -1)
    values = logprobs_at(logits, rows, positions, input_ids[:, offset + 1 :], chunk_size, temperature, entropy)
    # Position t holds the value of the logit at t - 1 - offset (the one that scores token t), 0 up to offset.
    zeros = torch.zeros(b, offset + 1, dtype=torch.float32, device=logits.device)
    if not entropy:
        return torch.cat([zeros, values], dim=1)
    return tuple(torch.cat([zeros, v], dim=1) for v in values)


def _scaled_chunks(logits: torch.Tensor, chunk_size: int | None, temperature: float) -> Iterator[torch.Tensor]:
    """`logits [R, L, V]` `chunk_size` positions at a time, in float32 and divided by the temperature:
    the distributions `logprobs_at` works on, at most that many positions x vocab at once."""
    step = chunk_size or logits.shape[1]
    for s in range(0, logits.shape[1], step):
        chunk = logits[:, s : s + step].float()
        yield chunk / temperature if temperature != 1.0 else chunk


def logprobs_at(logits: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, targets: torch.Tensor,
                chunk_size: int | None = None, temperature: float = 1.0,
                entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`out[i, t] = log softmax(logits[rows[i], positions[i, t]] / temperature)[targets[i, t]]`, float32.

    logits `[R, L, V]`, rows `[b]`, positions and targets `[b, T]` -> `[b, T]`. The normaliser
    log Z is computed `chunk_size` positions at a time (`_scaled_chunks`); the picked logits are
    gathered directly. With `entropy`, `(out, H)`: `H[i, t]`, the entropy of the same
    distribution, without gradient (`loss_fn.top_entropy_quantile` picks tokens by it), from the
    same pass: H = log Z - sum_v p_v z_v with p = exp(z - log Z), so the vocabulary is not
    normalised a second time.
    """
    lse, entropies = [], []
    for chunk in _scaled_chunks(logits, chunk_size, temperature):
        chunk_lse = torch.logsumexp(chunk, dim=-1)
        lse.append(chunk_lse)
        if entropy:
            with torch.no_grad():
                z, log_z = chunk.detach(), chunk_lse.detach()
                entropies.append(log_z - (torch.exp(z - log_z[..., None]) * z).sum(-1))
    lse = torch.cat(lse, dim=1)
    picked = logits[rows[:, None], positions, targets].float()
    if temperature != 1.0:
        picked = picked / temperature
    out = picked - lse[rows[:, None], positions]
    if not entropy:
        return out
    return out, torch.cat(entropies, dim=1)[rows[:, None], positions]


def _attention_score_cost(config) -> float:
    """One attention score's cost relative to one token through the projections, MLP and head.

    A score is a q.k product and a weighted v sum (4 x heads x head_dim FLOPs per layer); a
    token costs 2 FLOPs per weight. Counted twice: masked dense attention runs well below the
    matmul rate (measured on CPU: a 30M model's shared-prefix rows of 522 tokens were slower
    than the plain rows of 74 despite 12% fewer tokens)."""
    c = getattr(config, "text_config", config)
    h, layers, heads = c.hidden_size, c.num_hidden_layers, getattr(c, "num_attention_heads", None)
    if not heads:  # no attention (Mamba): nothing to share a prompt through (`_check_rows_stay_apart`)
        return 0.0
    hd = getattr(c, "head_dim", None) or h // heads
    kv = getattr(c, "num_key_value_heads", None) or heads
    inter = mlp_size(c)
    per_token = 2 * (layers * (2 * h * heads * hd + 2 * h * kv * hd + 3 * h * inter) + h * c.vocab_size)
    return 2 * 4 * heads * hd * layers / per_token


def _takes_logits_to_keep(model: torch.nn.Module) -> bool:
    """Whether the causal LM's forward can compute logits for its last positions only."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # peft
    return "logits_to_keep" in inspect.signature(base.forward).parameters


def _first_trained(token_mask: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """`[b]`: each row's first position with `token_mask > 0` (its length when it has none)."""
    trained = token_mask > 0
    return torch.where(trained.any(1), trained.int().argmax(1), lengths.to(token_mask.device))


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks, by the class names transformers marks as not splittable (also
    once FSDP2 has made them subclasses of those classes)."""
    names = set(getattr(model, "_no_split_modules", None) or [])
    layers = [m for m in model.modules() if any(c.__name__ in names for c in type(m).__mro__)]
    if not layers:
        raise ValueError(f"cannot find the decoder layers of {type(model).__name__} to shard or compile "
                         f"(_no_split_modules={sorted(names)})")
    return layers


def check_compile_backend(cfg: CompileConfig) -> None:
    """Refuse a policy.compile.backend torch does not have (the driver asks before Ray starts; it
    failed in the workers, after the cluster had started)."""
    if not cfg.enabled:
        return
    import torch._dynamo

    if cfg.backend not in torch._dynamo.list_backends(exclude_tags=()):
        raise ConfigError(f"policy.compile.backend={cfg.backend!r} is not a torch.compile backend; available: "
                          f"{', '.join(torch._dynamo.list_backends())} (and debugging ones such as aot_eager, eager)")


def check_compile(cfg: CompileConfig, device: torch.device) -> None:
    """Refuse policy.compile settings that would fail at the first forward, deep in torch."""
    check_compile_backend(cfg)
    if cfg.backend == "inductor" and device.type == "cpu":
        from torch._inductor import config as inductor_config
        from torch._inductor.cpp_builder import get_cpp_compiler

        try:
            get_cpp_compiler()
        except Exception:  # torch's InvalidCxxCompiler: none of the names it tries runs
            tried = [c for c in inductor_config.cpp.cxx if c]
            raise ConfigError(
                "policy.compile.enabled with backend inductor on a CPU builds its kernels with a C++ compiler, and "
                f"none runs here (tried {', '.join(tried) or 'none'}; torch reads the CXX variable): install one "
                "(Debian/Ubuntu: apt-get install g++), or set policy.compile.enabled=false") from None


def compile_layers(model: torch.nn.Module, cfg: CompileConfig) -> None:
    """torch.compile the forward of every decoder layer of `model` (policy.compile). The forward,
    not the module: FSDP2's hooks around it stay eager (they swap sharded and gathered
    parameters), and the parameter names (state dicts, checkpoints) stay as they are. The layers
    share their compiled graphs: torch passes a layer's parameters as graph inputs."""
    for layer in _decoder_layers(model):
        layer.forward = torch.compile(layer.forward, backend=cfg.backend, mode=cfg.mode, dynamic=cfg.dynamic)


class FSDPPolicyWorker:
    """One FSDP2 rank of the policy (see the module docstring). `setup()` does the loading."""

    def __init__(self, cfg: PolicyConfig, init_reference: bool = True, model_kind: str = "causal_lm",
                 export_bos: bool = True, export_eos: bool = False):
        self.cfg = cfg
        self._export_special = {"bos": export_bos, "eos": export_eos}  # see Policy
        self.init_reference = init_reference
        self.model_kind = model_kind
        self.rank = int(os.environ["RANK"])
        self.world_size = int(os.environ["WORLD_SIZE"])
        # Tensor parallelism: ranks r with the same r // tp form a group that computes on the
        # same rows (see posttrain.policy.tensor_parallel); sums over all ranks count them tp times.
        self.tp = cfg.dtensor_cfg.tensor_parallel_size
        self.gen_engine = None
        self.weights_version = 0  # bumped by every applied optimizer step; generation refits when it lags
        self.gen_version = -1
        # Logprobs are of logits / the rollouts' sampling temperature (greedy = 0 -> unscaled).
        self._temperature = cfg.generation.temperature or 1.0
        self._model_tokens = 0  # positions through the model in the current train step
        self._twin: LowPrecisionTwin | None = None  # one rank in bf16/fp16 (see LowPrecisionTwin)
        # The same for a reference that policy.reference_sync moves: its float32 master takes the
        # syncs (in bf16 an update below the value's rounding step was lost: 30% of its elements
        # moved at mixup_alpha 0.01), the twin computes; `_reference_version` counts the syncs.
        self._reference_twin: LowPrecisionTwin | None = None
        self._reference_version = 0
        self._reference_is_base = False  # a LoRA policy's reference: its own forward with the adapters off
        self._skipped_in_a_row = 0  # optimizer steps skipped for a non-finite gradient, up to now

    # ------------------------------------------------------------------ setup

    def setup(self) -> dict[str, Any]:
        cfg = self.cfg
        self.device = resolve_device(cfg.device)
        # Before the process group: an embedded model built here (a cold cache, ranks started by
        # run_local_ranks) is written by whichever rank takes its lock, and transformers writes
        # no model files on a rank other than 0 of a started group.
        (path, hf_config), reference = load_model_configs(cfg, with_reference=self.init_reference,
                                                           model_kind=self.model_kind)
        if not dist.is_initialized():
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                    rank=self.rank, world_size=self.world_size)
        ref_path, ref_config = reference or (None, None)
        # The policy's attention kernel: its models, and the generation engine's copy, load with it.
        self.attn_kernel = attention_kernel(cfg.attn_implementation, cfg.max_total_sequence_length, self.device.type,
                                            hf_config)
        # A LoRA policy's reference is its own base model: its forward with the adapters off (as
        # TRL's), not a second full copy of the base beside it.
        self._reference_is_base = reference is not None and cfg.lora.enabled and cfg.reference_model_name is None
        if self._reference_is_base:
            ref_path, ref_config = None, None
        self.model_path, self.hf_config = path, hf_config
        self.generation_config = load_generation_config(path)  # for the export and the checkpoints
        if cfg.prefix_sharing.enabled and self.model_kind == "causal_lm":
            self._score_cost = _attention_score_cost(hf_config)  # prefix sharing's cost model, once
        n_params = check_fits_in_memory(cfg.model_name, hf_config, cfg, model_kind=self.model_kind, device=self.device,
                                        world_size=self.world_size, local_workers=self._local_workers(),
                                        reference_config=ref_config)
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # keeps worker logs readable line by line
        self.tokenizer = AutoTokenizer.from_pretrained(resolve_tokenizer_path(cfg))
        if cfg.tokenizer.chat_template is not None:
            self.tokenizer.chat_template = cfg.tokenizer.chat_template
        self._export_template = exported_chat_template(self.tokenizer, **self._export_special)
        # The id the driver pads batches with (`load_tokenizer`: the pad token, else EOS).
        self.pad_id = pad_token_id(self.tokenizer)
        if self.model_kind == "sequence_classification":
            # A reward model scores each row at its last non-pad token, which transformers finds
            # by the config's pad_token_id (without one it refuses batches of more than one row):
            # it must be the id the rows are padded with, or a shorter row is scored at a padding
            # position. Set here, it reaches the model, the HF export and the checkpoints' config alike.
            hf_config.pad_token_id = self.pad_id
            # And the BOS/EOS data.add_bos/add_eos put around its rows, which the reward_model
            # environment then adds as they were (its own default, both, scored an RM trained
            # without the EOS on other ids: -0.60 against -0.14).
            hf_config.posttrain_row_tokens = {"add_bos": self._export_special["bos"],
                                              "add_eos": self._export_special["eos"]}
        if cfg.compile.enabled:
            check_compile(cfg.compile, self.device)  # before the minutes of loading
        t0 = time.perf_counter()
        self.model = self._load_and_shard(path, train=True)
        if self._single_rank_plain() and DTYPES[cfg.precision] != torch.float32:
            self._twin = LowPrecisionTwin(self.model, DTYPES[cfg.precision])
        self.optimizer = build_optimizer([p for p in self.model.parameters() if p.requires_grad], cfg.optimizer)
        self.scheduler = build_scheduler(self.optimizer, cfg.scheduler)
        self.reference = self._load_and_shard(ref_path, train=False) if ref_path is not None else None
        if self.reference is not None and self._reference_keeps_master():
            self._reference_twin = LowPrecisionTwin(self.reference, DTYPES[cfg.precision])
        # The policy's and the reference's (a distillation teacher of another class) forwards alike.
        self._keeps_logits = self.model_kind == "causal_lm" and all(
            _takes_logits_to_keep(m) for m in (self.model, self.reference) if m is not None)
        if cfg.compile.enabled:
            for model in (self._twin.module if self._twin is not None else self.model,
                          self._reference_twin.module if self._reference_twin is not None else self.reference):
                if model is not None:
                    compile_layers(model, cfg.compile)
        if self.reference is not None and cfg.reference_sync.enabled:
            self._synced_pairs()  # a reference of another architecture fails here, not at the first sync
        self._check_rows_stay_apart()
        freeze_setup_objects()
        positions = {"policy.model_name": getattr(hf_config, "max_position_embeddings", None)}
        if ref_config is not None and cfg.reference_model_name is not None:
            positions["policy.reference_model_name"] = getattr(ref_config, "max_position_embeddings", None)
        return {"num_parameters": n_params, "load_s": time.perf_counter() - t0, "device": str(self.device),
                "pad_id": self.pad_id, "max_position_embeddings": positions}

    def _load_and_shard(self, path: str, train: bool) -> torch.nn.Module:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import (CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy,
                                            fully_shard)

        cfg = self.cfg
        kwargs = {"num_labels": 1} if self.model_kind == "sequence_classification" else {}
        kwargs["attn_implementation"] = self.attn_kernel
        # Weights that are not in the checkpoint (a reward model's score head, LoRA's A) are
        # initialised randomly: the same seed on every rank gives every rank the same model.
        torch.manual_seed(0)
        key = "policy.model_name" if train else "policy.reference_model_name"
        model = load_pretrained(self.model_kind, path, key, cfg.model_name if train else cfg.reference_model_name,
                                new_head=train, dtype=torch.float32, **kwargs)
        if self.model_kind == "sequence_classification":
            model.config.pad_token_id = self.hf_config.pad_token_id
        if self._wants_blockwise():
            enable_blockwise(model)  # long shared-prefix rows then skip their masked scores
        if train:
            if cfg.disable_dropout:
                disable_dropout(model)  # before LoRA: its adapters' dropout is policy.lora.dropout
            model = maybe_apply_lora(model, cfg.lora)
            if cfg.dtensor_cfg.activation_checkpointing:
                # Non-reentrant checkpointing is the variant that composes with FSDP2.
                if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
                    model.activation_checkpointing_enable({"use_reentrant": False})
                else:
                    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        else:
            model.requires_grad_(False)
        model.config.use_cache = False
        compute = DTYPES[cfg.precision]
        if self._single_rank_plain():
            # One rank: FSDP2 would not shard, only add a copy and a collective per layer and
            # DTensor dispatch to every optimizer op (measured: over a third of the
            # quickstart's float32 training step). The plain module goes through the same
            # worker code: the DCP state-dict helpers and checkpoints work on both. A bf16/fp16
            # policy computes in its LowPrecisionTwin; a frozen reference model is simply cast.
            model.to(self.device)
            if not train and compute != torch.float32 and not self._reference_keeps_master():
                cast_parameters(model, compute)
            model.train(train)
            return model
        if self.tp > 1:
            from posttrain.policy.tensor_parallel import apply_tensor_parallel

            mesh = init_device_mesh(self.device.type, (self.world_size // self.tp, self.tp),
                                    mesh_dim_names=("dp", "tp"))
            # The (dp, tp) group as one: a reduction over both dims (the gradient norm of the split
            # projections) is then one all-reduce instead of one per dim, which DTensor warned of.
            mesh._flatten()
            apply_tensor_parallel(model, _decoder_layers(model), mesh["tp"], cfg.dtensor_cfg.sequence_parallel)
            mesh = mesh["dp"]
        else:
            mesh = init_device_mesh(self.device.type, (self.world_size,), mesh_dim_names=("dp",))
        shard_kwargs = {
            "mesh": mesh,
            # float32 master weights; bf16/fp16 compute, fp32 gradient reduction.
            "mp_policy": MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32),
            # Pinned host memory needs an accelerator; on a CPU-only machine offload is a no-op anyway.
            "offload_policy": (CPUOffloadPolicy(pin_memory=self.device.type == "cuda")
                               if cfg.dtensor_cfg.cpu_offload else OffloadPolicy()),
        }
        for layer in _decoder_layers(model):
            fully_shard(layer, **shard_kwargs)
        fully_shard(model, **shard_kwargs)
        if not cfg.dtensor_cfg.cpu_offload:
            model.to(self.device)
        # The loss is already divided by the global counts: sum gradients over ranks, not mean.
        # Plain SUM collectives (with the factor applied around them) also work on gloo,
        # which has no PREMUL_SUM/AVG.
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        model.train(train)
        return model

    def _wants_blockwise(self) -> bool:
        """`policy.prefix_sharing.blockwise_attention` resolved for this worker's device."""
        ps = self.cfg.prefix_sharing
        if not ps.enabled or self.model_kind != "causal_lm":
            return False
        return ps.blockwise_attention == "on" or (ps.blockwise_attention == "auto" and self.device.type == "cpu")

    @staticmethod
    def _local_workers() -> int:
        """The policy workers on this node (each loads its own full copy into the node's RAM)."""
        return int(os.environ.get("LOCAL_WORLD_SIZE", 1))

    def _reference_keeps_master(self) -> bool:
        """Whether the reference stays float32 beside a low-precision twin: one plain rank in
        bf16/fp16 with policy.reference_sync (FSDP2 keeps float32 parameters of its own)."""
        return (self.cfg.reference_sync.enabled and self._single_rank_plain()
                and DTYPES[self.cfg.precision] != torch.float32)

    def _single_rank_plain(self) -> bool:
        """One rank without CPU offload keeps the plain module instead of FSDP2."""
        return self.world_size == 1 and not self.cfg.dtensor_cfg.cpu_offload

    def _compute_model(self) -> torch.nn.Module:
        """The module the policy's forward and backward run on (the master, or its twin)."""
        return self._twin.sync(self.weights_version) if self._twin is not None else self.model

    def _reference_compute_model(self) -> torch.nn.Module | None:
        """The module the reference's forward runs on (the reference, or its twin)."""
        twin = self._reference_twin
        return twin.sync(self._reference_version) if twin is not None else self.reference

    # ------------------------------------------------------------------ micro-batches

    def _microbatches(self, batch: BatchedDataDict, train: bool,
                      group: int) -> tuple[list[list[int]], list[list[int]] | None]:
        """Row indices of each micro-batch, and (packing) the number of sequences in each packed row."""
        cfg = self.cfg
        lengths = [int(x) for x in batch["input_lengths"].tolist()]
        packing = cfg.sequence_packing.enabled and self.model_kind == "causal_lm"
        if packing:
            key = "train_mb_tokens" if train else "logprob_mb_tokens"
            mbs = packed_microbatches(lengths, getattr(cfg.sequence_packing, key), cfg.sequence_packing.algorithm,
                                      group, budget_key=f"policy.sequence_packing.{key}",
                                      round_to=cfg.sequence_packing.sequence_length_round)
            return [[i for row in mb for i in row] for mb in mbs], [[len(row) for row in mb] for mb in mbs]
        if cfg.dynamic_batching.enabled:
            budget = cfg.dynamic_batching.train_mb_tokens if train else cfg.dynamic_batching.logprob_mb_tokens
            return dynamic_microbatches(lengths, budget, cfg.dynamic_batching.sequence_length_round, group), None
        size = cfg.train_micro_batch_size if train else cfg.logprob_batch_size
        if size % group:
            raise ValueError(f"a pair loss needs an even micro-batch size, got {size} "
                             f"(policy.{'train_micro_batch_size' if train else 'logprob_batch_size'})")
        return [list(range(s, min(s + size, len(lengths)))) for s in range(0, len(lengths), size)], None

    def _max_over_ranks(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.long, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def _forward(self, model: torch.nn.Module, mb: BatchedDataDict, rows: list[int] | None,
                 entropy: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token-aligned logprobs `[b, S]` (causal LM) or scores `[b]` (sequence classification);
        `rows`: pack the micro-batch into rows of that many sequences each (None: no packing).
        With a `token_mask`, the logprobs of the tokens before a row's first trained token are 0
        (their logits are not computed where that saves work: `_untrained_logits`). With `entropy`
        (a causal LM), `(logprobs, entropies)`: the entropy of the distribution behind each logprob,
        aligned and zeroed alike, without gradient (`logprobs_at`)."""
        ids = mb["input_ids"].to(self.device)
        lengths = mb["input_lengths"]
        seq_len = ids.shape[1]
        if self.model_kind == "sequence_classification":
            fitted = self._fit(ids, lengths)
            self._model_tokens += fitted.numel()
            return model(input_ids=fitted, use_cache=False).logits[:, 0].float()
        first = _first_trained(mb["token_mask"].to(self.device), lengths) if "token_mask" in mb else None
        values = None
        if rows is not None and all(n == 1 for n in rows):
            # Nothing packed (rows of similar lengths): the rows as they are, padded to the
            # longest instead of to sequence_length_round (128 positions for rows of ~90: 43% more).
            rows = None
        if rows is not None:
            packed = pack_rows(ids, lengths, rows, self.pad_id, self.cfg.sequence_packing.sequence_length_round)
            # No attention mask + restarting position_ids = packed sequences in transformers.
            logits = model(input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=False).logits
            self._model_tokens += packed.input_ids.numel()
            values = token_logprobs(logits, packed.input_ids, self.cfg.logprob_chunk_size, self._temperature,
                                    entropy=entropy)
            values = [unpack_token_values(v, packed, seq_len) for v in (values if entropy else [values])]
        elif self._shares_prefixes and first is not None:
            values = self._forward_shared_prefixes(model, ids, lengths, first, entropy)
        if values is None:
            values = self._forward_rows(model, ids, lengths, first, entropy)
        if first is not None:
            trained_on = torch.arange(seq_len, device=values[0].device)[None] >= first.to(values[0].device)[:, None]
            values = [v * trained_on for v in values]
        return tuple(values) if entropy else values[0]

    def _check_rows_stay_apart(self) -> None:
        """Prefix sharing and sequence packing run several sequences in one row, kept apart by the
        attention mask and restarting positions alone. A model that mixes positions elsewhere (a
        convolution or recurrent layer: LFM2, Mamba, Qwen3-Next's linear attention) or builds its
        mask without the position ids (OPT, Bloom) computed other logprobs and gradients, without
        a word. So one forward of each layout is checked against the plain rows here, for the
        policy and a reference or teacher of its own (its logprobs take the same paths): prefix
        sharing (on by default) is turned off when either mixes, with a warning, and packing (asked
        for) refused. Every rank runs the same forwards (FSDP's and tensor parallelism's collectives)."""
        cfg = self.cfg
        self._shares_prefixes = cfg.prefix_sharing.enabled and self.model_kind == "causal_lm"
        packs = cfg.sequence_packing.enabled and self.model_kind == "causal_lm"
        if not (self._shares_prefixes or packs):
            return
        # Two rows of 11 random tokens that share their first 6 (a prompt), trained after it.
        ids = torch.randint(0, self.hf_config.get_text_config().vocab_size, (2, 11),
                            generator=torch.Generator().manual_seed(0))
        ids[1, :6] = ids[0, :6]
        mb = BatchedDataDict(input_ids=ids, input_lengths=torch.full((2,), 11),
                             token_mask=(torch.arange(11) >= 6).float().expand(2, 11).clone())
        # The plain module in float32 where there is one; FSDP2 computes in policy.precision.
        tolerance = 1e-3 if self._single_rank_plain() or cfg.precision == "float32" else 0.1
        sharing = self._shares_prefixes
        models = [("policy.model_name", self.model, self.hf_config)]
        if self.reference is not None:
            models.append(("policy.reference_model_name", self.reference, self.reference.config))
        for key, model, config in models:
            was_training, mixed = model.training, {}
            model.eval()
            with torch.no_grad():
                self._shares_prefixes = False
                plain = self._forward(model, mb, None)
                if packs:
                    mixed["sequence packing"] = self._forward(model, mb, [2])
                if sharing:  # at no cost for its scores, the two rows share their prompt
                    self._shares_prefixes, cost, self._score_cost = True, self._score_cost, 0.0
                    mixed["prefix sharing"] = self._forward(model, mb, None)
                    self._score_cost = cost
            model.train(was_training)
            _reshard(model)
            wrong = {k: d for k, v in mixed.items() if not (d := float((v - plain).abs().max())) <= tolerance}
            name = type(config).__name__.removesuffix("Config")
            if "sequence packing" in wrong:
                raise ConfigError(f"policy.sequence_packing.enabled=true: {name} models ({key}) mix the sequences "
                                  f"packed in one row (logprobs off by up to {wrong['sequence packing']:.3g} against "
                                  "each sequence alone: a layer other than masked attention, or a mask built without "
                                  "position ids); set it to false")
            if "prefix sharing" in wrong and sharing:
                sharing = False
                log.warning("policy.prefix_sharing: off for %s models (%s), which mix the completions packed after a "
                            "shared prompt (logprobs off by up to %.3g against the plain rows); each row runs on its "
                            "own", name, key, wrong["prefix sharing"])
        self._shares_prefixes = sharing

    def _forward_rows(self, model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor,
                      first: torch.Tensor | None, entropy: bool) -> list[torch.Tensor]:
        """Token logprobs `[b, S]` of the right-padded rows as they are (and their entropies)."""
        seq_len = ids.shape[1]
        fitted = self._fit(ids, lengths)
        skip = self._untrained_logits(first)
        # Right padding + causal attention: valid tokens never see the padding, so no mask is
        # needed and attention takes the fast causal path.
        logits = model(input_ids=fitted, use_cache=False, **self._logits_kwargs(fitted.shape[1], skip)).logits
        self._model_tokens += fitted.numel()
        values = token_logprobs(logits, fitted, self.cfg.logprob_chunk_size, self._temperature, skip, entropy)
        values = values if entropy else [values]
        out = []
        for v in values:
            v = v[:, :seq_len]
            v = v * (torch.arange(v.shape[1], device=v.device)[None] < lengths.to(v.device)[:, None])
            out.append(torch.nn.functional.pad(v, (0, seq_len - v.shape[1])) if v.shape[1] < seq_len else v)
        return out

    def _untrained_logits(self, first: torch.Tensor | None) -> int:
        """How many leading positions of the micro-batch give no trained token its logprob: the
        logit at t-1 scores token t, and no row trains a token (`token_mask`) before `first`.

        Their logits are not computed (`logits_to_keep`, as TRL does): the LM head and the
        float32 log-softmax over a prompt cost vocab x prompt length, most of a long prompt's
        work and memory with a 150k vocabulary (benchmarks/prompt_logits.py: 8 rows of 300 prompt
        + 100 trained tokens, a small body with Qwen's vocabulary, bf16 on CPU: train step 12.7 ->
        3.4 s, log-prob pass 3.9 -> 0.9 s)."""
        if first is None or not self._keeps_logits:
            return 0
        return max(int(first.min()) - 1, 0)

    @staticmethod
    def _logits_kwargs(length: int, skip: int) -> dict[str, int]:
        # logits_to_keep=N keeps the last N positions; 0 keeps all.
        return {"logits_to_keep": length - skip} if skip else {}

    def _forward_shared_prefixes(self, model: torch.nn.Module, ids: torch.Tensor, lengths: torch.Tensor,
                                 first: torch.Tensor, entropy: bool) -> list[torch.Tensor] | None:
        """Token logprobs `[b, S]` (and their entropies) with rows that share their prompt packed over one copy of it
        (`policy.prefix_sharing`); None when no rows share one, the attention backend cannot
        take a custom mask, or a row is longer than the model's sliding window (the shared-prefix
        mask and blocks are full causal attention). The prompt is what precedes a row's first
        trained token, `first`."""
        attn = base_implementation(model)
        if attn not in ("sdpa", "eager"):
            return None
        window = sliding_window(model.config)
        if window is not None and window < int(lengths.max()):
            return None
        layout = share_prefixes(ids, lengths, first, self.pad_id, self.cfg.prefix_sharing.max_row_tokens,
                                self.cfg.make_sequence_length_divisible_by, self._score_cost,
                                blockwise=is_blockwise(model))
        if layout is None:
            return None
        # Every packed row is its prompt, then completions trained from their first token on.
        skip = self._untrained_logits(layout.prefix_lengths)
        kwargs = self._logits_kwargs(layout.input_ids.shape[1], skip)
        if layout.blockwise:
            # The blocks replace the mask; a 4D placeholder (transformers passes 4D masks on
            # as they are) keeps it from building a dense one that nothing reads.
            placeholder = torch.ones(layout.input_ids.shape[0], 1, 1, 1, dtype=torch.bool, device=ids.device)
            logits = model(input_ids=layout.input_ids, position_ids=layout.position_ids, attention_mask=placeholder,
                           prefix_blocks=PrefixBlocks.from_layout(layout), use_cache=False, **kwargs).logits
        else:
            mask = layout.attention_mask(None if attn == "sdpa" else DTYPES[self.cfg.precision])
            logits = model(input_ids=layout.input_ids, position_ids=layout.position_ids, attention_mask=mask,
                           use_cache=False, **kwargs).logits
        self._model_tokens += layout.input_ids.numel()
        # Token t of row r is scored by the logit at its packed position index[r, t-1] - skip.
        at = layout.index[:, :-1].clamp(min=skip) - skip
        values = logprobs_at(logits, layout.row, at, ids[:, 1:], self.cfg.logprob_chunk_size, self._temperature,
                             entropy)
        values = values if entropy else [values]
        t = torch.arange(1, ids.shape[1], device=ids.device)
        in_row = t[None] < lengths.to(ids.device)[:, None]
        return [torch.cat([torch.zeros(ids.shape[0], 1, dtype=v.dtype, device=v.device), v * in_row], dim=1)
                for v in values]

    def _fit(self, ids: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        """`ids` cut (or padded) to the longest row, rounded up to make_sequence_length_divisible_by."""
        length = round_up(int(lengths.max()), self.cfg.make_sequence_length_divisible_by)
        if length <= ids.shape[1]:
            return ids[:, :length]
        return torch.nn.functional.pad(ids, (0, length - ids.shape[1]), value=self.pad_id)

    # ------------------------------------------------------------------ train

    def train(self, shard: BatchedDataDict, loss_fn: Callable, local_batch_size: int,
              lr: float | None = None, temperature: float | None = None) -> dict[str, Any]:
        """Optimizer steps over consecutive local global-batch chunks of `local_batch_size` rows.

        `lr` overrides the learning rate for these steps only, without stepping the scheduler
        (a separate phase such as GRPO's warm-up SFT, which must not use up the schedule);
        `temperature` the logprobs' temperature (that warm-up fits the model itself, at 1)."""
        self._compute_model().train()
        sampling_temperature = self._temperature
        self._temperature = temperature if temperature is not None else sampling_temperature
        try:
            steps = [self._train_step(shard.slice(s, s + local_batch_size), loss_fn, lr)
                     for s in range(0, shard.size, local_batch_size)]
        finally:
            self._temperature = sampling_temperature
        out = _over_steps([{k: v for k, v in s.items() if k not in ("lr", "skipped")} for s in steps])
        out["lr"] = steps[-1]["lr"]
        out["num_optimizer_steps"] = len(steps)
        out["skipped_steps"] = sum(s["skipped"] for s in steps)
        out["skipped_in_a_row"] = self._skipped_in_a_row  # for Policy.train's stop rule, not a metric
        return out

    def reset_optimizer(self) -> None:
        """Forget the optimizer's moments and step counts (the parameters stay)."""
        self.optimizer.state.clear()

    def _train_step(self, batch: BatchedDataDict, loss_fn: Callable, lr_override: float | None) -> dict[str, float]:
        t0 = time.perf_counter()
        group = 2 if getattr(loss_fn, "needs_pairs", False) else 1
        full = batch
        batch, placeholder = self._rows_to_train(batch, loss_fn, group)
        # One all-reduce: the global batch's counts (the loss's normalization), the trained rows'
        # and the placeholders' (apart), the trained rows, the left-out rows and all rows.
        run, none = self._valid_counts(batch), torch.zeros(2)
        counts = torch.cat([self._valid_counts(full), none if placeholder else run, run if placeholder else none,
                            torch.tensor([0.0 if placeholder else float(batch.size),
                                          float(full.size - (0 if placeholder else batch.size)), float(full.size)])]
                           ).to(self.device)
        dist.all_reduce(counts)
        counts /= self.tp
        (global_toks, global_seqs), trained, placeholders, rows = counts.split([2, 2, 2, 3])
        trained_rows, left_out, all_rows = rows
        # Rows with an exactly zero gradient left out (_rows_to_train): the loss normalizes by the
        # trained rows' counts, so its metrics are means over them, and `scale` turns it back into
        # the global batch's loss, sum over rows / global count: the same gradient up to rounding.
        # A rank's placeholder row is measured only when no rank trains a row (its means are then
        # the only ones): counted beside trained rows, it diluted their metrics by the number of
        # workers (pg_loss -0.63 on one worker, -0.41 on two, over the same batch).
        trained_anywhere = bool(trained_rows > 0)
        norm_toks, norm_seqs = trained if trained_anywhere else placeholders
        measured = not placeholder or not trained_anywhere
        by_tokens = getattr(loss_fn, "loss_type", "token") == "token"
        done, total = (norm_toks, global_toks) if by_tokens else (norm_seqs, global_seqs)
        scale = float(done / total) if total > 0 else 1.0

        mbs, packed = self._microbatches(batch, train=True, group=group)
        # Every rank must run the same number of forward/backward passes (FSDP collectives):
        # ranks with fewer micro-batches repeat their first one with the loss scaled by 0.
        n_mb = self._max_over_ranks(len(mbs))
        # Dropout's masks (the model's, LoRA's) follow the weights' version: a run resumed from a
        # checkpoint draws what the uninterrupted run drew at this step (the RNG states of the
        # workers are not in the checkpoint; their own seed at load repeated the first steps'
        # masks). By data-parallel rank: the ranks of a tensor-parallel group, which hold the same
        # activations, draw the same masks.
        seed = version_seed(0, self.weights_version) + self.rank // self.tp
        if self.device.type == "cpu":  # torch.manual_seed seeds every device type: 65 us against 1 us here
            torch.default_generator.manual_seed(seed)
        else:
            torch.manual_seed(seed)
        self.optimizer.zero_grad(set_to_none=True)
        model = self._compute_model()
        self._model_tokens = 0
        loss_sum = 0.0
        metrics: dict[str, float] = {}
        tokens = 0
        for i in range(n_mb):
            real = i < len(mbs)
            mb = batch.select_indices(mbs[i] if real else mbs[0]).to(self.device)
            rows = packed[i if real else 0] if packed else None
            if getattr(loss_fn, "needs_entropy", False):  # loss_fn.top_entropy_quantile: tokens picked by it
                curr, mb["token_entropy"] = self._forward(model, mb, rows, entropy=True)
            else:
                curr = self._forward(model, mb, rows)
            loss, mb_metrics = loss_fn(curr, mb, norm_toks, norm_seqs)
            loss = loss * scale
            (loss if real else loss * 0.0).backward()
            if self._twin is not None:
                self._twin.accumulate_grads()
            if real and measured:
                loss_sum += float(loss.detach())
                tokens += int(mb["input_lengths"].sum())
                _accumulate(metrics, mb_metrics)
        grad_norm = self._clip_grads()
        # A NaN or inf gradient would make every weight it reaches NaN (clipping multiplies by
        # max_norm / norm) along with Adam's moments, and a checkpoint of them loses the run.
        # The norm is global, so every rank skips the same steps: weights, moments and the LR
        # schedule stay as they were, and the caller stops after too many in a row.
        skipped = not math.isfinite(grad_norm)
        lr = lr_override if lr_override is not None else self.optimizer.param_groups[0]["lr"]
        if skipped:
            self.optimizer.zero_grad(set_to_none=True)
            self._skipped_in_a_row += 1
        elif lr_override is None:
            self.optimizer.step()
            self.scheduler.step()
        else:
            scheduled = [g["lr"] for g in self.optimizer.param_groups]
            for g in self.optimizer.param_groups:
                g["lr"] = lr_override
            self.optimizer.step()
            for g, value in zip(self.optimizer.param_groups, scheduled):
                g["lr"] = value
        if not skipped:
            self._skipped_in_a_row = 0
            self.weights_version += 1
        local = {"loss": loss_sum, **metrics}
        gathered: list[dict[str, float]] = [local]
        if self.world_size > 1:  # the pickling round costs ~0.5 ms per optimizer step, for nothing on one rank
            gathered = [None] * self.world_size  # type: ignore[list-item]
            dist.all_gather_object(gathered, local)
        out: dict[str, float] = {}
        for g in gathered[:: self.tp]:  # one rank per tensor-parallel group
            _accumulate(out, g)
        tok = torch.tensor([tokens, self._model_tokens], dtype=torch.long, device=self.device)
        dist.all_reduce(tok)
        tok //= self.tp
        # model_tokens: positions run through the model, padding included (prefix sharing and
        # packing make it smaller than num_tokens; padding larger).
        if left_out > 0:  # the loss counted only the trained rows; the left-out ones are in the loss too
            out["num_valid_samples"] = float(global_seqs)
        out.update(grad_norm=grad_norm, lr=lr, skipped=float(skipped), num_tokens=float(tok[0]),
                   model_tokens=float(tok[1]), global_valid_toks=float(global_toks),
                   global_valid_seqs=float(global_seqs), zero_gradient_fraction=float(left_out / all_rows),
                   num_microbatches=float(n_mb),
                   optimizer_step_time_s=time.perf_counter() - t0)  # the loops' step_time_s is their whole step
        return out

    @staticmethod
    def _valid_counts(batch: BatchedDataDict) -> torch.Tensor:
        """[valid tokens, valid sequences] of `batch` (rows without a token_mask: all their tokens)."""
        sample_mask = batch["sample_mask"].float() if "sample_mask" in batch else torch.ones(batch.size)
        if "token_mask" in batch:
            toks, _ = valid_counts({"token_mask": batch["token_mask"], "sample_mask": sample_mask})
        else:
            toks = (batch["input_lengths"].float() * sample_mask).sum()
        return torch.stack([toks, sample_mask.sum()])

    def _rows_to_train(self, batch: BatchedDataDict, loss_fn: Callable, group: int) -> tuple[BatchedDataDict, bool]:
        """`batch` without the rows whose gradient is exactly 0 (`loss_fn.zero_gradient_rows`, e.g. a
        GRPO group whose samples all got the same reward) when policy.skip_zero_gradient_samples,
        and whether what is left is a placeholder: when no row has a gradient, one stays, so that
        every rank runs its passes and the optimizer steps on a zero gradient as it would have
        (Adam's moments still decay and move the weights). It is counted as left out
        (zero_gradient_fraction 1), and measured when no rank trains a row: the step's per-token
        means (token_mult_prob_error, the ratio, entropy) are then the placeholders', the only ones
        there are."""
        zero_rows = getattr(loss_fn, "zero_gradient_rows", None)
        if not self.cfg.skip_zero_gradient_samples or zero_rows is None or group != 1:
            return batch, False
        keep = (~zero_rows(batch)).nonzero().flatten()
        if len(keep) == batch.size:
            return batch, False
        return batch.select_indices(keep if len(keep) else torch.tensor([0])), not len(keep)

    def _clip_grads(self) -> float:
        """Global L2 grad norm over all shards (DTensor-aware); clips to policy.max_grad_norm."""
        from torch.distributed.tensor import DTensor

        params = [p for p in self.model.parameters() if p.grad is not None]
        if not params:
            return 0.0
        # One group per device mesh: under tensor parallelism the split projections live on the
        # (dp, tp) mesh and the rest on dp, and DTensor ops do not mix meshes.
        groups: dict[Any, list[torch.Tensor]] = {}
        for p in params:
            groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
        norms = []
        for group in groups.values():
            norm = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0)
            norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
        total = torch.linalg.vector_norm(torch.stack(norms)) if len(norms) > 1 else norms[0]
        if self.cfg.max_grad_norm is not None:
            for group in groups.values():
                torch.nn.utils.clip_grads_with_norm_(group, self.cfg.max_grad_norm, total)
        return float(total)

    # ------------------------------------------------------------------ inference

    @torch.no_grad()
    def get_logprobs(self, shard: BatchedDataDict, reference: bool = False) -> BatchedDataDict:
        """`logprobs` (or `reference_logprobs`) `[b, S]` of the rows of `shard`."""
        base = reference and self._reference_is_base
        model = self._reference_compute_model() if reference and not base else self._compute_model()
        if model is None:
            raise RuntimeError("get_reference_logprobs: this Policy was built with init_reference=False")
        key = "reference_logprobs" if reference else "logprobs"
        out = torch.zeros(shard["input_ids"].shape, dtype=torch.float32)
        with model.disable_adapter() if base else contextlib.nullcontext():
            return BatchedDataDict({key: self._inference(model, shard, out)})

    @torch.no_grad()
    def get_scores(self, shard: BatchedDataDict) -> BatchedDataDict:
        """`scores` `[b]` of a sequence-classification (reward) model."""
        out = torch.zeros(shard.size, dtype=torch.float32)
        return BatchedDataDict(scores=self._inference(self._compute_model(), shard, out))

    def _inference(self, model: torch.nn.Module, shard: BatchedDataDict, out: torch.Tensor) -> torch.Tensor:
        was_training = model.training
        model.eval()
        mbs, packed = self._microbatches(shard, train=False, group=1)
        n_mb = self._max_over_ranks(len(mbs))
        for i in range(n_mb):
            if i < len(mbs):
                out[mbs[i]] = self._forward(model, shard.select_indices(mbs[i]), packed[i] if packed else None).cpu()
            else:  # keep FSDP collectives in step with ranks that have more micro-batches
                self._forward(model, self._dummy_batch(), None)
        model.train(was_training)
        _reshard(model)
        return out

    def _dummy_batch(self) -> BatchedDataDict:
        return BatchedDataDict(input_ids=torch.full((1, 2), self.pad_id, dtype=torch.long),
                               input_lengths=torch.tensor([2]))

    # ------------------------------------------------------------------ weights out

    def _full_state_dict(self, all_ranks: bool) -> dict[str, torch.Tensor]:
        """The unsharded fp32 state dict: on every rank (`all_ranks`) or on rank 0 only, on CPU."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        if self._single_rank_plain():
            # Nothing to gather: the module's own state dict (get_model_state_dict's walk over
            # the module took 2.3 ms of the quickstart's 3 ms in-process refit).
            sd = self.model.state_dict()
        else:
            sd = get_model_state_dict(self.model,
                                      options=StateDictOptions(full_state_dict=True, cpu_offload=not all_ranks))
        return {k: v.detach().to("cpu") for k, v in sd.items()}

    def _base_weights(self, all_ranks: bool) -> dict[str, torch.Tensor]:
        """The full state dict in the base architecture's keys (LoRA adapters merged in)."""
        sd = self._full_state_dict(all_ranks)
        if sd and self.cfg.lora.enabled:
            sd = merge_lora_state_dict(sd, self.cfg.lora)
        return sd

    def full_state_dict_ref(self) -> list | None:
        """Rank 0: `[ObjectRef]` of the full CPU state dict in Ray's object store (others: None)."""
        import ray

        sd = self._base_weights(all_ranks=False)
        return [ray.put(sd)] if self.rank == 0 else None

    def export_hf(self, path: str) -> None:
        """Rank 0 writes a transformers checkpoint (LoRA: merged weights, or the adapter alone
        when policy.lora.export == "adapter")."""
        if self.cfg.lora.enabled and self.cfg.lora.export == "adapter":
            sd = self._full_state_dict(all_ranks=False)
            if self.rank == 0:
                with writing_folder(Path(path)) as tmp:
                    save_adapter(sd, self.cfg.lora, tmp, base_model_name_or_path=self.cfg.model_name,
                                 model=self.model)
                    self._save_tokenizer(tmp)
                    if (row_tokens := getattr(self.hf_config, "posttrain_row_tokens", None)) is not None:
                        (tmp / ROW_TOKENS_FILE).write_text(json.dumps(row_tokens), encoding="utf-8")
        else:
            sd = self._base_weights(all_ranks=False)
            if self.rank == 0:
                with self._exported_tokenizer() as tokenizer:
                    save_hf(sd, self.hf_config, tokenizer, path, self.model_kind, self.generation_config)
        dist.barrier()

    @contextlib.contextmanager
    def _exported_tokenizer(self) -> Iterator[Any]:
        """The tokenizer with the chat template an export writes (`exported_chat_template`) and,
        when it has none, the pad token the run padded with (EOS, `load_tokenizer`'s): a reward
        model's export said pad_token_id in config.json, and its tokenizer could not pad a batch."""
        template, pad = self.tokenizer.chat_template, self.tokenizer.pad_token
        self.tokenizer.chat_template = self._export_template
        if pad is None and self.tokenizer.eos_token is not None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        try:
            yield self.tokenizer
        finally:
            self.tokenizer.chat_template = template
            if pad is None:
                self.tokenizer.pad_token = None

    def _save_tokenizer(self, path: str | Path) -> None:
        with self._exported_tokenizer() as tokenizer:
            tokenizer.save_pretrained(path)

    def _synced_pairs(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(reference, policy) local tensors of every policy parameter, by name (sharded alike)."""
        from torch.distributed.tensor import DTensor

        if self.reference is None:
            raise RuntimeError("sync_reference: this Policy was built with init_reference=False")
        reference = dict(self.reference.named_parameters())
        pairs = []
        for name, p in self.model.named_parameters():
            r = reference.get(name)
            if r is None or r.shape != p.shape:
                raise InputError(
                    f"policy.reference_sync: the reference model has no parameter {name} of shape {tuple(p.shape)} "
                    f"(policy.reference_model_name={self.cfg.reference_model_name!r} is another architecture); "
                    "name a reference of the policy's architecture, or turn the sync off")
            pairs.append(tuple(t.to_local() if isinstance(t, DTensor) else t for t in (r, p)))
        return pairs

    @torch.no_grad()
    def sync_reference(self, alpha: float) -> None:
        """TR-DPO's update (policy.reference_sync): reference <- alpha * policy + (1 - alpha) * reference,
        each parameter on this rank's shard, in float32 (FSDP2's parameters; on one plain rank in
        bf16/fp16 the master beside the reference's twin, see `_reference_keeps_master`)."""
        for r, p in self._synced_pairs():
            r.lerp_(p.to(r.dtype), alpha)
        self._reference_version += 1

    # ------------------------------------------------------------------ checkpoints

    def save_checkpoint(self, path: str) -> None:
        """Sharded model + optimizer with torch.distributed.checkpoint (and the reference model once
        policy.reference_sync moves it); scheduler and HF config on rank 0."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        if self.reference is not None and self.cfg.reference_sync.enabled:
            state["reference"] = get_model_state_dict(self.reference)
        self._dcp(dcp.save, state, path)
        if self.rank == 0:
            torch.save({"scheduler": self.scheduler.state_dict(), "weights_version": self.weights_version},
                       Path(path) / TRAINER_STATE_FILE)
            # Lets `posttrain convert dcp-to-hf` rebuild the model without the run config.
            self.hf_config.save_pretrained(Path(path) / HF_CONFIG_DIR)
            if self.generation_config is not None:
                self.generation_config.save_pretrained(Path(path) / HF_CONFIG_DIR)
            self._save_tokenizer(Path(path) / HF_CONFIG_DIR)  # dcp-to-hf exports it
            meta = {"model_kind": self.model_kind, "lora": self.cfg.lora.model_dump()}
            (Path(path) / META_FILE).write_text(json.dumps(meta, indent=1))
        dist.barrier()

    def _dcp(self, fn: Callable, state: dict, path: str) -> None:
        """`dcp.save` / `dcp.load`. One rank passes no_dist: DCP's collectives on a single gloo
        rank left the process's training ~1.5x slower for the rest of the run (measured on the
        quickstart, with or without FSDP2; the cause inside DCP/gloo is not known)."""
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            fn(state, checkpoint_id=path, no_dist=self.world_size == 1)

    def load_checkpoint(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                             set_model_state_dict, set_state_dict)

        if not (Path(path) / ".metadata").is_file():
            raise FileNotFoundError(f"no torch.distributed.checkpoint at {path} (missing .metadata)")
        run_groups = run_hyperparameters(self.optimizer)
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        state = {"model": model_sd, "optim": optim_sd}
        # A reference the run has moved (policy.reference_sync) comes back as it was saved; one
        # that was never saved is the frozen one this worker loaded.
        saved = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        with_reference = self.reference is not None and any(k.startswith("reference.") for k in saved)
        if with_reference:
            state["reference"] = get_model_state_dict(self.reference)
        self._dcp(dcp.load, state, path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        if with_reference:
            set_model_state_dict(self.reference, state["reference"])
        extra = torch.load(Path(path) / TRAINER_STATE_FILE, weights_only=False)
        self.scheduler = resumed_scheduler(self.optimizer, run_groups, self.cfg.scheduler,
                                           extra["scheduler"]["last_epoch"])
        self.weights_version = extra["weights_version"]
        self.gen_version = -1  # the generation copy holds other weights now
        for twin in (self._twin, self._reference_twin):
            if twin is not None:
                twin.version = None
        dist.barrier()

    # ------------------------------------------------------------------ colocated generation

    def generate(self, shard: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """Generate with the torch (or hf) backend on this rank's unsharded copy of the policy.

        After each optimizer step the copy is refit in process from the gathered full state
        dict (a collective, so every rank takes part even with an empty shard)."""
        self.prepare_for_generation()
        if shard.size == 0:
            return BatchedDataDict()
        return self.gen_engine.generate(shard.to("cpu") if self.device.type == "cpu" else shard, greedy=greedy)

    def prepare_for_generation(self, force: bool = False) -> dict[str, float]:
        """Refit the generation copy to the current weights (and so reseed its sampler) unless it
        holds them already; `force`: refit anyway."""
        if self.gen_version == self.weights_version and self.gen_engine is not None and not force:
            return {"refit_s": 0.0}
        t0 = time.perf_counter()
        sd = self._base_weights(all_ranks=True)
        if self.gen_engine is None:
            from posttrain.generation import build_generation

            # Loaded once from the model folder (so buffers such as rotary frequencies are
            # built), then refit in place from the live weights. hf runs on this copy as the torch
            # engine does (it is the backend for architectures the torch engine cannot run). vLLM
            # loads its own model: colocated vLLM is not implemented, and GRPO's config refuses it.
            # With the policy's attention kernel: the torch engine's prefill computes as it does.
            check_generation_fits(self.cfg.model_name, self.hf_config, self.cfg, device=self.device,
                                  world_size=self.world_size, local_workers=self._local_workers())
            copy = model_class("causal_lm").from_pretrained(self.model_path, dtype=torch.float32,
                                                            attn_implementation=self.attn_kernel)
            self.gen_engine = build_generation(
                self.cfg.generation.backend, model=copy.to(self.device).eval(), tokenizer=self.tokenizer,
                cfg=self.cfg.generation,
                max_total_sequence_length=self.cfg.max_total_sequence_length, precision=self.cfg.precision,
                device=self.device, rank=self.rank,
            )
        self.gen_engine.update_weights(sd, self.weights_version)
        self.gen_version = self.weights_version
        refit_s = time.perf_counter() - t0
        log.info("rank %d: generation refit (weights version %d) took %.3f s", self.rank, self.gen_version, refit_s)
        return {"refit_s": refit_s}


def _reshard(model: torch.nn.Module) -> None:
    """Back to this rank's shards after a pass without a backward: FSDP2 keeps the root module's
    parameters gathered after a forward (for the backward that a no-grad pass never runs), so
    the frozen reference held its whole embedding and norms from its first logprob pass on, and
    reference_sync, pairing its parameters with the policy's shards, failed on their shapes."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _over_steps(steps: list[dict[str, float]]) -> dict[str, float]:
    """One value per metric for several optimizer steps: keys ending in `_min` / `_max` the
    extreme over the steps (a mean of per-step minima hid the smallest ratio of a batch trained in
    several steps: its first step's are 1 by construction), the others the mean. Each over the
    steps that measured it: one without a valid token (every sample masked: an environment that
    failed them all) has no per-token means (the loss leaves them out) and no min or max
    (masked_min's +inf)."""
    out = {}
    for k in dict.fromkeys(k for s in steps for k in s):
        values = [s[k] for s in steps if k in s and (not k.endswith(("_min", "_max")) or math.isfinite(s[k]))]
        if not values:
            continue
        out[k] = min(values) if k.endswith("_min") else max(values) if k.endswith("_max") else sum(values) / len(values)
    return out


def _accumulate(into: dict[str, float], metrics: dict[str, Any]) -> None:
    """Combine loss metrics over micro-batches and ranks: a loss divides its metrics by the
    global counts like the loss itself, so they add up; keys ending in `_max`/`_min` take the
    max/min."""
    for k, v in metrics.items():
        v = float(v.detach()) if isinstance(v, torch.Tensor) else float(v)
        if k not in into:
            into[k] = v
        elif k.endswith("_max"):
            into[k] = max(into[k], v)
        elif k.endswith("_min"):
            into[k] = min(into[k], v)
        else:
            into[k] += v
