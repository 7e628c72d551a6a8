"""The `hf` backend: transformers' `model.generate`, the slow reference (and the fallback for
architectures the torch engine does not run).

Rows are left-padded and generated as one batch per distinct set of stop strings (HF applies
stop strings to the whole batch). Logprobs come from the processed scores HF samples from
(after temperature/top-k/top-p; greedy: raw logits), so they match the torch engine's
definition. Each row is then cut with the same stop rules as the torch engine (first stop
token id, first completed stop string, or the row's token limit).
"""

from __future__ import annotations

import copy
import time

import torch

from posttrain.data.batch import BatchedDataDict
from posttrain.distributed.weight_sync import load_state_dict_inplace, resolve_state_dict
from posttrain.generation.interfaces import (
    prepare_prompts,
    assemble_output,
    pad_token_id,
)
from posttrain.generation.sampling import SamplingSettings, StopChecker
from posttrain.generation.torch_engine import DTYPES, stop_token_ids


class HFGeneration:
    """`model.generate` behind `GenerationInterface`."""

    def __init__(self, model, tokenizer, cfg, max_total_sequence_length: int, precision: str = "float32",
                 device: str | torch.device = "cpu"):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        dtype = DTYPES[precision]
        if next(model.parameters()).dtype != dtype:
            # Module.to() is in place: cast a copy, never the caller's (e.g. the policy's) model.
            model = copy.deepcopy(model).to(dtype)
        self.model = model.eval()
        self.context = max_total_sequence_length
        self.stop = StopChecker(tokenizer, stop_token_ids(tokenizer, model.config, cfg))
        self.pad_id = pad_token_id(tokenizer)
        self.weight_version = 0
        self._calls = 0
        self.last_metrics: dict[str, float] = {}

    def prepare_for_generation(self) -> None:
        return None

    def finish_generation(self) -> None:
        return None

    def update_weights(self, state_dict_or_ref, version: int) -> float:
        t0 = time.perf_counter()
        load_state_dict_inplace(self.model, resolve_state_dict(state_dict_or_ref))
        self.weight_version = version
        return time.perf_counter() - t0

    @torch.inference_mode()
    def generate(self, batch: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        cfg = self.cfg
        prompts, stops, prompt_truncated = prepare_prompts(batch, cfg, self.context)
        n = len(prompts)
        settings = SamplingSettings.from_config(cfg, greedy)
        generated: list = [None] * n
        gen_lp: list = [None] * n
        truncated = [False] * n
        groups: dict[tuple[str, ...], list[int]] = {}
        for i, s in enumerate(stops):
            groups.setdefault(tuple(s), []).append(i)
        # HF samples from the global RNG: seed a forked copy so runs are reproducible and the
        # caller's RNG state is untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed + self._calls)
            self._calls += 1
            for stop_set, rows in groups.items():
                self._generate_group(prompts, rows, list(stop_set), settings, generated, gen_lp, truncated)
        return assemble_output(prompts, generated, gen_lp, truncated, prompt_truncated, self.pad_id)

    def _generate_group(self, prompts, rows, stop_strings, s: SamplingSettings, generated, gen_lp, truncated):
        plen = torch.tensor([len(prompts[r]) for r in rows])
        width = int(plen.max())
        limits = torch.clamp(self.context - plen, max=self.cfg.max_new_tokens)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):
            input_ids[j, width - len(prompts[r]) :] = prompts[r]
            mask[j, width - len(prompts[r]) :] = 1
        sampling = {} if s.greedy else {"temperature": s.temperature, "top_p": s.top_p, "top_k": s.top_k or 0}
        out = self.model.generate(
            input_ids=input_ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=not s.greedy,
            max_new_tokens=int(limits.max()),
            eos_token_id=self.stop.stop_token_ids,
            pad_token_id=self.pad_id,
            stop_strings=stop_strings or None,
            tokenizer=self.tokenizer if stop_strings else None,
            output_scores=True,
            return_dict_in_generate=True,
            **sampling,
        )
        seqs = out.sequences[:, width:].cpu()
        scores = torch.stack(out.scores, dim=1).float().cpu()  # [b, T, V], processed as sampled from
        lps = torch.log_softmax(scores, dim=-1).gather(-1, seqs[:, : scores.shape[1], None]).squeeze(-1)
        stop_ids = set(self.stop.stop_token_ids)
        for j, r in enumerate(rows):
            toks = seqs[j].tolist()
            end, stopped = int(limits[j]), False
            for t in range(min(int(limits[j]), len(toks))):
                if toks[t] in stop_ids or self.stop.ends_with_stop_string(toks[: t + 1], stop_strings):
                    end, stopped = t + 1, True
                    break
            generated[r] = seqs[j, :end].clone()
            gen_lp[r] = lps[j, :end].clone()
            truncated[r] = not stopped
