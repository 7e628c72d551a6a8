"""The generation contract shared by every backend (see docs/architecture.md, "Generation").

Input batch (`BatchedDataDict`):
```
input_ids      # [B, S] long, right-padded prompts
input_lengths  # [B]    long, unpadded prompt lengths
stop_strings   # optional: list (length B) of per-row lists of strings, or None per row
```
Output batch:
```
output_ids                 # [B, S'] prompt + generated tokens, right padded with pad id
logprobs                   # [B, S'] token-aligned logprob of each generated token under the
                           #         sampling distribution (after temperature/top-k/top-p;
                           #         greedy: the temperature-1 distribution); 0 elsewhere
generation_lengths         # [B] generated tokens, including the stop/EOS token
unpadded_sequence_lengths  # [B] input_length + generation_length
truncated                  # [B] bool, hit max_new_tokens or the context without stopping
prompt_truncated           # [B] bool, the prompt was left-truncated (overlong_prompt="truncate");
                           #     output_ids then hold the truncated prompt
```
Stop strings: the sequence ends at the token that completes the stop string and that token
stays in the output (vLLM's `include_stop_str_in_output=True`; HF `generate` does the same).
Only generated text is searched, never the prompt.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from posttrain.config import InputError
from posttrain.data.batch import BatchedDataDict


@runtime_checkable
class GenerationInterface(Protocol):
    def generate(self, batch: BatchedDataDict, greedy: bool = False) -> BatchedDataDict:
        """Generate a continuation of every prompt (see the module docstring for the fields)."""

    def prepare_for_generation(self) -> None:
        """Make the engine ready (allocate, refresh derived weights); idempotent."""

    def finish_generation(self) -> None:
        """Release what generation holds (caches) so training gets the memory back."""

    def update_weights(self, state_dict_or_ref: Any, version: int) -> float | dict[str, float]:
        """Load new weights (a CPU state dict or a Ray ObjectRef to one) tagged with `version`;
        returns the refit's time: an engine its seconds, `GenerationWorkerGroup` {"refit_s": wall
        seconds, "refit_load_s": the slowest worker's load seconds}."""


def validate_prompts(batch: BatchedDataDict) -> tuple[torch.Tensor, torch.Tensor]:
    """Check the input batch and return (`input_ids [B, S]`, `input_lengths [B]`) on CPU.

    No rows, an empty prompt (length 0) or a length beyond the padded width is an error (naming the row).
    """
    for key in ("input_ids", "input_lengths"):
        if key not in batch:
            raise KeyError(f"generation batch is missing {key!r}; it has {sorted(batch.keys())}")
    ids = batch["input_ids"]
    lengths = torch.as_tensor(batch["input_lengths"]).long().cpu()
    if ids.dim() != 2 or lengths.dim() != 1 or ids.shape[0] != lengths.shape[0]:
        raise ValueError(
            f"generation batch needs input_ids [B, S] and input_lengths [B], got {tuple(ids.shape)} "
            f"and {tuple(lengths.shape)}"
        )
    if ids.shape[0] == 0:  # (a torch or hf backend crashed in a reduction over no rows)
        raise ValueError("generation batch has no prompts (0 rows): generate needs at least one")
    empty = (lengths <= 0).nonzero().flatten().tolist()
    if empty:
        raise ValueError(f"empty prompt in generation batch at row(s) {empty[:10]}: every prompt needs >= 1 token")
    too_long = (lengths > ids.shape[1]).nonzero().flatten().tolist()
    if too_long:
        r = too_long[0]
        raise ValueError(
            f"input_lengths[{r}] = {int(lengths[r])} exceeds the padded width {ids.shape[1]} of input_ids"
        )
    return ids.cpu().long(), lengths


def prompt_limits(
    lengths: torch.Tensor, *, max_total_sequence_length: int, max_new_tokens: int, overlong_prompt: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """Apply `overlong_prompt` to prompts that leave no room for a single new token.

    Returns (`keep [B]` = prompt tokens kept from the right end, `prompt_truncated [B]` bool).
    "error" raises naming the first overlong row; "truncate" keeps the last
    `max(1, max_total_sequence_length - max_new_tokens)` tokens of each overlong row, so the
    row can still generate (up to) max_new_tokens.
    """
    overlong = lengths >= max_total_sequence_length
    if bool(overlong.any()) and overlong_prompt == "error":
        r = int(overlong.nonzero()[0])
        raise InputError(
            f"prompt at row {r} has {int(lengths[r])} tokens, which leaves no room to generate within "
            f"policy.max_total_sequence_length={max_total_sequence_length} "
            f"({int(overlong.sum())} overlong row(s)); shorten it or set "
            f"policy.generation.overlong_prompt=truncate"
        )
    keep_len = max(1, max_total_sequence_length - max_new_tokens)
    keep = torch.where(overlong, torch.full_like(lengths, keep_len), lengths)
    return keep, overlong


def prepare_prompts(batch: BatchedDataDict, cfg, context: int,
                    pad_id: int) -> tuple[torch.Tensor, torch.Tensor, list[list[str]], torch.Tensor]:
    """What every backend does first: validate the batch, apply `cfg.overlong_prompt`, and cut
    the prompts. Returns (the kept prompt tokens right-padded with `pad_id` `[B, P]`, their
    lengths `[B]`, per-row stop strings, `prompt_truncated [B]`)."""
    ids, lengths = validate_prompts(batch)
    keep, prompt_truncated = prompt_limits(
        lengths, max_total_sequence_length=context, max_new_tokens=cfg.max_new_tokens,
        overlong_prompt=cfg.overlong_prompt,
    )
    # Row i keeps its last keep[i] tokens, ids[i, lengths[i] - keep[i] : lengths[i]]: one gather,
    # not a slice per row (1.5 ms of Python for a GRPO step's 512 prompts, 0.02 ms gathered).
    pos = torch.arange(int(keep.max()) if len(keep) else 0)[None]
    at = (lengths - keep)[:, None] + pos
    prompts = torch.gather(ids, 1, at.clamp(max=ids.shape[1] - 1)).masked_fill_(pos >= keep[:, None], pad_id)
    return prompts, keep, combine_stop_strings(cfg.stop_strings, batch, ids.shape[0]), prompt_truncated


def unpadded(prompts: torch.Tensor, lengths: torch.Tensor) -> list[torch.Tensor]:
    """The rows of right-padded `prompts [B, P]` cut to their `lengths [B]` (1-D tensors)."""
    return [row[:n] for row, n in zip(prompts, lengths.tolist())]


def pad_token_id(tokenizer) -> int:
    """The id that pads outputs: the tokenizer's pad token, else its EOS, else 0."""
    for t in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if t is not None:
            return int(t)
    return 0


def combine_stop_strings(cfg_stop: list[str] | None, batch: BatchedDataDict, n: int) -> list[list[str]]:
    """Per-row stop strings: the config's plus the batch's own `stop_strings` for that row."""
    rows = batch.get("stop_strings") if "stop_strings" in batch else None
    if rows is not None and len(rows) != n:  # a short list failed as an IndexError, a long one was cut silently
        raise ValueError(f"the batch's stop_strings holds {len(rows)} lists for its {n} rows; give one list (may "
                         "be empty) per row")
    out = []
    for i in range(n):
        s = list(cfg_stop or [])
        if rows is not None and rows[i]:
            # A bare string would be read as its characters, each one a stop string.
            if isinstance(rows[i], str) or not all(isinstance(x, str) for x in rows[i]):
                raise ValueError(f"stop strings of row {i} must be a list of strings (an environment's "
                                 f"next_stop_strings: one list per sample), got {rows[i]!r:.80}")
            s += [x for x in rows[i] if x not in s]
        if any(x == "" for x in s):
            raise ValueError(f"empty stop string for row {i}; stop strings must be non-empty")
        out.append(s)
    return out


def assemble_output(
    prompts: torch.Tensor,
    prompt_lengths: torch.Tensor,
    generated: list[torch.Tensor],
    gen_logprobs: list[torch.Tensor],
    truncated: list[bool],
    prompt_truncated: torch.Tensor,
    pad_id: int,
) -> BatchedDataDict:
    """`assemble_padded` from per-row lists of generated tokens and their logprobs."""
    gen_ids, lens_gen = pad_rows(generated, 0)
    gen_lp, _ = pad_rows(gen_logprobs, 0.0)
    return assemble_padded(prompts, prompt_lengths, gen_ids.long(), gen_lp.float(), lens_gen,
                           torch.tensor(truncated, dtype=torch.bool), prompt_truncated, pad_id)


def pad_rows(rows: list[torch.Tensor], value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """1-D tensors of different lengths as one right-padded `[len(rows), longest]` tensor, and the lengths."""
    lengths = torch.tensor([r.shape[0] for r in rows], dtype=torch.long)
    return torch.nn.utils.rnn.pad_sequence(rows, batch_first=True, padding_value=value), lengths


def assemble_padded(
    prompt_ids: torch.Tensor,
    prompt_lengths: torch.Tensor,
    generated: torch.Tensor,
    gen_logprobs: torch.Tensor,
    generation_lengths: torch.Tensor,
    truncated: torch.Tensor,
    prompt_truncated: torch.Tensor,
    pad_id: int,
) -> BatchedDataDict:
    """The output batch (see `GenerationInterface.generate`) from right-padded prompts `[B, P]`,
    generated tokens and logprobs `[B, G]` and their lengths `[B]`, in whole-tensor operations."""
    n = prompt_ids.shape[0]
    lens_in, lens_gen = prompt_lengths.long(), generation_lengths.long()
    width = int((lens_in + lens_gen).max())
    output_ids = torch.full((n, width), pad_id, dtype=torch.long)
    logprobs = torch.zeros((n, width), dtype=torch.float32)
    # Boolean-mask indexing walks rows in order, position by position, on both sides: each
    # row's valid tokens land in its own place, one copy per tensor.
    pos = torch.arange(width)[None]
    output_ids[pos < lens_in[:, None]] = prompt_ids[torch.arange(prompt_ids.shape[1])[None] < lens_in[:, None]]
    if int(lens_gen.sum()):
        in_gen = (pos >= lens_in[:, None]) & (pos < (lens_in + lens_gen)[:, None])
        valid = torch.arange(generated.shape[1])[None] < lens_gen[:, None]
        output_ids[in_gen] = generated[valid]
        logprobs[in_gen] = gen_logprobs[valid].float()
    return BatchedDataDict(
        output_ids=output_ids,
        logprobs=logprobs,
        generation_lengths=lens_gen,
        unpadded_sequence_lengths=lens_in + lens_gen,
        truncated=truncated.bool(),
        prompt_truncated=prompt_truncated.clone().bool(),
    )
