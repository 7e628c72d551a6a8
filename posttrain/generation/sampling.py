"""Token sampling and stop detection shared by the generation backends.

Sampling distribution (what `logprobs` report, as vLLM does, in vLLM's order):
    z = logits, with the logits z_v of the tokens already in the sequence (prompt or response)
    replaced by z_v / r where z_v > 0 and z_v * r otherwise (r = repetition_penalty, CTRL,
    Keskar et al. 2019, https://arxiv.org/abs/1909.05858);
    l = z / T;  keep the tokens with l >= max(l) + log(min_p), i.e. at least min_p times
    as likely as the most likely one (min-p sampling, Nguyen et al. 2024,
    https://arxiv.org/abs/2407.01082);  keep the top-k of l;  keep the smallest prefix of the
    sorted distribution whose mass reaches top_p (nucleus sampling, Holtzman et al. 2019,
    https://arxiv.org/abs/1904.09751);  p = softmax(l over the kept tokens).
Greedy picks argmax(z) and reports its logprob under softmax(z) (temperature 1).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    greedy: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    @classmethod
    def from_config(cls, cfg, greedy: bool) -> "SamplingSettings":
        """From a `GenerationConfig`; temperature 0 means greedy."""
        return cls(cfg.temperature, cfg.top_p, cfg.top_k, greedy or cfg.temperature == 0, cfg.min_p,
                   cfg.repetition_penalty)

    @property
    def penalises_repeats(self) -> bool:
        """Whether the distribution depends on the tokens already seen (`sampling_logprobs`' `seen`)."""
        return self.repetition_penalty != 1.0


def version_seed(seed: int, version: int) -> int:
    """The sampling seed of an engine (seed = generation seed + its rank) holding weights
    `version`: a resumed run, whose engines start at the checkpoint's version, draws the same
    random numbers as the run it continues did from there. The prime keeps (rank, version)
    pairs apart for fewer than a million ranks."""
    return seed + 1_000_003 * version


class GlobalRngSeeds:
    """Per-call seeding for backends that sample from torch's global generator (HF `generate`,
    vLLM's in-process engine), seeded as the torch engine's own generator is: a stream of seeds
    from `seed`, restarted at every refit from `version_seed`, so the same config and inputs
    give the same samples and a resumed run (its engines start at the checkpoint's version)
    samples what the uninterrupted one did. Each call runs on a forked global RNG, which the
    caller gets back untouched. The seed + the number of calls made engine `seed` + 1 (the next
    worker's) replay engine `seed`'s next call, so two workers sampled alike: hence a stream."""

    def __init__(self, seed: int):
        self.seed = seed
        self._stream = torch.Generator().manual_seed(seed)

    def reseed(self, version: int) -> None:
        self._stream.manual_seed(version_seed(self.seed, version))

    @contextmanager
    def call(self) -> Iterator[None]:
        """Run one generation call on the global generator seeded with the stream's next seed."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(int(torch.randint(2**62, (), generator=self._stream)))
            yield


def seen_tokens(ids: torch.Tensor, valid: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Bool `[B, vocab_size]`: the tokens of each row of `ids [B, L]` at its `valid [B, L]`
    positions (padding is not a seen token), the `seen` of `sampling_logprobs`."""
    seen = torch.zeros(ids.shape[0], vocab_size + 1, dtype=torch.bool, device=ids.device)
    return seen.scatter_(1, torch.where(valid, ids, vocab_size), True)[:, :vocab_size]


def sampling_logprobs(logits: torch.Tensor, s: SamplingSettings, seen: torch.Tensor | None = None) -> torch.Tensor:
    """Log-probabilities `[B, V]` of the sampling distribution for `logits [B, V]` (-inf = excluded);
    `seen [B, V]` bool: the tokens already in each row's sequence (needed when `s.penalises_repeats`)."""
    logits = logits.float()
    if s.penalises_repeats:
        if seen is None:
            raise ValueError("repetition_penalty needs each row's seen tokens")
        r = s.repetition_penalty
        logits = torch.where(seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if s.greedy:
        return torch.log_softmax(logits, dim=-1)
    if s.temperature != 1.0:
        logits = logits / s.temperature
    if s.min_p > 0:
        # p_i >= min_p * p_max, compared in logits (the softmax's normaliser cancels).
        floor = logits.max(dim=-1, keepdim=True).values + math.log(s.min_p)
        logits = logits.masked_fill(logits < floor, float("-inf"))
    if s.top_k is not None and s.top_k < logits.shape[-1]:
        kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if s.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the first is always kept).
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= s.top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return torch.log_softmax(logits, dim=-1)


def sample(
    logits: torch.Tensor, s: SamplingSettings, generator: torch.Generator | None, seen: torch.Tensor | None = None,
    rows: Sequence[int] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row of `logits [B, V]`; returns (`tokens [B]` long, `logprobs [B]` float32).
    `seen`: as `sampling_logprobs` takes it.

    A row whose distribution is not finite (NaN or inf logits) is a FloatingPointError naming it:
    its picked token's logprob is then NaN or -inf, whatever the token, greedy or sampled. `rows`
    names the caller's batch row of each logits row (-1: a row whose pick is discarded, never an
    error); without it, the rows of `logits`."""
    lp = sampling_logprobs(logits, s, seen)
    if s.greedy:
        tokens = lp.argmax(dim=-1)
    else:
        probs = lp.exp()
        u = torch.rand(probs.shape[0], 1, generator=generator, device=probs.device)
        tokens = inverse_cdf_pick(probs, u)
    picked = lp.gather(-1, tokens[:, None]).squeeze(-1)
    bad = ~torch.isfinite(picked)
    if bool(bad.any()):
        names = torch.as_tensor(rows if rows is not None else range(len(picked)), dtype=torch.long)
        named = [r for r in names[bad.cpu()].tolist() if r >= 0]
        if named:
            raise non_finite_error(named)
    return tokens, picked


def non_finite_error(rows: list[int]) -> FloatingPointError:
    """The error of a generation backend whose next-token distribution is not finite in batch `rows`."""
    return FloatingPointError(f"the next-token distribution of batch row(s) {rows[:8]} is not finite "
                              "(NaN or inf logits): the model's weights or activations have overflowed")


def inverse_cdf_pick(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Per row of `probs [B, V]` (non-negative, any total), the token whose cumulative-mass
    interval holds `u [B, 1]` (uniform in [0, 1)) times the row's total: an exact draw.

    Why not `torch.multinomial`: on a CPU it draws one exponential variate per vocabulary entry
    (~11 ns each), so sampling cost grows with the vocabulary; this draws one number per row
    and does a cumulative sum (measured, 2 threads: 128 x 32,000: 72 -> 2.1 ms per step;
    64 x 151,936: 186 -> 16 ms; 512 x 104: 0.98 -> 0.05 ms). A float32 cumulative sum shifts a
    token's mass by at most ~1e-7. A token of probability 0 (cut by top-k/top-p) has an
    empty interval and is never picked. A row that is not finite picks some token (`sample`
    names such rows)."""
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:]
    tokens = torch.searchsorted(cdf, u * total, right=True).clamp_max_(probs.shape[-1] - 1)
    # u * total can round up to total itself, past the last token of positive mass: take that token.
    past_end = probs.gather(-1, tokens) == 0
    if bool(past_end.any()):
        last = probs.shape[-1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1, keepdim=True)
        tokens = torch.where(past_end, last, tokens)
    return tokens.squeeze(-1)


_CONTINUATION_BYTE = re.compile(r"<0x[89AB][0-9A-F]>")


class StopChecker:
    """Finds the generated token that ends a sequence: EOS / stop token ids, or a completed stop string.

    Stop strings are matched on the decoded text of the generated tokens only. Decoding every
    row every step would dominate a small model's step time, so a row's tail is decoded only
    when its new token could complete one of the stop strings: its text (as it reads after other
    text) contains a stop string's last character, or it is a partial character (byte-level BPE).
    Tokens are decoded as they read after other text (the prompt) throughout: a sentencepiece
    token decoded first in its text drops the space it starts with ("\u2581was" -> "was"), which
    would hide a stop string beginning with that space in the first generated tokens.
    """

    def __init__(self, tokenizer, stop_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.stop_token_ids = sorted(set(int(t) for t in stop_token_ids))
        self._token_texts: list[str] | None = None
        self._anchor: tuple[list[int], str] | None = None
        self._candidate_cache: dict[tuple[frozenset[str], int], torch.Tensor] = {}
        self._continuations: frozenset[int] | None = None

    def stop_id_tensor(self, device) -> torch.Tensor:
        return torch.tensor(self.stop_token_ids, dtype=torch.long, device=device)

    def candidates(self, stop_strings: set[str], vocab_size: int) -> torch.Tensor:
        """Bool `[max(vocab_size, len(tokenizer))]`: tokens that may complete one of `stop_strings`
        (cached per set). `vocab_size` is the model's: embeddings are often padded past the
        tokenizer's vocabulary (Qwen2.5: 151,936 rows for 151,665 tokens), and such an id decodes to
        nothing, so it can complete no stop string."""
        key = (frozenset(stop_strings), vocab_size)
        if key not in self._candidate_cache:
            if self._token_texts is None:
                self._token_texts = self._texts_after_text()
            last_chars = {s[-1] for s in key[0]}
            mask = torch.zeros(max(vocab_size, len(self._token_texts)), dtype=torch.bool)
            mask[: len(self._token_texts)] = torch.tensor(
                [("\ufffd" in t) or any(c in t for c in last_chars) for t in self._token_texts])
            self._candidate_cache[key] = mask
        return self._candidate_cache[key]

    def _after_text(self, rows: list[list[int]]) -> list[str]:
        """The text of each token list as it reads after other text (here after "a"): decoded
        alone, a sentencepiece token drops the space it starts with ("\u2581was" -> "was"), which
        would hide that it completes a stop string ending in a space, or begins one."""
        if self._anchor is None:
            anchor = self.tokenizer.encode("a", add_special_tokens=False)[-1:]
            self._anchor = anchor, self.tokenizer.decode(anchor)
        anchor, prefix = self._anchor
        texts = self.tokenizer.batch_decode([anchor + r for r in rows])
        return [t[len(prefix) :] if t.startswith(prefix) else t for t in texts]

    def _continuation_bytes(self) -> frozenset[int]:
        """Ids of the byte-fallback tokens of UTF-8 continuation bytes, "<0x80>".."<0xBF>" (none
        for byte-level BPE, whose decoder replaces only the bytes of a cut character)."""
        if self._continuations is None:
            pieces = self.tokenizer.convert_ids_to_tokens(list(range(len(self.tokenizer))))
            self._continuations = frozenset(i for i, p in enumerate(pieces)
                                            if isinstance(p, str) and _CONTINUATION_BYTE.fullmatch(p))
        return self._continuations

    def _texts_after_text(self) -> list[str]:
        """Each token's text as it reads after other text."""
        return self._after_text([[i] for i in range(len(self.tokenizer))])

    def ends_with_stop_string(self, generated: list[int], stop_strings: list[str]) -> bool:
        """Whether the decoded `generated` tokens contain one of `stop_strings` ending in the last token."""
        if not stop_strings:
            return False
        # 4 tokens per character covers byte-level BPE; the extra 4 covers a cut partial character.
        start = max(len(generated) - (4 * max(len(s) for s in stop_strings) + 4), 0)
        # Nor may the tail begin inside a character of byte tokens: sentencepiece's byte fallback
        # decodes a run of them that is not valid UTF-8 as one U+FFFD per byte, the characters
        # after the cut too, and "語" completed by the last token went unseen.
        continuation = self._continuation_bytes()
        for _ in range(3):  # a UTF-8 character has at most 3 continuation bytes
            if start == 0 or generated[start] not in continuation:
                break
            start -= 1
        text, prev = self._after_text([generated[start:], generated[start:-1]])
        # A match already present without the last token would have stopped the row earlier.
        return any(s in text and s not in prev for s in stop_strings)
