"""The environment contract (docs/architecture.md) and the per-sample base every built-in
environment uses, which turns a verifier that raises into reward 0 plus a recorded error.

`step(message_logs, metadata)` gets, per sample, the conversation so far (the last message
is the model's) and the sample's metadata (for RL rows: the row's `metadata` plus its
`answer`), and returns an `EnvironmentReturn`. The metadata returned for a sample is what
the next `step` of a multi-turn conversation receives. A sample whose verification failed
carries `metadata["env_error"]` (the error text); the rollout counts these as `env_errors`.

Correctness is the environment's verdict, not the reward's sign: a sample is correct when
its returned metadata has `metadata["env_correct"] = True` (`CORRECT_KEY`), wrong when False,
and unjudged when the key is missing or None. The reward is what training optimises and may
give partial credit (a fraction of tests, a format bonus, a reward model's score); the
verdict is what `accuracy`, pass@k and cons@k count (`posttrain.evals`). Samples without a
verdict are left out of those metrics, never counted by their reward: an environment with no
notion of a right answer (the reward model), a user's environment that sets no verdict, a
sample whose verification failed (`env_error`: the sample was not judged), and reward
functions without `env.<name>.correct_at_least`. Of a multi-turn conversation the verdict is
its last step's: the rollout never passes a verdict on to the next step, so a step that sets
none leaves the conversation unjudged.
"""

from __future__ import annotations

import logging
import math
import numbers
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, ClassVar

log = logging.getLogger("posttrain.environments")

ENV_ERROR_KEY = "env_error"
# Metadata key of a sample's reward components ({name: value}), which the rollouts log as
# reward/<name> means (reward functions in a list, posttrain.environments.custom).
REWARD_COMPONENTS_KEY = "reward_components"
# Metadata key of a sample's turns with tool calls so far (reward functions with tools,
# posttrain.environments.custom), logged as tool_calls_mean.
TOOL_CALLS_KEY = "tool_calls"
# Metadata key the rollout sets on every sample for the environment's step (and removes from
# what comes back): {"completion_ids": the conversation's tokens after its prompt, "global_step":
# the GRPO steps done, "max_steps": grpo.max_num_steps (the steps are None outside GRPO),
# "last_turn": whether the conversation ends after this step whatever the environment says
# (grpo.max_rollout_turns reached, or the answer cut at the token limit): its last chance to
# score; "tokens_left": the context's tokens after the model's turn (policy.max_total_sequence_length
# less the conversation's): an observation that does not fit in them (its chat-template text
# and the next generation prompt included) ends the conversation after this step too, which
# `last_turn` cannot tell in advance}. TRL reward functions get the first three as
# `completion_ids` and `trainer_state`.
ROLLOUT_KEY = "_rollout"
# Metadata keys of a sample's metrics ({name: number}, logged as env/<name> means over the
# samples that have them) and of extra values shown with it in samples.jsonl ({column: value});
# TRL reward functions write them with `log_metric` and `log_extra`.
ENV_METRICS_KEY = "env_metrics"
LOG_EXTRA_KEY = "log_extra"
# Metadata key of a sample's verdict (module docstring): True correct, False wrong, None or
# missing not judged. A metadata key like the ones above, not a field of StepResult and
# EnvironmentReturn: metadata already carries every per-sample fact an environment reports,
# through the actors, `concat` and `failed`, and an environment class of the user's sets it
# without a new constructor argument.
CORRECT_KEY = "env_correct"
# What the user's code (a verifier, a reward function, a tool; often running the model's own
# code) may raise and fail only its sample: SystemExit too (`exit()`, `sys.exit()`), which would
# end the environment's Ray actor, lose its whole slice and, repeated, stop the run.
USER_CODE_ERRORS = (Exception, SystemExit)


class UserCodeError(Exception):
    """An error the user's code raised (a reward function), told as `user_code_error` tells it."""


def user_code_error(what: str, e: BaseException, fn: Callable) -> UserCodeError:
    """`e`, raised by the user's function `fn`, as an error naming `what` and the line of `fn`'s
    file it was raised at (the innermost one: a helper in the same file is the line to look at):
    "ValueError: boom" alone named neither the function of several nor where it failed."""
    source = getattr(getattr(fn, "__code__", None) or getattr(type(fn).__call__, "__code__", None),
                     "co_filename", None)
    frame = next((f for f in reversed(traceback.extract_tb(e.__traceback__)) if f.filename == source), None)
    at = f" at {frame.filename.rsplit('/', 1)[-1]}:{frame.lineno} in {frame.name}" if frame else ""
    return UserCodeError(f"{what} raised {type(e).__name__}{at}: {e}")


def _error_text(e: BaseException) -> str:
    """How a sample's error reads in its metadata (`ENV_ERROR_KEY`) and the log."""
    return str(e) if isinstance(e, UserCodeError) else f"{type(e).__name__}: {e}"


@dataclass
class EnvironmentReturn:
    # One per sample: a message {"role": "environment"|"user"|"tool", "content": str}, or a list of
    # messages (one tool result per call of the model's turn, as chat templates expect them; a
    # tool message may name its call: "tool_call_id", and its tool: "name").
    observations: list[dict[str, Any] | list[dict[str, Any]]]
    metadata: list[dict[str, Any]]  # per sample; passed to the next step of a multi-turn conversation
    # Stop strings of the next generation turn, besides policy.generation.stop_strings (None: the row's own).
    next_stop_strings: list[list[str] | None]
    # One per sample, as plain lists: an environment actor imports no torch (~3 s of CPU and ~200 MB
    # per actor). A user's environment may return a 1-D NumPy array or torch tensor instead; the
    # driver (`EnvironmentGroup.step`) turns it into a list.
    rewards: list[float]
    terminateds: list[bool]
    answers: list[str | None]  # the answer the environment extracted (for logs), None if none
    # Per sample, the tool calls the environment read from the model's last turn, in the OpenAI
    # message format ({"id", "type": "function", "function": {"name", "arguments"}}), or None.
    # The rollout sets them as that assistant message's `tool_calls`: chat templates that
    # render tool results against the calls (Mistral's) need them. None: no sample has any.
    tool_calls: list[list[dict[str, Any]] | None] | None = None

    @property
    def num_errors(self) -> int:
        """Samples whose verification raised or timed out (they scored 0)."""
        return sum(1 for m in self.metadata if m.get(ENV_ERROR_KEY))

    @staticmethod
    def concat(parts: list["EnvironmentReturn"]) -> "EnvironmentReturn":
        """The parts' samples in order; their rewards and terminateds are lists already (the actors'
        slices as `EnvironmentGroup.step` reads them)."""
        return EnvironmentReturn(
            observations=[o for p in parts for o in p.observations],
            metadata=[m for p in parts for m in p.metadata],
            next_stop_strings=[s for p in parts for s in p.next_stop_strings],
            rewards=[r for p in parts for r in p.rewards],
            terminateds=[t for p in parts for t in p.terminateds],
            answers=[a for p in parts for a in p.answers],
            tool_calls=([c for p in parts for c in (p.tool_calls or [None] * len(p.metadata))]
                        if any(p.tool_calls for p in parts) else None),
        )

    @staticmethod
    def failed(metadata: list[dict[str, Any]], error: str) -> "EnvironmentReturn":
        """Every sample scores 0, ends its conversation and records `error`."""
        n = len(metadata)
        return EnvironmentReturn(
            observations=[{"role": "environment", "content": "Environment error."} for _ in range(n)],
            metadata=[{**m, ENV_ERROR_KEY: error} for m in metadata],
            next_stop_strings=[None] * n,
            rewards=[0.0] * n,
            terminateds=[True] * n,
            answers=[None] * n,
        )


class EnvironmentInterface(ABC):
    # Python functions the model may call, each with type hints and a docstring with an Args:
    # section: their JSON schemas go to the chat template with every prompt of the environment's
    # rows (`with_tool_schemas`). The environment reads and runs the calls itself
    # (`posttrain.environments.tool_calls.parse_tool_calls` reads the usual formats).
    tools: ClassVar[tuple[Callable[..., Any], ...]] = ()
    # Scores against the row's reference `answer`: eval refuses, at setup, a row of this environment
    # without one (each of its samples would score 0 as an env error, a wrong score).
    needs_answer: ClassVar[bool] = False

    @abstractmethod
    def step(self, message_logs: list[list[dict[str, str]]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        """Score the last assistant message of each conversation; see the module docstring."""

    def close(self) -> None:
        """Release processes or files the environment holds (called before its actor is stopped)."""


@dataclass
class StepResult:
    """What a `PerSampleEnvironment` returns for one sample."""

    # A text or a whole message, or a list: one message per item (e.g. one per tool call), each a
    # text or a whole message (a tool result with its "tool_call_id" and "name"); None (or []): no
    # message, as at the end of a conversation.
    observation: str | dict[str, Any] | list[str | dict[str, Any]] | None
    reward: float
    terminated: bool
    metadata: dict[str, Any]
    answer: str | None = None
    next_stop_strings: list[str] | None = None
    # The chat role of the observation's texts: "environment" (shown as a user turn) or e.g. "tool".
    observation_role: str = "environment"
    # The calls read from the model's turn (OpenAI message format; EnvironmentReturn.tool_calls).
    tool_calls: list[dict[str, Any]] | None = None


def real_number(value: Any) -> float | None:
    """`value` as a float when it is one real number: a Python number or bool, or a NumPy or torch
    scalar of one (np.isclose gives a NumPy bool, which is no numbers.Real); else None (a string
    "1.0" too). An integer too large for a float is infinite (a reward check then names it)."""
    if isinstance(value, numbers.Real):
        try:
            return float(value)
        except OverflowError:  # 10**400
            return math.inf if value > 0 else -math.inf
    if getattr(value, "shape", None) == () and not isinstance(value, (str, bytes, numbers.Complex)):
        try:
            return float(value)
        except (TypeError, ValueError, RuntimeError):  # RuntimeError: torch's complex scalars
            return None
    return None


def _is_bool(value: Any) -> bool:
    """A bool, or a NumPy or torch bool scalar (what `np.all(...)` gives)."""
    return isinstance(value, bool) or (getattr(value, "shape", None) == ()
                                       and "bool" in str(getattr(value, "dtype", "")))


def _is_flag(value: Any) -> bool:
    """A bool or the integer 0 or 1: what `terminated` may be (bool("False") is True: a string
    ended a conversation meant to go on)."""
    return _is_bool(value) or (isinstance(value, numbers.Integral) and value in (0, 1))


def _observation_problem(obs: Any) -> str | None:
    """What keeps `obs` from being a StepResult observation (see there), or None."""
    if obs is None or isinstance(obs, (str, dict)):
        return None
    if isinstance(obs, (list, tuple)) and all(isinstance(o, (str, dict)) for o in obs):
        return None
    return f"observation {obs!r:.80} ({type(obs).__name__}), not a text, a message (dict), a list of them or None"


class PerSampleEnvironment(EnvironmentInterface):
    """An environment defined one sample at a time by `step_one`.

    `step` calls `step_one` per sample; an exception (a broken verifier, a malformed
    conversation, a timeout) scores that sample 0, ends its conversation, stores the error
    text in its metadata under "env_error" and is logged. It never stops the batch.
    """

    # Samples scored at once, in threads: for a `step_one` that waits on a child process (code).
    parallel_samples: int = 1

    @abstractmethod
    def step_one(self, messages: list[dict[str, str]], metadata: dict[str, Any]) -> StepResult:
        """One sample's turn: `messages` ends with the model's message."""

    def _score(self, messages: list[dict[str, str]], meta: dict[str, Any] | None) -> tuple[StepResult, BaseException | None]:
        """The sample's result, and the error that scored it 0 (None)."""
        meta = {k: v for k, v in (meta or {}).items() if k != ENV_ERROR_KEY}
        try:
            try:
                result = self.step_one(messages, meta)
            except USER_CODE_ERRORS as e:  # noqa: BLE001 - recorded below
                if isinstance(e, UserCodeError) or type(self).__module__.startswith("posttrain."):
                    raise
                # A class of the user's: the line of its file that raised ("RuntimeError: boom"
                # alone, in the error that stops the run, named neither).
                raise user_code_error(f"{type(self).__name__}.step_one", e, type(self).step_one) from e
            # Read whole into the batch's return after every sample: a wrong type failed every sample of the slice.
            if not isinstance(result, StepResult):
                raise TypeError(f"step_one returned {result!r:.80}, not a StepResult")
            # Checked here, per sample: converted for the batch's return below, a string reward "0.75"
            # passed as 0.75 and a terminated "False" as True; an observation 12345 failed the whole slice.
            if real_number(result.reward) is None:
                raise TypeError(f"step_one returned reward {result.reward!r:.80} ({type(result.reward).__name__}), "
                                "not a number")
            if not _is_flag(result.terminated):
                raise TypeError(f"step_one returned terminated {result.terminated!r:.80} "
                                f"({type(result.terminated).__name__}), not a bool")
            if problem := _observation_problem(result.observation):
                raise TypeError(f"step_one returned {problem}")
            # The rest of the return's contract, checked per sample too: found in the slice's return
            # (actors._contract_violation), one sample's None observation scored the whole slice 0.
            obs = result.observation
            shown = obs if isinstance(obs, (list, tuple)) else [] if obs is None else [obs]
            if not result.terminated and not (shown and all(isinstance(o, str) or is_message(o) for o in shown)):
                raise TypeError(f"step_one returned observation {obs!r:.80} for a conversation that goes on "
                                "(terminated=False): give a text, a message {'role': ..., 'content': ...} or a list of "
                                "them")
            if problem := metadata_problem(result.metadata):
                raise TypeError(f"step_one returned metadata{problem}")
            if not stop_strings_ok(result.next_stop_strings):
                raise TypeError(f"step_one returned next_stop_strings {result.next_stop_strings!r:.80}, not None or a "
                                "list of non-empty strings")
            return result, None
        except USER_CODE_ERRORS as e:  # noqa: BLE001 - any verifier failure scores 0 and is recorded
            return StepResult("Environment error.", 0.0, True, {**meta, ENV_ERROR_KEY: _error_text(e)}), e

    def _log_errors(self, errors: list[tuple[int, BaseException]], n: int, shown: int = 3) -> None:
        """A warning per kind of error of a step's samples, `shown` kinds at most (a line per sample
        was 512 lines a step for a reward function that always raises), the first with its traceback."""
        kinds: dict[str, list[tuple[int, BaseException]]] = {}
        for i, e in errors:
            kinds.setdefault(_error_text(e), []).append((i, e))
        for k, (text, failed) in enumerate(list(kinds.items())[:shown]):
            more = f" and {len(failed) - 1} more with the same error" if len(failed) > 1 else ""
            log.warning("%s: sample %d%s (of %d) scored 0: %s", type(self).__name__, failed[0][0], more, n, text,
                        exc_info=failed[0][1] if k == 0 else None)
        if len(kinds) > shown:
            rest = sum(len(f) for f in list(kinds.values())[shown:])
            log.warning("%s: %d more samples scored 0 with other errors", type(self).__name__, rest)

    def step(self, message_logs: list[list[dict[str, str]]], metadata: list[dict[str, Any]]) -> EnvironmentReturn:
        if len(message_logs) != len(metadata):
            raise ValueError(f"step: {len(message_logs)} conversations but {len(metadata)} metadata dicts")
        n = len(message_logs)
        if self.parallel_samples > 1 and n > 1:
            with ThreadPoolExecutor(min(self.parallel_samples, n)) as pool:
                scored = list(pool.map(self._score, message_logs, metadata))
        else:
            scored = [self._score(m, meta) for m, meta in zip(message_logs, metadata)]
        results = [r for r, _ in scored]
        if errors := [(i, e) for i, (_, e) in enumerate(scored) if e is not None]:
            self._log_errors(errors, n)
        return EnvironmentReturn(
            # A whole message is one observation too: iterated as a list, its keys became messages.
            observations=[_message(r.observation, r.observation_role) if isinstance(r.observation, (str, dict))
                          else [_message(o, r.observation_role) for o in r.observation or ()] for r in results],
            metadata=[r.metadata for r in results],
            next_stop_strings=[r.next_stop_strings for r in results],
            rewards=[real_number(r.reward) for r in results],
            terminateds=[bool(r.terminated) for r in results],
            answers=[r.answer for r in results],
            tool_calls=[r.tool_calls for r in results] if any(r.tool_calls for r in results) else None,
        )


def is_verdict(value: Any) -> bool:
    """Whether `value` is a verdict `CORRECT_KEY` may hold: None, a bool, or a NumPy or torch
    bool scalar (what `np.all(...)` gives). A number is not one: 1.0 or 0.5 is a reward."""
    return value is None or _is_bool(value)


def metadata_problem(metadata: Any) -> str | None:
    """What keeps `metadata` from being a sample's returned metadata (None keeps what it had):
    the rollout reads it as a dict, and a reward in the verdict's place would count partial
    credit as correct. Worded to follow its name ("metadata[3]" + this)."""
    if metadata is None:
        return None
    if not isinstance(metadata, dict):
        return f" = {metadata!r:.80}, not a dict"
    if not is_verdict(metadata.get(CORRECT_KEY)):
        return f"[{CORRECT_KEY!r}] = {metadata[CORRECT_KEY]!r:.80}, not True, False or None"
    return None


def stop_strings_ok(stops: Any) -> bool:
    """Whether `stops` is a sample's next_stop_strings: None or a list of non-empty strings (the
    generation backend refused others at the next turn, stopping the run)."""
    return stops is None or (isinstance(stops, list) and all(isinstance(x, str) and x for x in stops))


def is_message(obs: Any) -> bool:
    """An observation message. Any content: a chat template may take a list of parts, or a dict
    it writes as JSON."""
    return isinstance(obs, dict) and "content" in obs


def verdict(metadata: dict[str, Any] | None) -> bool | None:
    """The sample's verdict in `metadata` (`CORRECT_KEY`): True, False, or None (not judged)."""
    value = (metadata or {}).get(CORRECT_KEY)
    return None if value is None else bool(value)


def _message(observation: str | dict[str, Any], role: str) -> dict[str, Any]:
    return {"role": role, "content": observation} if isinstance(observation, str) else observation


def last_assistant_text(messages: list[dict[str, str]]) -> str:
    """Content of the last assistant message; a conversation without one is an error."""
    for m in reversed(messages):
        if m.get("role") == "assistant":
            return str(m.get("content", ""))
    raise ValueError("the conversation has no assistant message to score")
