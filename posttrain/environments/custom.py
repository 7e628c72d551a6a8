"""Environments and reward functions of the user's own, named in the config (`env.<name>.target`).

`target` is `"module:attr"` (an importable module; the working directory is on the path) or
`"path/to/file.py:attr"` (relative to the working directory, else to the project root, like data
paths). It names either

- an `EnvironmentInterface` subclass, built like a built-in environment with the `env.<name>`
  section (a `config_class` attribute validates its `cfg` on the driver), or
- a reward function `fn(response: str, metadata: dict) -> float` that scores single-turn rows:
  `response` is the model's answer, `metadata` the row's metadata with its `answer`. A function
  that also names a `prompt` parameter gets the user's message the response answers, one that
  names `messages` the whole conversation (role/content dicts, the response last), as keywords.
  A function with a `completions` parameter is a TRL reward function and is called as TRL
  calls it, once per batch on the final answers (`_trl_values`), so TRL users' reward functions
  run unchanged.

Reward functions may come with tools (`env.<name>.tools`): Python functions the model calls as
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (the Hermes / Qwen format), or with an
answer that is nothing but the JSON call (Llama 3.x, Mistral; `parse_tool_calls`). Each
turn with calls gets their results back as one tool message per call (an error text for a
malformed call, an unknown tool or one that raised, so the model can recover), each naming its
call by `tool_call_id`, and the calls are set on the model's message as OpenAI-form `tool_calls`
(`StepResult.tool_calls`), as templates that render results against calls need; the first turn without
calls, or the turn after `max_tool_calls` turns with calls, is the final answer the reward
functions score. The tools' JSON schemas (from their type hints and docstrings) go to the chat
template with every prompt of the environment's rows (`with_tool_schemas`).

The target's module is pickled by value into the environment actors, so a file next to the
config needs no installing; what it imports must be installed where the actors run. Everything
is resolved on the driver before Ray starts, so a wrong target fails in seconds, naming the key.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import importlib
import importlib.util
import inspect
import math
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from posttrain.config import ConfigError, MissingInputError
from posttrain.data.formats import TEXT_PROMPT_KEY
from posttrain.environments.interfaces import (
    CORRECT_KEY,
    ENV_METRICS_KEY,
    LOG_EXTRA_KEY,
    REWARD_COMPONENTS_KEY,
    ROLLOUT_KEY,
    TOOL_CALLS_KEY,
    USER_CODE_ERRORS,
    EnvironmentInterface,
    EnvironmentReturn,
    PerSampleEnvironment,
    StepResult,
    last_assistant_text,
    real_number,
    user_code_error,
)
from posttrain.environments.timeout import SubprocessRunner, import_cloudpickle
from posttrain.environments.tool_calls import (
    ToolCall,
    call_pickled_tool,
    parse_tool_calls,
    tool_call_ids,
    tool_result_text,
)
from posttrain.schemas import EnvWorkerConfig

# Keywords a reward function receives when its signature names them (or takes **kwargs).
CONTEXT_KEYWORDS = ("prompt", "messages")


def _import_module(module_part: str, key: str):
    if module_part.endswith(".py") or "/" in module_part or os.sep in module_part:
        from posttrain.data.datasets import resolve_path

        path = resolve_path(module_part).resolve()  # as given, else under the project root, as data paths
        if not path.is_file():
            raise MissingInputError(f"{key}: no file {module_part} (relative paths start at the working "
                                    f"directory, {os.getcwd()}, or the project root)")
        # A name of its own per file, so two files called rewards.py do not collide.
        name = f"posttrain_user_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
        if name in sys.modules:
            return sys.modules[name]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        # Its folder on the path, as `python file.py` has it: `from helpers import norm` finds the
        # helpers.py beside it. Last: a file there never shadows an installed module.
        if str(path.parent) not in sys.path:
            sys.path.append(str(path.parent))
        before = set(sys.modules)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        import ray.cloudpickle

        # The modules it imported from its folder go to the actors by value, as it does: their
        # processes have no such folder on their path.
        for new in set(sys.modules) - before:
            origin = getattr(sys.modules[new], "__file__", None)
            if origin and Path(origin).resolve().parent == path.parent:
                ray.cloudpickle.register_pickle_by_value(sys.modules[new])
        return module
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # last: a local file never shadows an installed module
    return importlib.import_module(module_part)


def _raised_at(e: BaseException, module_part: str) -> str:
    """" at file.py:LINE": the innermost line of the imported file (`module_part`, a path) that `e`
    went through, else of any code past the import machinery and this module (a module given by
    name, or a library it imported); "" when there is none. A SyntaxError names its line itself."""
    import importlib as machinery

    skip = (str(Path(machinery.__file__).parent), __file__)
    frames = [f for f in traceback.extract_tb(e.__traceback__)
              if not f.filename.startswith("<") and not f.filename.startswith(skip)]
    own = [f for f in frames if module_part.endswith(".py") and Path(f.filename) == Path(module_part).resolve()]
    frame = (own or frames or [None])[-1]
    return f" at {Path(frame.filename).name}:{frame.lineno}" if frame else ""


def load_target(spec: str, key: str) -> Any:
    """The object `spec` ("module:attr" or "file.py:attr") names; errors name `key`."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr.isidentifier():
        raise ConfigError(f"{key}={spec!r}: expected 'module:name' or 'path/to/file.py:name'")
    try:
        module = _import_module(module_part, key)
    except MissingInputError:
        raise
    except USER_CODE_ERRORS as e:  # noqa: BLE001 - any failure (an argparse's exit) is a config error
        raise ConfigError(f"{key}={spec!r}: importing {module_part} failed{_raised_at(e, module_part)}: "
                          f"{type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ConfigError(f"{key}={spec!r}: {module_part} has no {attr!r} (it has: {', '.join(public) or 'nothing'})")
    import ray.cloudpickle

    # By value: the actors need not import the module (a file anywhere, a module in the cwd).
    ray.cloudpickle.register_pickle_by_value(module)
    obj = getattr(module, attr)
    try:  # here, naming the key, rather than as Ray's report when the actors start
        ray.cloudpickle.dumps(obj)
    except Exception as e:  # noqa: BLE001 - whatever pickling raises: the object cannot reach the actors
        raise ConfigError(f"{key}={spec!r} cannot be sent to the environment's actors: {type(e).__name__}: {e} (it goes "
                          "by value, with the module globals it uses: create a client, lock or open file inside the "
                          "function, e.g. in a functools.cache'd helper)") from None
    return obj


class RewardFunctionEnvironment(PerSampleEnvironment):
    """Reward functions as an environment: a sample's final answer is scored
    sum_i weight_i * fn_i(response, metadata). With more than one function each value is kept in
    the sample's metadata (`REWARD_COMPONENTS_KEY`). A function that raises or returns no number
    scores the sample 0 and records the error (PerSampleEnvironment). Without tools every sample
    ends after one answer; with tools, turns that call them come first (module docstring).

    The verdict (`CORRECT_KEY`) comes from `env.<name>.correct_at_least` ({function: minimum}):
    correct when every function named there scored at least its minimum, so a format bonus or
    partial credit alone is not correct; a turn that calls tools is not an answer (wrong, should
    the conversation end there). Without it the functions judge nothing (no verdict)."""

    def __init__(self, cfg: EnvWorkerConfig, fns: dict[str, Callable[..., float]], weights: list[float],
                 name: str, tools: dict[str, Callable[..., Any]] | None = None):
        self.fns, self.weights, self.name = fns, weights, name
        self.extras = {label: _context_parameters(fn) for label, fn in fns.items()}
        self.trl = {label for label, fn in fns.items() if is_trl_reward_function(fn)}
        self.tools, self.max_tool_calls = tools or {}, cfg.max_tool_calls
        self.tool_timeout_s = cfg.tool_timeout_s
        self.correct_at_least = cfg.correct_at_least
        # With a time limit each call runs in a child process, which gets the tool pickled by
        # value: its file is not importable there by the name it was loaded under.
        self._runner = SubprocessRunner(warmup=import_cloudpickle) if self.tools and self.tool_timeout_s else None
        self._pickled: dict[str, bytes] = {}

    def _call_tool(self, call: ToolCall) -> str:
        """The tool's result as text (JSON unless it returned a string), or what went wrong."""
        if call.error is not None:
            return f"error: {call.error}"
        name, args = call.name, call.arguments
        if name not in self.tools:
            return f"error: there is no tool {name!r}; the tools are {', '.join(self.tools)}"
        if self._runner is None:
            return tool_result_text(self.tools[name], name, args)
        if name not in self._pickled:
            import ray.cloudpickle

            self._pickled[name] = ray.cloudpickle.dumps(self.tools[name])
        try:
            return self._runner.run(call_pickled_tool, (self._pickled[name], name, args), self.tool_timeout_s)
        except TimeoutError:
            return f"error: {name} timed out after {self.tool_timeout_s:g} s"
        except ChildProcessError as e:
            return f"error: {name} crashed: {e}"
        except USER_CODE_ERRORS as e:  # noqa: BLE001 - the child could not run it (unpickling it failed)
            return f"error: {name} could not run: {type(e).__name__}: {e}"

    def close(self) -> None:
        if self._runner is not None:
            self._runner.close()

    def _tool_calls(self, response: str, metadata: dict[str, Any]) -> list[ToolCall]:
        """The calls of the model's turn that the tools answer; none: the turn is the final answer."""
        used = int(metadata.get(TOOL_CALLS_KEY, 0))
        return parse_tool_calls(response) if self.tools and used < self.max_tool_calls else []

    def step(self, message_logs: list[list[dict[str, str]]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        if self.trl:
            # TRL reward functions score the batch's final answers at once (step_one reads their
            # values). Like TRL, they never see a turn that calls tools: a function that reads a
            # final answer would raise on one, and its error would score every sample of the batch.
            final = [i for i, (log, m) in enumerate(zip(message_logs, metadata))
                     if any(x.get("role") == "assistant" for x in log)
                     and not self._tool_calls(last_assistant_text(log), m)]
            if final:
                per_sample, logged = _trl_values({label: self.fns[label] for label in self.trl},
                                                 [message_logs[i] for i in final], [metadata[i] for i in final])
                metadata = list(metadata)
                for i, v, extra in zip(final, per_sample, logged):
                    metadata[i] = {**metadata[i], **extra, _TRL_VALUES_KEY: v}
        ret = super().step(message_logs, metadata)
        if self.trl:  # a sample whose step_one raised keeps the metadata it was given, the values included
            ret.metadata = [{k: v for k, v in m.items() if k != _TRL_VALUES_KEY} for m in ret.metadata]
        return ret

    def step_one(self, messages: list[dict[str, str]], metadata: dict[str, Any]) -> StepResult:
        response = last_assistant_text(messages)
        metadata = dict(metadata)
        batch_values = metadata.pop(_TRL_VALUES_KEY, {})
        used = int(metadata.get(TOOL_CALLS_KEY, 0))
        calls = self._tool_calls(response, metadata)
        if calls and (metadata.get(ROLLOUT_KEY) or {}).get("last_turn"):
            # The conversation ends after this turn (its last, or one cut at the token limit, often
            # mid-call): no result would be shown. The call neither runs nor counts in
            # tool_calls_mean, which counted cut-off calls early in training; the turn scores 0.
            return StepResult(observation=None, reward=0.0, terminated=True,
                              metadata={**metadata, **({CORRECT_KEY: False} if self.correct_at_least else {})})
        if calls:
            ids = tool_call_ids(calls, seed=f"{used}\0{response}")
            results = [{"role": "tool", "content": self._call_tool(c), "name": c.name, "tool_call_id": i}
                       for c, i in zip(calls, ids)]
            return StepResult(observation=results, reward=0.0, terminated=False,
                              metadata={**metadata, TOOL_CALLS_KEY: used + 1,
                                        **({CORRECT_KEY: False} if self.correct_at_least else {})},
                              tool_calls=[c.message(i) for c, i in zip(calls, ids)])
        context = {"prompt": _prompt_text(messages), "messages": messages}
        values = {}
        for label, fn in self.fns.items():
            if label in self.trl:
                value = batch_values[label]
                if isinstance(value, BaseException):
                    raise value
                if value is None:
                    # TRL's None: not applicable. It adds nothing, and its component stays None so
                    # that reward/<function> averages the samples it applies to (TRL's nanmean);
                    # as 0 it read as a wrong answer.
                    values[label] = None
                    continue
            else:
                try:
                    value = fn(response, metadata, **{k: context[k] for k in self.extras[label]})
                    if inspect.iscoroutine(value):  # an `async def` function, awaited as a TRL one is
                        value = asyncio.run(value)
                except USER_CODE_ERRORS as e:  # noqa: BLE001 - the sample scores 0 (PerSampleEnvironment)
                    raise user_code_error(f"reward function {label!r} of environment {self.name!r}", e, fn) from e
            number = real_number(value)
            if number is None:
                raise TypeError(f"reward function {label!r} of environment {self.name!r} returned {value!r}, "
                                "not a number")
            if not math.isfinite(number):
                # Scored 0 here, not only as a NaN sum by the actor: in the sample's reward
                # components it made the step's logged reward/<function> mean NaN.
                raise ValueError(f"reward function {label!r} of environment {self.name!r} returned {number}")
            values[label] = number
        reward = sum(w * v for w, v in zip(self.weights, values.values()) if v is not None)
        if len(values) > 1:
            metadata = {**metadata, REWARD_COMPONENTS_KEY: values}
        if self.correct_at_least:
            needed = [(values[label], least) for label, least in self.correct_at_least.items()]
            metadata[CORRECT_KEY] = None if any(v is None for v, _ in needed) else all(v >= m for v, m in needed)
        return StepResult(observation="", reward=reward, terminated=True, metadata=metadata, answer=response)


# Metadata key of a sample's TRL reward function values, from `step` to `step_one` (removed there).
_TRL_VALUES_KEY = "_trl_reward_values"


def is_trl_reward_function(fn: Callable) -> bool:
    """TRL's reward function signature: `fn(completions, **kwargs) -> list[float | None]`."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except ValueError:
        return False


# The keywords `_trl_values` gives a TRL reward function besides the metadata keys of the batch.
TRL_KEYWORDS = ("prompts", "completions", "completion_ids", "trainer_state", "log_metric", "log_extra")


def check_trl_columns(name: str, fns: dict[str, Callable], rows: list[dict[str, Any]]) -> None:
    """Refuse a TRL reward function with a required parameter that neither `TRL_KEYWORDS` nor a
    key of the rows (their `answer` and `metadata` keys: TRL's dataset columns) fills. Called with
    the rows before Ray starts: the function otherwise raised TypeError at every step, every sample
    scored 0, and the run stopped only at env.<name>.max_failed_steps."""
    keys = {*TRL_KEYWORDS, *(["answer"] if any("answer" in r for r in rows) else []),
            *(k for r in rows for k in (r.get("metadata") or {}))}
    for label, fn in fns.items():
        if not is_trl_reward_function(fn):
            continue
        try:
            params = inspect.signature(fn).parameters.values()
        except ValueError:  # no signature to read: its first call tells
            continue
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        missing = [p.name for p in params if p.kind in named and p.default is p.empty and p.name not in keys]
        if missing:
            columns = sorted(keys - set(TRL_KEYWORDS))
            raise ConfigError(
                f"env.{name}.target: the TRL reward function {label!r} takes {', '.join(missing)}, which TRL fills from "
                f"dataset columns, but the rows of environment {name!r} have no such key (theirs: "
                f"{', '.join(columns) or 'none'}; a row's `answer` and the keys of its `metadata` are passed); add it "
                "to each row's metadata, or give the parameter a default")


def _trl_values(fns: dict[str, Callable], message_logs: list[list[dict[str, str]]],
                metadata: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each sample's value of each TRL reward function, called as TRL's GRPOTrainer calls it, and
    what the functions logged for each sample.

    Keywords: `prompts` (each sample's messages before its first answer), `completions` (its
    messages from there on: assistant turns, and tool or environment turns between them; both as
    text, the prompt's last message and the completion's, for a prompt-only row whose prompt was
    a string: TRL's standard format),
    `completion_ids` (its tokens after the prompt), `trainer_state` (`global_step`: GRPO steps
    done, `max_steps`), `log_metric(name, value)` (logged as env/<name>), `log_extra(column,
    values)` (one value per sample, shown in samples.jsonl), and every metadata key of the
    batch (the row's `answer` among them) as a list, None where a sample lacks it. A function
    gets those it names (all with **kwargs); an `async def` one is awaited. One that raises or returns the wrong count of
    values gives every sample its exception (they score 0, recorded)."""
    starts = [next((i for i, m in enumerate(log) if m.get("role") == "assistant"), len(log)) for log in message_logs]
    rollout = [m.get(ROLLOUT_KEY) or {} for m in metadata]
    metrics: dict[str, list[float]] = {}
    extras: dict[str, list[Any]] = {}

    def log_metric(name: str, value: float) -> None:
        metrics.setdefault(name, []).append(float(value))

    def log_extra(column: str, values: list[Any]) -> None:
        values = list(values)
        if len(values) != len(message_logs):  # zipped with the samples, the rest went unlogged without a word
            raise ValueError(f"log_extra({column!r}, ...) got {len(values)} values for {len(message_logs)} completions")
        extras[column] = values

    # TRL's standard format (a prompt-only row's string prompt) gives strings: the prompt's text and
    # the completion's; conversational data gives the messages.
    text = [bool(m.get(TEXT_PROMPT_KEY)) for m in metadata]
    batch = {"prompts": [_text_of(log[i - 1:i]) if t else log[:i] for log, i, t in zip(message_logs, starts, text)],
             "completions": [_text_of(log[i:]) if t else log[i:] for log, i, t in zip(message_logs, starts, text)],
             "completion_ids": [r.get("completion_ids") for r in rollout],
             "trainer_state": SimpleNamespace(global_step=(rollout[0].get("global_step") if rollout else None) or 0,
                                              max_steps=rollout[0].get("max_steps") if rollout else None),
             "log_metric": log_metric, "log_extra": log_extra}
    keys = sorted({k for m in metadata for k in m if k not in batch and not k.startswith("_")})
    columns = {k: [m.get(k) for m in metadata] for k in keys}
    out: list[dict[str, Any]] = [{} for _ in message_logs]
    available = {**batch, **columns}
    for label, fn in fns.items():
        kwargs = {k: available[k] for k in _keywords_taken(fn, tuple(available))}
        try:
            values = fn(**kwargs)
            if inspect.iscoroutine(values):  # an `async def` function, which TRL awaits too
                values = asyncio.run(values)
            values = list(values)
            if len(values) != len(message_logs):
                raise ValueError(f"returned {len(values)} values for {len(message_logs)} completions")
            bad = next((v for v in values if v is not None and real_number(v) is None), None)
            if bad is not None:
                raise TypeError(f"returned {bad!r}, not a number")
        except USER_CODE_ERRORS as e:  # noqa: BLE001 - the user's function: every sample scores 0 and records it
            error = user_code_error(f"TRL reward function {label!r}", e, fn)
            values = [error] * len(message_logs)
        for sample, value in zip(out, values):
            sample[label] = value
    logged: list[dict[str, Any]] = [{} for _ in message_logs]
    if metrics:  # a value per call: every sample of the batch carries the batch's mean
        means = {name: sum(v) / len(v) for name, v in metrics.items()}
        for sample in logged:
            sample[ENV_METRICS_KEY] = means
    for column, values in extras.items():
        for sample, value in zip(logged, values):
            sample.setdefault(LOG_EXTRA_KEY, {})[column] = value
    return out, logged


def _text_of(messages: list[dict[str, Any]]) -> str:
    return "".join(str(m.get("content") or "") for m in messages)


def _keywords_taken(fn: Callable, names: tuple[str, ...]) -> tuple[str, ...]:
    """Which of the keywords `names` `fn` takes: those it names, all when it takes **kwargs,
    none without a signature to inspect (a builtin)."""
    try:
        params = inspect.signature(fn).parameters
    except ValueError:
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return names
    return tuple(k for k in names if k in params)


def _context_parameters(fn: Callable) -> tuple[str, ...]:
    """Which of the optional keywords (`prompt`, `messages`) a per-sample reward function takes."""
    return _keywords_taken(fn, CONTEXT_KEYWORDS)


def _prompt_text(messages: list[dict[str, str]]) -> str:
    """The last user message before the model's last answer ("" when there is none)."""
    answered = False
    for m in reversed(messages):
        answered = answered or m.get("role") == "assistant"
        if answered and m.get("role") == "user":
            return str(m.get("content", ""))
    return ""


def _reward_function(obj: Any, spec: str, key: str) -> Callable[..., float]:
    if inspect.isclass(obj):
        raise ConfigError(f"{key}: {spec!r} is a class; a list of targets holds reward functions only")
    if not callable(obj):
        raise ConfigError(f"{key}={spec!r} is a {type(obj).__name__}, not an environment class or a reward function")
    if is_trl_reward_function(obj):
        return obj
    try:
        inspect.signature(obj).bind("response", {}, **dict.fromkeys(_context_parameters(obj), ""))
    except TypeError:
        raise ConfigError(f"{key}={spec!r}: a reward function is called fn(response, metadata) "
                          f"(optional keywords: {', '.join(CONTEXT_KEYWORDS)}); "
                          f"{getattr(obj, '__name__', spec)}{inspect.signature(obj)} cannot be") from None
    except ValueError:
        pass  # no signature to inspect (a builtin): the first call tells
    return obj


def load_tools(name: str, cfg: EnvWorkerConfig) -> tuple[dict[str, Callable[..., Any]], list[dict[str, Any]]]:
    """The functions `env.<name>.tools` names, by name, and their JSON schemas."""
    key = f"env.{name}.tools"
    return describe_tools([(spec, load_target(spec, key)) for spec in cfg.tools or []], key)


def describe_tools(named: list[tuple[str, Any]], key: str) -> tuple[dict[str, Callable[..., Any]], list[dict[str, Any]]]:
    """Tool functions (each given as (what names it, the function)) by name, and their JSON
    schemas (transformers' `get_json_schema`: from the type hints and the docstring's Args
    section); errors name `key`."""
    from transformers.utils import get_json_schema

    tools: dict[str, Callable[..., Any]] = {}
    schemas = []
    for spec, fn in named:
        if inspect.isclass(fn) or not callable(fn):
            raise ConfigError(f"{key}: {spec!r} is a {type(fn).__name__}, not a function")
        try:
            schema = get_json_schema(fn)
        except Exception as e:  # noqa: BLE001 - transformers' reasons (no docstring, a hint it cannot map)
            raise ConfigError(f"{key}: {spec!r} has no JSON schema for the chat template: {e} (a tool needs type "
                              "hints and a docstring with an Args: section)") from None
        tool_name = schema["function"]["name"]
        if tool_name in tools:
            raise ConfigError(f"{key}: two tools are called {tool_name!r}")
        tools[tool_name] = fn
        schemas.append(schema)
    return tools, schemas


@dataclasses.dataclass(frozen=True)
class RewardFunctions:
    """What `env_factory` gives for reward functions: called with the worker config (in each
    environment actor) it builds their RewardFunctionEnvironment."""

    name: str
    fns: dict[str, Callable[..., float]]
    weights: list[float]
    tools: dict[str, Callable[..., Any]]

    def __call__(self, cfg: EnvWorkerConfig) -> RewardFunctionEnvironment:
        return RewardFunctionEnvironment(cfg, fns=self.fns, weights=self.weights, name=self.name, tools=self.tools)

    def check_rows(self, rows: list[dict[str, Any]]) -> None:
        """Refuse rows the functions cannot be called with (`check_trl_columns`)."""
        check_trl_columns(self.name, self.fns, rows)


def env_factory(name: str, cfg: EnvWorkerConfig) -> Callable[[EnvWorkerConfig], EnvironmentInterface]:
    """What builds environment `name` from its `target`: an environment class, or reward
    functions (one, or a weighted list, with the tools of `env.<name>.tools`) wrapped in
    RewardFunctionEnvironment."""
    key, target, weights = f"env.{name}.target", cfg.target, cfg.reward_weights
    specs = target if isinstance(target, list) else [target]
    if not specs:
        raise ConfigError(f"{key}: an empty list names no reward function")
    objs = [load_target(spec, key) for spec in specs]
    if isinstance(target, str) and inspect.isclass(objs[0]):
        if not issubclass(objs[0], EnvironmentInterface):
            raise ConfigError(f"{key}={target!r}: the class {objs[0].__name__} is no "
                              "posttrain.environments.EnvironmentInterface subclass (nor a reward function)")
        cls = objs[0]
        # Its actors build it as cls(cfg): a class that cannot be built failed only there, after
        # Ray had started and the policy had loaded.
        if inspect.isabstract(cls):
            missing = ", ".join(sorted(cls.__abstractmethods__))
            raise ConfigError(f"{key}={target!r}: the class {cls.__name__} does not define {missing}, which an "
                              "environment must (docs/environments.md)")
        try:
            signature = inspect.signature(cls)
        except ValueError:  # no signature to read (a C extension's class): its actors will say
            signature = None
        try:
            if signature is not None:
                signature.bind(cfg)
        except TypeError as e:
            raise ConfigError(f"{key}={target!r}: the class {cls.__name__} is built as {cls.__name__}(cfg), one "
                              f"argument (its env.{name} settings), but its __init__ takes {signature} ({e})") \
                from None
        if cfg.tools:
            raise ConfigError(f"env.{name}.tools: tools go with reward functions; the environment class "
                              f"{objs[0].__name__} runs its own (its `tools` attribute)")
        if cfg.correct_at_least:
            raise ConfigError(f"env.{name}.correct_at_least goes with reward functions; the environment class "
                              f"{objs[0].__name__} judges its samples itself (posttrain.environments.CORRECT_KEY "
                              "in the metadata it returns)")
        return objs[0]
    # Settings a built-in environment or a class reads, which nothing would read here: accepted,
    # they promised a time limit per call (a hung function holds its slice to step_timeout_s) or
    # settings the functions never see.
    if "timeout_s" in cfg.model_fields_set:
        raise ConfigError(f"env.{name}.timeout_s: reward functions run without a time limit per call (a hung one "
                          f"scores its slice of the step 0 after env.{name}.step_timeout_s and restarts the actor); "
                          f"set env.{name}.step_timeout_s instead")
    if cfg.cfg:
        raise ConfigError(f"env.{name}.cfg: reward functions get no settings ({sorted(cfg.cfg)}); give them in the "
                          "rows' metadata, as module constants of the functions' file, or write an environment "
                          "class with a config_class that reads them")
    fns: dict[str, Callable[..., float]] = {}
    for spec, obj in zip(specs, objs):
        label = spec.rpartition(":")[2]
        label = label if label not in fns else f"{label}_{len(fns)}"  # the same function twice
        fns[label] = _reward_function(obj, spec, key)
    unknown = sorted(set(cfg.correct_at_least or {}) - set(fns))
    if unknown:
        raise ConfigError(f"env.{name}.correct_at_least names {unknown}, which are not reward functions of "
                          f"{key}; they are: {', '.join(fns)}")
    tools, _ = load_tools(name, cfg)
    return RewardFunctions(name, fns, weights or [1.0] * len(fns), tools)
