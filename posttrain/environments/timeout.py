"""Run a verification with a hard time limit, in a child process that is killed on timeout.

math-verify's own timeout uses SIGALRM: it works only in a main thread, and it cannot
interrupt C code (a sympy big-integer power such as 9^(9^(9^9)) runs until done). A child
process can always be killed, so a hang costs one respawn of the child, never the run.
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Callable


def _noop() -> None:
    return None


class SubprocessRunner:
    """One long-lived child process (spawned, so it is safe inside a threaded Ray worker).

    `run(fn, args, timeout_s)` returns `fn(*args)` computed in the child, re-raises its
    exception, or raises `TimeoutError` after killing the child (the next call starts a
    fresh one). `fn` must be importable (a module-level function). `warmup` runs once in
    each new child, untimed by `timeout_s`, so imports do not count against a verification.
    """

    def __init__(self, warmup: Callable[[], Any] = _noop, startup_timeout_s: float = 120.0):
        self._warmup = warmup
        self._startup_timeout_s = startup_timeout_s
        self._pool: Any = None

    def _ensure(self) -> Any:
        if self._pool is None:
            pool = multiprocessing.get_context("spawn").Pool(1)
            try:
                pool.apply_async(self._warmup).get(timeout=self._startup_timeout_s)
            except BaseException:
                pool.terminate()
                raise
            self._pool = pool
        return self._pool

    def run(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        pending = self._ensure().apply_async(fn, args)
        try:
            return pending.get(timeout=timeout_s)
        except multiprocessing.TimeoutError:
            self.close()
            raise TimeoutError(f"verification exceeded its time limit of {timeout_s:g} s") from None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
            self._pool = None


def import_cloudpickle() -> None:
    """A child's warm-up for a function pickled by value (`tool_calls.call_pickled_tool`):
    unpickling it imports Ray's cloudpickle, which should not count against the first call's
    time limit."""
    import ray.cloudpickle  # noqa: F401
