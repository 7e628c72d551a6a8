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
final answers (samples with no extractable answer do not vote), and score the problem 1 if
the most common answer is a correct one. Ties go to the answer seen first.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence


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


def cons_at_k(answers: Sequence[str | None], correct: Sequence[bool | float], k: int) -> float:
    """Majority-vote accuracy of one problem over its first `k` samples.

    answers: [n] extracted final answer of each sample (None when nothing was extracted).
    correct: [n] whether each sample was scored correct (reward > 0 counts as correct).
    Returns 1.0 when the majority answer of samples [0, k) is correct, else 0.0.
    """
    if len(answers) != len(correct):
        raise ValueError(f"cons_at_k: {len(answers)} answers but {len(correct)} correctness flags")
    if not 1 <= k <= len(answers):
        raise ValueError(f"cons_at_k needs 1 <= k <= n, got k={k}, n={len(answers)}")
    winner = majority_answer(answers[:k])
    if winner is None:
        return 0.0
    for a, ok in zip(answers[:k], correct[:k]):
        if a is not None and a.strip() == winner:
            return 1.0 if float(ok) > 0 else 0.0
    raise AssertionError("unreachable: the majority answer comes from these samples")


def aggregate(
    answers_per_prompt: Sequence[Sequence[str | None]],
    correct_per_prompt: Sequence[Sequence[bool | float]],
) -> dict[str, float]:
    """Dataset metrics: mean over prompts of pass@k and cons@k for k = 1..n.

    answers_per_prompt / correct_per_prompt: [P][n], the same n for every prompt.
    Returns {"pass@1": ..., ..., "pass@n": ..., "cons@1": ..., ..., "cons@n": ...,
    "accuracy": mean correctness over all samples, "num_prompts": P, "num_samples": P*n}.
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
    metrics: dict[str, float] = {}
    for k in range(1, n + 1):
        metrics[f"pass@{k}"] = (
            sum(pass_at_k(n, sum(float(x) > 0 for x in c), k) for c in correct_per_prompt) / num_prompts
        )
    for k in range(1, n + 1):
        metrics[f"cons@{k}"] = (
            sum(cons_at_k(a, c, k) for a, c in zip(answers_per_prompt, correct_per_prompt)) / num_prompts
        )
    metrics["accuracy"] = sum(float(x) > 0 for c in correct_per_prompt for x in c) / (num_prompts * n)
    metrics["num_prompts"] = num_prompts
    metrics["num_samples"] = num_prompts * n
    return metrics
