"""The `hf` backend: transformers' `model.generate`, the slow reference (and the fallback for
architectures the torch engine does not run).

Rows are left-padded and generated as one batch (one per token limit, see `_generate`). Stop
strings are matched per row on the generated tokens only, by a stopping criterion with the
torch engine's rules (HF's own `stop_strings` are one set for the whole batch and also match a
string begun in the prompt, which ends the row there). HF samples from, and reports as
logprobs, the distribution of `sampling.sampling_logprobs` (a logits processor in place of HF's
own temperature/min-p/top-k/top-p warpers, whose order differs from vLLM's), so every backend
samples one distribution. Each row is then cut with the same stop rules as the torch engine
(first stop token id, first completed stop string, or the row's token limit).
"""

from __future__ import annotations

import copy
import time
import weakref

import torch
from transformers import (GenerationConfig, LogitsProcessor, LogitsProcessorList, StoppingCriteria,
                          StoppingCriteriaList)

from posttrain.data.batch import BatchedDataDict
from posttrain.distributed.weight_sync import load_state_dict_inplace, resolve_state_dict
from posttrain.generation.interfaces import (
    prepare_prompts,
    unpadded,
    assemble_output,
    pad_token_id,
)
from posttrain.generation.sampling import (GlobalRngSeeds, SamplingSettings, StopChecker, non_finite_error,
                                           sampling_logprobs, seen_tokens)
from posttrain.generation.torch_engine import stop_token_ids
from posttrain.policy.hf_io import DTYPES, cast_parameters


class HFGeneration:
    """`model.generate` behind `GenerationInterface`."""

    def __init__(self, model, tokenizer, cfg, max_total_sequence_length: int, precision: str = "float32",
                 device: str | torch.device = "cpu"):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.device = torch.device(device)
        dtype = DTYPES[precision]
        # The caller's model while it lives, when this engine generates with a cast copy of it: a
        # weak reference, as a caller that refits by update_weights hands over a model it drops.
        self._trained = None
        if next(model.parameters()).dtype != dtype:
            self._trained = weakref.ref(model)
            # A copy, never the caller's (the policy's) model; its parameters only, as the policy's
            # own low-precision forward: rotary frequencies rounded to bfloat16 put the logprobs
            # off the policy's (mean exp|diff| 1.022 on stories260K), failing
            # grpo.prev_logprobs_from_generation's check and biasing importance weights.
            model = copy.deepcopy(model)
            cast_parameters(model, dtype)
        self.model = model.eval()
        self.context = max_total_sequence_length
        self.stop = StopChecker(tokenizer, stop_token_ids(tokenizer, cfg, model.config, model.generation_config))
        self.pad_id = pad_token_id(tokenizer)
        self.weight_version = 0
        self._seeds = GlobalRngSeeds(cfg.seed)  # HF samples from torch's global generator

    @torch.no_grad()
    def prepare_for_generation(self) -> None:
        # Colocated: the policy trained its model in place; a cast copy must follow it.
        trained = self._trained() if self._trained is not None else None
        if trained is not None:
            for mine, theirs in zip(self.model.parameters(), trained.parameters(), strict=True):
                mine.copy_(theirs)

    def finish_generation(self) -> None:
        return None

    def update_weights(self, state_dict_or_ref, version: int) -> float:
        t0 = time.perf_counter()
        load_state_dict_inplace(self.model, resolve_state_dict(state_dict_or_ref))
        self._trained = None  # the weights now come from here: the model given at the start is stale
        self.weight_version = version
        self._seeds.reseed(version)
        return time.perf_counter() - t0

    @torch.inference_mode()
    def generate(self, batch: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        cfg = self.cfg
        prompts, plen, stops, prompt_truncated = prepare_prompts(batch, cfg, self.context, self.pad_id)
        settings = SamplingSettings.from_config(cfg, greedy)
        with self._seeds.call():
            generated, gen_lp, truncated = self._generate(unpadded(prompts, plen), stops, settings)
        out = assemble_output(prompts, plen, generated, gen_lp, truncated, prompt_truncated, self.pad_id)
        return out

    def _generate(self, prompts, stops, s: SamplingSettings):
        """Per row: generated tokens, their logprobs, and whether it hit no stop.

        Rows go to `generate` in groups of one token limit: `generate` runs every row of a batch
        for the batch's longest limit, so a prompt near the context would run past it, beyond
        the position embeddings of a model that has learned ones (GPT-2: an IndexError)."""
        limits = torch.clamp(self.context - torch.tensor([len(p) for p in prompts]), max=self.cfg.max_new_tokens)
        groups: dict[int, list[int]] = {}
        for j, limit in enumerate(limits.tolist()):
            groups.setdefault(limit, []).append(j)
        rows = {}
        for limit, js in groups.items():
            got = self._generate_group([prompts[j] for j in js], [stops[j] for j in js], limit, s, js)
            rows.update(zip(js, zip(*got)))
        generated, gen_lp, truncated = zip(*(rows[j] for j in range(len(prompts))))
        return list(generated), list(gen_lp), list(truncated)

    def _generate_group(self, prompts, stops, limit: int, s: SamplingSettings, rows: list[int]):
        """`_generate` for rows that may all generate `limit` tokens (`rows`: their batch rows)."""
        n = len(prompts)
        plen = torch.tensor([len(p) for p in prompts])
        width = int(plen.max())
        input_ids = torch.full((n, width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for j, p in enumerate(prompts):
            input_ids[j, width - len(p) :] = p
            mask[j, width - len(p) :] = 1
        # generate() takes every setting it is not given from the model's generation config, and a
        # checkpoint's generation_config.json may add logits processors (repetition_penalty,
        # min_new_tokens, no_repeat_ngram_size, ...) to the documented distribution: it runs under
        # a blank one (the EOS ids it lists come in through self.stop).
        own, self.model.generation_config = self.model.generation_config, GenerationConfig()
        try:
            out = self.model.generate(
                input_ids=input_ids.to(self.device),
                attention_mask=mask.to(self.device),
                do_sample=not s.greedy,
                # HF's own warpers off (a blank GenerationConfig has top_k 50): the processor is the rule.
                **({} if s.greedy else {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": None}),
                logits_processor=LogitsProcessorList([_SamplingDistribution(s, (width - plen).to(self.device), rows)]),
                max_new_tokens=limit,
                eos_token_id=self.stop.stop_token_ids,
                pad_token_id=self.pad_id,
                stopping_criteria=StoppingCriteriaList([_GeneratedStopStrings(self.stop, width, stops)]),
                output_scores=True,
                return_dict_in_generate=True,
            )
        finally:
            self.model.generation_config = own
        seqs = out.sequences[:, width:].cpu()
        scores = torch.stack(out.scores, dim=1).float().cpu()  # [b, T, V]: the sampling distribution's logprobs
        lps = scores.gather(-1, seqs[:, : scores.shape[1], None]).squeeze(-1)
        stop_ids = set(self.stop.stop_token_ids)
        generated, gen_lp, truncated = [], [], []
        for j in range(n):
            toks = seqs[j].tolist()
            end, stopped = limit, False
            for t in range(min(limit, len(toks))):
                if toks[t] in stop_ids or self.stop.ends_with_stop_string(toks[: t + 1], stops[j]):
                    end, stopped = t + 1, True
                    break
            generated.append(seqs[j, :end].clone())
            gen_lp.append(lps[j, :end].clone())
            truncated.append(not stopped)
        return generated, gen_lp, truncated


class _SamplingDistribution(LogitsProcessor):
    """Replaces the next-token scores with the logprobs of posttrain's sampling distribution
    (`sampling_logprobs`): HF samples from softmax of them, which is that distribution, and
    `output_scores` returns them (greedy: argmax and log_softmax of the logits). `starts [b]`:
    where each left-padded row's prompt begins, so that padding is not a seen token. A row whose
    distribution is not finite (a NaN or +inf, or no finite entry) is a FloatingPointError naming
    its batch row (`rows`), as the torch engine's `sample` raises: greedy decoding went on with
    NaN logprobs, sampling failed in torch's multinomial naming no row."""

    def __init__(self, settings: SamplingSettings, starts: torch.Tensor, rows: list[int]):
        self.settings, self.starts, self.rows = settings, starts, rows

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        seen = None
        if self.settings.penalises_repeats:
            real = torch.arange(input_ids.shape[1], device=input_ids.device)[None] >= self.starts[:, None]
            seen = seen_tokens(input_ids, real, scores.shape[-1])
        lp = sampling_logprobs(scores, self.settings, seen)
        bad = torch.isnan(lp).any(-1) | torch.isposinf(lp).any(-1) | ~torch.isfinite(lp).any(-1)
        if bool(bad.any()):
            raise non_finite_error([self.rows[i] for i in bad.nonzero().flatten().tolist()])
        return lp


class _GeneratedStopStrings(StoppingCriteria):
    """Ends each row of a left-padded batch `[b, width + t]` at its own stop strings, searched in
    its generated tokens only."""

    def __init__(self, stop: StopChecker, width: int, stops: list[list[str]]):
        self.stop, self.width, self.stops = stop, width, stops

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        done = [bool(s) and self.stop.ends_with_stop_string(row[self.width :].tolist(), s)
                for row, s in zip(input_ids, self.stops)]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)
