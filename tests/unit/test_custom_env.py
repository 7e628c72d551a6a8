"""Environments and reward functions of the user's own, named by `env.<name>.target`."""

import json
import re
import textwrap
from pathlib import Path

import pytest

from posttrain.config import ConfigError, InputError, MissingInputError
from posttrain.environments import create_env, resolve_env
from posttrain.schemas import EnvWorkerConfig

REWARDS = '''
import math

from posttrain.environments import PerSampleEnvironment, StepResult

THRESHOLD = 2

def exact(response, metadata):
    return float(response.strip() == str(metadata["answer"]))

def long_enough(response, metadata):
    return len(response) >= THRESHOLD  # a bool counts as a number

def not_a_number(response, metadata):
    return "high"

def close_enough(response, metadata):
    import numpy as np

    return np.isclose(float(response), float(metadata["answer"]))  # a NumPy bool

def half_as_tensor(response, metadata):
    import torch

    return torch.tensor(0.5)

def trl_close_enough(completions, answer, **kwargs):
    import numpy as np

    return list(np.array([float(c[-1]["content"]) for c in completions]) == np.array(answer, dtype=float))

def one_argument(response):
    return 1.0

def repeats_prompt(response, metadata, prompt):
    return float(response == prompt)

def turns(response, metadata, *, messages):
    return len(messages)

def context_keys(response, metadata, **context):
    return len(context["prompt"]) + 10 * len(context["messages"])

def needs_a_judge(response, metadata, judge):
    return 1.0

import threading

CLIENT_LOCK = threading.Lock()  # as in an API client made at import: no pickling it

def locked(response, metadata):
    with CLIENT_LOCK:
        return 1.0

def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b

def mean(values: list[float]) -> float:
    """The mean of some numbers.

    Args:
        values: The numbers.
    """
    import numpy as np

    return {"mean": np.mean(values), "count": np.int64(len(values)), "values": np.array(values)}

def divide(a: float, b: float) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b

def undocumented(a: int) -> int:
    return a

def trl_exact(completions, answer, **kwargs):
    # TRL's conversational layout: each completion is a list of messages.
    return [float(c[-1]["content"].strip() == str(a)) for c, a in zip(completions, answer)]

def trl_prompt_length(prompts, completions, **kwargs):
    return [None if len(p[-1]["content"]) > 3 else len(p[-1]["content"]) for p in prompts]

def trl_integer(completions, answer, log_metric, **kwargs):
    # Reads a final answer: int() raises on a turn that calls a tool.
    log_metric("scored", len(completions))
    return [float(int(c[-1]["content"]) == int(a)) for c, a in zip(completions, answer)]

async def async_exact(response, metadata):
    # A per-sample one that awaits a judge: it scored every sample 0 as "returned <coroutine>".
    return float(response.strip() == str(metadata["answer"]))

async def trl_async_exact(completions, answer, **kwargs):
    # TRL awaits an async reward function (one that calls a judge over the network, say).
    return [float(c[-1]["content"].strip() == str(a)) for c, a in zip(completions, answer)]

def trl_nan_for_short(completions, **kwargs):
    return [float("nan") if len(c[-1]["content"]) < 2 else 1.0 for c in completions]

def trl_wrong_count(completions, **kwargs):
    return [1.0]

def trl_shorter_later(prompts, completions, completion_ids, trainer_state, log_metric, log_extra):
    # TRL's documented signature: token ids, the run's progress, and logging of its own.
    lengths = [len(ids) for ids in completion_ids]
    log_metric("mean_tokens", sum(lengths) / len(lengths))
    log_extra("tokens", lengths)
    return [trainer_state.global_step / trainer_state.max_steps - n for n in lengths]

def run_python(code: str) -> str:
    """Run Python code, as a code-interpreter tool does.

    Args:
        code: The program.
    """
    exec(code, {})
    return "done"

def exits(response, metadata):
    import sys

    sys.exit(f"bad {response}")

def trl_exits(completions, **kwargs):
    exit()

def sleepy(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: How long.
    """
    import time

    time.sleep(seconds)
    return f"slept {THRESHOLD * seconds / 2:g} s"  # a module global: the tool arrives with its module

def crashy(code: int) -> str:
    """Exit the process at once, as a crash in C code would.

    Args:
        code: The exit code.
    """
    import os

    os._exit(code)

class NotFound(Exception):  # an API client's own error: its class exists only in this file
    def __init__(self, key, detail):
        super().__init__(f"{key}: {detail}")

def lookup(key: str) -> dict:
    """Look a key up.

    Args:
        key: The key.
    """
    if key == "grid":
        return {(0, 0): "x"}  # tuple keys: no JSON
    raise NotFound(key, "no such key")

class Echo(PerSampleEnvironment):
    """Two turns: asks again once, then scores the second answer's length."""

    def __init__(self, cfg):
        self.scale = cfg.cfg.get("scale", 1.0)

    def step_one(self, messages, metadata):
        turns = sum(m["role"] == "assistant" for m in messages)
        if turns < 2:
            return StepResult("once more", 0.0, False, metadata)
        return StepResult("", self.scale * len(messages[-1]["content"]), True, metadata)

class Calculator(Echo):
    """An environment class with a tool the model may call."""

    tools = (add,)

class BadTools(Echo):
    tools = (undocumented,)

class NotAnEnvironment:
    pass
'''


def convo(answer: str) -> list[dict]:
    return [{"role": "user", "content": "q"}, {"role": "assistant", "content": answer}]


@pytest.fixture
def rewards_file(tmp_path):
    # Outside the project and every import path: only pickling by value gets it into the actors.
    path = tmp_path / "my_rewards.py"
    path.write_text(textwrap.dedent(REWARDS))
    return path


def _cfg(target: str, **kw) -> EnvWorkerConfig:
    return EnvWorkerConfig(target=target, **kw)


def test_reward_function_and_class_run_inside_ray_actors(ray_session, rewards_file):
    group = create_env("exact", _cfg(f"{rewards_file}:exact", num_workers=2))
    try:
        ret = group.step([convo(" 42"), convo("41"), convo("7")], [{"answer": "42"}, {"answer": 42}, {"answer": "7"}])
        assert ret.rewards == [1.0, 0.0, 1.0] and all(ret.terminateds) and ret.num_errors == 0
        assert ret.answers == [" 42", "41", "7"]
    finally:
        group.shutdown()
    group = create_env("trl", _cfg(f"{rewards_file}:trl_exact", num_workers=2))  # a batch per actor
    try:
        ret = group.step([convo("42"), convo("41"), convo("7")], [{"answer": "42"}, {"answer": 42}, {"answer": "7"}])
        assert ret.rewards == [1.0, 0.0, 1.0] and ret.num_errors == 0
    finally:
        group.shutdown()
    group = create_env("echo", _cfg(f"{rewards_file}:Echo", cfg={"scale": 0.5}))
    try:
        first = group.step([convo("ab")], [{}])
        assert first.rewards == [0.0] and not first.terminateds[0]
        assert first.observations[0]["content"] == "once more"
        second = group.step([convo("ab") + [first.observations[0], {"role": "assistant", "content": "abcd"}]], [{}])
        assert second.rewards == [2.0] and second.terminateds[0]
    finally:
        group.shutdown()


def test_a_reward_file_imports_the_modules_beside_it_also_in_the_actors(ray_session, tmp_path):
    # As `python my_rewards.py` would: the file's folder was on no path, so its own helper
    # module failed to import ("No module named ..."), which the module form of the same file did.
    folder = tmp_path / "user"
    folder.mkdir()
    (folder / "posttrain_test_norms.py").write_text("def norm(text):\n    return text.strip().lstrip('0') or '0'\n")
    (folder / "posttrain_test_scale.py").write_text("FULL = 2.0\n")
    (folder / "scored.py").write_text(
        "import posttrain_test_scale\n"
        "from posttrain_test_norms import norm\n\n"
        "def exact(response, metadata):\n"
        "    return posttrain_test_scale.FULL * (norm(response) == norm(str(metadata['answer'])))\n"
    )
    group = create_env("beside", _cfg(f"{folder / 'scored.py'}:exact"))  # the actor's path has no such folder
    try:
        ret = group.step([convo(" 042"), convo("41")], [{"answer": "42"}, {"answer": "42"}])
        assert ret.rewards == [2.0, 0.0] and ret.num_errors == 0
    finally:
        group.shutdown()


def test_reward_function_failures_score_zero_and_are_recorded(rewards_file):
    env = resolve_env("f", _cfg(f"{rewards_file}:not_a_number"))(EnvWorkerConfig())
    ret = env.step([convo("x")], [{}])
    assert ret.rewards == [0.0] and ret.num_errors == 1
    assert "returned 'high', not a number" in ret.metadata[0]["env_error"]
    env = resolve_env("g", _cfg(f"{rewards_file}:exact"))(EnvWorkerConfig())
    ret = env.step([convo("1"), convo("1")], [{}, {"answer": "1"}])  # the first row has no answer: KeyError
    assert ret.rewards == [0.0, 1.0] and ret.num_errors == 1
    env = resolve_env("h", _cfg(f"{rewards_file}:long_enough"))(EnvWorkerConfig())
    assert env.step([convo("a"), convo("abc")], [{}, {}]).rewards == [0.0, 1.0]


def test_module_path_target_from_the_working_directory(tmp_path, monkeypatch):
    (tmp_path / "cwd_rewards_mod.py").write_text("def score(response, metadata):\n    return 0.25\n")
    monkeypatch.chdir(tmp_path)
    env = resolve_env("cwd", _cfg("cwd_rewards_mod:score"))(EnvWorkerConfig())
    assert env.step([convo("x")], [{}]).rewards == [0.25]


def test_bad_targets_fail_naming_the_key(rewards_file, tmp_path):
    cases = [
        ("no_colon", ConfigError, r"env.x.target='no_colon': expected 'module:name'"),
        (f"{tmp_path}/missing.py:f", MissingInputError, r"env.x.target: no file .*missing.py"),
        ("posttrain_no_such_module:f", ConfigError, r"importing posttrain_no_such_module failed: ModuleNotFoundError"),
        (f"{rewards_file}:exactt", ConfigError, r"has no 'exactt' \(it has: .*exact"),
        (f"{rewards_file}:NotAnEnvironment", ConfigError, r"NotAnEnvironment is no posttrain.environments.EnvironmentInterface"),
        (f"{rewards_file}:THRESHOLD", ConfigError, r"is a int, not an environment class or a reward function"),
        (f"{rewards_file}:one_argument", ConfigError,
         r"called fn\(response, metadata\) \(optional keywords: prompt, messages\); one_argument\(response\) cannot be"),
        (f"{rewards_file}:needs_a_judge", ConfigError, r"needs_a_judge\(response, metadata, judge\) cannot be"),
        (f"{rewards_file}:locked", ConfigError,
         r"env.x.target='.*:locked' cannot be sent to the environment's actors: TypeError: cannot pickle '_thread.lock'"),
    ]
    for target, error, message in cases:
        with pytest.raises(error, match=message):
            resolve_env("x", _cfg(target))
    broken = tmp_path / "broken.py"
    broken.write_text("import posttrain_no_such_dependency\n")
    with pytest.raises(ConfigError, match=r"importing .*broken.py failed at broken.py:1: ModuleNotFoundError.*"
                                          r"posttrain_no_such_dependency"):
        resolve_env("x", _cfg(f"{broken}:f"))
    broken.write_text("import os\nraise ValueError('no API key')\n")  # the line that raised, not only what
    with pytest.raises(ConfigError, match=r"importing .*broken.py failed at broken.py:2: ValueError: no API key"):
        resolve_env("x", _cfg(f"{broken}:f"))
    with pytest.raises(ConfigError, match=r"env.math.target: 'math' is a built-in environment"):
        resolve_env("math", _cfg(f"{rewards_file}:exact"))
    with pytest.raises(ConfigError, match=r"unknown environment 'chess'.*or your own .* env.chess.target"):
        resolve_env("chess", EnvWorkerConfig())
    # Settings nothing reads for reward functions, which were accepted without a word: a time limit
    # per call a hung function never met, and settings it never saw.
    with pytest.raises(ConfigError, match=r"env.x.timeout_s: reward functions run without a time limit per call .* "
                                          r"set env.x.step_timeout_s instead"):
        resolve_env("x", _cfg(f"{rewards_file}:exact", timeout_s=1.0))
    with pytest.raises(ConfigError, match=r"env.x.cfg: reward functions get no settings \(\['threshold'\]\)"):
        resolve_env("x", _cfg(f"{rewards_file}:exact", cfg={"threshold": 2}))
    resolve_env("x", _cfg(f"{rewards_file}:exact", step_timeout_s=9.0))


def test_an_environment_with_nemo_rls_batch_hook_is_refused_naming_what_to_do_instead(tmp_path):
    # Nothing calls global_post_process_and_metrics: a NeMo RL environment ported with one ran, and
    # the metrics it computed there never reached a log.
    (tmp_path / "ported.py").write_text(textwrap.dedent("""
        from posttrain.environments import PerSampleEnvironment, StepResult

        class Ported(PerSampleEnvironment):
            def __init__(self, cfg):
                self.cfg = cfg

            def step_one(self, messages, metadata):
                return StepResult(observation="", reward=1.0, terminated=True, metadata=metadata)

            def global_post_process_and_metrics(self, batch):
                return batch, {"accuracy": 1.0}
    """))
    with pytest.raises(ConfigError, match=r"environment 'p' \(Ported\) defines global_post_process_and_metrics, "
                                          r"which posttrain does not call: return per-sample numbers in each "
                                          r"sample's metadata\['env_metrics'\]"):
        resolve_env("p", _cfg(f"{tmp_path / 'ported.py'}:Ported"))


def test_data_task_name_routes_every_rl_row(tmp_path):
    from posttrain.data.datasets import load_rows
    from posttrain.schemas import DataConfig

    path = tmp_path / "problems.jsonl"
    path.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "2+2?", "answer": "4"}\n')
    cfg = DataConfig(dataset_name=str(path), format="math", val_data_path=str(path))
    assert {r["task_name"] for r in load_rows(cfg, "train")} == {"math"}
    rows = load_rows(cfg.model_copy(update={"task_name": "exact"}), "train")
    assert [(r["task_name"], r["answer"]) for r in rows] == [("exact", "2"), ("exact", "4")]


def test_relative_file_falls_back_to_the_project_root(tmp_path, monkeypatch):
    # The example config's path works from any working directory, like data paths.
    monkeypatch.chdir(tmp_path)
    env = resolve_env("digits", _cfg("examples/rewards/arithmetic.py:digits_right"))(EnvWorkerConfig())
    ret = env.step([convo("035"), convo("045"), convo("45")], [{"answer": "045"}] * 3)
    assert ret.rewards == pytest.approx([2 / 3, 1.0, 0.0]) and ret.num_errors == 0


def test_a_weighted_list_of_reward_functions(rewards_file):
    from posttrain.rollouts import Conversation, summarize_rollouts

    cfg = _cfg([f"{rewards_file}:exact", f"{rewards_file}:long_enough", f"{rewards_file}:exact"],
               reward_weights=[1.0, 0.5, 2.0])
    env = resolve_env("mix", cfg)(cfg)
    ret = env.step([convo("42"), convo("7")], [{"answer": "42"}, {"answer": "8"}])
    assert ret.rewards == [3.5, 0.0]  # 1 + 0.5 + 2 for "42"; "7" is short and wrong
    assert ret.metadata[0]["reward_components"] == {"exact": 1.0, "long_enough": 1.0, "exact_2": 1.0}
    convs = [Conversation(messages=[], metadata=m, task_name="mix", tokens=[], prompt_length=0, reward=float(r))
             for m, r in zip(ret.metadata, ret.rewards)]
    metrics = summarize_rollouts(convs)
    assert metrics["reward"] == 1.75 and metrics["reward/exact"] == 0.5 and metrics["reward/long_enough"] == 0.5
    assert "accuracy" not in metrics  # without correct_at_least the functions judge nothing
    with pytest.raises(ValueError, match="reward_weights\n.*1 weights for the 2 reward functions in target"):
        _cfg([f"{rewards_file}:exact", f"{rewards_file}:exact"], reward_weights=[1.0])
    with pytest.raises(ValueError, match=r"reward_weights\n.*target is one reward function \(.*:exact\), which takes "
                                         "no weight"):
        _cfg(f"{rewards_file}:exact", reward_weights=[1.0])
    with pytest.raises(ValueError, match="reward_weights\n.*weights of a list of reward functions in target, and "
                                         "target names none"):
        _cfg(None, reward_weights=[1.0])
    with pytest.raises(ConfigError, match=r"env.mix.target: '.*:Echo' is a class; a list of targets holds reward functions"):
        resolve_env("mix", _cfg([f"{rewards_file}:exact", f"{rewards_file}:Echo"]))


def test_reward_functions_that_name_prompt_or_messages_receive_them(rewards_file):
    system = {"role": "system", "content": "be brief"}
    two_turns = [system, {"role": "user", "content": "first"}, {"role": "assistant", "content": "a"},
                 {"role": "user", "content": "say hi"}, {"role": "assistant", "content": "say hi"}]
    for fn, expected in [("repeats_prompt", [0.0, 1.0]), ("turns", [2.0, 5.0]),
                         ("context_keys", [1 + 20, 6 + 50])]:  # len(prompt) + 10 x len(messages)
        env = resolve_env("c", _cfg(f"{rewards_file}:{fn}"))(EnvWorkerConfig())
        ret = env.step([convo("x"), two_turns], [{}, {}])
        assert ret.rewards == expected and ret.num_errors == 0, fn


def _call(name, **arguments):
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


def test_reward_functions_with_tools_call_them_turn_by_turn(rewards_file):
    cfg = _cfg(f"{rewards_file}:exact", tools=[f"{rewards_file}:add", f"{rewards_file}:divide"], max_tool_calls=2)
    env = resolve_env("calc", cfg)(cfg)
    first = convo("Let me add. " + _call("add", a=40, b=2))
    ret = env.step([first], [{"answer": "42"}])
    # The result answers its call by id; the call itself comes back structured for the assistant message.
    (call,) = ret.tool_calls[0]
    assert call == {"id": call["id"], "type": "function", "function": {"name": "add", "arguments": {"a": 40, "b": 2}}}
    assert ret.observations == [[{"role": "tool", "content": "42", "name": "add", "tool_call_id": call["id"]}]]
    assert ret.rewards == [0.0]
    assert not ret.terminateds[0] and ret.metadata[0]["tool_calls"] == 1 and ret.num_errors == 0
    final = first + [*ret.observations[0], {"role": "assistant", "content": "42"}]
    ret = env.step([final], ret.metadata)
    assert ret.rewards == [1.0] and ret.terminateds[0]  # no call: the final answer, scored
    # What goes wrong in a call is the model's to see; it is no environment error.
    bad = convo(_call("divide", a=1, b=0) + _call("mul", a=2, b=3) + "<tool_call>{oops</tool_call>"
                + '<tool_call>{"name": "add", "arguments": "{\\"a\\": 1, \\"b\\": 1}"}</tool_call>'
                + '<tool_call>{"name": "add", "parameters": {"a": 1, "b": "x"}}')  # cut off by the token limit
    ret = env.step([bad], [{}])
    lines = [m["content"] for m in ret.observations[0]]  # one tool message per call
    assert [c["function"]["name"] for c in ret.tool_calls[0]] == ["divide", "mul", "", "add", "add"]
    ids = [m["tool_call_id"] for m in ret.observations[0]]
    assert ids == [c["id"] for c in ret.tool_calls[0]] and len(set(ids)) == 5
    assert lines[0] == "error: divide raised ZeroDivisionError: division by zero"
    assert lines[1] == "error: there is no tool 'mul'; the tools are add, divide"
    assert lines[2].startswith("error: malformed tool call, not JSON") and lines[3] == "2"
    assert lines[4] == "error: add raised TypeError: unsupported operand type(s) for +: 'int' and 'str'"
    assert ret.num_errors == 0 and not ret.terminateds[0]
    # NumPy results read as numbers, not as their quoted text.
    cfg = _cfg(f"{rewards_file}:exact", tools=[f"{rewards_file}:mean"])
    ret = resolve_env("calc", cfg)(cfg).step([convo(_call("mean", values=[1, 2]))], [{}])
    assert json.loads(ret.observations[0][0]["content"]) == {"mean": 1.5, "count": 2, "values": [1, 2]}
    # After max_tool_calls turns with calls the next answer is final, calls or not.
    ret = env.step([convo(_call("add", a=1, b=1))], [{"answer": "2", "tool_calls": 2}])
    assert ret.terminateds[0] and ret.rewards == [0.0] and ret.observations[0]["role"] == "environment"
    assert ret.tool_calls is None
    # A call in the conversation's last turn (here one cut at the token limit) would show no result:
    # it does not run, nor count in tool_calls_mean (it did, ahead of the turns with a result).
    cut = convo('<tool_call>{"name": "add", "ar')
    ret = env.step([cut], [{"answer": "2", "_rollout": {"last_turn": True}}])
    assert ret.terminateds[0] and ret.rewards == [0.0] and "tool_calls" not in ret.metadata[0]
    assert ret.tool_calls is None and ret.num_errors == 0


def test_tool_call_ids_are_the_models_own_or_nine_stable_alphanumerics():
    from posttrain.environments.tool_calls import ToolCall, parse_tool_calls, tool_call_ids

    # Mistral's format carries an id; a valid one is kept, anything else is replaced.
    calls = parse_tool_calls('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}, "id": "Ab3dE6gH9"}, '
                             '{"name": "add", "arguments": {"a": 2}, "id": "call_1"}, {"name": "add", "arguments": {}}]')
    assert [c.id for c in calls] == ["Ab3dE6gH9", "call_1", None]
    ids = tool_call_ids(calls, seed="0\0turn")
    assert ids[0] == "Ab3dE6gH9" and len(set(ids)) == 3
    assert all(len(i) == 9 and i.isalnum() and i.isascii() for i in ids)
    assert tool_call_ids(calls, seed="0\0turn") == ids  # reruns give the same ids
    assert tool_call_ids(calls, seed="1\0turn")[1:] != ids[1:]  # another turn of the conversation: others
    assert ToolCall("add", {"a": 1}).message("x") == {"id": "x", "type": "function",
                                                      "function": {"name": "add", "arguments": {"a": 1}}}


def test_bare_json_tool_calls_of_llama_and_mistral():
    from posttrain.environments.tool_calls import parse_tool_calls

    def read(text):
        return [(c.name, c.arguments) if c.error is None else c.error for c in parse_tool_calls(text)]

    llama = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}'
    assert read(llama) == [("add", {"a": 1, "b": 2})]
    assert read(' {"name": "add", "parameters": "{\\"a\\": 3}"}\n') == [("add", {"a": 3})]
    mistral = '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}, {"name": "div", "arguments": [1]}]'
    assert read(mistral) == [("add", {"a": 1}), "malformed tool call to div: its arguments must be an object"]
    assert parse_tool_calls(mistral)[1].name == "div"  # named, so its result can say which call failed
    # answers, not calls: JSON without a name and arguments, prose around JSON, broken JSON
    for answer in ('{"answer": 3}', '{"name": "Ada"}', '[1, 2]', 'It is {"name": "add", "arguments": {}}',
                   '{"name": "add", "arguments": {', "42", ""):
        assert parse_tool_calls(answer) == [], answer
    # a tagged call wins: the JSON around it is not read again
    assert read('<tool_call>{"name": "a", "arguments": {}}</tool_call>') == [("a", {})]


def test_a_degenerate_call_json_cannot_parse_is_a_malformed_call_not_a_crash():
    # json.loads raises ValueError past 4300 digits and RecursionError past ~1000 nested
    # brackets: both escaped the JSONDecodeError handlers and crashed the step.
    from posttrain.environments.tool_calls import parse_tool_calls, without_tool_calls

    huge = '<tool_call>{"name": "add", "arguments": {"a": ' + "1" * 5000 + "}}</tool_call>"
    deep = "<tool_call>" + "[" * 3000 + "]" * 3000 + "</tool_call>"
    for text in (huge, deep):
        (call,) = parse_tool_calls(text)
        assert call.name == "" and call.error.startswith("malformed tool call, not JSON ("), call.error
        assert without_tool_calls(text) == text  # kept: the only record of what was written
    assert "Exceeds the limit (4300 digits)" in parse_tool_calls(huge)[0].error
    assert parse_tool_calls("[" * 3000 + "]" * 3000) == []  # bare JSON: an answer, not a call
    stringly = '<tool_call>{"name": "add", "arguments": "{\\"a\\": ' + "1" * 5000 + '}"}</tool_call>'
    assert parse_tool_calls(stringly)[0].error == "malformed tool call to add: its arguments must be an object"


def test_a_turns_content_keeps_the_text_around_its_calls():
    # The content of a turn whose calls go to `tool_calls` (the template writes them): with them in
    # it too, each call was written twice. A malformed call stays, the only record of what was written.
    from posttrain.environments.tool_calls import without_tool_calls

    call = '<tool_call>{"name": "add", "arguments": {"a": 1}}</tool_call>'
    assert without_tool_calls(f"Let me add.\n{call}\n{call}") == "Let me add."
    assert without_tool_calls(f"{call}<tool_call>{{oops</tool_call>") == "<tool_call>{oops</tool_call>"
    assert without_tool_calls('[TOOL_CALLS][{"name": "add", "arguments": {"a": 1}}]') == ""
    assert without_tool_calls('The answer is {"name": "Ada"}') == 'The answer is {"name": "Ada"}'


def test_tool_schemas_reach_the_rows_and_bad_tools_fail_naming_the_key(rewards_file):
    from posttrain.environments import with_tool_schemas
    from posttrain.schemas import EnvConfig

    env_cfg = EnvConfig.model_validate({"calc": {"target": f"{rewards_file}:exact", "tools": [f"{rewards_file}:add"]}})
    rows = with_tool_schemas([{"messages": [], "task_name": "calc"}, {"messages": [], "task_name": "math"}], env_cfg)
    (schema,) = rows[0]["tools"]
    assert schema["function"]["name"] == "add" and schema["function"]["description"] == "Add two integers."
    assert schema["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first number."}
    assert "tools" not in rows[1]
    with pytest.raises(ConfigError, match=r"env.x.tools: '.*:undocumented' has no JSON schema .*docstring"):
        resolve_env("x", _cfg(f"{rewards_file}:exact", tools=[f"{rewards_file}:undocumented"]))
    with pytest.raises(ConfigError, match=r"env.x.tools: '.*:THRESHOLD' is a int, not a function"):
        resolve_env("x", _cfg(f"{rewards_file}:exact", tools=[f"{rewards_file}:THRESHOLD"]))
    with pytest.raises(ConfigError, match=r"env.x.tools: two tools are called 'add'"):
        resolve_env("x", _cfg(f"{rewards_file}:exact", tools=[f"{rewards_file}:add", f"{rewards_file}:add"]))
    with pytest.raises(ConfigError, match=r"env.x.tools: tools go with reward functions; the environment class Echo"):
        resolve_env("x", _cfg(f"{rewards_file}:Echo", tools=[f"{rewards_file}:add"]))
    with pytest.raises(ValueError, match=r"tools\n.*tools run beside reward functions in target, and "
                                         r"target names none: a built-in environment runs no tools"):
        _cfg(None, tools=[f"{rewards_file}:add"])
    with pytest.raises(ValueError, match=r"tools\n.*empty: name a tool function or leave the key out"):
        _cfg(f"{rewards_file}:exact", tools=[])
    # An environment class declares its tools in its `tools` attribute.
    env_cfg = EnvConfig.model_validate({"calc": {"target": f"{rewards_file}:Calculator"},
                                        "bad": {"target": f"{rewards_file}:BadTools"}})
    (row,) = with_tool_schemas([{"messages": [], "task_name": "calc"}], env_cfg)
    assert row["tools"] == [schema]
    with pytest.raises(ConfigError, match=r"BadTools.tools \(environment 'bad'\): 'undocumented' has no JSON schema"):
        with_tool_schemas([{"messages": [], "task_name": "bad"}], env_cfg)


def test_too_few_rollout_turns_for_the_tool_calls_fail_at_config_load(rewards_file):
    from posttrain.config import load_config

    keys = [f"env.calc.target={rewards_file}:exact", f"env.calc.tools=[{rewards_file}:add]", "env.calc.max_tool_calls=2"]
    with pytest.raises(ConfigError, match=r"env.calc.max_tool_calls=2 needs grpo.max_rollout_turns >= 3 .* got 1"):
        load_config("grpo", None, keys)
    assert load_config("grpo", None, [*keys, "grpo.max_rollout_turns=3"]).env.get_worker_cfg("calc").tools
    with pytest.raises(ConfigError, match=r"needs eval.max_rollout_turns >= 3"):
        load_config("eval", None, keys)


def test_a_tool_time_limit_runs_calls_in_a_child_that_a_hang_cannot_stop(rewards_file):
    import time

    cfg = _cfg(f"{rewards_file}:exact", tools=[f"{rewards_file}:sleepy", f"{rewards_file}:add", f"{rewards_file}:crashy"],
               tool_timeout_s=2.0)
    env = resolve_env("slow", cfg)(cfg)
    try:
        # The file is not importable in the child by the name it was loaded under: the tools go
        # there pickled by value, module globals and all.
        ret = env.step([convo(_call("sleepy", seconds=0.1) + _call("add", a=2, b=3))], [{}])
        assert [m["content"] for m in ret.observations[0]] == ["slept 0.1 s", "5"]
        start = time.monotonic()
        ret = env.step([convo(_call("sleepy", seconds=60) + _call("add", a=1, b=1))], [{}])
        assert time.monotonic() - start < 30  # killed at 2 s; the next call waits for a fresh child
        assert [m["content"] for m in ret.observations[0]] == ["error: sleepy timed out after 2 s", "2"]
        assert ret.num_errors == 0 and not ret.terminateds[0]
        # a tool whose process dies is reported at once, not after the time limit
        env.tool_timeout_s = 60.0
        start = time.monotonic()
        ret = env.step([convo(_call("crashy", code=7) + _call("add", a=1, b=2))], [{}])
        assert time.monotonic() - start < 30
        assert [m["content"] for m in ret.observations[0]] == ["error: crashy crashed: the child process died (exit code 7)", "3"]
    finally:
        env.close()


@pytest.mark.parametrize("tool_timeout_s", [None, 5.0])
def test_a_tools_own_error_reads_the_same_with_or_without_a_time_limit(rewards_file, tool_timeout_s):
    # In the child of a tool with a time limit, an exception of a class from the tools' file
    # could not be pickled back: the model read "MaybeEncodingError: Error sending result: ...
    # PicklingError" instead of the tool's error. In the actor, a result JSON cannot write
    # (tuple keys) raised outside the call's guard: the sample scored 0 as an environment error.
    cfg = _cfg(f"{rewards_file}:exact", tools=[f"{rewards_file}:lookup"], tool_timeout_s=tool_timeout_s)
    env = resolve_env("lookup", cfg)(cfg)
    try:
        ret = env.step([convo(_call("lookup", key="k") + _call("lookup", key="grid"))], [{}])
        assert [m["content"] for m in ret.observations[0]] == [
            "error: lookup raised NotFound: k: no such key",
            "error: lookup raised TypeError: keys must be str, int, float, bool or None, not tuple"]
        assert ret.num_errors == 0 and not ret.terminateds[0]
    finally:
        env.close()


def test_the_step_time_limit_leaves_each_tool_call_its_own(rewards_file):
    from posttrain.environments.actors import slice_time_limit

    # Each call of a turn may run out tool_timeout_s (and its child restart after): a slice whose
    # tools were each stopped in time must not run out the slice's limit, which kills the actor
    # and scores every sample of the slice 0. Measured in Ray: 16 hanging calls of one sample
    # with tool_timeout_s=1 and timeout_s=0.1 lost the slice at 30.1 s.
    cfg = _cfg(f"{rewards_file}:exact", tools=[f"{rewards_file}:sleepy"], tool_timeout_s=10.0, timeout_s=2.0)
    calls = convo(_call("sleepy", seconds=60) * 3)
    assert slice_time_limit(cfg, [calls, calls, convo("42")]) > 3 * 2.0 + 6 * 10.0 + 30
    assert slice_time_limit(cfg, [convo("42")] * 3) == 3 * 2.0 + 30  # answers: timeout_s each, + 30 s
    assert slice_time_limit(cfg.model_copy(update={"step_timeout_s": 7.0}), [calls]) == 7.0  # as set
    untimed = cfg.model_copy(update={"tool_timeout_s": None})  # tools in the actor: step_timeout_s bounds them
    assert slice_time_limit(untimed, [calls]) == 2.0 + 30


def line(function: str) -> int:
    """The line of my_rewards.py (`REWARDS`) that defines `function`."""
    return textwrap.dedent(REWARDS).splitlines().index(next(
        s for s in textwrap.dedent(REWARDS).splitlines() if s.startswith(f"def {function}("))) + 1


def test_code_that_exits_fails_only_its_call_or_sample(rewards_file, tmp_path):
    # exit() in a tool (the model's own code), a reward function or a TRL one raises SystemExit:
    # it must fail its call or sample like any error, not end the environment's actor and its slice.
    for timeout in (None, 5.0):  # in the actor, or in the child process of a tool time limit
        cfg = _cfg(f"{rewards_file}:exact", tools=[f"{rewards_file}:run_python"], tool_timeout_s=timeout)
        env = resolve_env("py", cfg)(cfg)
        try:
            ret = env.step([convo(_call("run_python", code="exit()") + _call("run_python", code="x = 1"))], [{}])
        finally:
            env.close()
        assert [m["content"] for m in ret.observations[0]] == ["error: run_python raised SystemExit: None", "done"]
        assert ret.num_errors == 0 and not ret.terminateds[0]
    env = resolve_env("f", _cfg(f"{rewards_file}:exits"))(EnvWorkerConfig())
    ret = env.step([convo("x"), convo("y")], [{}, {}])
    # Named with the function and the line of its file it failed at: "ValueError: boom" named neither.
    assert ret.rewards == [0.0, 0.0] and [m["env_error"] for m in ret.metadata] == [
        f"reward function 'exits' of environment 'f' raised SystemExit at my_rewards.py:{line('exits') + 3} in exits: "
        f"bad {x}" for x in "xy"]
    env = resolve_env("t", _cfg(f"{rewards_file}:trl_exits"))(EnvWorkerConfig())
    ret = env.step([convo("x")], [{}])
    assert ret.num_errors == 1 and ret.metadata[0]["env_error"] == (
        f"TRL reward function 'trl_exits' raised SystemExit at my_rewards.py:{line('trl_exits') + 1} in trl_exits: None")
    # A file that exits as it is imported (a script's argparse) is a config error naming the key.
    script = tmp_path / "script_rewards.py"
    script.write_text("import sys\nsys.exit(2)\ndef score(response, metadata):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"env.s.target=.*importing .*script_rewards.py failed at script_rewards.py:2: "
                                          r"SystemExit: 2"):
        resolve_env("s", _cfg(f"{script}:score"))


def test_trl_reward_functions_run_unchanged_once_per_batch(rewards_file):
    cfg = _cfg([f"{rewards_file}:trl_exact", f"{rewards_file}:trl_prompt_length", f"{rewards_file}:exact"],
               reward_weights=[1.0, 0.5, 2.0])
    env = resolve_env("trl", cfg)(cfg)
    long_prompt = [{"role": "user", "content": "what is 6*7?"}, {"role": "assistant", "content": "42"}]
    ret = env.step([convo("42"), convo("7"), long_prompt], [{"answer": "42"}, {"answer": "8"}, {"answer": 42}])
    # trl_exact + 0.5 x len("q") (None for the long prompt: adds nothing) + 2 x exact
    assert ret.rewards == [1 + 0.5 + 2, 0.5, 1 + 0 + 2] and ret.num_errors == 0
    assert ret.metadata[0]["reward_components"] == {"trl_exact": 1.0, "trl_prompt_length": 1.0, "exact": 1.0}
    assert ret.metadata[2]["reward_components"] == {"trl_exact": 1.0, "trl_prompt_length": None, "exact": 1.0}
    assert all("_trl_reward_values" not in m for m in ret.metadata)
    # reward/<function> averages the samples a function applies to, as TRL's nanmean: the
    # long prompt's None counted as 0 and logged trl_prompt_length at 2/3, not 1.
    from posttrain.rollouts import Conversation, summarize_rollouts

    convs = [Conversation(messages=[], metadata=m, task_name="trl", tokens=[], prompt_length=0, reward=float(r))
             for m, r in zip(ret.metadata, ret.rewards)]
    metrics = summarize_rollouts(convs)
    assert metrics["reward/trl_prompt_length"] == 1.0 and metrics["reward/trl_exact"] == pytest.approx(2 / 3)
    cfg = _cfg(f"{rewards_file}:trl_async_exact")
    ret = resolve_env("trl", cfg)(cfg).step([convo("42"), convo("7")], [{"answer": "42"}, {"answer": "8"}])
    assert ret.rewards == [1.0, 0.0] and ret.num_errors == 0
    cfg = _cfg(f"{rewards_file}:async_exact")
    ret = resolve_env("trl", cfg)(cfg).step([convo("42"), convo("7")], [{"answer": "42"}, {"answer": "8"}])
    assert ret.rewards == [1.0, 0.0] and ret.num_errors == 0
    broken = _cfg(f"{rewards_file}:trl_wrong_count")
    ret = resolve_env("trl", broken)(broken).step([convo("a"), convo("b")], [{}, {}])
    assert ret.rewards == [0.0, 0.0] and ret.num_errors == 2
    assert ret.metadata[0]["env_error"] == (  # posttrain's own check: no line of the function to name
        "TRL reward function 'trl_wrong_count' raised ValueError: returned 1 values for 2 completions")
    assert all("_trl_reward_values" not in m for m in ret.metadata)  # failed samples do not keep them either


def test_trl_reward_functions_get_completion_ids_trainer_state_and_logging(rewards_file):
    from posttrain.environments.interfaces import ROLLOUT_KEY

    cfg = _cfg(f"{rewards_file}:trl_shorter_later")
    env = resolve_env("trl", cfg)(cfg)
    meta = [{"answer": "1", ROLLOUT_KEY: {"completion_ids": ids, "global_step": 3, "max_steps": 4}}
            for ids in ([5, 6], [7, 8, 9, 10])]
    ret = env.step([convo("ab"), convo("abcd")], meta)
    assert ret.rewards == [0.75 - 2, 0.75 - 4] and ret.num_errors == 0
    assert [m["env_metrics"] for m in ret.metadata] == [{"mean_tokens": 3.0}] * 2
    assert [m["log_extra"] for m in ret.metadata] == [{"tokens": 2}, {"tokens": 4}]


def test_log_extra_with_a_value_count_unlike_the_completions_is_an_error(tmp_path):
    # Zipped with the samples, one value for two logged the first and dropped the other without a word.
    path = tmp_path / "trl.py"
    path.write_text("def one_extra(completions, log_extra, **kwargs):\n    log_extra('gold', ['x'])\n"
                    "    return [1.0] * len(completions)\n")
    cfg = _cfg(f"{path}:one_extra")
    ret = resolve_env("trl", cfg)(cfg).step([convo("a"), convo("b")], [{}, {}])
    assert ret.rewards == [0.0, 0.0] and ret.num_errors == 2
    assert ret.metadata[0]["env_error"].startswith("TRL reward function 'one_extra' raised ValueError")
    assert ret.metadata[0]["env_error"].endswith("log_extra('gold', ...) got 1 values for 2 completions")


def test_trl_reward_functions_with_tools_score_only_final_answers(rewards_file):
    # As in TRL, which calls them once a conversation's tool calls are over. Before, they got the
    # tool-calling turns too: one that reads a final answer raised on them, and the right answer
    # of another sample of the batch scored 0 with that error.
    cfg = _cfg(f"{rewards_file}:trl_integer", tools=[f"{rewards_file}:add"])
    env = resolve_env("trl", cfg)(cfg)
    call = convo('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    ret = env.step([convo("3"), call, convo("4")], [{"answer": "3"}] * 3)
    assert ret.rewards == [1.0, 0.0, 0.0] and ret.num_errors == 0
    assert ret.terminateds == [True, False, True]
    assert ret.observations[1][0]["content"] == "3"
    # log_metric counted the two final answers, not the call.
    assert [m.get("env_metrics") for m in ret.metadata] == [{"scored": 2.0}, None, {"scored": 2.0}]
    ret = env.step([call], [{"answer": "3"}])  # a batch of calls only: nothing to score
    assert ret.num_errors == 0 and not ret.terminateds[0] and "env_metrics" not in ret.metadata[0]


def test_numpy_and_torch_scalars_are_numbers(rewards_file):
    # np.isclose gives a NumPy bool, which is no numbers.Real: every sample scored 0 with
    # "returned True, not a number", although a bool counts as 0/1.
    cfg = _cfg([f"{rewards_file}:close_enough", f"{rewards_file}:half_as_tensor", f"{rewards_file}:trl_close_enough"])
    env = resolve_env("numeric", cfg)(cfg)
    ret = env.step([convo("3.0"), convo("4")], [{"answer": "3"}, {"answer": "3"}])
    assert ret.rewards == [2.5, 0.5] and ret.num_errors == 0
    assert ret.metadata[0]["reward_components"] == {"close_enough": 1.0, "half_as_tensor": 0.5,
                                                    "trl_close_enough": 1.0}
    assert all(type(v) is float for v in ret.metadata[0]["reward_components"].values())
    # Text (NumPy's too, which float() would read), arrays and complex numbers are still no reward.
    import numpy as np
    import torch

    from posttrain.environments.interfaces import real_number

    assert [real_number(v) for v in (True, np.int64(2), np.float32(0.25), torch.tensor(1), 10**400, -10**400)] == \
        [1.0, 2.0, 0.25, 1.0, float("inf"), float("-inf")]
    assert [real_number(v) for v in ("1", np.str_("1"), None, [1.0], np.array([1.0]), np.complex128(1j),
                               torch.tensor(1j), torch.ones(2))] == [None] * 8


def test_a_non_finite_value_scores_its_sample_0_without_reaching_the_logged_components(rewards_file):
    # The sample's reward was NaN (scored 0 by the actor), but its components kept the NaN: the
    # step's train/reward/<function> mean was NaN, and the other functions' means counted a
    # sample that scored 0.
    from posttrain.rollouts import Conversation, summarize_rollouts

    cfg = _cfg([f"{rewards_file}:exact", f"{rewards_file}:trl_nan_for_short"])
    env = resolve_env("mix", cfg)(cfg)
    ret = env.step([convo("42"), convo("4")], [{"answer": "42"}, {"answer": "4"}])
    assert ret.rewards == [2.0, 0.0] and ret.num_errors == 1
    assert ret.metadata[1]["env_error"] == "ValueError: reward function 'trl_nan_for_short' of environment 'mix' returned nan"
    convs = [Conversation(messages=[], metadata=m, task_name="mix", tokens=[], prompt_length=0, reward=float(r))
             for m, r in zip(ret.metadata, ret.rewards)]
    metrics = summarize_rollouts(convs)
    assert metrics["reward/trl_nan_for_short"] == 1.0 and metrics["reward/exact"] == 1.0 and metrics["reward"] == 1.0


def test_correct_at_least_judges_by_the_named_functions(rewards_file):
    # A weighted list: the format bonus (long_enough) alone is no correct answer; an exact
    # answer is, with or without the bonus.
    from posttrain.environments.interfaces import verdict

    cfg = _cfg([f"{rewards_file}:exact", f"{rewards_file}:long_enough"], reward_weights=[1.0, 0.5],
               correct_at_least={"exact": 1.0})
    env = resolve_env("mix", cfg)(cfg)
    ret = env.step([convo("41"), convo("7"), convo("42")], [{"answer": "42"}, {"answer": "7"}, {"answer": "42"}])
    assert ret.rewards == [0.5, 1.0, 1.5]
    assert [verdict(m) for m in ret.metadata] == [False, True, True]
    with pytest.raises(ConfigError, match=r"correct_at_least names \['format'\], which are not reward functions.*"
                                          r"they are: exact, long_enough"):
        resolve_env("mix", _cfg(cfg.target, reward_weights=[1.0, 0.5], correct_at_least={"format": 1.0}))
    with pytest.raises(ConfigError, match="correct_at_least goes with reward functions"):
        resolve_env("echo", _cfg(f"{rewards_file}:Echo", correct_at_least={"exact": 1.0}))
    with pytest.raises(ValueError, match="correct_at_least\n.*judges by the reward functions in target, and target "
                                         "names none"):
        EnvWorkerConfig(correct_at_least={"exact": 1.0})
    with pytest.raises(ValueError, match=r"correct_at_least\n.*empty: name \{function: minimum\}"):
        EnvWorkerConfig(target=f"{rewards_file}:exact", correct_at_least={})


def test_rows_of_a_reward_function_some_without_an_answer_are_warned_of(rewards_file, caplog):
    from posttrain.environments import resolve_task_envs
    from posttrain.schemas import EnvConfig

    # A reward function comparing with metadata["answer"] scored the rows without one as wrong answers,
    # silently; a file where no row has one (a length reward) reads none, and says nothing.
    cfg = EnvConfig.model_validate({"exact": {"target": f"{rewards_file}:exact"}})
    rows = [{"messages": [{"role": "user", "content": f"{a}+1="}], "answer": str(a + 1), "task_name": "exact"}
            for a in range(4)]
    rows[1]["answer"] = rows[3]["answer"] = None
    with caplog.at_level("WARNING", logger="posttrain.environments.registry"):
        assert resolve_task_envs(rows, cfg) == ["exact"]
        assert caplog.messages == ["2 of the 4 rows for environment 'exact' have no reference `answer` (first: row 2, "
                                   "prompt '1+1='): it gets metadata['answer'] = None for them"]
        caplog.clear()
        resolve_task_envs([{**r, "answer": None} for r in rows], cfg)
        assert not caplog.messages


def test_an_environment_class_that_cannot_be_built_fails_before_ray_starts(tmp_path):
    # Each failed in its actors ("Can't instantiate abstract class ..."), after the policy had loaded.
    path = tmp_path / "envs.py"
    path.write_text(textwrap.dedent("""
        from posttrain.environments import EnvironmentInterface, PerSampleEnvironment, StepResult

        class NoStep(EnvironmentInterface):
            def __init__(self, cfg):
                pass

        class NoCfg(PerSampleEnvironment):
            def __init__(self):
                pass

            def step_one(self, messages, metadata):
                return StepResult("", 1.0, True, metadata)

        class Fine(NoCfg):
            def __init__(self, cfg, *, scale=1.0):
                pass
    """))
    with pytest.raises(ConfigError, match=re.escape(f"env.u.target='{path}:NoStep': the class NoStep does not define "
                                                    "step, which an environment must")):
        resolve_env("u", _cfg(f"{path}:NoStep"))
    with pytest.raises(ConfigError, match=re.escape(f"env.u.target='{path}:NoCfg': the class NoCfg is built as "
                                                    "NoCfg(cfg), one argument (its env.u settings), but its __init__ "
                                                    "takes ()")):
        resolve_env("u", _cfg(f"{path}:NoCfg"))
    assert resolve_env("u", _cfg(f"{path}:Fine")).__name__ == "Fine"


def test_a_trl_reward_function_needing_a_column_the_rows_lack_fails_at_setup(tmp_path):
    from posttrain.environments import resolve_task_envs
    from posttrain.schemas import EnvConfig

    # TRL fills such a parameter from a dataset column: it raised TypeError at every step, every
    # sample scored 0, and the run stopped only at env.<name>.max_failed_steps.
    path = tmp_path / "trl.py"
    path.write_text("def needs_solution(completions, solution, **kwargs):\n    return [1.0] * len(completions)\n"
                    "def all_keywords(prompts, completions, completion_ids, trainer_state, log_metric, log_extra, "
                    "answer, level):\n    return [1.0] * len(completions)\n")
    rows = [{"messages": [{"role": "user", "content": "1+1="}], "answer": "2", "task_name": "u",
             "metadata": {"level": 1}}]
    cfg = EnvConfig.model_validate({"u": {"target": f"{path}:needs_solution"}})
    with pytest.raises(ConfigError, match=re.escape(
            "env.u.target: the TRL reward function 'needs_solution' takes solution, which TRL fills from dataset "
            "columns, but the rows of environment 'u' have no such key (theirs: answer, level; a row's `answer` and "
            "the keys of its `metadata` are passed)")):
        resolve_task_envs(rows, cfg)
    assert resolve_task_envs([{**rows[0], "metadata": {"solution": "2"}}], cfg) == ["u"]
    cfg = EnvConfig.model_validate({"u": {"target": f"{path}:all_keywords"}})
    assert resolve_task_envs(rows, cfg) == ["u"]
    env = resolve_env("u", cfg.get_worker_cfg("u"))(cfg.get_worker_cfg("u"))
    ret = env.step([convo("2")], [{"answer": "2", "level": 1}])  # every keyword given: no TypeError
    assert ret.rewards == [1.0] and ret.num_errors == 0


def test_trl_prompt_only_rows_run_with_their_columns_and_text_for_string_prompts(tmp_path):
    from posttrain.data.datasets import load_rows
    from posttrain.environments import resolve_task_envs
    from posttrain.schemas import DataConfig, EnvConfig

    # TRL's GRPO data, {"prompt", "solution"}, was refused ("cannot tell the format"), and renamed to
    # `messages` it lost `solution`, which TRL's accuracy reward takes as a keyword.
    data = tmp_path / "trl.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in [
        {"prompt": [{"role": "user", "content": "1+1="}], "solution": "2", "level": 1},
        {"prompt": "2+2=", "solution": "4", "level": 2},
        {"prompt": "3+3=", "solution": "6", "level": None}]) + "\n")
    (tmp_path / "trl_rewards.py").write_text(
        "def accuracy(completions, solution, **kwargs):\n"
        "    texts = [c if isinstance(c, str) else c[0]['content'] for c in completions]\n"
        "    return [float(t.strip() == s) for t, s in zip(texts, solution)]\n"
        "def kinds(prompts, completions, **kwargs):\n"
        "    return [float(isinstance(p, str)) + 2 * float(isinstance(c, str)) for p, c in zip(prompts, completions)]\n")
    cfg = DataConfig(dataset_name=str(data), task_name="acc", val_split_fraction=0.01)
    rows = load_rows(cfg, "train") + load_rows(cfg, "val")
    rows.sort(key=lambda r: r["metadata"]["solution"])
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": f"{n}+{n}="}] for n in (1, 2, 3)]
    assert [r["metadata"] for r in rows] == [{"solution": "2", "level": 1},
                                             {"solution": "4", "level": 2, "_text_prompt": True},
                                             {"solution": "6", "_text_prompt": True}]
    assert {r["task_name"] for r in rows} == {"acc"} and "answer" not in rows[0]
    env_cfg = EnvConfig.model_validate({"acc": {"target": [f"{tmp_path}/trl_rewards.py:accuracy",
                                                           f"{tmp_path}/trl_rewards.py:kinds"]}})
    assert resolve_task_envs(rows, env_cfg) == ["acc"]  # `solution` is a column of the rows
    env = resolve_env("acc", env_cfg.get_worker_cfg("acc"))(env_cfg.get_worker_cfg("acc"))
    logs = [r["messages"] + [{"role": "assistant", "content": answer}] for r, answer in zip(rows, ["2", " 4", "5"])]
    ret = env.step(logs, [r["metadata"] for r in rows])
    assert ret.num_errors == 0
    # accuracy 1, 1, 0; kinds: messages for the conversational row (0), strings for the others (3)
    assert ret.rewards == [1.0, 4.0, 3.0]
    with pytest.raises(InputError, match=r"trl.jsonl row 1: a prompt-only row .* set data.task_name=<environment>"):
        load_rows(DataConfig(dataset_name=str(data)), "train")


def test_reward_function_keys_on_a_builtin_environment_name_the_key_and_where_it_was_set():
    # The error named env.arithmetic as a whole, where the quickstart YAML defines it, in a type's words.
    from posttrain.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=re.escape(
            "env.arithmetic.tools: tools run beside reward functions in target, and target names none") + ".*"
            + re.escape("[env.arithmetic.tools set at command line (env.arithmetic.tools=[calc.py:add])]")):
        load_config("grpo", Path(__file__).resolve().parents[2] / "examples/configs/grpo_quickstart.yaml",
                    ["env.arithmetic.tools=[calc.py:add]"])


def test_an_environment_class_settings_are_checked_by_its_config_class_before_any_actor_starts(tmp_path):
    # A config_class of pydantic's default (extra keys ignored) ran env.mine.cfg.bonuss=0.1 at the
    # default bonus without a word; its errors named 'bonuss' alone, and only once the actors started.
    (tmp_path / "my_envs.py").write_text(textwrap.dedent('''
        from pydantic import BaseModel, ConfigDict
        from posttrain.environments import PerSampleEnvironment, StepResult

        class MyCfg(BaseModel):
            bonus: float = 0.0

        class MyEnv(PerSampleEnvironment):
            config_class = MyCfg

            def __init__(self, cfg):
                self.settings = MyCfg.model_validate(cfg.cfg)

            def step_one(self, messages, metadata):
                return StepResult(None, self.settings.bonus, True, metadata)

        class Open(BaseModel):
            model_config = ConfigDict(extra="allow")

        class OpenEnv(MyEnv):
            config_class = Open

        class NotAModel(MyEnv):
            config_class = dict
    '''))
    target = f"{tmp_path / 'my_envs.py'}:MyEnv"
    with pytest.raises(ConfigError, match=re.escape(
            "invalid config (env.mine.cfg):\n"
            "  - unknown key 'env.mine.cfg.bonuss' (did you mean env.mine.cfg.bonus?)")):
        resolve_env("mine", EnvWorkerConfig(target=target, cfg={"bonuss": 0.1}))
    with pytest.raises(ConfigError, match=r"  - env.mine.cfg.bonus: got 'x', expected a valid number"):
        resolve_env("mine", EnvWorkerConfig(target=target, cfg={"bonus": "x"}))
    assert resolve_env("mine", EnvWorkerConfig(target=target, cfg={"bonus": 0.5})).__name__ == "MyEnv"
    # A schema that takes any key, on purpose, keeps taking them.
    resolve_env("mine", EnvWorkerConfig(target=target.replace(":MyEnv", ":OpenEnv"), cfg={"anything": 1}))
    with pytest.raises(ConfigError, match=r"environment 'mine' \(NotAModel\): config_class is <class 'dict'>, not a "
                                          r"pydantic model"):
        resolve_env("mine", EnvWorkerConfig(target=target.replace(":MyEnv", ":NotAModel")))
