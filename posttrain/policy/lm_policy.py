"""`Policy`: the driver-side facade over a group of FSDP2 policy workers.

It checks batches early (lengths, batch sizes), shards them over the data-parallel workers,
dispatches, and gathers the results back in the caller's row order. Every worker method is
collective, so every call goes to all workers.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable

import ray

from posttrain.config import InputError, RunStopped
from posttrain.data.batch import BatchedDataDict
from posttrain.distributed.cluster import RayVirtualCluster
from posttrain.distributed.worker_group import RayWorkerGroup
from posttrain.policy.fsdp_worker import FSDPPolicyWorker
from posttrain.schemas import PolicyConfig

log = logging.getLogger(__name__)


class NonFiniteGradients(RunStopped, FloatingPointError):
    """`policy.max_consecutive_skipped_steps` optimizer steps in a row had a non-finite gradient:
    a stop the docs name, whose message the CLI prints alone (it was a traceback)."""


class Policy:
    """See docs/architecture.md ("Policy")."""

    def __init__(self, cluster: RayVirtualCluster, cfg: PolicyConfig, *, init_reference: bool = True,
                 model_kind: str = "causal_lm", name_prefix: str = "policy", export_bos: bool = True,
                 export_eos: bool = False):
        """`export_bos` / `export_eos`: the BOS and EOS the run's rows have around the chat template's
        text (data.add_bos; data.add_eos, which matters to a reward model), written into the template
        of its HF exports and checkpoints (`hf_io.exported_chat_template`)."""
        self.cfg = cfg
        self.model_kind = model_kind
        # Tensor parallelism: groups of tp consecutive ranks hold one copy of the model between
        # them and compute on the same rows; the data is split over the dp = world / tp groups.
        self.tp = cfg.dtensor_cfg.tensor_parallel_size
        if cluster.world_size % self.tp:
            raise ValueError(f"policy.dtensor_cfg.tensor_parallel_size={self.tp} does not divide the "
                             f"{cluster.world_size} policy workers (cluster.num_nodes x workers_per_node)")
        self.workers = RayWorkerGroup(cluster, FSDPPolicyWorker, cfg, init_reference=init_reference,
                                      model_kind=model_kind, name_prefix=name_prefix, export_bos=export_bos,
                                      export_eos=export_eos)
        self.dp = self.workers.world_size // self.tp
        try:
            info = self.workers.get(self.workers.run_all("setup"))
        except BaseException:
            self.workers.shutdown()
            raise
        self.num_parameters = info[0]["num_parameters"]
        self.pad_id = info[0]["pad_id"]
        log.info("policy %s: %d workers (data parallel %d x tensor parallel %d), %.2fM parameters, "
                 "loaded in %.1f s", cfg.model_name, self.workers.world_size, self.dp, self.tp,
                 self.num_parameters / 1e6, info[0]["load_s"])
        # The policy's, and the reference's (a distillation teacher scores the same sequences).
        for key, trained_positions in info[0]["max_position_embeddings"].items():
            if trained_positions and cfg.max_total_sequence_length > trained_positions:
                # Not an error: rotary and ALiBi models run past it (and long-context fine-tuning does so on
                # purpose); a learned table of positions was refused (hf_io.check_positions).
                log.warning("policy.max_total_sequence_length=%d exceeds the max_position_embeddings=%d of %s: "
                            "positions past %d were not trained", cfg.max_total_sequence_length, trained_positions,
                            key, trained_positions)

    # ------------------------------------------------------------------ checks

    def _check_batch(self, batch: BatchedDataDict, what: str) -> None:
        for key in ("input_ids", "input_lengths"):
            if key not in batch:
                raise KeyError(f"{what}: the batch has no {key!r} (keys: {sorted(batch)})")
        lengths = batch["input_lengths"]
        longest = int(lengths.max())
        if longest > self.cfg.max_total_sequence_length:
            row = int(lengths.argmax())
            raise ValueError(f"{what}: row {row} has {longest} tokens, more than "
                             f"policy.max_total_sequence_length={self.cfg.max_total_sequence_length}")
        if longest > batch["input_ids"].shape[1]:
            raise ValueError(f"{what}: row {int(lengths.argmax())} has input_length {longest} > input_ids width "
                             f"{batch['input_ids'].shape[1]}")

    def _sharded(self, method: str, batch: BatchedDataDict, *args, pad_values: dict | None = None,
                 replicas: int | None = None) -> BatchedDataDict:
        """`method` over the data-parallel shards of `batch`, results in row order; `replicas`:
        consecutive ranks that get the same shard (default: a tensor-parallel group's tp)."""
        n, replicas = batch.size, self.tp if replicas is None else replicas
        groups = self.workers.world_size // replicas
        extra = -n % groups  # the last row repeated up to a multiple of the shard count
        padded = batch.select_indices(list(range(n)) + [n - 1] * extra) if extra else batch
        outs = self.workers.get(self.workers.run_sharded(method, padded, *args, replicas=replicas))
        return BatchedDataDict.from_batches(outs[::replicas], pad_value_dict=pad_values).slice(0, n)

    # ------------------------------------------------------------------ train and inference

    def train(self, batch: BatchedDataDict, loss_fn: Callable, lr: float | None = None,
              temperature: float | None = None) -> dict[str, float]:
        """One optimizer step per `policy.train_global_batch_size` rows of `batch`; returns loss,
        grad_norm, lr (of the last step), and the loss function's metrics (means over the steps;
        `*_min` / `*_max` their extremes).
        `lr` overrides the learning rate for these steps without advancing the scheduler;
        `temperature` the logprobs' temperature (default: the sampling one, as RL's losses need)."""
        self._check_batch(batch, "train")
        gbs = self.cfg.train_global_batch_size
        if batch.size == 0 or batch.size % gbs:
            raise ValueError(f"train: batch of {batch.size} rows is not a multiple of "
                             f"policy.train_global_batch_size={gbs}")
        if gbs % self.dp:
            raise ValueError(f"policy.train_global_batch_size={gbs} does not split over {self.dp} data-parallel "
                             "workers")
        local = gbs // self.dp
        if getattr(loss_fn, "needs_pairs", False) and local % 2:
            raise ValueError(f"train: {type(loss_fn).__name__} needs chosen/rejected pairs, but each of the "
                             f"{self.dp} data-parallel workers would get {local} rows (odd); make "
                             "policy.train_global_batch_size / workers even")
        refs = self.workers.run_sharded("train", batch, loss_fn, local, lr, temperature, batch_size=gbs,
                                        replicas=self.tp)
        out = self.workers.get(refs)[0]
        in_a_row = out.pop("skipped_in_a_row")
        if out["skipped_steps"]:
            log.warning("policy: %d of %d optimizer steps skipped: non-finite gradient norm (grad_norm %s, loss %s); "
                        "the weights are unchanged by them", out["skipped_steps"], out["num_optimizer_steps"],
                        out["grad_norm"], out["loss"])
        limit = self.cfg.max_consecutive_skipped_steps
        if limit is not None and in_a_row >= limit:
            raise NonFiniteGradients(
                f"the last {in_a_row} optimizer steps had a non-finite gradient norm and were skipped "
                f"(policy.max_consecutive_skipped_steps={limit}); stopping. The weights are those of the last "
                "finite update, so a checkpoint saved before is intact: lower the learning rate or check the "
                "data and rewards of these steps, then resume from it (or start again if none was saved)")
        return out

    def reset_optimizer(self) -> None:
        """Start the optimizer afresh: a new training stage (RL after SFT) should not inherit the
        previous objective's Adam moments, which are scaled for different gradients."""
        self.workers.get(self.workers.run_all("reset_optimizer"))

    def get_logprobs(self, batch: BatchedDataDict) -> BatchedDataDict:
        """`logprobs [B, S]`: position t = log p(token_t | <t) under the current policy; 0 at t=0 and
        padding, and, when the batch has a `token_mask`, before each row's first trained token
        (those logits are not computed)."""
        self._check_batch(batch, "get_logprobs")
        return self._sharded("get_logprobs", batch, False)

    def get_reference_logprobs(self, batch: BatchedDataDict) -> BatchedDataDict:
        """`reference_logprobs [B, S]` under the frozen reference policy: the initial weights, or
        `policy.reference_model_name` when set (on-policy distillation's teacher)."""
        self._check_batch(batch, "get_reference_logprobs")
        return self._sharded("get_logprobs", batch, True)

    def sync_reference_if_due(self, step: int) -> bool:
        """After loop step `step` (1-based): every policy.reference_sync.sync_steps steps, move the
        reference toward the policy, mixup_alpha * policy + (1 - mixup_alpha) * reference (TR-DPO).
        Whether it moved: reference logprobs computed before are stale then."""
        sync = self.cfg.reference_sync
        if not sync.enabled or step % sync.sync_steps:
            return False
        self.workers.get(self.workers.run_all("sync_reference", sync.mixup_alpha))
        return True

    def get_scores(self, batch: BatchedDataDict) -> BatchedDataDict:
        """`scores [B]` of a reward model (model_kind="sequence_classification")."""
        if self.model_kind != "sequence_classification":
            raise ValueError("get_scores needs a Policy with model_kind='sequence_classification'")
        self._check_batch(batch, "get_scores")
        return self._sharded("get_scores", batch)

    # ------------------------------------------------------------------ generation

    def generate(self, batch: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """Colocated generation: each worker generates its shard with the torch (or hf) backend on its own
        unsharded copy of the current weights (refit in process after each train step)."""
        # Every rank generates on its own full copy of the weights: a share of the rows each.
        return self._sharded("generate", batch, greedy, pad_values={"output_ids": self.pad_id}, replicas=1)

    def prepare_for_generation(self, force: bool = False) -> dict[str, float]:
        """Refit the generation copies to the current weights (`force`: even when they hold them,
        which restarts their samplers' streams); returns {"refit_s": seconds (rank 0)}."""
        return self.workers.get(self.workers.run_all("prepare_for_generation", force))[0]

    def finish_generation(self) -> None:
        """Nothing to release, so no round trip to the workers: their engines (torch, hf; colocated
        vLLM is not implemented) hold their KV caches only inside `generate`."""

    def full_state_dict_ref(self) -> ray.ObjectRef:
        """Ref to the full CPU state dict (base-model keys, LoRA merged) in Ray's object store."""
        return self.workers.get(self.workers.run_all("full_state_dict_ref"))[0][0]

    # ------------------------------------------------------------------ checkpoints and export

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Sharded model + optimizer (torch.distributed.checkpoint) + scheduler into folder `path`."""
        self.workers.get(self.workers.run_all("save_checkpoint", os.path.abspath(path)))

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Load the policy part (`<step_N>/policy`) of a checkpoint that `CheckpointManager` found
        complete (every file there, of its size): one whose bytes are damaged fails naming it."""
        try:
            self.workers.get(self.workers.run_all("load_checkpoint", os.path.abspath(path)))
        except (InputError, RunStopped):  # said already: another model's checkpoint, a worker that died
            raise
        except Exception as e:  # noqa: BLE001 - torch's reader on a file cut and refilled, overwritten...
            step = os.path.dirname(os.path.abspath(path))
            cause = (str(getattr(e, "cause", None) or e).strip().splitlines() or [""])[-1]
            # It was an 86-line traceback naming no folder, and every later start failed the same way.
            raise InputError(f"checkpoint {step} cannot be loaded ({type(e).__name__}: {cause:.200}): one of its files "
                             "is damaged; move that folder aside to resume from the checkpoint before it, or start "
                             "over with checkpointing.start_fresh=true") from None

    def export_hf(self, path: str | os.PathLike) -> None:
        """safetensors + config + tokenizer that `AutoModelForCausalLM.from_pretrained(path)` loads."""
        self.workers.get(self.workers.run_all("export_hf", os.path.abspath(path)))

    def shutdown(self) -> None:
        self.workers.shutdown()

    # Worker processes are named in errors; this lets tests and tools reach them.
    @property
    def worker_info(self) -> list[dict[str, Any]]:
        return self.workers.worker_info

