"""Environments as Ray actors behind one driver-side facade, `EnvironmentGroup`.

`create_env(name, cfg)` starts `cfg.num_workers` actors (0 CPUs each: they are light and
must not starve training) of the environment registered as `name`. `group.step(...)`
splits the batch into one contiguous slice per actor, runs the slices in parallel and
gathers them in order. A slice that does not finish within the step time limit, or whose
actor crashes, raises or returns other than one entry per sample (of the types
`EnvironmentReturn` names), scores 0 for its samples
(each records "env_error" in its metadata, which the rollout counts), as does a sample with
a non-finite reward, and the run goes on; a stuck actor is killed and, like
a crashed one, restarted by Ray (`max_restarts`). An actor that fails more often than
`max_restarts` allows is broken for good, and so is an environment in which every sample
failed in `max_failed_steps` steps in a row: the step raises `EnvironmentFailure` instead of
scoring zeros (GRPO then checkpoints its last complete step before it stops).
"""

from __future__ import annotations

import logging
import math
import re
import time
from dataclasses import replace
from typing import Any

from posttrain.config import RunStopped
from posttrain.environments.interfaces import (
    ENV_ERROR_KEY,
    ROLLOUT_KEY,
    EnvironmentInterface,
    EnvironmentReturn,
    is_message,
    metadata_problem,
    stop_strings_ok,
)
from posttrain.runtime import STOP_REQUESTED, freeze_setup_objects
from posttrain.schemas import EnvWorkerConfig

log = logging.getLogger("posttrain.environments")


class EnvironmentActor:
    """The Ray actor around one environment instance (its methods mirror the interface). Nothing
    here imports torch: an environment that needs it (the reward model) imports it itself."""

    def __init__(self, env_cls: type[EnvironmentInterface], cfg: EnvWorkerConfig):
        self.env = env_cls(cfg)
        freeze_setup_objects()

    def ready(self) -> bool:
        return True

    def step(self, message_logs: list[list[dict]], metadata: list[dict]) -> EnvironmentReturn:
        ret = self.env.step(message_logs, metadata)
        if isinstance(ret, EnvironmentReturn):  # anything else is the driver's to name (_contract_violation)
            # The rollout's own entry, which environments echo back with the rest, is the
            # driver's already: not sent back (a fifth of a GRPO step's return, ~0.3 ms).
            ret = replace(ret, metadata=[{k: v for k, v in m.items() if k != ROLLOUT_KEY}
                                         if isinstance(m, dict) and ROLLOUT_KEY in m else m for m in ret.metadata])
        return ret

    def close(self) -> None:
        self.env.close()


def _contract_violation(ret: Any, n: int) -> str | None:
    """What is wrong with an environment's return for `n` samples (None: nothing)."""
    if not isinstance(ret, EnvironmentReturn):
        return f"a {type(ret).__name__}, not an EnvironmentReturn"
    sizes = {"observations": len(ret.observations), "metadata": len(ret.metadata),
             "next_stop_strings": len(ret.next_stop_strings), "rewards": len(ret.rewards),
             "terminateds": len(ret.terminateds), "answers": len(ret.answers),
             **({"tool_calls": len(ret.tool_calls)} if ret.tool_calls is not None else {})}
    wrong = {k: v for k, v in sizes.items() if v != n}
    if wrong:
        return f"{wrong} entries for {n} samples"
    # Checked here, where the slice can score 0 naming the environment: a text observation
    # (StepResult takes one, EnvironmentReturn does not) crashed the driver's rollout.
    for field, kind in (("rewards", float), ("terminateds", bool)):
        if (problem := _not_values(field, getattr(ret, field), n, kind)) is not None:
            return problem
    for i, m in enumerate(ret.metadata):
        if (problem := metadata_problem(m)) is not None:
            return f"metadata[{i}]{problem}"
    for i, stops in enumerate(ret.next_stop_strings):
        if not stop_strings_ok(stops):
            return f"next_stop_strings[{i}] = {stops!r:.80}, not None or a list of non-empty strings"
    terminateds = _values(ret.terminateds, bool)
    for i, obs in enumerate(ret.observations):  # an ended conversation's observation is never shown
        if not terminateds[i] and not (is_message(obs) or (
                isinstance(obs, list) and obs and all(map(is_message, obs)))):
            return (f"observations[{i}] = {obs!r:.80}, not a message {{'role': ..., 'content': ...}} or a list of "
                    "them, for a conversation that goes on")
    return None


def _not_values(field: str, value: Any, n: int, kind: type) -> str | None:
    """What keeps `value` (the return's `field`) from being `n` values of `kind` (float or bool),
    one per sample: a list or tuple of Python or NumPy scalars, or a 1-D NumPy array or torch
    tensor (None: nothing)."""
    shape = getattr(value, "shape", None)
    if shape is not None:
        # One value per sample: a [B, 1] reward column passed the count check, then failed to
        # concatenate with the other actors' slices and stopped the driver's rollout.
        return None if len(shape) == 1 else f"{field} of shape {list(shape)}, not [{n}]"
    if not isinstance(value, (list, tuple)):
        return f"{field} as a {type(value).__name__}, not a list"
    for i, v in enumerate(value):
        # A number per sample (a bool is one too); a string "1.0" or a nested [r] is not.
        if isinstance(v, (str, bytes)) or not hasattr(v, "__float__"):
            return f"{field}[{i}] = {v!r:.80}, not a {kind.__name__}"
    return None


def _values(value: Any, kind: type) -> list:
    """`value`, checked by `_not_values`, as a list of Python floats or bools."""
    return [kind(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]


def _as_lists(ret: EnvironmentReturn, name: str) -> EnvironmentReturn:
    """`ret` (checked by `_contract_violation`) with its rewards and terminateds as lists, a NaN or
    infinite reward scored 0: it would poison its whole group's advantages (and the loss), so
    the sample records the error and ends, like one whose verifier raised (it went on to more
    turns, counted in env_errors again at each)."""
    rewards, metadata = _values(ret.rewards, float), list(ret.metadata)
    terminateds = _values(ret.terminateds, bool)
    bad = [j for j, r in enumerate(rewards) if not math.isfinite(r)]
    for j in bad:
        metadata[j] = {**(metadata[j] or {}), ENV_ERROR_KEY: f"environment {name!r} returned reward {rewards[j]}"}
        rewards[j], terminateds[j] = 0.0, True
    if bad:
        log.warning("environment %r returned %d non-finite rewards (samples %s of its %d); they score 0", name,
                    len(bad), ", ".join(map(str, bad[:10])) + (", ..." if len(bad) > 10 else ""), len(rewards))
    return replace(ret, rewards=rewards, terminateds=terminateds, metadata=metadata)


# Seconds a tool call's child process takes to start again after it was killed at its time limit.
_TOOL_CHILD_RESTART_S = 5.0


class EnvironmentFailure(RunStopped):
    """An environment that keeps failing: the run stops rather than scoring every sample 0."""


class _Abandoned(Exception):
    """The run was told to stop while an actor was still scoring its slice."""


# Seconds between looks at STOP_REQUESTED while an actor scores.
_STOP_POLL_S = 0.5
# Seconds a step's environments still get once the run is told to stop: a verifier that is merely
# working finishes (its step is then trained and saved); a hung one is abandoned.
_STOP_GRACE_S = 5.0


def _result(ref: Any, deadline: float, stop_seen: list[float]) -> Any:
    """`ray.get(ref)` by `deadline` (time.monotonic(); GetTimeoutError after it), or _Abandoned
    `_STOP_GRACE_S` after the run is told to stop (`stop_seen`: when it was first seen in this
    step, shared by its slices)."""
    import ray
    from ray.exceptions import GetTimeoutError

    while True:
        now = time.monotonic()
        if STOP_REQUESTED.is_set() and not stop_seen:
            stop_seen.append(now)
        if stop_seen:
            deadline = min(deadline, stop_seen[0] + _STOP_GRACE_S)
        left = deadline - now
        ready, _ = ray.wait([ref], timeout=max(0.0, min(left, _STOP_POLL_S)))
        if ready:
            return ray.get(ref)
        if stop_seen and left <= _STOP_POLL_S:
            raise _Abandoned
        if left <= _STOP_POLL_S:
            raise GetTimeoutError(f"no result within the slice's limit ({left:.1f} s left at the last look)")


def slice_time_limit(cfg: EnvWorkerConfig, message_logs: list[list[dict]]) -> float:
    """Seconds an actor's slice of a step (these conversations) may take: `step_timeout_s`, by
    default `timeout_s` per sample + 30 s, plus, with `tool_timeout_s`, that time and a restart
    of the child for each tool call in the slice's last turns: every call may run out its limit,
    and a slice lost to tools that were each stopped in time would kill the actor, and count."""
    if cfg.step_timeout_s is not None:
        return cfg.step_timeout_s
    calls = 0
    if cfg.tools and cfg.tool_timeout_s:
        from posttrain.environments.tool_calls import parse_tool_calls

        last = [next((str(m.get("content", "")) for m in reversed(log) if m.get("role") == "assistant"), "")
                for log in message_logs]
        calls = sum(len(parse_tool_calls(text)) for text in last)
    return cfg.timeout_s * len(message_logs) + calls * ((cfg.tool_timeout_s or 0) + _TOOL_CHILD_RESTART_S) + 30.0


def _actor_error(err: Exception) -> str:
    """The exception an actor's method raised and where, from Ray's error (whose text is Ray's
    framing, the traceback and terminal colour codes): "OSError: ... (file.py:12, in __init__)"."""
    from ray.exceptions import RayError

    if not isinstance(err, RayError):  # raised here, not in the actor
        return f"{type(err).__name__}: {err}"
    lines = [line.strip() for line in re.sub(r"\x1b\[[0-9;]*m", "", str(err)).splitlines() if line.strip()]
    if not lines:
        return type(err).__name__
    frames = [m for m in map(re.compile(r'File "(.+)", line (\d+), in (\S+)').match, lines) if m]
    where = f" ({frames[-1][1]}:{frames[-1][2]}, in {frames[-1][3]})" if frames else ""
    return lines[-1] + where


class EnvironmentGroup:
    """Driver facade over `cfg.num_workers` actors of one environment (see the module docstring)."""

    def __init__(self, name: str, env_cls: type[EnvironmentInterface], cfg: EnvWorkerConfig, wait: bool = True):
        """Starts the actors; `wait=False` returns before they are up (call `wait_ready` before
        the first step), so a caller can start other workers while they import."""
        import ray

        self.name = name
        self.cfg = cfg
        remote_cls = ray.remote(EnvironmentActor).options(
            num_cpus=0, max_restarts=cfg.max_restarts, max_task_retries=0
        )
        self._actors = [remote_cls.remote(env_cls, cfg) for _ in range(cfg.num_workers)]
        self._failures = [0] * cfg.num_workers
        self._failed_steps = 0  # steps in a row in which every sample failed
        self._restarting: set[int] = set()
        self._starting = [a.ready.remote() for a in self._actors]
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until every actor has started (returns at once when they have); one that failed
        stops them all and raises."""
        import ray

        if not self._starting:
            return
        starting, self._starting = self._starting, []
        try:
            ray.get(starting)
        except Exception as e:
            self.shutdown()
            raise EnvironmentFailure(f"environment {self.name!r} failed to start: {_actor_error(e)}") from e

    def step(self, message_logs: list[list[dict]], metadata: list[dict]) -> EnvironmentReturn:
        """`EnvironmentInterface.step` over the actors; failed slices score 0 (module docstring)."""
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError

        if len(message_logs) != len(metadata):
            raise ValueError(f"env {self.name}: {len(message_logs)} conversations but {len(metadata)} metadata dicts")
        self.wait_ready()
        for i in sorted(self._restarting):
            self._await_restart(i)
        n = len(message_logs)
        k = min(len(self._actors), n)
        bounds = [(i * n // k, (i + 1) * n // k) for i in range(k)]
        started = time.monotonic()
        pending = [
            (i, lo, hi, self._actors[i].step.remote(message_logs[lo:hi], metadata[lo:hi]))
            for i, (lo, hi) in enumerate(bounds)
        ]
        parts = []
        abandoned = False
        stop_seen: list[float] = []
        for i, lo, hi, ref in pending:
            limit = slice_time_limit(self.cfg, message_logs[lo:hi])
            try:
                ret = _result(ref, started + limit, stop_seen)
                problem = _contract_violation(ret, hi - lo)
                if problem is None:
                    parts.append(_as_lists(ret, self.name))
                    continue
                error = f"environment {self.name!r} step returned {problem}"
            except _Abandoned:
                # Scored as failed, not counted as a failure of the actor (the shutdown stops it):
                # the step ends and its checkpoint is saved before a scheduler's grace period runs out.
                error = f"environment {self.name!r} actor {i} was still scoring when the run was told to stop"
                abandoned = True
            except GetTimeoutError:
                error = f"environment {self.name!r} actor {i} did not answer within {limit:g} s"
                self._count_failure(i, error)
                ray.kill(self._actors[i], no_restart=False)
            except RayActorError as e:
                # Ray's own text is an RPC error ("Socket closed"), which names nothing of the environment's.
                error = (f"environment {self.name!r} actor {i} died during its step (its process exited: os._exit, "
                         f"a crash in native code, or out of memory): {str(e).splitlines()[0][:200]}")
                self._count_failure(i, error)
            except Exception as e:  # noqa: BLE001 - the environment's step raised: the slice scores 0
                # Its own exception and where, not Ray's framing, traceback and colour codes.
                error = f"environment {self.name!r} step failed: {_actor_error(e)}"
            log.warning("%s; %d samples score 0", error, hi - lo)
            parts.append(EnvironmentReturn.failed(metadata[lo:hi], error))
        ret = EnvironmentReturn.concat(parts)
        if not abandoned:
            self._count_failed_step(ret)
        return ret

    def _count_failed_step(self, ret: EnvironmentReturn) -> None:
        """Counts the calls in a row in which every sample failed. Only a sample the environment
        ended without an error ends the streak: one it merely continued (a tool call's result)
        says nothing of its scoring, and a reward function that raised on every answer never
        stopped a run whose answers came after a tool call."""
        errors = [m.get(ENV_ERROR_KEY) if m else None for m in ret.metadata]
        if not errors:
            return
        if not all(errors):
            if any(done and not e for done, e in zip(ret.terminateds, errors)):
                self._failed_steps = 0
            return
        self._failed_steps += 1
        limit = self.cfg.max_failed_steps
        if limit is not None and self._failed_steps >= limit:
            raise EnvironmentFailure(
                f"environment {self.name!r}: every sample failed in {self._failed_steps} steps in a row "
                f"(env.{self.name}.max_failed_steps={limit}); the last error: {errors[0]}. Stopping rather than "
                "scoring every sample 0"
            )

    def _count_failure(self, i: int, error: str) -> None:
        self._failures[i] += 1
        self._restarting.add(i)
        if self._failures[i] > self.cfg.max_restarts:
            raise EnvironmentFailure(
                f"{error}; it has failed {self._failures[i]} times, more than env.{self.name}.max_restarts="
                f"{self.cfg.max_restarts}: stopping rather than scoring every sample 0"
            )

    def _await_restart(self, i: int, timeout_s: float = 120.0) -> None:
        """Block until Ray has restarted actor `i` (calls to a restarting actor fail instead of waiting)."""
        import ray
        from ray.exceptions import ActorUnavailableError, GetTimeoutError

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                ray.get(self._actors[i].ready.remote(), timeout=max(0.1, deadline - time.monotonic()))
                self._restarting.discard(i)
                return
            except (ActorUnavailableError, GetTimeoutError) as e:
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"environment {self.name!r} actor {i} did not restart within {timeout_s:g} s") from e
                time.sleep(0.2)

    def shutdown(self) -> None:
        """Close the environments (their child processes) and stop the actors."""
        import ray

        from posttrain.distributed.cluster import local_ray_node_lost

        lost = local_ray_node_lost()  # then no close() would be answered: only the kills
        if not lost:
            # All at once, within one deadline: an actor left scoring at a stop answers only after
            # that step, and 10 s each held the exit (33 s with 3 hung actors). A dead or stuck
            # one is killed below anyway.
            closing = [actor.close.remote() for actor in self._actors]
            if closing:
                ray.wait(closing, num_returns=len(closing), timeout=10)
        for actor in self._actors:
            ray.kill(actor, no_restart=True)
        self._actors = []
