"""Evaluation metrics over several samples per prompt: pass@k and cons@k, and their
aggregation over a dataset.

pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code",
https://arxiv.org/abs/2107.03374, eq. 1): with n samples per problem of which c are
correct, the unbiased estimate of the probability that at least one of k samples drawn
without replacement is correct is

    pass@k = 1 - C(n - c, k) / C(n, k)

computed as the numerically stable product 1 - prod_{i = n-c+1}^{n} (1 - k / i)
(the same identity the paper's reference uses), and 1 when n - c < k.

cons@k (majority voting, "self-consistency", Wang et al. 2022,
https://arxiv.org/abs/2203.11171): take the first k samples, vote over their extracted
final answers (samples with no extractable answer do not vote: an environment that extracts none,
StepResult.answer None, gets cons@k 0), and score the problem 1 if
the most common answer is a correct one. Ties go to the answer seen first. The samples judged
correct vote as one answer: each is equivalent to the reference, so "0.5" and "\\frac{1}{2}" are
one answer, as an equivalence vote makes them (a text vote split them, and a wrong answer
written one way beat a right one written two ways). Wrong answers vote by their text.

"Correct" is the environment's verdict of a sample (`CORRECT_KEY`), not a positive reward:
partial credit (one test of five, a format bonus) is wrong here. Samples without a verdict
(a reward model's, a user environment's that gives none, a failed verification) are left
out: a prompt's n and c count its judged samples, and a prompt with fewer than k of them
has no pass@k or cons@k.
"""

from __future__ import annotations

import numbers
from collections import Counter
from typing import Sequence

from posttrain.environments.interfaces import is_verdict


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one problem with `n` samples of which `c` are correct (1 <= k <= n)."""
    if n < 1 or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs n >= 1 and 0 <= c <= n, got n={n}, c={c}")
    if not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n, got k={k}, n={n}")
    if n - c < k:
        return 1.0
    prob_all_wrong = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_wrong *= 1.0 - k / i
    return 1.0 - prob_all_wrong


def majority_answer(answers: Sequence[str | None]) -> str | None:
    """The most common non-None answer (whitespace-stripped); ties go to the earliest; None if none."""
    votes = [a.strip() for a in answers if a is not None and a.strip() != ""]
    if not votes:
        return None
    counts = Counter(votes)
    best = max(counts.values())
    return next(a for a in votes if counts[a] == best)


# The vote of every sample judged correct: they are one answer, the reference's.
_CORRECT_VOTE = "\0correct"


def cons_at_k(answers: Sequence[str | None], correct: Sequence[bool | float], k: int) -> float:
    """Majority-vote accuracy of one problem over its first `k` samples.

    answers: [n] extracted final answer of each sample (None when nothing was extracted).
    correct: [n] each sample's verdict (True/False, or 1/0) from its environment; a reward is no verdict.
    Returns 1.0 when the majority answer of samples [0, k) is correct, else 0.0; the correct
    samples' answers count as one (all equal the reference), the wrong ones' by their text.
    """
    if len(answers) != len(correct):
        raise ValueError(f"cons_at_k: {len(answers)} answers but {len(correct)} correctness flags")
    correct = _verdicts(correct, "cons_at_k")
    if None in correct:
        raise ValueError("cons_at_k: a sample without a verdict (None); leave it out first (mean_cons_at_k)")
    if not 1 <= k <= len(answers):
        raise ValueError(f"cons_at_k needs 1 <= k <= n, got k={k}, n={len(answers)}")
    votes = [None if a is None or not a.strip() else _CORRECT_VOTE if ok else a
             for a, ok in zip(answers[:k], correct[:k])]
    return 1.0 if majority_answer(votes) == _CORRECT_VOTE else 0.0


def _verdicts(correct: Sequence[bool | float | None], where: str) -> list[bool | None]:
    """`correct` as verdicts: True, False, None (not judged); 1 and 0 (a 0/1 score) are True and
    False. Any other number is refused: a reward passed as a verdict is what counted partial
    credit (0.2 of a format bonus, 1 test of 5) as correct."""
    out: list[bool | None] = []
    for x in correct:
        if is_verdict(x):  # a NumPy or torch bool too, as an environment's verdict may be
            out.append(None if x is None else bool(x))
        elif isinstance(x, numbers.Real) and x in (0, 1):
            out.append(bool(x))
        else:
            raise TypeError(f"{where}: correctness flags are True, False or None (not judged), got {x!r}: a reward "
                            "is no verdict (posttrain.environments.interfaces.CORRECT_KEY)")
    return out


def accuracy(correct: Sequence[bool | float | None]) -> float | None:
    """The share of the judged samples (verdict True or False) that are correct; None if none is."""
    judged = [x for x in _verdicts(correct, "accuracy") if x is not None]
    return sum(judged) / len(judged) if judged else None


def mean_pass_at_k(correct_per_prompt: Sequence[Sequence[bool | float | None]], k: int) -> float | None:
    """pass@k averaged over the prompts with at least k judged samples (the others have no
    estimate); each prompt's n and c count its judged samples only. None if no prompt has k."""
    judged = [[x for x in _verdicts(c, "pass@k") if x is not None] for c in correct_per_prompt]
    values = [pass_at_k(len(c), sum(c), k) for c in judged if len(c) >= k]
    return sum(values) / len(values) if values else None


def mean_cons_at_k(answers_per_prompt: Sequence[Sequence[str | None]],
                   correct_per_prompt: Sequence[Sequence[bool | float | None]], k: int) -> float | None:
    """cons@k averaged over the prompts with at least k judged samples, each voting over its
    first k judged ones (an unjudged sample's answer has no verdict to score). None if no prompt has k."""
    values = []
    for answers, correct in zip(answers_per_prompt, correct_per_prompt):
        judged = [(a, x) for a, x in zip(answers, _verdicts(correct, "cons@k")) if x is not None]
        if len(judged) >= k:
            values.append(cons_at_k([a for a, _ in judged], [x for _, x in judged], k))
    return sum(values) / len(values) if values else None


def aggregate(
    answers_per_prompt: Sequence[Sequence[str | None]],
    correct_per_prompt: Sequence[Sequence[bool | float | None]],
) -> dict[str, float | None]:
    """Dataset metrics: mean over prompts of pass@k and cons@k for k = 1..n.

    answers_per_prompt / correct_per_prompt: [P][n], the same n for every prompt; each
    sample's verdict is True, False (or 1, 0) or None (not judged: left out, see `mean_pass_at_k`).
    Returns {"pass@1": ..., ..., "pass@n": ..., "cons@1": ..., ..., "cons@n": ...,
    "accuracy": the share of judged samples that are correct, "num_prompts": P,
    "num_samples": P*n, "num_judged": samples with a verdict}; a metric that no prompt has
    enough judged samples for is None.
    """
    if len(answers_per_prompt) != len(correct_per_prompt):
        raise ValueError(
            f"aggregate: {len(answers_per_prompt)} prompts of answers but {len(correct_per_prompt)} of scores"
        )
    if not correct_per_prompt:
        raise ValueError("aggregate: no prompts to evaluate")
    sizes = {len(c) for c in correct_per_prompt}
    if len(sizes) != 1 or 0 in sizes:
        raise ValueError(f"aggregate: every prompt needs the same number (>= 1) of samples, got sizes {sorted(sizes)}")
    n = sizes.pop()
    num_prompts = len(correct_per_prompt)
    metrics: dict[str, float | None] = {}
    for k in range(1, n + 1):
        metrics[f"pass@{k}"] = mean_pass_at_k(correct_per_prompt, k)
    for k in range(1, n + 1):
        metrics[f"cons@{k}"] = mean_cons_at_k(answers_per_prompt, correct_per_prompt, k)
    flat = [x for c in correct_per_prompt for x in c]
    metrics["accuracy"] = accuracy(flat)
    metrics["num_prompts"] = num_prompts
    metrics["num_samples"] = num_prompts * n
    metrics["num_judged"] = sum(x is not None for x in flat)
    return metrics
