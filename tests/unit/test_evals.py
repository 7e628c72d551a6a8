"""pass@k and cons@k against hand-computed cases and a brute-force enumeration."""

import itertools
import json
import re
from math import comb

import pytest

from posttrain.evals import aggregate, cons_at_k, majority_answer, pass_at_k


@pytest.mark.parametrize(
    "n,c,k,expected",
    [
        (5, 0, 1, 0.0),
        (5, 0, 5, 0.0),
        (5, 5, 3, 1.0),
        (5, 2, 1, 0.4),  # pass@1 = c / n
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 5, 1 - 21 / 252),  # 1 - C(7,5)/C(10,5)
        (4, 1, 4, 1.0),  # n - c < k: every draw of 4 contains the correct one
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
    ],
)
def test_pass_at_k_hand_computed(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


@pytest.mark.parametrize("n", [1, 2, 5, 7])
def test_pass_at_k_equals_enumeration_over_subsets(n):
    """The estimator is the fraction of size-k subsets of the n samples that hold a correct one."""
    for c in range(n + 1):
        samples = [1] * c + [0] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(samples, k))
            frac = sum(any(s) for s in subsets) / len(subsets)
            assert len(subsets) == comb(n, k)
            assert pass_at_k(n, c, k) == pytest.approx(frac, abs=1e-12)


def test_pass_at_k_large_n_is_stable():
    # C(1000, 500) overflows a float; the product form does not.
    v = pass_at_k(1000, 1, 500)
    assert v == pytest.approx(0.5, abs=1e-12)


@pytest.mark.parametrize("n,c,k", [(0, 0, 1), (3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)])
def test_pass_at_k_rejects_bad_arguments(n, c, k):
    with pytest.raises(ValueError, match="pass_at_k"):
        pass_at_k(n, c, k)


def test_cons_at_k_majority_vote_and_ties():
    answers = ["3", "5", "5", "3", "3"]
    correct = [True, False, False, True, True]
    assert cons_at_k(answers, correct, 1) == 1.0  # "3"
    assert cons_at_k(answers, correct, 2) == 1.0  # tie 3/5 -> first seen, "3"
    assert cons_at_k(answers, correct, 3) == 0.0  # "5" x2 beats "3" x1
    assert cons_at_k(answers, correct, 4) == 1.0  # tie 2/2 -> "3"
    assert cons_at_k(answers, correct, 5) == 1.0  # "3" x3


def test_cons_at_k_ignores_missing_answers_and_whitespace():
    answers = [None, "", " 7", "8", "7 "]
    correct = [0.0, 0.0, 1.0, 0.0, 1.0]
    assert cons_at_k(answers, correct, 2) == 0.0  # nobody voted
    assert cons_at_k(answers, correct, 3) == 1.0
    assert cons_at_k(answers, correct, 4) == 1.0  # tie 7/8 -> 7 seen first
    assert majority_answer(answers) == "7"
    assert majority_answer([None, None]) is None


def test_cons_at_k_counts_correct_answers_as_one_whatever_their_notation():
    # Three right answers in three notations against two equal wrong ones: a text vote gave
    # "0.4" (2 votes) the win over "0.5", "1/2" and "\\frac{1}{2}" (1 each).
    answers = ["0.4", "0.5", "1/2", "0.4", "\\frac{1}{2}"]
    correct = [False, True, True, False, True]
    assert cons_at_k(answers, correct, 1) == 0.0
    assert cons_at_k(answers, correct, 3) == 1.0  # right 2, "0.4" 1
    assert cons_at_k(answers, correct, 4) == 0.0  # tie 2/2 -> "0.4", seen first
    assert cons_at_k(answers, correct, 5) == 1.0  # right 3, "0.4" 2
    # Wrong answers still vote by their text; a correct sample without an answer casts no vote.
    assert cons_at_k(["7", "8", "9", "9 "], [False, False, True, True], 4) == 1.0
    assert cons_at_k(["7", "7", None, "9"], [False, False, True, True], 4) == 0.0
    # No answer at all (a model that never writes a number, an environment that extracts none): 0.
    assert aggregate([[None, None], [None, None]], [[False, True], [False, False]])["cons@2"] == 0.0
    assert aggregate([[None, "3"], [None, None]], [[False, True], [False, False]])["cons@2"] == 0.5


def test_cons_at_k_rejects_bad_arguments():
    with pytest.raises(ValueError, match="answers"):
        cons_at_k(["1"], [True, False], 1)
    with pytest.raises(ValueError, match="k="):
        cons_at_k(["1"], [True], 2)


def test_aggregate_two_prompts():
    answers = [["4", "5"], ["1", "1"]]
    correct = [[1.0, 0.0], [0.0, 0.0]]
    m = aggregate(answers, correct)
    assert m["pass@1"] == pytest.approx(0.25)
    assert m["pass@2"] == pytest.approx(0.5)
    assert m["cons@1"] == pytest.approx(0.5)
    assert m["cons@2"] == pytest.approx(0.5)  # prompt 1: tie -> "4" (correct); prompt 2: "1" wrong
    assert m["accuracy"] == pytest.approx(0.25)
    assert (m["num_prompts"], m["num_samples"]) == (2, 4)


def test_aggregate_rejects_ragged_samples():
    with pytest.raises(ValueError, match="same number"):
        aggregate([["1"], ["1", "2"]], [[1.0], [1.0, 0.0]])
    with pytest.raises(ValueError, match="no prompts"):
        aggregate([], [])


def test_samples_without_a_verdict_are_left_out():
    # Prompt 1: judged True, unjudged, judged False; prompt 2: nothing judged (a reward model's).
    answers = [["1", "1", "2"], ["3", "3", "3"]]
    m = aggregate(answers, [[True, None, False], [None, None, None]])
    assert m["accuracy"] == 0.5 and m["num_judged"] == 2 and m["num_samples"] == 6
    assert m["pass@1"] == 0.5 and m["pass@2"] == 1.0 and m["pass@3"] is None  # prompt 1 has 2 judged samples
    assert m["cons@1"] == 1.0 and m["cons@2"] == 1.0 and m["cons@3"] is None  # "1" vs "2": tie, "1" first
    nothing = aggregate([["3"]], [[None]])
    assert nothing["accuracy"] is None and nothing["pass@1"] is None and nothing["num_judged"] == 0


def test_a_partial_reward_is_refused_as_a_verdict():
    # Rewards passed as correctness flags counted partial credit as correct; 1 and 0 are verdicts.
    for bad in (0.5, 0.2, -1.0, "yes"):
        with pytest.raises(TypeError, match="a reward is no verdict"):
            aggregate([["1"]], [[bad]])
        with pytest.raises(TypeError, match="a reward is no verdict"):
            cons_at_k(["1"], [bad], 1)
    assert aggregate([["1"], ["2"]], [[1.0], [0]])["accuracy"] == 0.5
    # NumPy and torch bools are verdicts, as an environment's may be (np.all gives one).
    import numpy as np
    import torch

    assert aggregate([["1", "2"], ["3", "4"]], [[np.True_, np.False_], [torch.tensor(True), None]])["accuracy"] == 2 / 3


def test_sample_counts_of_environments_with_and_without_tools():
    # Only the tool environment's samples count calls: summing r["tool_calls"] over all raised a
    # KeyError after every sample was generated, and no results were written.
    from posttrain.algorithms.eval import sample_counts

    def record(correct, tool_calls=None, env_error=None):
        r = {"correct": correct, "truncated": False, "prompt_truncated": False, "extracted_answer": "1",
             "env_error": env_error, "reward": float(bool(correct)), "response_tokens": 4}
        return r if tool_calls is None else {**r, "tool_calls": tool_calls}

    counts = sample_counts([record(True, 2), record(False, 1), record(True), record(None, env_error="ValueError: x")])
    assert counts["mean_tool_calls"] == 3 / 4 and counts["num_correct"] == 2 and counts["mean_reward"] == 0.5
    assert counts["num_env_errors"] == 1  # the error's text counts once
    assert "mean_tool_calls" not in sample_counts([record(True)])


def test_tool_call_ids_are_unique_even_when_the_model_repeats_one():
    from posttrain.environments.tool_calls import ToolCall, tool_call_ids

    calls = [ToolCall("add", {"a": 1}, id="abcdefghi"), ToolCall("add", {"a": 2}, id="abcdefghi")]
    ids = tool_call_ids(calls, seed="0")
    assert ids[0] == "abcdefghi" and ids[1] != "abcdefghi" and len(ids[1]) == 9


def test_eval_on_preference_pairs_names_the_datas_kind(tmp_path):
    # It named a held-out row ("row 107") and told to set data.format, which no format would mend.
    from posttrain.algorithms.eval import load_eval_rows
    from posttrain.config import InputError, load_config

    path = tmp_path / "pairs.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": f"q{i}", "chosen": "good", "rejected": "bad"}) for i in range(3)))
    cfg = load_config("eval", None, [f"data.dataset_name={path}"])
    with pytest.raises(InputError, match=re.escape(
            f"eval: {str(path)!r} holds preference pairs (`chosen`/`rejected`; first: {path} row 1), which DPO and "
            "RM train on; evaluation needs prompts with reference answers")):
        load_eval_rows(cfg)


def test_eval_scores_every_row_of_a_folder_without_a_split_for_validation(tmp_path):
    # It scored the 5% a training run holds out (2 of 40 rows), without a word, whatever eval.split.
    from posttrain.algorithms.eval import load_eval_rows
    from posttrain.config import InputError, load_config

    rows = [{"question": f"{i}+1=", "answer": str(i + 1)} for i in range(40)]
    (tmp_path / "plain").mkdir()
    for name, part in (("a.jsonl", rows[:25]), ("b.jsonl", rows[25:])):
        (tmp_path / "plain" / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    for split in ("val", "train"):
        cfg = load_config("eval", None, [f"data.dataset_name={tmp_path / 'plain'}", f"eval.split={split}"])
        assert sorted(r["answer"] for r in load_eval_rows(cfg)) == sorted(str(i + 1) for i in range(40))
    # A folder with files named for its splits: eval.split picks one, as for a training run.
    (tmp_path / "split").mkdir()
    (tmp_path / "split" / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:30]))
    (tmp_path / "split" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[30:]))
    cfg = load_config("eval", None, [f"data.dataset_name={tmp_path / 'split'}"])
    assert [r["answer"] for r in load_eval_rows(cfg)] == [str(i + 1) for i in range(30, 40)]
    cfg = load_config("eval", None, [f"data.dataset_name={tmp_path / 'split'}", "eval.split=train"])
    assert len(load_eval_rows(cfg)) == 30
    # A validation file beside a folder: the folder's file names give its splits.
    cfg = load_config("eval", None, [f"data.dataset_name={tmp_path / 'plain'}",
                                     f"data.val_data_path={tmp_path / 'split' / 'test.jsonl'}"])
    with pytest.raises(InputError, match="reads no data files \\(a folder: its files' names give its splits, "
                                         "e.g. train.jsonl and test.jsonl\\)"):
        load_eval_rows(cfg)
