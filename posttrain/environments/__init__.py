"""Environments: score model answers (and answer back, in multi-turn tasks) as Ray actors.

`create_env(name, cfg)` -> an `EnvironmentGroup` whose `step(message_logs, metadata)`
follows `EnvironmentInterface` (docs/architecture.md, docs/environments.md). Built-in
environments by name (`ENVIRONMENTS`): "math", "arithmetic", "sliding_puzzle", "code",
"story", "reward_model";
`register_env` adds one, and `env.<name>.target` names a class or reward function of the
user's own (`posttrain.environments.custom`).

The names below are imported on first use: the child processes that run verifications
with a time limit import `posttrain.environments.*` modules, and must not pay for torch
and Ray, which the environments themselves need.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "ENVIRONMENTS": "registry",
    "create_env": "registry",
    "resolve_env": "registry",
    "resolve_task_envs": "registry",
    "with_tool_schemas": "registry",
    "register_env": "registry",
    "EnvironmentGroup": "actors",
    "EnvironmentFailure": "actors",
    "EnvironmentInterface": "interfaces",
    "EnvironmentReturn": "interfaces",
    "PerSampleEnvironment": "interfaces",
    "StepResult": "interfaces",
    "CORRECT_KEY": "interfaces",
    "ArithmeticEnvironment": "arithmetic",
    "CodeEnvironment": "code",
    "MathEnvironment": "math",
    "SlidingPuzzleEnvironment": "sliding_puzzle",
    "make_sliding_puzzle_rows": "sliding_puzzle",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'posttrain.environments' has no attribute {name!r}")
    return getattr(importlib.import_module(f"posttrain.environments.{_EXPORTS[name]}"), name)
