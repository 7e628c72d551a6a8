"""Environments: answer extraction, each environment's rules, verifier failures scoring 0,
and the Ray facade (slicing, order, timeouts, crashes and restarts)."""

import functools
import importlib
import logging
import os
import re
import threading
import time

import pytest
import ray
import torch

from posttrain.environments import (
    ENVIRONMENTS,
    EnvironmentFailure,
    EnvironmentGroup,
    EnvironmentReturn,
    PerSampleEnvironment,
    StepResult,
    create_env,
    make_sliding_puzzle_rows,
)
from posttrain.environments.arithmetic import ArithmeticEnvironment
from posttrain.environments.interfaces import CORRECT_KEY, ROLLOUT_KEY
from posttrain.environments.math import VERIFY_FAILED_KEY, MathEnvironment
from posttrain.environments.math_answers import extract_boxed, extract_final_answer, gold_answer
from posttrain.environments.sliding_puzzle import (
    SlidingPuzzleEnvironment,
    apply_move,
    parse_action,
    render_board,
    shortest_move,
    shuffled_board,
    solved_board,
)
from posttrain.environments.timeout import SubprocessRunner
from posttrain.schemas import EnvWorkerConfig, SlidingPuzzleEnvConfig


def convo(answer: str, prompt: str = "q") -> list[dict]:
    return [{"role": "user", "content": prompt}, {"role": "assistant", "content": answer}]


# --------------------------------------------------------------------------- math


def test_answer_extraction():
    assert extract_boxed(r"so \boxed{\frac{1}{2}} and \boxed{x^{2}+1}") == "x^{2}+1"
    assert extract_boxed(r"\fbox{7}") == "7"
    assert extract_boxed(r"\boxed{unclosed") is None
    # Without braces the argument is the word after the command, not a later expression's braces.
    assert extract_boxed(r"so $\boxed 5$, as $\frac{1}{2}$ of 10") == "5"
    assert extract_boxed(r"it is \boxed -3.") == "-3" and extract_boxed(r"boxed: \boxed.") is None
    assert extract_final_answer(r"\boxedsymbol{2} and 7") == "7"
    assert extract_final_answer("first 3, then 1,234.5 apples.") == "1234.5"
    assert extract_final_answer(r"-4 but \boxed{12} is final") == "12"
    assert extract_final_answer("it is -7.") == "-7"
    # An unboxed LaTeX fraction is one number, as "3/4" is: it ended in its denominator.
    assert extract_final_answer(r"so the share is $\frac{3}{4}$.") == "3/4"
    assert extract_final_answer(r"\dfrac{-3}{ 8 } of it") == "-3/8"
    # Its sign goes with it (a wrong sign scored right), unless it follows a term; LaTeX's \frac34 is 3/4.
    assert extract_final_answer(r"so $x = -\frac{3}{4}$.") == "-3/4" and extract_final_answer(r"$-\dfrac12$") == "-1/2"
    assert extract_final_answer(r"x-\frac{1}{2}") == "1/2" and extract_final_answer(r"$\frac34$") == "3/4"
    assert extract_final_answer("no digits") is None
    # A fraction is one number, and a Unicode minus is a sign; a hyphen after a number is not.
    assert extract_final_answer("she ate 3/4 of it.") == "3/4"
    assert extract_final_answer("x = \u22127, not 7") == "7" and extract_final_answer("x = \u22127") == "-7"
    assert extract_final_answer("pages 10-12") == "12" and extract_final_answer("then (-2)") == "-2"
    # Commas separate thousands only before groups of three digits.
    assert extract_final_answer("the terms 1,2,3") == "3" and extract_final_answer("at (3,4)") == "4"
    assert extract_final_answer("paid $1,234,567.89, then 12,3456") == "3456"
    assert extract_final_answer("paid $1,234,567.89.") == "1234567.89"
    # Scientific notation is one number, as LaTeX math-verify reads (it ended in its exponent: "1e3"
    # read as 3; math-verify reads "1e3" as 1*e*3), boxed or not.
    assert extract_final_answer("so it is 1e3") == extract_final_answer(r"\boxed{1e3}") == r"1\times10^{3}"
    assert extract_final_answer("x = 2.5E-3.") == r"2.5\times10^{-3}"
    assert extract_final_answer("-4e+2") == r"-4\times10^{2}"
    # Thousands grouped as LaTeX and typography do are one number (they ended in "000"); a plain
    # space is not a separator.
    assert extract_final_answer(r"a total of $1{,}000$ and") == extract_final_answer(r"1\,000") == "1000"
    assert extract_final_answer("1\u2009234\u202f567.5") == "1234567.5" and extract_final_answer("1 000") == "000"
    assert extract_final_answer(r"\boxed{12\,000}") == "12,000" and gold_answer(r" 3{,}500 ") == "3,500"
    # A power is one number (it ended in its exponent); a sign before a currency sign is the number's.
    assert extract_final_answer("so 2^10.") == extract_final_answer("2 ^ {10}") == "2^{10}"
    assert extract_final_answer(r"$10^{-3}$") == "10^{-3}" and extract_final_answer("x^2 = 9") == "9"
    assert extract_final_answer("lost -$5 today") == extract_final_answer("\u2212\\$5") == "-5"
    assert extract_final_answer("from 10-$5") == "5"
    assert extract_final_answer("3 exams, 3eggs") == "3" and extract_final_answer("1e3.5") == "3.5"
    assert gold_answer("#### \u22125") == "-5"
    assert gold_answer("Natalia sold 48/2 = 24 clips.\n#### 72") == "72"
    assert gold_answer("step #### 3\n#### 72") == "72"  # the last "####" is the answer's
    assert gold_answer("#### 1,000") == "1000"
    assert gold_answer(" 1e3") == r"1\times10^{3}" and gold_answer("1e3 m") == "1e3 m"
    assert gold_answer(r" \frac{14}{3} ") == r"\frac{14}{3}"


@pytest.fixture(scope="module")
def math_env():
    env = MathEnvironment(EnvWorkerConfig(timeout_s=2.0))
    yield env
    env.close()


def test_math_rewards(math_env):
    cases = [
        (r"The answer is \boxed{\frac{1}{2}}", "0.5", 1.0),  # equivalent, checked by math-verify
        ("So she sold 1,000 clips.", "She sold ... #### 1000", 1.0),  # GSM8K gold, last number
        ("72", "#### 72", 1.0),
        ("It is 73", "#### 72", 0.0),
        ("I do not know", "3", 0.0),  # no answer: 0, not an error
        (r"\boxed{x^{2}}", "x^2", 1.0),
        ("The answer is 3/4", "4", 0.0),  # not its denominator
        ("The answer is 3/4", r"\frac{3}{4}", 1.0),
        ("The answer is \u22123", "3", 0.0),  # not without its sign
        ("The answer is \u22123", "-3", 1.0),
        (r"So $x = -\frac{3}{4}$.", r"\frac{3}{4}", 0.0),
        (r"So $x = -\frac{3}{4}$.", r"-\frac{3}{4}", 1.0),
        ("It is 1e3.", "1000", 1.0),  # scientific notation: its exponent was the answer
        (r"\boxed{2.5e-3}", "0.0025", 1.0),
        ("It is 6.02e23", r"6.02\times10^{23}", 1.0),
        ("It is 1e3", "3", 0.0),
    ]
    ret = math_env.step([convo(a) for a, _, _ in cases], [{"answer": g} for _, g, _ in cases])
    assert ret.rewards == [r for _, _, r in cases]
    assert all(ret.terminateds) and ret.num_errors == 0
    assert ret.answers[:3] == [r"\frac{1}{2}", "1000", "72"] and ret.answers[4] is None


def test_math_verification_that_hangs_is_a_wrong_answer_and_the_next_one_works(math_env):
    # sympy evaluates 9^(9^(9^9)) in C: only killing the child process stops it
    start = time.monotonic()
    ret = math_env.step(
        [convo(r"\boxed{9^{9^{9^{9}}}}"), convo(r"\boxed{\frac{6}{4}}")], [{"answer": "1"}, {"answer": "1.5"}]
    )
    assert time.monotonic() - start < 60
    assert ret.rewards == [0.0, 1.0]
    # An equality not shown in time is a verdict (math-verify's rule), not an environment error
    # that eval leaves out of its accuracy and GRPO out of its loss.
    assert [m[CORRECT_KEY] for m in ret.metadata] == [False, True] and ret.num_errors == 0
    assert "time limit" in ret.metadata[0][VERIFY_FAILED_KEY] and VERIFY_FAILED_KEY not in ret.metadata[1]


def test_failed_samples_are_logged_once_per_kind_of_error(caplog):
    # A verifier that always raises wrote a line per sample: 512 lines a step at the quickstart's size.
    from posttrain.environments import PerSampleEnvironment

    class Fails(PerSampleEnvironment):
        def step_one(self, messages, metadata):
            raise ValueError(f"boom {metadata['kind']}")

    with caplog.at_level(logging.WARNING, logger="posttrain.environments"):
        ret = Fails().step([convo("x")] * 50, [{"kind": 0}] * 45 + [{"kind": k} for k in range(1, 6)])
    # A class of the user's names the line of its file that raised.
    at = f"Fails.step_one raised ValueError at test_environments.py:{Fails.step_one.__code__.co_firstlineno + 1} in step_one"
    assert ret.num_errors == 50 and ret.metadata[49]["env_error"] == f"{at}: boom 5"
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [f"Fails: sample 0 and 44 more with the same error (of 50) scored 0: {at}: boom 0",
                     f"Fails: sample 45 (of 50) scored 0: {at}: boom 1",
                     f"Fails: sample 46 (of 50) scored 0: {at}: boom 2",
                     "Fails: 3 more samples scored 0 with other errors"]
    assert caplog.records[0].exc_info is not None and caplog.records[1].exc_info is None  # one traceback
    assert isinstance(caplog.records[0].exc_info[1].__cause__, ValueError)  # the original's traceback


def test_math_missing_gold_is_an_error_not_a_crash(math_env):
    ret = math_env.step([convo("5"), convo("5")], [{}, {"answer": "5"}])
    assert ret.rewards == [0.0, 1.0]
    assert "answer" in ret.metadata[0]["env_error"]


def test_math_on_real_gsm8k_and_math500_answers(math_env, shared_data):
    import json
    import os

    def read(rel, n):
        with open(os.path.join(shared_data, rel)) as f:
            return [json.loads(line) for _, line in zip(range(n), f)]

    # GSM8K reference solutions end with "#### N": as responses their last number is N
    gsm = read("gsm8k/test.jsonl", 200)
    ret = math_env.step([convo(r["answer"]) for r in gsm], [{"answer": r["answer"]} for r in gsm])
    assert set(ret.rewards) == {1.0} and ret.num_errors == 0
    off_by_one = [convo(f"The answer is {int(gold_answer(r['answer'])) + 1}.") for r in gsm[:20]]
    assert math_env.step(off_by_one, [{"answer": r["answer"]} for r in gsm[:20]]).rewards == [0.0] * 20
    # MATH-500 fractions written as \dfrac: equal only under math-verify
    rows = [r for r in read("math500/test.jsonl", 500) if "\\frac" in r["answer"]][:25]
    responses = [convo("So \\boxed{" + r["answer"].replace("\\frac", "\\dfrac") + "}.") for r in rows]
    ret = math_env.step(responses, [{"answer": r["answer"]} for r in rows])
    assert len(rows) == 25 and set(ret.rewards) == {1.0} and ret.num_errors == 0


def test_subprocess_runner_recovers_after_a_timeout():
    runner = SubprocessRunner()
    try:
        with pytest.raises(TimeoutError, match="0.5 s"):
            runner.run(time.sleep, (30,), 0.5)
        assert runner.run(sorted, ([3, 1, 2],), 30) == [1, 2, 3]
        with pytest.raises(ZeroDivisionError):
            runner.run(divmod, (1, 0), 30)
        # a child that dies is reported at once, not after the time limit, and replaced
        start = time.monotonic()
        with pytest.raises(ChildProcessError, match="exit code 3"):
            runner.run(os._exit, (3,), 60)
        assert time.monotonic() - start < 20
        assert runner.run(sorted, ([2, 1],), 30) == [1, 2]
    finally:
        runner.close()


def test_a_timed_out_call_kills_what_the_child_started():
    # A tool that runs a command (subprocess.run here) and times out: the command outlived the
    # killed child, orphaned, one per timed-out call.
    import subprocess

    import psutil

    marker = "61.4142"  # an argument no other process has

    def sleepers():
        return [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", marker]]

    runner = SubprocessRunner()
    try:
        with pytest.raises(TimeoutError):
            runner.run(subprocess.run, (["sleep", marker],), 2)
    finally:
        runner.close()
    deadline = time.monotonic() + 5
    while sleepers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not [p for p in sleepers() if p.status() != psutil.STATUS_ZOMBIE]


def test_subprocess_runner_reraises_a_failing_warmup():
    runner = SubprocessRunner(warmup=functools.partial(importlib.import_module, "posttrain_no_such_verifier"))
    with pytest.raises(ModuleNotFoundError, match="posttrain_no_such_verifier"):
        runner.run(sorted, ([1],), 30)
    assert runner._process is None


# --------------------------------------------------------------------------- arithmetic


def test_arithmetic_exact_match():
    env = ArithmeticEnvironment(EnvWorkerConfig())
    responses = ["46", " 46\n", "046", "46.", "4 6", ""]
    ret = env.step([convo(r, "12+34=") for r in responses], [{"answer": "46"}] * len(responses))
    assert ret.rewards == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    strict = ArithmeticEnvironment(EnvWorkerConfig(cfg={"strip_response": False}))
    assert strict.step([convo("46 "), convo("46")], [{"answer": "46"}] * 2).rewards == [0.0, 1.0]
    ret = env.step([convo("-4")], [{"answer": "-4", "operation": "-"}])
    assert ret.rewards == [1.0] and ret.metadata[0]["operation"] == "-"


def test_a_raising_verifier_scores_zero_for_that_sample_only():
    class Flaky(PerSampleEnvironment):
        def step_one(self, messages, metadata):
            if messages[-1]["content"] == "boom":
                raise RuntimeError("verifier exploded")
            return StepResult("ok", 1.0, True, metadata)

    ret = Flaky().step(
        [convo("fine"), convo("boom"), [{"role": "user", "content": "no answer yet"}], convo("fine")],
        [{"i": 0}, {"i": 1, "env_error": "stale error from an earlier turn"}, {"i": 2}, {"i": 3}],
    )
    assert ret.rewards == [1.0, 0.0, 1.0, 1.0]
    assert ret.metadata[1]["i"] == 1 and ret.metadata[1]["env_error"] == (
        f"Flaky.step_one raised RuntimeError at test_environments.py:{Flaky.step_one.__code__.co_firstlineno + 2} "
        "in step_one: verifier exploded")
    assert ret.terminateds == [True] * 4 and ret.num_errors == 1


def test_step_one_observations_as_texts_messages_or_lists_of_them():
    class Hints(PerSampleEnvironment):
        def step_one(self, messages, metadata):
            observation = {"text": "hint", "message": {"role": "user", "content": "hint"},
                           "list": ["hint", {"role": "user", "content": "more"}], "end": None}[messages[-1]["content"]]
            return StepResult(observation, 0.0, observation is None, metadata)

    ret = Hints().step([convo("text"), convo("message"), convo("list"), convo("end")], [{}] * 4)
    # A whole message is one message (its keys are no messages of their own); None, at the end of a
    # conversation, none (it failed inside posttrain, "'NoneType' object is not iterable").
    assert ret.observations == [{"role": "environment", "content": "hint"}, {"role": "user", "content": "hint"},
                                [{"role": "environment", "content": "hint"}, {"role": "user", "content": "more"}], []]
    assert ret.terminateds == [False, False, False, True] and ret.num_errors == 0


def test_a_step_one_return_of_the_wrong_types_fails_its_own_sample_only():
    # Converted for the batch's return, a string reward "0.75" passed as 0.75 and a terminated
    # "False" ended the conversation (bool("False")); an observation 12345 failed the whole slice.
    import numpy as np

    class Sloppy(PerSampleEnvironment):
        def step_one(self, messages, metadata):
            return {"reward": StepResult("", "0.75", True, metadata),
                    "terminated": StepResult("next?", 1.0, "False", metadata),
                    "observation": StepResult(12345, 1.0, True, metadata),
                    "listed": StepResult(["a", 7], 1.0, False, metadata),
                    "numpy": StepResult(("a", {"role": "tool", "content": "b"}), np.float32(0.5), np.bool_(False),
                                        metadata),
                    "fine": StepResult("ok", 1, 0, metadata)}[messages[-1]["content"]]

    cases = ["reward", "terminated", "observation", "listed", "numpy", "fine"]
    ret = Sloppy().step([convo(c) for c in cases], [{}] * len(cases))
    assert ret.rewards == [0.0, 0.0, 0.0, 0.0, 0.5, 1.0] and ret.num_errors == 4
    assert ret.terminateds == [True, True, True, True, False, False]
    assert all(type(r) is float for r in ret.rewards) and all(type(t) is bool for t in ret.terminateds)
    assert [m.get("env_error") for m in ret.metadata[:4]] == [
        "TypeError: step_one returned reward '0.75' (str), not a number",
        "TypeError: step_one returned terminated 'False' (str), not a bool",
        "TypeError: step_one returned observation 12345 (int), not a text, a message (dict), a list of them or None",
        "TypeError: step_one returned observation ['a', 7] (list), not a text, a message (dict), a list of them or None",
    ]
    assert ret.observations[4] == [{"role": "environment", "content": "a"}, {"role": "tool", "content": "b"}]


# --------------------------------------------------------------------------- sliding puzzle


def test_board_mechanics():
    assert solved_board(2) == [[1, 2], [3, 0]]
    assert render_board(solved_board(3)) == "1 2 3\n4 5 6\n7 8 _"
    assert apply_move([[1, 2], [3, 0]], "up") == [[1, 0], [3, 2]]
    assert apply_move([[1, 2], [3, 0]], "left") == [[1, 2], [0, 3]]
    assert apply_move([[1, 2], [3, 0]], "down") is None and apply_move([[1, 2], [3, 0]], "right") is None
    assert parse_action("I think <action> Up </action>") == "up"
    assert parse_action("<action>left</action><action>down</action>") == "down"
    assert parse_action("<action>jump</action>") is None and parse_action("up") is None
    assert parse_action("<action>right") == "right"  # stop string dropped by the backend
    assert parse_action("<action>right and more") is None
    board = shuffled_board(3, 10, seed=7)
    assert board == shuffled_board(3, 10, seed=7) and board != solved_board(3)
    assert sorted(v for row in board for v in row) == list(range(9))
    assert shuffled_board(2, 1, seed=0) != solved_board(2)


def _solution(board):
    """Moves of the blank that solve a board (breadth-first search from it)."""
    from collections import deque

    seen, queue = {str(board)}, deque([(board, [])])
    while queue:
        b, path = queue.popleft()
        if b == solved_board(len(board)):
            return path
        for a in ("up", "down", "left", "right"):
            nb = apply_move(b, a)
            if nb is not None and str(nb) not in seen:
                seen.add(str(nb))
                queue.append((nb, path + [a]))
    raise AssertionError("unsolvable")


def test_too_few_rollout_turns_for_a_sliding_puzzles_moves_fail_at_config_load():
    # With grpo.max_rollout_turns at its default of 1 every game ended after one move, scored 0
    # unless that solved it, and nothing said why no puzzle was ever solved.
    from posttrain.config import ConfigError, load_config

    keys = ["data.dataset_name=sliding_puzzle"]
    with pytest.raises(ConfigError, match=r"env.sliding_puzzle.cfg.max_moves=8 needs grpo.max_rollout_turns >= 8 "
                                          r"\(a turn per move\), got 1"):
        load_config("grpo", None, keys)
    with pytest.raises(ConfigError, match=r"max_moves=3 needs eval.max_rollout_turns >= 3 .* got 2"):
        load_config("eval", None, [*keys, "env.sliding_puzzle.cfg.max_moves=3", "eval.max_rollout_turns=2"])
    assert load_config("grpo", None, [*keys, "env.sliding_puzzle.cfg.max_moves=3", "grpo.max_rollout_turns=3"])
    assert load_config("grpo", None, ["grpo.max_rollout_turns=1"])  # arithmetic rows: one turn is theirs


def test_sliding_puzzle_game_is_won_turn_by_turn():
    cfg = SlidingPuzzleEnvConfig(size=2, shuffle_moves=4, max_moves=8)
    env = SlidingPuzzleEnvironment(EnvWorkerConfig(cfg=cfg.model_dump()))
    (row,) = make_sliding_puzzle_rows(1, cfg, seed=3)
    assert row["task_name"] == "sliding_puzzle" and row["stop_strings"] == ["</action>"]
    assert render_board(row["metadata"]["board"]) in row["messages"][0]["content"]
    moves = _solution(row["metadata"]["board"])
    messages, meta = list(row["messages"]), dict(row["metadata"])
    for k, move in enumerate(moves):
        messages.append({"role": "assistant", "content": f"<action>{move}</action>"})
        ret = env.step([messages], [meta])
        meta = ret.metadata[0]
        last = k == len(moves) - 1
        assert ret.rewards == [1.0 if last else 0.0]
        assert ret.terminateds == [last] and meta["moves"] == k + 1
        if not last:
            assert ret.next_stop_strings == [["</action>"]]
            assert ret.observations[0]["content"] == "Board:\n" + render_board(meta["board"])
            messages.append(ret.observations[0])
    assert ret.observations[0]["content"] == "Solved!" and meta["solved"]


def _replay(env, row):
    """Play a row's demonstration in the environment, checking each observation against the
    demonstration's; returns (moves played, reward of the last)."""
    demo, messages, meta = row["demonstration"], list(row["messages"]), dict(row["metadata"])
    for k in range(0, len(demo), 2):
        messages.append(demo[k])
        ret = env.step([messages], [meta])
        meta = ret.metadata[0]
        if k + 1 < len(demo):
            assert not ret.terminateds[0] and demo[k + 1] == {"role": "user", "content": ret.observations[0]["content"]}
            messages.append(demo[k + 1])
    assert ret.terminateds[0] and ret.num_errors == 0  # the demonstration ends with the game
    return meta["moves"], float(ret.rewards[0])


def test_teacher_demonstrations_play_shortest_solutions_with_a_blind_spot():
    cfg = SlidingPuzzleEnvConfig(size=3, shuffle_moves=6, max_moves=8)
    env = SlidingPuzzleEnvironment(EnvWorkerConfig(cfg=cfg.model_dump()))
    perfect = make_sliding_puzzle_rows(30, cfg, seed=5)
    blind = make_sliding_puzzle_rows(30, cfg, seed=5, demo_error_rate=1.0)
    assert [r["metadata"] for r in perfect] == [r["metadata"] for r in blind]  # the same puzzles
    needs_left = 0
    for p, b in zip(perfect, blind):
        board = p["metadata"]["board"]
        assert _replay(env, p) == (len(_solution(board)), 1.0)  # shortest, by an independent search
        path = []
        while (move := shortest_move(board)) is not None:
            path.append(move)
            board = apply_move(board, move)
        moves, reward = _replay(env, b)
        assert "left" not in str(b["demonstration"])
        if "left" in path:
            needs_left += 1
            assert reward == 0.0 and moves == cfg.max_moves  # it walks back and forth until out of moves
        else:
            assert b["demonstration"] == p["demonstration"]
    assert 10 <= needs_left <= 29
    half = make_sliding_puzzle_rows(30, cfg, seed=5, demo_error_rate=0.5)
    solved = sum(_replay(env, r)[1] for r in half)
    assert 30 - needs_left < solved < 30  # some blind-spot puzzles solved, not all


def test_teacher_distance_table_is_bounded(monkeypatch):
    from posttrain.environments import sliding_puzzle

    sliding_puzzle._distances.cache_clear()
    monkeypatch.setattr(sliding_puzzle, "_MAX_TABLE_BOARDS", 50)
    try:
        assert shortest_move(apply_move(solved_board(3), "up")) == "down"
        with pytest.raises(ValueError, match=r"passed \d+ boards; lower env.sliding_puzzle.cfg.shuffle_moves or max_moves"):
            shortest_move(shuffled_board(3, 12, seed=1))
        # Rows of puzzles too far for the teacher come without demonstrations (a warm-up then
        # fails, naming what it needs); the puzzles themselves are unchanged.
        far = SlidingPuzzleEnvConfig(size=3, shuffle_moves=12, max_moves=12)
        rows = make_sliding_puzzle_rows(3, far, seed=1)
        assert all("demonstration" not in r for r in rows) and rows[0]["metadata"]["board"] != solved_board(3)
        from posttrain.algorithms.grpo import _warmup_examples
        from posttrain.config import InputError, load_config

        with pytest.raises(InputError, match="grpo.warmup_sft_steps=5 needs an `answer`"):  # None: nothing to imitate
            _warmup_examples(load_config("grpo", None, ["grpo.warmup_sft_steps=5"]), None, rows)
    finally:
        sliding_puzzle._distances.cache_clear()


def test_sliding_puzzle_invalid_moves_and_move_limit():
    start_meta = {"board": [[1, 0], [3, 2]], "moves": 0}  # one "down" from solved
    env = SlidingPuzzleEnvironment(EnvWorkerConfig(cfg={"max_moves": 2}))
    ret = env.step([convo("<action>up</action>"), convo("go down"), convo("<action>down</action>")], [start_meta] * 3)
    assert ret.rewards == [0.0, 0.0, 1.0]
    assert ret.terminateds == [True, True, True]  # off the board / no tag: invalid ends the game
    assert ret.observations[0]["content"].startswith("Invalid move.")
    lenient = SlidingPuzzleEnvironment(EnvWorkerConfig(cfg={"max_moves": 2, "terminate_on_invalid": False}))
    ret = lenient.step([convo("nothing")], [start_meta])
    assert ret.terminateds == [False] and ret.metadata[0]["moves"] == 1
    assert ret.metadata[0]["board"] == [[1, 0], [3, 2]]
    ret = lenient.step([convo("<action>left</action>")], [ret.metadata[0]])  # second move: the limit
    assert ret.terminateds == [True] and ret.rewards == [0.0]
    assert ret.observations[0]["content"].startswith("Out of moves.")
    # a seed alone is enough: the board is rebuilt from it
    seeded = env.step([convo("<action>up</action>")], [{"seed": 11}])
    assert seeded.metadata[0]["moves"] == 1 and "board" in seeded.metadata[0]
    bad = env.step([convo("<action>up</action>")], [{"moves": 0}])
    assert bad.rewards == [0.0] and "seed" in bad.metadata[0]["env_error"]


# --------------------------------------------------------------------------- Ray facade


def test_builtin_env_settings_fail_at_config_load():
    from pydantic import ValidationError

    from posttrain.schemas import EnvConfig

    # A typo gets the closest valid key, as a typo anywhere else in the config does.
    with pytest.raises(ValidationError, match=r"unknown key 'env.sliding_puzzle.cfg.sizee' \(did you mean "
                                              r"env.sliding_puzzle.cfg.size\?\)"):
        EnvConfig.model_validate({"sliding_puzzle": {"cfg": {"sizee": 3}}})
    with pytest.raises(ValidationError, match="env.math.cfg.float_rounding: got -1"):
        EnvConfig.model_validate({"math": {"cfg": {"float_rounding": -1}}})
    # story and reward_model too (they were checked only in their actors, after Ray started).
    with pytest.raises(ValidationError, match="missing required key 'env.reward_model.cfg.model_name'"):
        EnvConfig.model_validate({"reward_model": {"cfg": {}}})
    with pytest.raises(ValidationError, match="env.story.cfg.min_mentions: got 0"):
        EnvConfig.model_validate({"story": {"cfg": {"min_mentions": 0}}})
    env = EnvConfig.model_validate({"custom": {"num_workers": 2, "cfg": {"anything": 1}}})
    assert env.get_worker_cfg("custom").num_workers == 2
    assert env.get_worker_cfg("math").timeout_s == 5.0  # not configured: defaults


def test_create_env_errors():
    with pytest.raises(ValueError, match="arithmetic, code, math, reward_model, sliding_puzzle, story"):
        create_env("chess", {})
    with pytest.raises(ValueError, match=re.escape("unknown key 'env.sliding_puzzle.cfg.sizee' (did you mean "
                                               "env.sliding_puzzle.cfg.size?)")):
        create_env("sliding_puzzle", {"cfg": {"sizee": 3}})
    assert set(ENVIRONMENTS) >= {"math", "arithmetic", "sliding_puzzle"}


def test_sft_rows_fail_before_any_environment_starts():
    from posttrain.environments import resolve_task_envs
    from posttrain.schemas import EnvConfig

    # An SFT file (a conversation with its answer, no task_name) given to GRPO went to `math`, its
    # answer in the prompt, and every sample scored 0 as an environment error: nothing trained.
    sft = {"messages": [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}]}
    prompt = {"messages": [{"role": "user", "content": "1+1="}], "answer": "2", "task_name": "math"}
    with pytest.raises(ValueError, match=r"1 of 2 rows are SFT rows.*set data.task_name"):
        resolve_task_envs([prompt, sft], EnvConfig())
    assert resolve_task_envs([prompt], EnvConfig()) == ["math"]


def test_an_env_entry_named_like_the_datas_environment_but_not_it_fails_at_setup():
    from posttrain.environments import resolve_task_envs
    from posttrain.schemas import EnvConfig

    # `env.mth.num_workers=2` made an entry no row names: math ran at its defaults, without a word.
    prompt = {"messages": [{"role": "user", "content": "1+1="}], "answer": "2", "task_name": "math"}
    with pytest.raises(ValueError, match=re.escape(
            "env.mth: no data row names environment 'mth' (task_name), which so configures nothing; "
            "did you mean env.math? (the data's: math)")):
        resolve_task_envs([prompt], EnvConfig.model_validate({"mth": {"num_workers": 2}}))
    # An entry unlike any of the data's (inherited from another config) is left alone.
    assert resolve_task_envs([prompt], EnvConfig.model_validate({"math": {}, "sliding_puzzle": {}})) == ["math"]


def test_rows_without_the_answer_their_environment_scores_against_fail_at_setup(caplog):
    from posttrain.environments import resolve_task_envs
    from posttrain.schemas import EnvConfig

    # A file read through `datasets` gives a row without `answer` answer=None: eval took it, and
    # math scored every sample of it 0 as an environment error.
    rows = [{"messages": [{"role": "user", "content": f"{a}+1="}], "answer": str(a + 1), "task_name": "math"}
            for a in range(3)]
    rows[2]["answer"] = None
    with pytest.raises(ValueError, match=r"1 of 3 rows for environment 'math' have no reference `answer`.*"
                                         r"first: row 3, prompt '2\+1='"):
        resolve_task_envs(rows, EnvConfig(), require_answers=True)
    with caplog.at_level("WARNING", logger="posttrain.environments.registry"):
        assert resolve_task_envs(rows, EnvConfig()) == ["math"]  # GRPO: scored 0 as env errors, counted
    assert "1 of 3 rows for environment 'math' have no reference `answer`" in caplog.text  # and said at setup
    assert "scores 0 and counts as an env error" in caplog.text
    # Code rows are scored by their tests, sliding-puzzle rows by their puzzle: no answer needed.
    code = {"messages": [{"role": "user", "content": "write f"}], "task_name": "code", "metadata": {"tests": []}}
    puzzle = {"messages": [{"role": "user", "content": "solve"}], "task_name": "sliding_puzzle", "answer": None}
    assert resolve_task_envs([rows[0], code, puzzle], EnvConfig(), require_answers=True) == [
        "code", "math", "sliding_puzzle"]


def test_env_group_splits_and_keeps_order(ray_session):
    group = create_env("arithmetic", {"num_workers": 2})
    try:
        answers = ["1", "2", "3", "4", "5"]
        responses = ["1", "x", "3", "4", "y"]
        ret = group.step([convo(r) for r in responses], [{"answer": a, "i": i} for i, a in enumerate(answers)])
        assert ret.rewards == [1.0, 0.0, 1.0, 1.0, 0.0]
        assert [m["i"] for m in ret.metadata] == [0, 1, 2, 3, 4] and ret.num_errors == 0
        # The rollout's own entry goes in (environments read it) but not back out; the rest comes back.
        ret = group.step([convo("1")], [{"answer": "1", "i": 9, ROLLOUT_KEY: {"completion_ids": [5, 6]}}])
        assert ret.metadata == [{"answer": "1", "i": 9, CORRECT_KEY: True}]
        assert group.step([convo("7")], [{"answer": "7"}]).rewards == [1.0]  # fewer samples than actors

        def loaded(actor_self, *names):  # local, so cloudpickle sends it by value, importing nothing
            import sys

            return [name for name in names if name in sys.modules]

        # Environment actors import no torch (~3 s of CPU and ~200 MB each): rewards travel as lists.
        assert ray.get([a.__ray_call__.remote(loaded, "torch", "posttrain.environments.actors")
                        for a in group._actors]) == [["posttrain.environments.actors"]] * 2
    finally:
        group.shutdown()


def test_math_env_runs_math_verify_inside_a_ray_actor(ray_session):
    # the verification child process is spawned from the actor process
    group = create_env("math", {"timeout_s": 10.0})
    try:
        ret = group.step([convo(r"\boxed{\frac{1}{2}}"), convo("it is 3")], [{"answer": "0.5"}, {"answer": "#### 4"}])
        assert ret.rewards == [1.0, 0.0] and ret.num_errors == 0
    finally:
        group.shutdown()


def test_env_group_multi_turn_puzzle(ray_session):
    group = create_env("sliding_puzzle", {"cfg": {"size": 2, "max_moves": 3}})
    try:
        meta = [{"board": [[1, 2], [0, 3]], "moves": 0}, {"board": [[1, 0], [3, 2]], "moves": 0}]
        ret = group.step([convo("<action>up</action>"), convo("<action>down</action>")], meta)
        assert ret.rewards == [0.0, 1.0] and ret.terminateds == [False, True]
        ret = group.step([convo("<action>down</action>")], [ret.metadata[0]])  # undo, board as at start
        ret = group.step([convo("<action>right</action>")], [ret.metadata[0]])
        assert ret.rewards == [1.0] and ret.metadata[0]["moves"] == 3
    finally:
        group.shutdown()


def test_a_stop_request_ends_the_wait_for_a_stuck_actor(ray_session):
    # A first SIGTERM sets STOP_REQUESTED: the step ends without waiting out the slice's limit
    # (the checkpoint after it is saved within a scheduler's grace period), the slice failed but
    # not counted against the actor's restarts or the failed-steps streak.
    from posttrain.runtime import STOP_REQUESTED

    class Stuck(PerSampleEnvironment):
        def __init__(self, cfg):
            pass

        def step_one(self, messages, metadata):
            if messages[-1]["content"] == "hang":
                time.sleep(600)
            return StepResult("ok", 1.0, True, metadata)

    group = EnvironmentGroup("stuck", Stuck, EnvWorkerConfig(num_workers=2, step_timeout_s=300.0, max_restarts=0,
                                                             max_failed_steps=1))
    timer = threading.Timer(1.0, STOP_REQUESTED.set)
    try:
        start = time.monotonic()
        timer.start()
        ret = group.step([convo("ok"), convo("hang")], [{}] * 2)
        assert time.monotonic() - start < 10
        assert ret.rewards == [1.0, 0.0] and ret.terminateds == [True, True]
        assert ret.metadata[1]["env_error"] == ("environment 'stuck' actor 1 was still scoring when the run was told "
                                                "to stop")
        ret = group.step([convo("hang")], [{}])  # neither max_restarts=0 nor max_failed_steps=1 stops it
        assert ret.num_errors == 1
        # The shutdown waits for the actors' close() within one deadline (10 s each held the exit).
        start = time.monotonic()
        group.shutdown()
        assert time.monotonic() - start < 15
    finally:
        timer.cancel()
        STOP_REQUESTED.clear()
        group.shutdown()


@pytest.mark.slow
def test_stuck_and_crashing_actors_score_zero_and_are_restarted(ray_session):
    class Troubled(PerSampleEnvironment):
        def __init__(self, cfg):
            pass

        def step_one(self, messages, metadata):
            text = messages[-1]["content"]
            if text == "hang":
                time.sleep(600)
            if text == "crash":
                import os

                os._exit(1)
            if text == "boom":
                raise ValueError("bad verifier")
            return StepResult("ok", 1.0, True, metadata)

    cfg = EnvWorkerConfig(num_workers=2, step_timeout_s=5.0, max_restarts=2)
    group = EnvironmentGroup("troubled", Troubled, cfg)
    try:
        # slice 0 = samples 0-1 (hangs), slice 1 = samples 2-3 (one verifier error)
        start = time.monotonic()
        ret = group.step([convo("ok"), convo("hang"), convo("boom"), convo("ok")], [{}] * 4)
        assert time.monotonic() - start < 30
        assert ret.rewards == [0.0, 0.0, 0.0, 1.0] and ret.num_errors == 3
        assert "did not answer within 5 s" in ret.metadata[0]["env_error"]
        assert "bad verifier" in ret.metadata[2]["env_error"]
        # the killed actor was restarted: the next step works on both actors
        assert group.step([convo("ok"), convo("ok")], [{}] * 2).rewards == [1.0, 1.0]
        ret = group.step([convo("crash"), convo("ok")], [{}] * 2)
        assert ret.rewards == [0.0, 1.0] and ret.metadata[0]["env_error"].startswith(
            "environment 'troubled' actor 0 died during its step (its process exited: os._exit, a crash in native "
            "code, or out of memory): ")
        assert group.step([convo("ok"), convo("ok")], [{}] * 2).rewards == [1.0, 1.0]
        # actor 0 has failed twice (max_restarts=2): a third failure stops the run loudly
        with pytest.raises(RuntimeError, match="max_restarts=2"):
            group.step([convo("crash"), convo("ok")], [{}] * 2)
    finally:
        group.shutdown()


def test_an_environment_that_cannot_start_is_named_and_stopped(ray_session):
    class Broken(PerSampleEnvironment):
        def __init__(self, cfg):
            raise OSError("no verifier binary")

        def step_one(self, messages, metadata):
            return StepResult("ok", 1.0, True, metadata)

    with pytest.raises(RuntimeError) as raised:
        EnvironmentGroup("broken", Broken, EnvWorkerConfig(num_workers=2))
    # The constructor's own error and where it was raised, not Ray's traceback in colour codes.
    assert str(raised.value) == (f"environment 'broken' failed to start: OSError: no verifier binary "
                                 f"({__file__}:{Broken.__init__.__code__.co_firstlineno + 1}, in __init__)")
    # Not waiting (GRPO starts its environments beside the policy workers): the first step
    # raises the same error, and the actors are gone.
    group = EnvironmentGroup("broken", Broken, EnvWorkerConfig(num_workers=2), wait=False)
    with pytest.raises(RuntimeError, match="environment 'broken' failed to start: .*no verifier binary"):
        group.step([convo("ok")], [{}])
    assert group._actors == []


def test_non_finite_rewards_and_broken_returns_score_zero_and_are_named(ray_session):
    import numpy as np

    # One environment (one actor) whose `step` builds its return as the first sample's "mode" says,
    # the ways a user's own `step` may build it.
    class Sloppy(PerSampleEnvironment):
        def __init__(self, cfg):
            pass

        def step_one(self, messages, metadata):
            return StepResult("ok", float(messages[-1]["content"]), True, metadata)

        def step(self, message_logs, metadata):
            mode, n = metadata[0].get("mode"), len(message_logs)
            ended = [m[-1]["content"] == "end" for m in message_logs]
            if mode == "texts":  # a text observation (StepResult takes one; the rollout needs messages)
                return EnvironmentReturn(["try again"] * n, metadata, [None] * n, [0.0] * n, ended, [None] * n)
            if mode == "stops":  # the generation backend refused it at the next turn, stopping the run
                return EnvironmentReturn([{"role": "user", "content": "go on"}] * n, metadata,
                                         [None if e else "</a>" for e in ended], [0.0] * n, ended, [None] * n)
            ret = super().step(message_logs, metadata)
            change = {
                "short": {"rewards": ret.rewards[:-1]},  # one reward missing
                # NeMo RL's environments return tensors, and NumPy arrays are as good: read as lists.
                "tensors": {"rewards": torch.tensor(ret.rewards), "terminateds": torch.tensor(ret.terminateds)},
                "numpy": {"rewards": np.array(ret.rewards), "terminateds": np.array(ret.terminateds)},
                "strings": {"rewards": [str(r) for r in ret.rewards]},
                # A reward column [B, 1] and a metadata entry that is no dict passed the check, then
                # stopped the driver: concatenating the slices, reading the metadata.
                "column": {"rewards": torch.tensor(ret.rewards)[:, None]},
                "named": {"metadata": ["done"] * n},
                "going": {"terminateds": [False] * n},  # every conversation continues
            }.get(mode, {})
            return type(ret)(**{**ret.__dict__, **change})

    # max_failed_steps off: every sample of most steps below fails, one step after the other.
    group = EnvironmentGroup("sloppy", Sloppy, EnvWorkerConfig(num_workers=1, max_failed_steps=None))
    try:
        ret = group.step([convo("1"), convo("nan"), convo("inf"), convo("0.5")], [{}] * 4)
        assert ret.rewards == [1.0, 0.0, 0.0, 0.5] and ret.num_errors == 2
        assert ret.metadata[1]["env_error"] == "environment 'sloppy' returned reward nan"
        # A non-finite reward ends its conversation, as an error does (it went on, counted at each turn).
        assert group.step([convo("1"), convo("nan")], [{"mode": "going"}] * 2).terminateds == [False, True]
        for mode in ("tensors", "numpy"):
            ret = group.step([convo("1"), convo("nan"), convo("0.5")], [{"mode": mode}] * 3)
            assert ret.rewards == [1.0, 0.0, 0.5] and ret.terminateds == [True] * 3 and ret.num_errors == 1
            assert [type(r) for r in ret.rewards + ret.terminateds] == [float] * 3 + [bool] * 3
        for mode, answers, error in [
            ("short", ["1", "1"], "{'rewards': 1} entries for 2 samples"),
            ("strings", ["1", "1"], "rewards[0] = '1.0', not a float"),
            ("column", ["1", "1"], "rewards of shape [2, 1], not [2]"),
            ("named", ["1", "1"], "metadata[0] = 'done', not a dict"),
            ("texts", ["end", "more"],
             "observations[1] = 'try again', not a message {'role': ..., 'content': ...} or a list of them"),
            ("stops", ["more", "more"], "next_stop_strings[0] = '</a>', not None or a list of non-empty strings"),
        ]:
            ret = group.step([convo(a) for a in answers], [{"mode": mode}] * 2)
            assert ret.rewards == [0.0, 0.0] and ret.num_errors == 2, mode
            assert ret.metadata[0]["env_error"].startswith(f"environment 'sloppy' step returned {error}")
            if mode in ("texts", "stops"):  # conversations that end: no observation shown, no next turn to stop
                assert group.step([convo("end"), convo("end")], [{"mode": mode}] * 2).num_errors == 0
    finally:
        group.shutdown()


def test_a_raising_step_is_named_in_one_line_and_a_wrong_step_one_return_fails_its_sample(ray_session):
    class Raising(PerSampleEnvironment):
        def __init__(self, cfg):
            pass

        def step(self, message_logs, metadata):
            raise RuntimeError("reward service down")

        def step_one(self, messages, metadata):
            raise AssertionError("not called")

    group = EnvironmentGroup("raising", Raising, EnvWorkerConfig(num_workers=1))
    try:
        ret = group.step([convo("1")], [{}])
        # Not Ray's framing, traceback, pid and colour codes, which made every step's text differ.
        line = Raising.step.__code__.co_firstlineno + 1
        assert ret.metadata[0]["env_error"] == (f"environment 'raising' step failed: RuntimeError: reward service "
                                                f"down ({__file__}:{line}, in step)")
    finally:
        group.shutdown()

    class Forgetful(PerSampleEnvironment):  # a step_one without its return on one path
        def step_one(self, messages, metadata):
            if messages[-1]["content"] == "1":
                return StepResult("ok", 1.0, True, metadata)

    ret = Forgetful().step([convo("1"), convo("2")], [{}, {}])
    assert ret.rewards == [1.0, 0.0]
    assert ret.metadata[1]["env_error"] == "TypeError: step_one returned None, not a StepResult"


def test_a_step_one_return_that_breaks_the_contract_fails_its_sample_only():
    # Found in the slice's return, one sample's None observation for a conversation that goes on
    # (read as [], and named so) scored every sample of the slice 0; so did a message without
    # content, an empty stop string and metadata that is not a dict.
    from posttrain.environments.actors import _contract_violation

    wrong = {
        "none": StepResult(None, 1.0, False, {}),
        "empty": StepResult([], 1.0, False, {}),
        "no content": StepResult({"role": "user"}, 1.0, False, {}),
        "stops": StepResult("go on", 1.0, False, {}, next_stop_strings=[""]),
        "metadata": StepResult("", 1.0, True, ["done"]),
        "verdict": StepResult("", 1.0, True, {"env_correct": 0.5}),
    }

    class Strict(PerSampleEnvironment):
        def step_one(self, messages, metadata):
            return wrong.get(messages[-1]["content"], StepResult(None, 1.0, True, {"env_correct": True}))

    names = [*wrong, "ok"]
    ret = Strict().step([convo(n) for n in names], [{}] * len(names))
    assert _contract_violation(ret, len(names)) is None
    assert ret.rewards == [0.0] * len(wrong) + [1.0] and ret.metadata[-1] == {"env_correct": True}
    errors = [m["env_error"] for m in ret.metadata[:-1]]
    assert errors[0].startswith("TypeError: step_one returned observation None for a conversation that goes on")
    assert errors[1].startswith("TypeError: step_one returned observation [] for a conversation that goes on")
    assert errors[2].startswith("TypeError: step_one returned observation {'role': 'user'} for a conversation")
    assert errors[3] == "TypeError: step_one returned next_stop_strings [''], not None or a list of non-empty strings"
    assert errors[4] == "TypeError: step_one returned metadata = ['done'], not a dict"
    assert errors[5] == "TypeError: step_one returned metadata['env_correct'] = 0.5, not True, False or None"


def test_the_failed_step_streak_counts_scored_samples_not_continued_ones(ray_session):
    # A reward function that raises on every answer after a tool call: the tool turns succeed,
    # and ended the streak, so max_failed_steps never stopped a run that trained on nothing.
    class Tooled(PerSampleEnvironment):
        def __init__(self, cfg):
            pass

        def step_one(self, messages, metadata):
            if messages[-1]["content"] == "call":
                return StepResult("tool result", 0.0, False, metadata)
            raise ConnectionError("reward service down")

    group = EnvironmentGroup("tooled", Tooled, EnvWorkerConfig(num_workers=1, max_failed_steps=2))
    try:
        group.step([convo("call")], [{}])
        group.step([convo("answer")], [{}])  # 1
        group.step([convo("call")], [{}])  # goes on: still 1
        with pytest.raises(EnvironmentFailure, match=r"every sample failed in 2 steps in a row"):
            group.step([convo("answer")], [{}])
    finally:
        group.shutdown()


def test_environment_return_lists():
    ret = ArithmeticEnvironment(EnvWorkerConfig()).step([convo("1"), convo("2")], [{"answer": "1"}] * 2)
    assert ret.rewards == [1.0, 0.0] and ret.terminateds == [True, True]
    assert [type(v) for v in ret.rewards + ret.terminateds] == [float, float, bool, bool]


# --------------------------------------------------------------------------- code


def _code_env(**cfg):
    from posttrain.environments.code import CodeEnvironment

    return CodeEnvironment(EnvWorkerConfig(timeout_s=3.0, cfg=cfg))


def _answer(text):
    return [{"role": "user", "content": "Write add(a, b)."}, {"role": "assistant", "content": text}]


ADD_TESTS = ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 4"]


def test_code_extracts_the_last_python_block():
    from posttrain.environments.code import extract_program

    text = "First try:\n```python\nx = 1\n```\nBetter:\n```py\ndef f():\n    return 2\n```\nDone."
    assert extract_program(text) == "def f():\n    return 2\n"
    assert extract_program("```bash\nls\n```\ndef g(): pass") == "```bash\nls\n```\ndef g(): pass"
    assert extract_program("```python\ndef h():\n    return 3") == "def h():\n    return 3"  # cut off by the limit
    assert extract_program("def k(): return 4") == "def k(): return 4"


def test_code_rewards_passing_tests_all_or_fraction():
    right = "Here:\n```python\ndef add(a, b):\n    return a + b\n```"
    half = "```python\ndef add(a, b):\n    return a + b if a > 0 else 99\n```"  # passes tests 1 and 3
    env = _code_env()
    ret = env.step([_answer(right), _answer(half)], [{"tests": ADD_TESTS}, {"tests": ADD_TESTS}])
    assert ret.rewards == [1.0, 0.0] and ret.num_errors == 0
    assert ret.observations[0]["content"] == "Environment: 3/3 tests passed"
    assert ret.observations[1]["content"].startswith("Environment: 2/3 tests passed; test 2 (assert add(-1, 1) == 0) "
                                                     "failed: AssertionError")
    assert ret.metadata[1]["tests_passed"] == 2 and ret.answers[0] == "def add(a, b):\n    return a + b\n"
    ret = _code_env(reward="fraction").step([_answer(half)], [{"tests": ADD_TESTS, "setup": "import math"}])
    assert ret.rewards == [pytest.approx(2 / 3)]


def test_code_wrong_programs_score_0_without_stopping_or_counting_as_env_errors():
    cases = {
        "syntax": "def add(a, b) return a + b",
        "raises": "raise RuntimeError('boom')",
        "exits": "import os\nos._exit(3)",
        "memory": "x = bytearray(4 << 30)",  # over memory_mb
        "fakes a result": "print('{\"passed\": 3, \"error\": null}')\nimport sys\nsys.exit(0)",
    }
    env = _code_env(memory_mb=256)
    ret = env.step([_answer(c) for c in cases.values()], [{"tests": ADD_TESTS} for _ in cases])
    assert ret.rewards == [0.0] * len(cases) and ret.num_errors == 0
    obs = dict(zip(cases, (o["content"] for o in ret.observations)))
    assert "SyntaxError" in obs["syntax"] and "RuntimeError: boom" in obs["raises"]
    assert "ended the interpreter (exit status 3)" in obs["exits"] and "MemoryError" in obs["memory"]
    assert "0/3 tests passed; the program raised SystemExit" in obs["fakes a result"]


# Programs that made the old harness (program and tests in one interpreter) report passing tests
# without computing add: there each scored 1 with reward `all`, but the count raiser (7.5 with
# `fraction`) and the builtins patcher (0.25 with `fraction`, its `sorted` test, where 0 was due).
REWARD_HACKS = {
    "always-equal object": "class A:\n    __eq__ = lambda *a: True\ndef add(a, b): return A()",
    "str subclass equal to anything": "class S(str):\n    __eq__ = lambda *a: True\n    __hash__ = str.__hash__\n"
                                      "def add(a, b): return S()",
    "raises the harness's count": "import __main__\n__main__.passed = 30\ndef add(a, b): return 7",
    "empties the harness's tests": "import __main__\n__main__.passed = len(__main__.job['tests'])\n__main__.job['tests'].clear()",
    "writes the report with the harness's nonce": (
        "import __main__, os\nn = len(__main__.job['tests'])\n"
        "__main__.out.write(__main__.nonce + '{\"passed\": %d, \"error\": null}\\n' % n)\n__main__.out.flush()\nos._exit(0)"),
    "reads the expected value from the test's frame": (
        "import sys\ndef add(a, b):\n    test = sys._getframe(1).f_code\n"
        "    return [c for c in test.co_consts if type(c) is int][-1] if test.co_filename.startswith('<test') else None"),
    "a child writes the report after the harness's": (
        "import os, time, __main__\nn, k = __main__.nonce, len(__main__.job['tests'])\nif os.fork() == 0:\n"
        "    time.sleep(0.3)\n    os.write(3, (n + '{\"passed\": %d, \"error\": null}\\n' % k).encode())\n    os._exit(0)\n"
        "def add(a, b): return 7"),
    "patches the builtins the tests use": (
        "import builtins\nbuiltins.AssertionError = type('Quiet', (Exception,), {})\nbuiltins.sorted = lambda *a: 0\n"
        "def add(a, b): return 7"),
}


def test_code_programs_that_forge_passing_tests_score_0():
    tests = ADD_TESTS + ["assert sorted([add(2, 3)]) == sorted([5])"]
    for reward in ("all", "fraction"):
        ret = _code_env(reward=reward).step([_answer(p) for p in REWARD_HACKS.values()],
                                            [{"tests": tests} for _ in REWARD_HACKS])
        got = dict(zip(REWARD_HACKS, ret.rewards))
        assert got == dict.fromkeys(REWARD_HACKS, 0.0) and ret.num_errors == 0, (
            got, [o["content"] for o in ret.observations])
    obs = dict(zip(REWARD_HACKS, (o["content"] for o in ret.observations)))
    assert "TypeError: the program's A is not plain data" in obs["always-equal object"]


def test_code_tests_see_the_programs_plain_results_and_handles_to_its_objects():
    # What honest programs return besides plain values still works through the pipe: the
    # program's classes and instances, generators, closures, exceptions, namedtuples and Counters
    # (as tuple and dict), a HumanEval-style check(candidate), and a standard module it imported.
    program = """
import re
from collections import Counter, namedtuple
Point = namedtuple("Point", "x y")
class Pair:
    def __init__(self, a, b):
        self.a, self.b = a, b
    def __str__(self):
        return f"({self.a}, {self.b})"
def longest(pairs):
    return max(p.b - p.a for p in pairs)
def evens(n):
    yield from range(0, n, 2)
def adder(n):
    return lambda x: x + n
def div(a, b):
    if b == 0:
        raise ValueError("zero")
    return a / b
def stats(s):
    return Counter(s), Point(1, 2), {"k": (1, [2, {3}], frozenset({4}), b"5", 6j, None, float("inf"))}
def words(s):
    return re.findall(r"[a-z]+", s)
"""
    tests = ["assert longest([Pair(5, 24), Pair(15, 25)]) == 19 and str(Pair(1, 2)) == '(1, 2)'",
             "assert list(evens(5)) == [0, 2, 4] and sum(evens(7)) == 12",
             "assert adder(2)(3) == 5",
             "try:\n    div(1, 0)\n    assert False\nexcept ValueError as e:\n    assert 'zero' in str(e)",
             "assert stats('aab') == ({'a': 2, 'b': 1}, (1, 2), {'k': (1, [2, {3}], frozenset({4}), b'5', 6j, None, "
             "float('inf'))})",
             "assert re.sub('a', 'b', ' '.join(words('a1a'))) == 'b b'",
             "def check(candidate):\n    assert candidate(1.0, 4.0) == 0.25\ncheck(div)",
             "assert Pair(1, 2)"]  # no truth value for the program's object: the one failing test
    ret = _code_env(reward="fraction").step([_answer(program)], [{"tests": tests}])
    assert ret.rewards == [pytest.approx(7 / 8)], ret.observations[0]["content"]
    assert ret.observations[0]["content"].endswith("test 8 (assert Pair(1, 2)) failed: TypeError: the program's Pair is "
                                                   "not plain data: a test cannot compare it or take its truth")


def test_code_large_top_level_tables_stay_in_the_program():
    # Every top-level name was copied to the tests as JSON: a 10^7-item table took 5 s of the
    # time limit. One of more than 100,000 items stays a handle the tests can index and measure.
    program = "SQUARES = [i * i for i in range(10**7)]\nSMALL = list(range(5))\ndef sq(i):\n    return SQUARES[i]\n"
    tests = ["assert sq(12) == 144", "assert SQUARES[3] == 9 and len(SQUARES) == 10**7", "assert SMALL == [0, 1, 2, 3, 4]",
             "assert SQUARES == []"]
    env = _code_env(reward="fraction", memory_mb=2048)
    env.timeout_s = 4.0  # under the 5 s the copy took; 2 s timed out on a CPU shared with other jobs
    ret = env.step([_answer(program)], [{"tests": tests}])
    assert ret.rewards == [0.75], ret.observations[0]["content"]
    assert "the program's list of 10000000 items (not copied to the tests) is not plain data" in \
        ret.observations[0]["content"]


def test_code_parent_reads_a_bounded_report_in_time():
    # The program can reach the parent's end of the report pipe through /proc (its user's, or
    # root's): the old parent read all of it (1.5 GB sent cost the actor 4.5 GB and 12 s), and
    # waited past timeout_s for the end of it. Now it stops at 64 KiB, or at the deadline.
    import subprocess
    import sys

    from posttrain.environments.code import _exchange

    flood = "import sys\nsys.stdin.read()\nsys.stdout.buffer.write(b'x' * (40 << 20))"
    hold = "import sys, time\nsys.stdin.read()\ntime.sleep(30)"
    for source, wanted in ((flood, "more than 65536 bytes came back instead of the tests' report"),
                           (hold, "timed out after 1 s")):
        with subprocess.Popen([sys.executable, "-c", source], stdin=subprocess.PIPE, stdout=subprocess.PIPE) as proc:
            start = time.monotonic()
            out, failure = _exchange(proc, b"job" * 100_000, 1.0)
            proc.kill()
        assert failure == wanted and len(out) <= (64 << 10) + (1 << 16) and time.monotonic() - start < 1.5


def test_code_hang_is_killed_with_what_it_started(tmp_path):
    marker = tmp_path / "child_alive"
    child = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    program = f"import subprocess, sys\nsubprocess.Popen([sys.executable, '-c', {child!r}])\nwhile True: pass"
    env = _code_env()
    env.timeout_s = 1.0
    start = time.monotonic()
    ret = env.step([_answer(program)], [{"tests": ADD_TESTS}])
    assert ret.rewards == [0.0] and "timed out after 1 s" in ret.observations[0]["content"]
    assert time.monotonic() - start < 2.5
    time.sleep(3.5)
    assert not marker.exists()  # the grandchild died with the program's process group


def test_code_hang_that_left_the_process_group_is_killed_too(tmp_path):
    # os.setsid() needs no privilege or fork: the program's interpreter left the group the kill
    # reached and slept on (no CPU limit fires in a sleep).
    pid_file = tmp_path / "pid"
    program = f"import os, time\nos.setsid()\nopen({str(pid_file)!r}, 'w').write(str(os.getpid()))\ntime.sleep(60)"
    env = _code_env()
    env.timeout_s = 1.0
    ret = env.step([_answer(program)], [{"tests": ADD_TESTS}])
    assert "timed out after 1 s" in ret.observations[0]["content"]
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid)


def test_code_a_passing_program_leaves_no_process_behind(tmp_path):
    # A child of a program that left the group (os.setsid(); forking needs root, where
    # RLIMIT_NPROC does not apply) outlived the program's interpreter, which the tests' side
    # killed before the parent could find what was under it.
    pid_file = tmp_path / "pid"
    program = (f"import os, time\nos.setsid()\ntry:\n    child = os.fork()\nexcept OSError:\n    child = os.getpid()\n"
               f"if child == 0:\n    time.sleep(60)\n    os._exit(0)\nopen({str(pid_file)!r}, 'w').write(str(child))\n"
               "def add(a, b):\n    return a + b\n")
    ret = _code_env().step([_answer(program)], [{"tests": ADD_TESTS}])
    assert ret.rewards == [1.0], ret.observations
    pid = int(pid_file.read_text())
    deadline = time.monotonic() + 5
    while _running(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(pid)


def _running(pid: int) -> bool:
    """Alive and not a zombie waiting for its reaper."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_code_row_without_tests_is_an_env_error():
    ret = _code_env().step([_answer("def add(a, b): return a + b")], [{}])
    assert ret.rewards == [0.0] and ret.num_errors == 1
    assert "has no 'tests'" in ret.metadata[0]["env_error"]


def test_code_setup_is_a_string_or_a_list_of_lines():
    program = _answer("def root(x):\n    return sqrt(x)")
    tests = ["assert root(9) == 3"]
    ret = _code_env().step([program] * 3, [{"tests": tests, "setup": "from math import sqrt"},
                                           {"tests": tests, "setup": ["import math", "from math import sqrt"]},
                                           {"tests": tests, "setup": {"imports": "math"}}])
    assert ret.rewards == [1.0, 1.0, 0.0] and ret.num_errors == 1
    assert ret.metadata[2]["env_error"] == ("ValueError: code: the sample's metadata 'setup' is a dict, not Python "
                                            "code (a string, or a list of lines)")


def test_code_env_runs_programs_inside_a_ray_actor(ray_session):
    group = create_env("code", {"num_workers": 2, "cfg": {"parallel_runs": 2}})
    try:
        right, wrong = "def add(a, b):\n    return a + b", "def add(a, b):\n    return a - b"
        ret = group.step([_answer(p) for p in (right, wrong, wrong, right)], [{"tests": ADD_TESTS}] * 4)
        assert ret.rewards == [1.0, 0.0, 0.0, 1.0] and ret.num_errors == 0
    finally:
        group.shutdown()


def test_code_a_passing_program_scores_1_whatever_it_leaves_behind_or_the_row_calls_its_fields(tmp_path, monkeypatch):
    # A tree 1,200 folders deep broke the folder's cleanup (RecursionError): a passing program was
    # an environment error, and its folder stayed. A row's own `score` (metadata from the data)
    # was taken for the last attempt's: a passing program scored 0.3.
    import tempfile

    from posttrain.environments.code import CodeEnvironment

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    env = CodeEnvironment(EnvWorkerConfig(timeout_s=30.0))  # 1,200 mkdirs in time on a loaded machine too
    deep = "import os\nfor i in range(1200):\n    os.mkdir('d'); os.chdir('d')\ndef add(a, b):\n    return a + b"
    ret = env.step([_answer(deep)], [{"tests": ADD_TESTS}])
    assert ret.rewards == [1.0] and ret.num_errors == 0
    assert not list(tmp_path.glob("posttrain-code-*"))
    ret = env.step([_answer("def add(a, b):\n    return a + b")], [{"tests": ADD_TESTS, "score": 0.7, "attempt": "x"}])
    assert ret.rewards == [1.0] and ret.num_errors == 0


def test_code_failing_attempt_comes_back_until_max_attempts():
    env = _code_env(max_attempts=2)
    wrong, right = "def add(a, b):\n    return a - b", "def add(a, b):\n    return a + b"
    first = env.step([_answer(wrong), _answer(right)], [{"tests": ADD_TESTS}, {"tests": ADD_TESTS}])
    assert first.terminateds == [False, True] and first.rewards == [0.0, 1.0]
    assert first.observations[0]["content"].endswith("Fix the program and answer with all of it again.")
    again = _answer(wrong) + [{"role": "user", "content": first.observations[0]["content"]},
                              {"role": "assistant", "content": right}]
    second = env.step([again, _answer(wrong) + again[2:3] + [{"role": "assistant", "content": wrong}]],
                      [first.metadata[0], first.metadata[0]])
    assert second.terminateds == [True, True] and second.rewards == [1.0, 0.0]
    assert [m["code_attempt"] for m in second.metadata] == [2, 2]


def test_code_turn_rewards_add_up_to_the_last_attempts_score_wherever_the_conversation_ends():
    # reward=fraction, 3 attempts allowed: a conversation may end after any turn (the rollout's
    # turns, or an observation that no longer fits the context), so each turn scores the change:
    # a half-right first attempt's fraction was lost when the context ended the conversation.
    env = _code_env(max_attempts=3, reward="fraction")
    half = "def add(a, b):\n    return a + b if a < 2 else 0"  # add(2, 2) fails
    worse, right = "def add(a, b):\n    return None", "def add(a, b):\n    return a + b"
    first = env.step([_answer(half)], [{"tests": ADD_TESTS}])
    assert first.terminateds == [False] and first.rewards == [pytest.approx(2 / 3)]
    totals = []
    for program in (worse, right):
        convo = _answer(half) + [{"role": "user", "content": first.observations[0]["content"]},
                                 {"role": "assistant", "content": program}]
        second = env.step([convo], [first.metadata[0]])
        totals.append(first.rewards[0] + second.rewards[0])
        assert second.metadata[0]["code_attempt"] == 2
    assert totals == [pytest.approx(0.0, abs=1e-6), pytest.approx(1.0)]  # the last attempt's score: 0/3, 3/3


def test_code_format_rows_are_solved_by_their_references_and_not_by_a_wrong_program():
    # The example tasks (MBPP's layout) and a HumanEval row, through the data loader's format
    # detection into the code environment: each reference solution (the row's `answer`) passes
    # all its tests, and the same program with its return value broken does not.
    import json
    from pathlib import Path

    from posttrain.data.datasets import load_rows
    from posttrain.data.formats import detect_format, normalize_row
    from posttrain.schemas import DataConfig

    path = Path(__file__).resolve().parents[2] / "examples" / "data" / "code_tasks.jsonl"
    rows = load_rows(DataConfig(dataset_name="local", train_data_path=str(path), val_data_path=str(path)), "train")
    assert len(rows) == 20 and {r["task_name"] for r in rows} == {"code"}
    assert rows[0]["messages"][0]["content"].endswith("Your code should pass these tests:\n" +
                                                      "\n".join(json.loads(path.read_text().splitlines()[0])["test_list"]))
    humaneval = {"task_id": "HumanEval/2", "entry_point": "truncate_number",
                 "prompt": "import math\n\n\ndef truncate_number(number: float) -> float:\n    \"\"\"Decimal part.\"\"\"\n",
                 "canonical_solution": "    return number - math.floor(number)\n",
                 "test": "def check(candidate):\n    assert candidate(3.5) == 0.5\n    assert candidate(1.25) == 0.25\n"}
    rows.append(normalize_row(humaneval, detect_format(humaneval), "he row 1"))
    assert rows[-1]["metadata"]["setup"] == "import math"
    right = [r["messages"] + [{"role": "assistant", "content": r["answer"]}] for r in rows]
    wrong = [r["messages"] + [{"role": "assistant", "content": r["answer"].replace("return ", "return None and ")}]
             for r in rows]
    env = _code_env(parallel_runs=2)
    metadata = [r["metadata"] for r in rows]
    ret = env.step(right, metadata)
    assert ret.rewards == [1.0] * 21 and ret.num_errors == 0, [o["content"] for o in ret.observations]
    assert env.step(wrong, metadata).rewards == [0.0] * 21


def test_reward_model_scores_padded_rows_as_each_alone(tiny_model_path, tmp_path):
    # An RM whose config pads with another id than its tokenizer (exported by an older posttrain
    # for a tokenizer without a pad token, or from elsewhere): batched rows are still scored at
    # their own last token, not at the padding after them.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain.environments.reward_model import RewardModelEnvironment

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    model.config.pad_token_id = tokenizer.eos_token_id
    assert tokenizer.pad_token_id not in (None, model.config.pad_token_id)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    env = RewardModelEnvironment(EnvWorkerConfig(cfg={"model_name": str(tmp_path), "add_eos": False}))
    convs = [[{"role": "user", "content": "1+1="}, {"role": "assistant", "content": answer}]
             for answer in ("2", "two, as one and one make two")]
    together = torch.tensor(env.step(convs, [{}, {}]).rewards)
    alone = torch.tensor([r for c in convs for r in env.step([c], [{}]).rewards])
    torch.testing.assert_close(together, alone, atol=1e-5, rtol=1e-5)


def test_reward_model_scores_0_for_a_conversation_past_its_positions(tiny_model_path, tmp_path):
    # env max_length (4096 by default) above the RM's max_position_embeddings: a longer
    # conversation is that sample's error, not scored past the positions the RM knows.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain.environments.reward_model import RewardModelEnvironment

    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1)
    model.config.max_position_embeddings = 16
    model.save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path)
    env = RewardModelEnvironment(EnvWorkerConfig(cfg={"model_name": str(tmp_path)}))
    convs = [[{"role": "user", "content": "1+1="}, {"role": "assistant", "content": answer}]
             for answer in ("2", "two, as one and one make two")]
    out = env.step(convs, [{}, {}])
    assert "env_error" not in out.metadata[0] and out.rewards[0] != 0
    assert out.rewards[1] == 0 and re.search(r"the conversation has \d+ tokens, more than the reward model's "
                                             r"max_position_embeddings=16", out.metadata[1]["env_error"])


def test_reward_model_scores_the_answer_its_template_shows_without_the_reasoning(tiny_model_path, tmp_path):
    # A reward model whose template drops <think> reasoning (DeepSeek-R1's) scores a policy's
    # answer as that template shows it: training rows refuse such a template, the RM's reading must not.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain.environments.reward_model import RewardModelEnvironment

    AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path)
    strip = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' + m['content'].split('</think>')[-1] + '<|end|>' }}"
             "{% endfor %}")
    env = RewardModelEnvironment(EnvWorkerConfig(cfg={"model_name": str(tmp_path), "chat_template": strip}))
    convs = [[{"role": "user", "content": "1+1="}, {"role": "assistant", "content": answer}]
             for answer in ("<think>one and one</think>2", "2")]
    out = env.step(convs, [{}, {}])
    assert out.metadata == [{}, {}]
    assert out.rewards[0] == out.rewards[1]



@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_reward_model_scores_a_multi_turn_conversation_as_rm_training_tokenized_it(tiny_model_path, tmp_path,
                                                                                   qwen3_template, add_generation_prompt):
    # Qwen3's template renders an earlier assistant turn differently once a user turn follows. The
    # conversation was tokenized with every assistant turn as a response, which such a template splits
    # into examples: every multi-turn conversation scored 0 with an env error. It is now the tokens
    # `posttrain rm` trained on for that prompt and answer, and scores as they do.
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from posttrain.data.processors import process_preference_rows, render_chat
    from posttrain.environments.reward_model import RewardModelEnvironment
    from posttrain.schemas import DataConfig

    torch.manual_seed(0)
    AutoModelForSequenceClassification.from_pretrained(tiny_model_path, num_labels=1).save_pretrained(tmp_path)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(tmp_path)
    env = RewardModelEnvironment(EnvWorkerConfig(cfg={"model_name": str(tmp_path), "chat_template": qwen3_template,
                                                      "add_generation_prompt": add_generation_prompt}))
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1+1?"},
             {"role": "assistant", "content": "<think>\nadd one\n</think>\n\n2"},
             {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nadd two\n</think>4"}]
    out = env.step([convo, convo[:3]], [{}, {}])
    assert out.metadata == [{}, {}]
    pair = {"prompt_messages": convo[:4], "chosen": convo[4:], "rejected": [{"role": "assistant", "content": "5"}]}
    ((trained, _),), _ = process_preference_rows([pair], env.tokenizer, DataConfig(
        add_generation_prompt=add_generation_prompt), max_len=4096)
    tok = env.tokenizer  # the conversation as the template renders it in one piece, with BOS and EOS
    whole = render_chat(tok, convo, add_generation_prompt=False)
    assert tok.decode(trained["input_ids"]) == tok.bos_token + whole + tok.eos_token
    # Scored alone rather than beside a padded shorter row: equal up to the kernels' rounding,
    # which differs between CPUs (bitwise on a Xeon, 1 ulp apart on an EPYC).
    alone = env.score([trained["input_ids"]])[0]
    assert abs(out.rewards[0] - alone) < 1e-6 < abs(out.rewards[0] - out.rewards[1])


def test_reward_model_refuses_a_model_without_a_trained_score_head(tiny_model_path):
    # A causal LM folder loads as a sequence classifier with a random score head (transformers
    # only logs it): rewards would be noise, different on every load.
    from posttrain.config import InputError
    from posttrain.environments.reward_model import RewardModelEnvironment

    with pytest.raises(InputError, match=r"env.reward_model.cfg.model_name=.*: .* has no weights for score.weight of "
                                         r"LlamaForSequenceClassification \(a reward model's folder holds no LM head, "
                                         r"a causal LM's no trained score head\)"):
        RewardModelEnvironment(EnvWorkerConfig(cfg={"model_name": str(tiny_model_path)}))


@pytest.mark.parametrize("mode", ["all", "fraction"])
def test_code_verdict_is_whether_every_test_of_the_last_attempt_passes(mode):
    # Over a multi-turn conversation: a half-right attempt is wrong in both reward modes (with
    # `fraction` it earns 2/3), and the verdict follows the last attempt, right or worse.
    from posttrain.environments.interfaces import verdict

    env = _code_env(max_attempts=3, reward=mode)
    half = "def add(a, b):\n    return a + b if a < 2 else 0"
    first = env.step([_answer(half)], [{"tests": ADD_TESTS}])
    assert first.rewards[0] == pytest.approx(2 / 3 if mode == "fraction" else 0.0)
    assert verdict(first.metadata[0]) is False
    verdicts = []
    for program in ("def add(a, b):\n    return a + b", "def add(a, b):\n    return None"):
        convo = _answer(half) + [{"role": "user", "content": first.observations[0]["content"]},
                                 {"role": "assistant", "content": program}]
        verdicts.append(verdict(env.step([convo], [first.metadata[0]]).metadata[0]))
    assert verdicts == [True, False]


def test_math_arithmetic_and_puzzle_verdicts():
    from posttrain.environments.interfaces import verdict
    from posttrain.environments.sliding_puzzle import play

    math_env = MathEnvironment(EnvWorkerConfig())
    ret = math_env.step([_answer("\\boxed{4}"), _answer("5")], [{"answer": "4"}, {"answer": "4"}])
    assert [verdict(m) for m in ret.metadata] == [True, False]
    math_env.close()
    ret = ArithmeticEnvironment(EnvWorkerConfig()).step([_answer("46"), _answer("47")], [{"answer": "46"}] * 2)
    assert [verdict(m) for m in ret.metadata] == [True, False]
    cfg = SlidingPuzzleEnvConfig(size=2)
    one_move = [[1, 2], [0, 3]]  # "right" solves it
    assert verdict(play(one_move, 0, "right", cfg, {}).metadata) is True
    assert verdict(play(one_move, 0, "up", cfg, {}).metadata) is False  # a valid move that does not solve
    assert verdict(play(one_move, 0, None, cfg, {}).metadata) is False  # unreadable


def test_a_verdict_that_is_not_a_bool_fails_the_slice_naming_it():
    from posttrain.environments.actors import _contract_violation

    def ret(value):
        return EnvironmentReturn(observations=[{"role": "environment", "content": ""}], metadata=[{CORRECT_KEY: value}],
                                 next_stop_strings=[None], rewards=[1.0], terminateds=[True],
                                 answers=[None])

    assert "['env_correct'] = 0.5, not True, False or None" in _contract_violation(ret(0.5), 1)
    for ok in (True, False, None, torch.tensor(True)):
        assert _contract_violation(ret(ok), 1) is None


def test_code_numpy_scalars_reach_the_tests_as_their_values():
    # np.sum gives an np.int64, no int subclass (np.float64 is a float's): it came back as a
    # handle, and `== 6` raised, so a right program that used NumPy scored 0 (np.bool_ too).
    pytest.importorskip("numpy")
    program = ("import numpy as np\ndef total(a):\n    return np.array(a).sum()\n"
               "def doubled(a):\n    return np.array(a) * 2\ndef positive(x):\n    return np.float32(x) > 0\n")
    tests = ["assert total([1, 2, 3]) == 6 and isinstance(total([1]), int)",
             "assert list(doubled([1, 2])) == [2, 4]",
             "assert positive(1.5) is True",
             "assert doubled([1]) == [2]"]  # an array stays the program's: no truth value, as in NumPy itself
    ret = _code_env(reward="fraction").step([_answer(program)], [{"tests": tests}])
    assert ret.rewards == [pytest.approx(3 / 4)], ret.observations[0]["content"]
    assert ret.observations[0]["content"].endswith("test 4 (assert doubled([1]) == [2]) failed: TypeError: the "
                                                   "program's ndarray is not plain data: a test cannot compare it or "
                                                   "take its truth")
