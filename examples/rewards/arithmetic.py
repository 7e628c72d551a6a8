"""Reward functions for the embedded arithmetic task, named in a config by
`env.<name>.target: examples/rewards/arithmetic.py:<function>` (see docs/environments.md).

A reward function takes the model's answer and the row's metadata (with its `answer`) and
returns a number; it runs in the environment's Ray actors, where an exception scores 0.
"""


def digits_right(response: str, metadata: dict) -> float:
    """Partial credit: the fraction of the answer's digits in the right place ("045" for "035"
    scores 2/3), so a sample that gets the carry wrong still beats one that gets nothing right."""
    gold, answer = str(metadata["answer"]).strip(), response.strip()
    if len(answer) != len(gold):
        return 0.0
    return sum(a == b for a, b in zip(answer, gold)) / len(gold)


def exact(response: str, metadata: dict) -> float:
    """1 for exactly the answer (surrounding whitespace ignored), as the built-in arithmetic
    environment scores; with tools, `response` is the answer after the tool calls."""
    return float(response.strip() == str(metadata["answer"]))
