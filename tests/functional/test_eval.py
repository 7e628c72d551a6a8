"""`posttrain eval` end to end: real data, real models, the real math and arithmetic
environments, on Ray. stories260K cannot do arithmetic, so GSM8K accuracy is ~0: the test
checks the files, the counts, the metric ranges and that the reported metrics follow from the
per-sample records."""

import json
import os
from pathlib import Path

import pytest
import yaml

from posttrain.config import load_config
from posttrain.evals import pass_at_k

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs" / "evals"


def _read(save_dir: Path):
    results = json.loads((save_dir / "results.json").read_text())
    samples = [json.loads(line) for line in (save_dir / "samples.jsonl").read_text().splitlines()]
    return results, samples


def _check_consistent(results, samples, num_prompts, n):
    assert results["num_prompts"] == num_prompts and results["num_samples"] == num_prompts * n == len(samples)
    assert [(s["prompt_index"], s["sample_index"]) for s in samples] == [
        (p, j) for p in range(num_prompts) for j in range(n)
    ]
    for k in range(1, n + 1):
        for name in (f"pass@{k}", f"cons@{k}"):
            assert 0.0 <= results[name] <= 1.0
        per_prompt = [sum(s["correct"] for s in samples[p * n:(p + 1) * n]) for p in range(num_prompts)]
        expected = sum(pass_at_k(n, c, k) for c in per_prompt) / num_prompts
        assert results[f"pass@{k}"] == pytest.approx(expected)
    assert results["num_correct"] == sum(s["correct"] for s in samples)
    assert results["accuracy"] == pytest.approx(results["num_correct"] / len(samples))
    assert results["num_truncated"] == sum(s["truncated"] for s in samples)
    # The environment's verdict, not reward > 0: these environments give full credit (1) exactly
    # to a correct sample, and partial credit (a story's one mention of three) to a wrong one.
    assert all(s["correct"] is (s["reward"] == 1.0) for s in samples)
    assert results["num_judged"] == len(samples)
    assert results["num_env_errors"] == 0
    assert results["generated_tokens"] == sum(s["response_tokens"] for s in samples) > 0


def test_eval_gsm8k_20_problems_with_stories260k(ray_session, shared_data, stories260k, tmp_path):
    from posttrain.algorithms.eval import run

    save = tmp_path / "gsm8k"
    cfg = load_config("eval", CONFIGS / "gsm8k.yaml", [
        f"policy.model_name={stories260k}", "policy.generation.backend=torch", "policy.precision=float32",
        "policy.max_total_sequence_length=512", "policy.generation.max_new_tokens=24",
        "policy.generation_batch_size=16", "cluster.gpus_per_node=0", "env.math.num_workers=1",
        "env.math.timeout_s=30",  # a loaded CI machine must not turn a slow check into an env error
        "eval.max_samples=20", "eval.num_tests_per_prompt=2", "eval.k_value=2", "eval.metric=cons@k",
        f"eval.save_path={save}", f"logger.log_dir={tmp_path / 'logs'}",
    ])
    summary = run(cfg)
    results, samples = _read(save)
    assert summary["results_path"] == str(save / "results.json")
    assert results["metric"] == "cons@2" and results["score"] == results["cons@2"]
    assert results["greedy"] is False  # 2 samples per prompt: sampled
    _check_consistent(results, samples, 20, 2)
    gold = [json.loads(line) for line in open(os.path.join(shared_data, "gsm8k", "test.jsonl"))][:20]
    assert [s["reference_answer"] for s in samples[::2]] == [g["answer"].rsplit("####", 1)[1].strip().replace(",", "")
                                                             for g in gold]
    assert samples[0]["prompt"][0]["content"].startswith(gold[0]["question"])
    assert "\\boxed{}" in samples[0]["prompt"][0]["content"]  # the prompt file was applied
    assert all(0 < s["response_tokens"] <= 24 for s in samples)
    assert results["accuracy"] <= 0.1  # a 260K-parameter story model does not solve GSM8K
    assert results["config"]["policy"]["model_name"] == stories260k


def test_eval_arithmetic_config(ray_session, tmp_path):
    from posttrain.algorithms.eval import RESULT_FILES, run

    save = tmp_path / "arith"
    cfg = load_config("eval", CONFIGS / "arithmetic.yaml", [f"eval.save_path={save}", f"logger.log_dir={save}"])
    run(cfg)
    results, samples = _read(save)
    _check_consistent(results, samples, 200, 4)
    assert results["metric"] == "pass@4" and results["score"] == results["pass@4"]
    assert all(s["task_name"] == "arithmetic" and s["prompt"][0]["content"].endswith("=") for s in samples)
    # The arithmetic environment's answer is the whole response: cons@k votes over responses
    # (an empty one is no answer).
    assert all(s["extracted_answer"] == (s["response"].strip() or None) for s in samples)
    assert (save / "config.yaml").is_file() and (save / "metrics.jsonl").is_file()
    assert (save / "pass_at_k.png").read_bytes()[:4] == b"\x89PNG"
    # Another model evaluated with the same config and folder: the earlier results are kept.
    first = (save / "results.json").read_text()
    # Temperature 0 decodes greedily: results said "greedy": false. (With several samples per prompt,
    # all one, the config is refused: tests/unit/test_config.py.)
    run(load_config("eval", CONFIGS / "arithmetic.yaml", [
        f"eval.save_path={save}", f"logger.log_dir={save}", "eval.max_samples=8", "policy.generation.temperature=0",
        "eval.num_tests_per_prompt=1", "eval.k_value=1"]))
    second = _read(save)
    assert second[0]["greedy"] is True and len(second[1]) == 8
    (aside,) = save.glob("previous-*")
    assert (aside / "results.json").read_text() == first
    assert {p.name for p in aside.iterdir()} >= {*RESULT_FILES, "metrics.jsonl", "config.yaml"}
    assert sorted(p.name for p in save.iterdir() if not p.name.startswith("previous-")) == sorted(
        p.name for p in aside.iterdir())  # the second run wrote each file anew
    assert json.loads((save / "results.json").read_text())["num_prompts"] == 8


def test_an_interrupted_eval_keeps_the_samples_of_its_finished_batches(ray_session, tmp_path, monkeypatch):
    """Ctrl-C in the middle of an eval lost every sample: samples.jsonl was written at the end."""
    from posttrain import generation
    from posttrain.algorithms.eval import run

    build = generation.build_generation

    def interrupted_at_the_second_batch(*args, **kwargs):
        engine, calls = build(*args, **kwargs), []

        def generate(batch, greedy=False):
            calls.append(1)
            if len(calls) == 2:
                raise KeyboardInterrupt
            return type(engine).generate(engine, batch, greedy)

        engine.generate = generate
        return engine

    monkeypatch.setattr(generation, "build_generation", interrupted_at_the_second_batch)
    save = tmp_path / "out"
    cfg = load_config("eval", CONFIGS / "arithmetic.yaml", [
        "eval.max_samples=3", "policy.generation_batch_size=4", f"eval.save_path={save}",
        "logger.plots_enabled=false",
    ])
    with pytest.raises(KeyboardInterrupt):
        run(cfg)
    samples = [json.loads(line) for line in (save / "samples.jsonl").read_text().splitlines()]
    assert [(s["prompt_index"], s["sample_index"]) for s in samples] == [(0, j) for j in range(4)]
    assert not (save / "results.json").exists()


def test_eval_loads_the_model_with_the_policys_attention_kernel(monkeypatch, tmp_path):
    # As GRPO's validation does: eval loaded transformers' default (sdpa), which rounded one greedy
    # answer of the quickstart's 200 prompts otherwise than its validation (0.225 against 0.23).
    import posttrain.generation
    from posttrain.algorithms.eval import setup

    class Built(Exception):
        pass

    def build_generation(backend, **kwargs):
        raise Built(kwargs["attn_implementation"])

    monkeypatch.setattr(posttrain.generation, "build_generation", build_generation)
    for setting, kernel in (("auto", "eager"), ("sdpa", "sdpa")):  # auto: eager on a CPU up to 256 positions
        cfg = load_config("eval", CONFIGS / "arithmetic.yaml", [f"eval.save_path={tmp_path}",
                                                                f"policy.attn_implementation={setting}"])
        with pytest.raises(Built, match=f"^{kernel}$"):
            setup(cfg)


def test_answers_an_environment_gives_as_numbers_are_voted_on_as_text():
    from posttrain.algorithms.eval import ANSWER_KEY, _AnswerRecorder
    from posttrain.environments.interfaces import PerSampleEnvironment, StepResult
    from posttrain.evals import aggregate

    class Counting(PerSampleEnvironment):
        def step_one(self, messages, metadata):
            n = len(messages[-1]["content"])
            return StepResult("", float(n == 2), True, metadata, answer=n if n else None)

    ret = _AnswerRecorder(Counting()).step(
        [[{"role": "assistant", "content": c}] for c in ("ab", "xyz", "cd", "")], [{}] * 4)
    answers = [m[ANSWER_KEY] for m in ret.metadata]
    assert answers == ["2", "3", "2", None]
    assert aggregate([answers], [[r > 0 for r in ret.rewards]])["cons@4"] == 1.0  # "2" wins, 2 of 4


def test_a_file_of_several_tasks_gets_each_tasks_metrics():
    # results.json had only the mixture's (0.162 for a task at 0.311 beside one at 0.025).
    from posttrain.algorithms.eval import per_task_metrics

    def record(task, answer, correct):
        return {"task_name": task, "extracted_answer": answer, "correct": correct, "reward": float(correct),
                "truncated": False, "prompt_truncated": False, "env_error": None, "response_tokens": 4}

    records = [record("a", "1", True), record("a", "2", False), record("b", None, False), record("b", "3", False),
               record("a", "1", True), record("a", "1", True)]
    per_task = per_task_metrics(records, 2, "pass@1")
    assert per_task["a"]["accuracy"] == 0.75 and per_task["a"]["num_prompts"] == 2
    assert per_task["a"]["pass@2"] == 1.0 and per_task["a"]["cons@2"] == 1.0  # tie 1/1 -> the first, correct
    assert per_task["b"]["accuracy"] == 0.0 and per_task["b"]["num_samples"] == 2
    # The results' score and counts too (docs/evaluation.md: "the same metrics").
    assert per_task["a"]["score"] == 0.75 and per_task["a"]["num_correct"] == 3 and per_task["a"]["mean_reward"] == 0.75
    assert per_task["b"]["num_no_answer"] == 1 and per_task["b"]["num_env_errors"] == 0
    assert per_task_metrics(records[:2], 2, "pass@1") == {}  # one task: the overall metrics are its own


def test_a_blank_answer_is_counted_as_no_answer():
    # The arithmetic environment answers with the response itself, "" when it is empty: the vote
    # ignored it, but num_no_answer (answers that are None) counted it as an answer.
    from posttrain.algorithms.eval import ANSWER_KEY, _AnswerRecorder
    from posttrain.environments.arithmetic import ArithmeticEnvironment
    from posttrain.schemas import EnvWorkerConfig

    env = ArithmeticEnvironment(EnvWorkerConfig())
    ret = _AnswerRecorder(env).step([[{"role": "assistant", "content": c}] for c in ("46", "", "  ")],
                                    [{"answer": "46"}] * 3)
    assert [m[ANSWER_KEY] for m in ret.metadata] == ["46", None, None]


def test_eval_rejects_k_above_n():
    from posttrain.config import ConfigError

    with pytest.raises(ConfigError, match="k_value"):
        load_config("eval", CONFIGS / "arithmetic.yaml", ["eval.k_value=5"])


def test_eval_story_task_scores_above_zero(ray_session, stories260k, tmp_path, monkeypatch):
    """A task stories260K can do: its stories mention the prompt's animal (`story` env), so the
    scores are non-zero and pass@k grows with k. Two mentions in 64 tokens (~1 in 5 stories
    here): three in 32 was 1 story of the 32, and a change of the engine's float rounding drew
    none."""
    from posttrain.algorithms.eval import run
    from posttrain.data import datasets
    from posttrain.environments import ENVIRONMENTS
    from posttrain.environments.story import StoryEnvironment, make_story_rows

    monkeypatch.setitem(ENVIRONMENTS, "story", StoryEnvironment)
    monkeypatch.setitem(datasets.REGISTRY, "stories", make_story_rows)
    save = tmp_path / "story"
    cfg = load_config("eval", None, [
        f"policy.model_name={stories260k}", "policy.device=cpu", "policy.max_total_sequence_length=128",
        "policy.generation.max_new_tokens=64", "policy.generation_batch_size=32", "data.dataset_name=stories",
        "data.num_val=8", "eval.num_tests_per_prompt=4", "eval.k_value=4", f"eval.save_path={save}",
        f"logger.log_dir={save}", "cluster.gpus_per_node=0", "env.story.cfg.min_mentions=2",
    ])
    run(cfg)
    results, samples = _read(save)
    _check_consistent(results, samples, 8, 4)
    assert 0.0 < results["pass@1"] < results["pass@4"] <= 1.0
    assert 0.0 < results["mean_reward"] < 1.0
    assert all(s["extracted_answer"].isdigit() for s in samples)  # the mention count


def test_eval_rejects_overlong_prompts_at_setup(stories260k, tmp_path):
    from posttrain.algorithms.eval import setup

    cfg = load_config("eval", CONFIGS / "gsm8k.yaml", [
        f"policy.model_name={stories260k}", "policy.generation.backend=torch", "policy.precision=float32",
        "policy.max_total_sequence_length=64", "eval.max_samples=5", f"eval.save_path={tmp_path}",
        "cluster.gpus_per_node=0",
    ])
    with pytest.raises(ValueError, match=r"prompts of data.dataset_name='gsm8k' .* row 1, \d+ tokens.*overlong_prompt=truncate"):
        setup(cfg)


def test_eval_of_prompts_truncated_by_the_engine_scores_their_answers(ray_session, stories260k, tmp_path):
    """overlong_prompt=truncate, which the setup error suggests: each answer was read at the uncut
    prompt's length, so every truncated sample was scored as an empty response."""
    from posttrain.algorithms.eval import run

    save = tmp_path / "out"
    run(load_config("eval", CONFIGS / "gsm8k.yaml", [
        f"policy.model_name={stories260k}", "policy.generation.backend=torch", "policy.precision=float32",
        "policy.max_total_sequence_length=64", "policy.generation.max_new_tokens=8",
        "policy.generation.overlong_prompt=truncate", "eval.max_samples=2", f"eval.save_path={save}",
        "env.math.num_workers=1", "cluster.gpus_per_node=0",
    ]))
    results, samples = _read(save)
    _check_consistent(results, samples, 2, 1)
    assert results["num_prompt_truncated"] == 2 and all(s["prompt_truncated"] for s in samples)
    assert all(s["response_tokens"] == 8 and s["response"].strip() for s in samples)


def test_eval_rows_need_an_answer_only_where_their_environment_scores_against_one(tmp_path):
    """Code rows without a reference solution are scored by their tests: eval refused them for
    lacking an `answer`; a math row whose `answer` is missing (None, as `datasets` fills it) passed."""
    from posttrain.algorithms.eval import load_eval_rows
    from posttrain.environments import resolve_task_envs

    code = tmp_path / "code.jsonl"
    code.write_text(json.dumps({"prompt": "def f(x):\n", "test": "def check(c):\n    assert c(1) == 1\n",
                                "entry_point": "f"}) + "\n")
    cfg = load_config("eval", None, [f"data.dataset_name={code}"])
    rows = load_eval_rows(cfg)
    assert resolve_task_envs(rows, cfg.env, require_answers=True) == ["code"] and "answer" not in rows[0]
    math = tmp_path / "math.jsonl"
    math.write_text("".join(json.dumps(r) + "\n" for r in [
        {"messages": [{"role": "user", "content": "1+1="}], "answer": "2", "task_name": "math"},
        {"messages": [{"role": "user", "content": "2+2="}], "task_name": "math"},
        {"messages": [{"role": "user", "content": "3+3="}], "answer": " ", "task_name": "math"}]))  # blank: none
    cfg = load_config("eval", None, [f"data.dataset_name={math}"])
    with pytest.raises(ValueError, match=r"2 of 3 rows for environment 'math' have no reference `answer`.*row 2"):
        resolve_task_envs(load_eval_rows(cfg), cfg.env, require_answers=True)


def test_eval_with_tools_checks_at_setup_that_the_chat_template_shows_tool_results(tmp_path):
    """As GRPO does: a template that cannot render a tool result failed at the first tool call."""
    from posttrain.algorithms.eval import setup
    from posttrain.config import InputError
    from posttrain.embedded import CHAT_TEMPLATE

    (tmp_path / "calc.py").write_text(
        "def exact(response, metadata):\n    return float(response == metadata['answer'])\n\n"
        "def add(a: int, b: int) -> int:\n    \"\"\"Add.\n\n    Args:\n        a: one\n        b: two\n    \"\"\"\n"
        "    return a + b\n")
    data = tmp_path / "calc.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": "1+2="}], "answer": "3",
                                "task_name": "calc"}) + "\n")
    strict = ("{% for m in messages %}{% if m['role'] not in ('user', 'assistant') %}"
              "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{% endfor %}" + CHAT_TEMPLATE)
    config = tmp_path / "eval.yaml"
    config.write_text(yaml.safe_dump({
        "eval": {"max_rollout_turns": 5, "save_path": str(tmp_path / "out")},
        "data": {"dataset_name": str(data)},
        "env": {"calc": {"target": f"{tmp_path}/calc.py:exact", "tools": [f"{tmp_path}/calc.py:add"]}},
        "policy": {"model_name": "embedded:tiny", "tokenizer": {"chat_template": strict}},
        "cluster": {"gpus_per_node": 0},
    }))
    with pytest.raises(InputError, match=r"environment 'calc' has tools, but the tokenizer's chat template cannot "
                                         r"render a tool result"):
        setup(load_config("eval", config))


def test_eval_local_file_is_evaluated_whole(ray_session, stories260k, tmp_path):
    """A file named by data.dataset_name: every row is scored (no validation split held out)."""
    from posttrain.algorithms.eval import run

    rows = [{"question": f"What is {a} plus {a}?", "answer": str(2 * a)} for a in range(1, 5)]
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    save = tmp_path / "out"
    run(load_config("eval", None, [
        f"policy.model_name={stories260k}", "policy.device=cpu", "policy.max_total_sequence_length=64",
        "policy.generation.max_new_tokens=8", f"data.dataset_name={path}", f"eval.save_path={save}",
        f"logger.log_dir={save}", "cluster.gpus_per_node=0",
    ]))
    results, samples = _read(save)
    _check_consistent(results, samples, 4, 1)
    assert results["greedy"] is True  # one sample per prompt: greedy
    assert [s["reference_answer"] for s in samples] == ["2", "4", "6", "8"]
    assert all(s["task_name"] == "math" for s in samples)
