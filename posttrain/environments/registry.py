"""Environments by name, and `create_env` that starts one as Ray actors."""

from __future__ import annotations

from posttrain.environments.actors import EnvironmentGroup
from posttrain.environments.arithmetic import ArithmeticEnvironment
from posttrain.environments.code import CodeEnvironment
from posttrain.environments.interfaces import EnvironmentInterface
from posttrain.environments.math import MathEnvironment
from posttrain.environments.reward_model import RewardModelEnvironment
from posttrain.environments.sliding_puzzle import SlidingPuzzleEnvironment
from posttrain.environments.story import StoryEnvironment
from posttrain.schemas import EnvWorkerConfig

ENVIRONMENTS: dict[str, type[EnvironmentInterface]] = {
    "math": MathEnvironment,
    "arithmetic": ArithmeticEnvironment,
    "sliding_puzzle": SlidingPuzzleEnvironment,
    "story": StoryEnvironment,
    "reward_model": RewardModelEnvironment,
    "code": CodeEnvironment,
}


def register_env(name: str, env_cls: type[EnvironmentInterface]) -> None:
    """Make `env_cls` available to `create_env(name, ...)` (and so to rows with task_name=name)."""
    ENVIRONMENTS[name] = env_cls


def create_env(name: str, cfg: EnvWorkerConfig | dict | None = None) -> EnvironmentGroup:
    """Start environment `name` as `cfg.num_workers` Ray actors behind an `EnvironmentGroup`
    (its `step` follows `EnvironmentInterface`); unknown names list the valid ones."""
    if name not in ENVIRONMENTS:
        raise ValueError(f"unknown environment {name!r}; valid: {', '.join(sorted(ENVIRONMENTS))}")
    if not isinstance(cfg, EnvWorkerConfig):
        cfg = EnvWorkerConfig.model_validate(cfg or {})
    return EnvironmentGroup(name, ENVIRONMENTS[name], cfg)
