"""Environments by name, and `create_env` that starts one as Ray actors."""

from __future__ import annotations

import difflib
import inspect
import logging
from collections.abc import Callable

from pydantic import BaseModel

from posttrain.config import ConfigError, InputError
from posttrain.data.formats import row_name, with_fields
from posttrain.environments.actors import EnvironmentGroup
from posttrain.environments.arithmetic import ArithmeticEnvironment
from posttrain.environments.code import CodeEnvironment
from posttrain.environments.custom import RewardFunctions, describe_tools, env_factory, load_tools
from posttrain.environments.interfaces import EnvironmentInterface
from posttrain.environments.math import MathEnvironment
from posttrain.environments.reward_model import RewardModelEnvironment
from posttrain.environments.sliding_puzzle import SlidingPuzzleEnvironment
from posttrain.environments.story import StoryEnvironment
from posttrain.schemas import EnvWorkerConfig, env_settings_problems

log = logging.getLogger(__name__)

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


def resolve_env(name: str, cfg: EnvWorkerConfig) -> Callable[[EnvWorkerConfig], EnvironmentInterface]:
    """What builds environment `name`: a registered one, or the class or reward function its
    `env.<name>.target` names (posttrain.environments.custom). Cheap to call again; setups call
    it before Ray starts, so an unknown name or a broken target fails in seconds."""
    if cfg.target is not None:
        if name in ENVIRONMENTS:
            raise ConfigError(f"env.{name}.target: {name!r} is a built-in environment; give yours another name "
                              "(and its rows that task_name, or set data.task_name)")
        factory = env_factory(name, cfg)
    elif name not in ENVIRONMENTS:
        raise ConfigError(f"unknown environment {name!r} (a row's task_name, or data.task_name); valid: "
                          f"{', '.join(sorted(ENVIRONMENTS))}, or your own class or reward function in "
                          f"env.{name}.target (docs/environments.md)")
    else:
        factory = ENVIRONMENTS[name]
    config_class = getattr(factory, "config_class", None) if inspect.isclass(factory) else None
    if config_class is not None:  # its settings fail here, naming the key, before any actor starts
        if not (inspect.isclass(config_class) and issubclass(config_class, BaseModel)):
            raise ConfigError(f"environment {name!r} ({factory.__qualname__}): config_class is {config_class!r}, "
                              "not a pydantic model (a subclass of pydantic.BaseModel) to validate env."
                              f"{name}.cfg with")
        problems = env_settings_problems(name, config_class, cfg.cfg)
        if problems:
            raise ConfigError(f"invalid config (env.{name}.cfg):\n" + "\n".join(f"  - {p}" for p in problems))
    if inspect.isclass(factory) and hasattr(factory, "global_post_process_and_metrics"):
        # NeMo RL's hook on the whole batch: nothing here calls it, and an environment ported with
        # one would lose what it computes without a word.
        raise ConfigError(f"environment {name!r} ({factory.__qualname__}) defines global_post_process_and_metrics, "
                          "which posttrain does not call: return per-sample numbers in each sample's "
                          "metadata['env_metrics'] (logged as env/<name> means; docs/environments.md) and remove it")
    return factory


def resolve_task_envs(rows: list[dict], env_cfg, require_answers: bool = False) -> list[str]:
    """The environments `rows` name (their `task_name`), sorted, each checked by `resolve_env`
    against its `env_cfg` section (an `EnvConfig`). Rows without one are SFT rows, refused here:
    their prompt would hold the answer, and no environment knows how to score them.
    Rows without a reference `answer` for an environment that `needs_answer` score 0 as an
    environment error in every sample: `require_answers` (eval, where that is a wrong score)
    refuses them; GRPO trains on such a file, those samples counted as env errors, with a warning
    here (a whole column missing, e.g. a gold answer under another name, would otherwise show only
    as env_errors in the step metrics)."""
    text = [r for r in rows if "text" in r]
    if text:
        raise InputError(f"{len(text)} of {len(rows)} rows are plain text (`text`; first: {row_name(text[0], 'row 1')}), which "
                         "SFT trains on as written; an environment scores answers to prompts (`messages` or `prompt` "
                         "rows)")
    sft = [r for r in rows if "task_name" not in r]
    if sft:
        raise InputError(f"{len(sft)} of {len(rows)} rows are SFT rows (a conversation with its answer, keys "
                         f"{sorted(sft[0])}), not prompts for an environment to score: set data.task_name=<environment> "
                         "(a conversation's last assistant message is then its answer), or give the rows a "
                         "task_name (docs/environments.md)")
    names = sorted({r["task_name"] for r in rows})
    # An entry no row names configures nothing. One inherited from another config (`arithmetic`
    # beside a `digits` task) is harmless; one named like an environment the data uses is a typo
    # (`env.mth.num_workers=2` left math at its defaults).
    for entry in sorted(set(env_cfg.model_extra or {}) - set(names)):
        close = difflib.get_close_matches(entry, names, n=1, cutoff=0.75)
        if close:
            raise ConfigError(f"env.{entry}: no data row names environment {entry!r} (task_name), which so "
                              f"configures nothing; did you mean env.{close[0]}? (the data's: {', '.join(names)})")
    for name in names:
        factory = resolve_env(name, env_cfg.get_worker_cfg(name))
        own = [i for i, r in enumerate(rows) if r["task_name"] == name]
        if isinstance(factory, RewardFunctions):
            factory.check_rows([rows[i] for i in own])
        for i in own:  # a blank answer is none: "" scored an empty response correct (arithmetic)
            if rows[i].get("answer") is not None and not str(rows[i]["answer"]).strip():
                rows[i]["answer"] = None
        missing = [i for i in own if rows[i].get("answer") is None]
        if not missing:
            continue
        first = rows[missing[0]]
        prompt = str(first["messages"][-1].get("content"))[:80]
        where = f"first: {row_name(first, f'row {missing[0] + 1}')}, prompt {prompt!r}"
        if getattr(factory, "needs_answer", False):
            what = (f"{len(missing)} of {len(rows)} rows for environment {name!r} have no reference `answer`, "
                    f"which it scores against ({where})")
            if require_answers:
                raise InputError(what)
            log.warning("%s: each of their samples scores 0 and counts as an env error", what)
        elif len(missing) < len(own):
            # Some rows with an answer and some without: a reward function that compares with it
            # scored the others as wrong answers, silently. None with one: the environment reads none.
            log.warning("%d of the %d rows for environment %r have no reference `answer` (%s): it gets "
                        "metadata['answer'] = None for them", len(missing), len(own), name, where)
    return names


def create_env(name: str, cfg: EnvWorkerConfig | dict | None = None, wait: bool = True) -> EnvironmentGroup:
    """Start environment `name` as `cfg.num_workers` Ray actors behind an `EnvironmentGroup`
    (its `step` follows `EnvironmentInterface`); unknown names list the valid ones. `wait=False`:
    return while the actors start (`EnvironmentGroup.wait_ready`)."""
    if not isinstance(cfg, EnvWorkerConfig):
        cfg = EnvWorkerConfig.model_validate(cfg or {})
    return EnvironmentGroup(name, resolve_env(name, cfg), cfg, wait=wait)


def with_tool_schemas(rows: list[dict], env_cfg) -> list[dict]:
    """`rows`, those of an environment with tools (`env.<name>.tools`, or an environment class's
    `tools` attribute) carrying the tools' JSON schemas under "tools", which every rendering of
    their conversations gives the chat template."""
    schemas: dict[str, list[dict]] = {}
    out = []
    for row in rows:
        name = row.get("task_name", "math")
        if name not in schemas:
            schemas[name] = _tool_schemas(name, env_cfg.get_worker_cfg(name))
        out.append(with_fields(row, tools=schemas[name]) if schemas[name] else row)
    return out


def _tool_schemas(name: str, cfg: EnvWorkerConfig) -> list[dict]:
    if cfg.tools:
        return load_tools(name, cfg)[1]
    factory = resolve_env(name, cfg)
    if not (inspect.isclass(factory) and factory.tools):
        return []
    key = f"{factory.__name__}.tools (environment {name!r})"
    return describe_tools([(getattr(fn, "__name__", repr(fn)), fn) for fn in factory.tools], key)[1]
