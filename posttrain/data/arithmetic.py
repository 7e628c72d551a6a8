"""The embedded task: integer arithmetic problems, made on the fly from a seed.

How the rows are made:
- The problem space is every `a <op> b` with `0 <= a, b < 10**num_digits` (so "2 digits"
  means up to two digits) and `op` in `operations` (`+`, `-`, `*`). Problem number `i`
  decodes as `op = operations[i % n_ops]`, `a`, `b` = the digits of `i // n_ops` in base
  `10**num_digits`, so a problem is drawn uniformly by drawing one integer.
- A `random.Random(seed)` draws the validation problems first (distinct), then the
  training problems, rejecting any validation problem: validation never shares a problem
  with training. Training problems are drawn with replacement, which matters only when the
  space is small (1 digit, `+`: 100 problems) and training then repeats problems.
- Validation is capped at a fifth of the problem space, so that training keeps most
  problems to learn from (1 digit, `+`: at most 20 validation problems).
- The same arguments give the same rows on every machine; the validation rows do not
  depend on `num_train`.

A row is `{"messages": [{"role": "user", "content": "12+34="}], "answer": "46",
"task_name": "arithmetic", "metadata": {"operation": "+", "num_digits": 2}}`. The prompt is
kept this terse on purpose: the embedded models read one character per token, and a short
prompt leaves their tiny context to the answer. Subtraction may give a negative answer
(`"3-7="` -> `"-4"`). With `zero_pad`, operands and answers have a fixed width: the
operands `num_digits`, the answer the widest result of its operation, after any sign
(2 digits: `"07+38="` -> `"045"`, `"03-17="` -> `"-14"`, `"12*11="` -> `"0132"`).

Warm-up demonstrations (`grpo.warmup_sft_steps`) are the answers, except that with
`demo_tool_rate` a share of training rows demonstrates calling the calculator instead:
`<tool_call>{"name": "add", "arguments": {"a": 7, "b": 38}}</tool_call>`, the tool's `45`,
then the answer `045` (`TOOL_NAMES`; examples/tools/calculator.py implements them), and with
`demo_carry_error_rate` a share of the other `+` rows demonstrates a sloppy teacher's answer.
"""

from __future__ import annotations

import json
import operator
import random
from typing import Any, Sequence

TASK_NAME = "arithmetic"
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
# The calculator tool of each operation, for demonstrations that call it.
TOOL_NAMES = {"+": "add", "-": "subtract", "*": "multiply"}
# At most this share of the problem space is held out, so that training keeps most of it.
VAL_FRACTION_CAP = 0.2


def _width(op: str, num_digits: int) -> int:
    """Digits of the widest result of `op` on `num_digits`-digit operands (sign not counted)."""
    return {"+": num_digits + 1, "-": num_digits, "*": 2 * num_digits}[op]


def _row(a: int, op: str, b: int, num_digits: int, zero_pad: bool, result: int | None = None) -> dict[str, Any]:
    result = OPERATIONS[op](a, b) if result is None else result
    if zero_pad:
        # Fixed width: every digit of every problem sits at the same position, which a
        # one-character-per-token model learns far faster (sign before the padded digits).
        prompt = f"{a:0{num_digits}d}{op}{b:0{num_digits}d}="
        answer = ("-" if result < 0 else "") + f"{abs(result):0{_width(op, num_digits)}d}"
    else:
        prompt, answer = f"{a}{op}{b}=", str(result)
    return {
        "messages": [{"role": "user", "content": prompt}],
        "answer": answer,
        "task_name": TASK_NAME,
        "metadata": {"operation": op, "num_digits": num_digits, "operands": [a, b]},
    }


def carry_free_sum(a: int, b: int) -> int:
    """a + b with every carry forgotten: each digit is (digit of a + digit of b) mod 10."""
    out, place = 0, 1
    while a or b:
        out += (a % 10 + b % 10) % 10 * place
        a, b, place = a // 10, b // 10, place * 10
    return out


def make_arithmetic_rows(
    num_digits: int, operations: Sequence[str], num_train: int, num_val: int, seed: int, zero_pad: bool = False,
    demo_carry_error_rate: float = 0.0, demo_tool_rate: float = 0.0,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`(train_rows, val_rows)` of arithmetic problems (see the module docstring for how)."""
    if num_digits < 1:
        raise ValueError(f"data.num_digits must be >= 1, got {num_digits}")
    ops = list(operations)
    bad = [o for o in ops if o not in OPERATIONS]
    if not ops or bad:
        raise ValueError(f"data.operations must be a non-empty subset of {list(OPERATIONS)}, got {ops}")
    if num_train < 0 or num_val < 0:
        raise ValueError(f"data.num_train and data.num_val must be >= 0, got {num_train}, {num_val}")
    base = 10**num_digits
    space = len(ops) * base * base
    cap = int(space * VAL_FRACTION_CAP)
    num_val = min(num_val, cap)  # the caller says so (posttrain.data.datasets: once per run, not per split)

    def decode(i: int) -> dict[str, Any]:
        a, b = divmod(i // len(ops), base)
        return _row(a, ops[i % len(ops)], b, num_digits, zero_pad)

    rng = random.Random(seed)
    val_ids: list[int] = []
    seen: set[int] = set()
    while len(val_ids) < num_val:
        i = rng.randrange(space)
        if i not in seen:
            seen.add(i)
            val_ids.append(i)
    train_ids: list[int] = []
    while len(train_ids) < num_train:
        i = rng.randrange(space)
        if i not in seen:
            train_ids.append(i)
    train = [decode(i) for i in train_ids]
    # Their own streams: the problems do not depend on the rates.
    tool_user, teacher = random.Random(seed + 2), random.Random(seed + 1)
    for row in train:
        (a, b), op = row["metadata"]["operands"], row["metadata"]["operation"]
        if demo_tool_rate > 0 and tool_user.random() < demo_tool_rate:
            call = {"name": TOOL_NAMES[op], "arguments": {"a": a, "b": b}}
            row["demonstration"] = [{"role": "assistant", "content": f"<tool_call>{json.dumps(call)}</tool_call>"},
                                    {"role": "tool", "content": str(OPERATIONS[op](a, b))},
                                    {"role": "assistant", "content": row["answer"]}]
            continue
        wrong = carry_free_sum(a, b) if op == "+" else None
        if demo_carry_error_rate > 0 and teacher.random() < demo_carry_error_rate and wrong is not None \
                and wrong != a + b:
            row["demonstration"] = _row(a, op, b, num_digits, zero_pad, result=wrong)["answer"]
    return train, [decode(i) for i in val_ids]
