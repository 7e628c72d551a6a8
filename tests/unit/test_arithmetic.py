"""The embedded arithmetic task: determinism, disjoint validation, answers, prompt format."""

import re

import pytest

from posttrain.data.arithmetic import carry_free_sum, make_arithmetic_rows


def _prompts(rows):
    return [r["messages"][0]["content"] for r in rows]


def test_row_format_and_answers_are_correct():
    train, val = make_arithmetic_rows(2, ["+", "-", "*"], 300, 50, seed=0)
    assert len(train) == 300 and len(val) == 50
    for row in train + val:
        assert row["task_name"] == "arithmetic"
        assert row["messages"] == [{"role": "user", "content": row["messages"][0]["content"]}]
        m = re.fullmatch(r"(\d{1,2})([+\-*])(\d{1,2})=", row["messages"][0]["content"])
        assert m, row
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        assert int(row["answer"]) == {"+": a + b, "-": a - b, "*": a * b}[op]
        assert "demonstration" not in row  # only with demo_carry_error_rate
    assert any(r["answer"].startswith("-") for r in train)  # negative results occur
    assert {r["messages"][0]["content"][-1] for r in train} == {"="}
    assert {re.search(r"[+\-*]", p[1:]).group(0) for p in _prompts(train)} == {"+", "-", "*"}


def test_known_values():
    row = make_arithmetic_rows(1, ["-"], 1, 0, seed=3)[0][0]
    a, b = map(int, row["messages"][0]["content"][:-1].split("-"))
    assert row["answer"] == str(a - b)


def test_deterministic_and_seed_dependent():
    a = make_arithmetic_rows(3, ["+"], 100, 20, seed=7)
    b = make_arithmetic_rows(3, ["+"], 100, 20, seed=7)
    c = make_arithmetic_rows(3, ["+"], 100, 20, seed=8)
    assert a == b
    assert _prompts(a[0]) != _prompts(c[0])
    # Validation does not depend on how many training rows are asked for.
    assert make_arithmetic_rows(3, ["+"], 5, 20, seed=7)[1] == a[1]


def test_val_disjoint_small_space_samples_with_replacement():
    train, val = make_arithmetic_rows(1, ["+"], 1000, 200, seed=0)
    assert len(val) == 20  # capped at a fifth of the 100 problems
    assert len(set(_prompts(val))) == 20
    assert not set(_prompts(train)) & set(_prompts(val))
    assert len(train) == 1000 and len(set(_prompts(train))) == 80  # every other problem, repeated


def test_val_disjoint_large_space():
    train, val = make_arithmetic_rows(4, ["+", "*"], 2000, 500, seed=1)
    assert len(set(_prompts(val))) == 500
    assert not set(_prompts(train)) & set(_prompts(val))


@pytest.mark.parametrize("kw", [dict(num_digits=0), dict(operations=["/"]), dict(operations=[]), dict(num_train=-1)])
def test_bad_arguments(kw):
    args = dict(num_digits=1, operations=["+"], num_train=1, num_val=1, seed=0) | kw
    with pytest.raises(ValueError, match="data."):
        make_arithmetic_rows(**args)


def test_zero_pad_gives_fixed_width_prompts_and_answers():
    train, val = make_arithmetic_rows(2, ["+", "-", "*"], 300, 50, seed=0, zero_pad=True)
    widths = {"+": 3, "-": 2, "*": 4}
    for row in train + val:
        prompt = row["messages"][0]["content"]
        op = row["metadata"]["operation"]
        a, b = prompt[:-1].split(op)
        assert len(a) == len(b) == 2 and prompt.endswith("=")
        expected = {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]
        assert int(row["answer"]) == expected
        assert len(row["answer"].lstrip("-")) == widths[op]
    # The same problem space and draws as without padding: only the rendering differs.
    plain, _ = make_arithmetic_rows(2, ["+"], 20, 5, seed=4)
    padded, _ = make_arithmetic_rows(2, ["+"], 20, 5, seed=4, zero_pad=True)
    assert [int(r["answer"]) for r in plain] == [int(r["answer"]) for r in padded]


def test_carry_free_sum():
    assert carry_free_sum(7, 38) == 35
    assert carry_free_sum(96, 23) == 19
    assert carry_free_sum(99, 99) == 88
    assert carry_free_sum(12, 34) == 46  # no carry: the true sum
    assert carry_free_sum(0, 0) == 0


def test_sloppy_teacher_demonstrations():
    clean, clean_val = make_arithmetic_rows(2, ["+", "-"], 4000, 100, seed=3, zero_pad=True)
    train, val = make_arithmetic_rows(2, ["+", "-"], 4000, 100, seed=3, zero_pad=True, demo_carry_error_rate=0.6)
    # The problems, answers and validation rows do not depend on the rate.
    assert [r["answer"] for r in train] == [r["answer"] for r in clean] and val == clean_val
    assert not any("demonstration" in r for r in val)
    wrong = [r for r in train if "demonstration" in r]
    with_carry = [r for r in train if r["metadata"]["operation"] == "+"
                  and carry_free_sum(*r["metadata"]["operands"]) != sum(r["metadata"]["operands"])]
    # Only "+" rows with a carry, about 60% of them, get the carry-free answer at the answer's width.
    assert all(r["metadata"]["operation"] == "+" for r in wrong)
    assert 0.55 < len(wrong) / len(with_carry) < 0.65
    for r in wrong:
        a, b = r["metadata"]["operands"]
        assert r["demonstration"] == f"{carry_free_sum(a, b):03d}" != r["answer"]


def test_tool_demonstrations_call_the_operations_calculator_and_copy_its_result():
    import json
    import runpy
    from pathlib import Path

    calculator = runpy.run_path(str(Path(__file__).resolve().parents[2] / "examples" / "tools" / "calculator.py"))
    train, val = make_arithmetic_rows(2, ["+", "-", "*"], 2000, 50, seed=0, zero_pad=True,
                                      demo_carry_error_rate=0.7, demo_tool_rate=0.3)
    tool_rows = [r for r in train if isinstance(r.get("demonstration"), list)]
    assert 0.25 < len(tool_rows) / len(train) < 0.35 and not any("demonstration" in r for r in val)
    for row in tool_rows:
        call_msg, result, answer = row["demonstration"]
        assert call_msg["content"].startswith("<tool_call>") and call_msg["content"].endswith("</tool_call>")
        call = json.loads(call_msg["content"][len("<tool_call>"):-len("</tool_call>")])
        # The example tool named for the operation gives the result the demonstration shows.
        assert result == {"role": "tool", "content": str(calculator[call["name"]](**call["arguments"]))}
        assert int(result["content"]) == int(row["answer"]) and answer == {"role": "assistant", "content": row["answer"]}
    # The problems, and the carry errors of the rows without tools, do not depend on the tool rate.
    plain, _ = make_arithmetic_rows(2, ["+", "-", "*"], 2000, 50, seed=0, zero_pad=True, demo_carry_error_rate=0.7)
    assert _prompts(plain) == _prompts(train)
    assert any(isinstance(r.get("demonstration"), str) for r in train)


def test_a_validation_split_larger_than_the_cap_is_said_once_when_validation_is_read(caplog):
    """One-digit additions are 100 problems, at most 20 held out: the run says so once (it did for
    each split it read), naming data.num_val."""
    import logging

    from posttrain.data.datasets import load_rows
    from posttrain.schemas import DataConfig

    cfg = DataConfig(dataset_name="arithmetic", num_digits=1, num_train=50, num_val=200)
    with caplog.at_level(logging.INFO, logger="posttrain.data"):
        assert len(load_rows(cfg, "train")) == 50
        assert not caplog.records
        assert len(load_rows(cfg, "val")) == 20
    assert [r.getMessage() for r in caplog.records] == [
        "data.num_val=200: 1-digit + problems allow 20 held out (the rest stay for training)"]
