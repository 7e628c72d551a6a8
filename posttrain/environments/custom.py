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

The target's module is pickled by value into the environment actors, so a file next to the
config needs no installing; what it imports must be installed where the actors run. Everything
is resolved on the driver before Ray starts, so a wrong target fails in seconds, naming the key.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import numbers
import os
import sys
from collections.abc import Callable
from typing import Any

from posttrain.config import ConfigError, MissingInputError
from posttrain.environments.interfaces import (
    REWARD_COMPONENTS_KEY,
    EnvironmentInterface,
    PerSampleEnvironment,
    StepResult,
    last_assistant_text,
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
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
        return module
    if os.getcwd() not in sys.path:
        sys.path.append(os.getcwd())  # last: a local file never shadows an installed module
    return importlib.import_module(module_part)


def load_target(spec: str, key: str) -> Any:
    """The object `spec` ("module:attr" or "file.py:attr") names; errors name `key`."""
    module_part, sep, attr = spec.rpartition(":")
    if not sep or not module_part or not attr.isidentifier():
        raise ConfigError(f"{key}={spec!r}: expected 'module:name' or 'path/to/file.py:name'")
    try:
        module = _import_module(module_part, key)
    except MissingInputError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of the user's module is a config error
        raise ConfigError(f"{key}={spec!r}: importing {module_part} failed: {type(e).__name__}: {e}") from None
    if not hasattr(module, attr):
        public = sorted(n for n in vars(module) if not n.startswith("_"))
        raise ConfigError(f"{key}={spec!r}: {module_part} has no {attr!r} (it has: {', '.join(public) or 'nothing'})")
    import ray.cloudpickle

    # By value: the actors need not import the module (a file anywhere, a module in the cwd).
    ray.cloudpickle.register_pickle_by_value(module)
    return getattr(module, attr)


class RewardFunctionEnvironment(PerSampleEnvironment):
    """Reward functions as a single-turn environment: every sample ends after one answer,
    scored sum_i weight_i * fn_i(response, metadata). With more than one function each value is
    kept in the sample's metadata (`REWARD_COMPONENTS_KEY`). A function that raises or returns
    no number scores the sample 0 and records the error (PerSampleEnvironment)."""

    def __init__(self, cfg: EnvWorkerConfig, fns: dict[str, Callable[..., float]], weights: list[float],
                 name: str):
        self.fns, self.weights, self.name = fns, weights, name
        self.extras = {label: _context_parameters(fn) for label, fn in fns.items()}

    def step_one(self, messages: list[dict[str, str]], metadata: dict[str, Any]) -> StepResult:
        response = last_assistant_text(messages)
        context = {"prompt": _prompt_text(messages), "messages": messages}
        values = {}
        for label, fn in self.fns.items():
            value = fn(response, metadata, **{k: context[k] for k in self.extras[label]})
            if not isinstance(value, numbers.Real):
                raise TypeError(f"reward function {label!r} of environment {self.name!r} returned {value!r}, "
                                "not a number")
            values[label] = float(value)
        reward = sum(w * v for w, v in zip(self.weights, values.values()))
        if len(values) > 1:
            metadata = {**metadata, REWARD_COMPONENTS_KEY: values}
        return StepResult(observation="", reward=reward, terminated=True, metadata=metadata, answer=response)


def _context_parameters(fn: Callable) -> tuple[str, ...]:
    """Which of the optional keywords (`prompt`, `messages`) `fn` takes: those it names, both
    when it takes **kwargs."""
    try:
        params = inspect.signature(fn).parameters
    except ValueError:  # no signature (a builtin): the two positional arguments only
        return ()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return CONTEXT_KEYWORDS
    return tuple(k for k in CONTEXT_KEYWORDS if k in params)


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
    try:
        inspect.signature(obj).bind("response", {}, **dict.fromkeys(_context_parameters(obj), ""))
    except TypeError:
        raise ConfigError(f"{key}={spec!r}: a reward function is called fn(response, metadata) "
                          f"(optional keywords: {', '.join(CONTEXT_KEYWORDS)}); "
                          f"{getattr(obj, '__name__', spec)}{inspect.signature(obj)} cannot be") from None
    except ValueError:
        pass  # no signature to inspect (a builtin): the first call tells
    return obj


def env_factory(name: str, target: str | list[str],
                weights: list[float] | None = None) -> Callable[[EnvWorkerConfig], EnvironmentInterface]:
    """What builds environment `name` from its `target`: an environment class, or reward
    functions (one, or a weighted list) wrapped in RewardFunctionEnvironment."""
    key = f"env.{name}.target"
    specs = target if isinstance(target, list) else [target]
    if not specs:
        raise ConfigError(f"{key}: an empty list names no reward function")
    objs = [load_target(spec, key) for spec in specs]
    if isinstance(target, str) and inspect.isclass(objs[0]):
        if not issubclass(objs[0], EnvironmentInterface):
            raise ConfigError(f"{key}={target!r}: the class {objs[0].__name__} is no "
                              "posttrain.environments.EnvironmentInterface subclass (nor a reward function)")
        return objs[0]
    fns: dict[str, Callable[..., float]] = {}
    for spec, obj in zip(specs, objs):
        label = spec.rpartition(":")[2]
        label = label if label not in fns else f"{label}_{len(fns)}"  # the same function twice
        fns[label] = _reward_function(obj, spec, key)
    return functools.partial(RewardFunctionEnvironment, fns=fns, weights=weights or [1.0] * len(fns), name=name)
