"""Run a verification with a hard time limit, in a child process that is killed on timeout.

math-verify's own timeout uses SIGALRM: it works only in a main thread, and it cannot
interrupt C code (a sympy big-integer power such as 9^(9^(9^9)) runs until done). A child
process can always be killed, so a hang costs one respawn of the child, never the run.
"""

from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Connection, wait
from typing import Any, Callable


def _noop() -> None:
    return None


def _serve(conn: Connection, warmup: Callable[[], Any]) -> None:
    """The child's loop: run each `(fn, args)` received, answer `(ok, value or exception)`."""
    try:
        warmup()
    except BaseException as e:  # noqa: BLE001 - the parent re-raises it
        conn.send((False, e))
        return
    conn.send((True, None))
    while True:
        try:
            fn, args = conn.recv()
        except EOFError:  # the parent closed its end: nothing more to run
            return
        try:
            answer = (True, fn(*args))
        except BaseException as e:  # noqa: BLE001 - the parent re-raises it
            answer = (False, e)
        try:
            conn.send(answer)
        except Exception as e:  # noqa: BLE001 - a result or exception that does not pickle
            conn.send((False, RuntimeError(f"{type(answer[1]).__name__} could not be sent back: {e}")))


class SubprocessRunner:
    """One long-lived child process (spawned, so it is safe inside a threaded Ray worker).

    `run(fn, args, timeout_s)` returns `fn(*args)` computed in the child, re-raises its
    exception, raises `TimeoutError` after killing the child, or `ChildProcessError` at once
    when the child dies (a crash in C code, `os._exit`); the next call starts a fresh child.
    The child's exit is watched beside its answer (`multiprocessing.Pool` would lose the task
    and leave the caller waiting out the whole limit). `fn` must be importable (a module-level
    function). `warmup` runs once in each new child, untimed by `timeout_s`, so imports do not
    count against a verification.
    """

    def __init__(self, warmup: Callable[[], Any] = _noop, startup_timeout_s: float = 120.0):
        self._warmup = warmup
        self._startup_timeout_s = startup_timeout_s
        self._process: Any = None
        self._conn: Connection | None = None

    def _ensure(self) -> Connection:
        if self._process is not None and not self._process.is_alive():  # died between calls
            self.close()
        if self._process is None:
            ctx = multiprocessing.get_context("spawn")
            parent, child = ctx.Pipe()
            process = ctx.Process(target=_serve, args=(child, self._warmup), daemon=True)
            process.start()
            child.close()
            self._process, self._conn = process, parent
            try:
                self._answer(self._startup_timeout_s, " while starting")
            except BaseException:
                self.close()
                raise
        assert self._conn is not None
        return self._conn

    def _answer(self, timeout_s: float, doing: str) -> Any:
        assert self._conn is not None and self._process is not None
        process = self._process
        ready = wait([self._conn, process.sentinel], timeout_s)
        if self._conn in ready:  # checked first: a child may answer and then exit
            try:
                ok, value = self._conn.recv()
            except EOFError:  # it died before answering
                pass
            else:
                if ok:
                    return value
                raise value
        self.close()
        if not ready:
            raise TimeoutError(f"verification exceeded its time limit of {timeout_s:g} s") from None
        raise ChildProcessError(f"the child process died{doing} (exit code {process.exitcode})")

    def run(self, fn: Callable[..., Any], args: tuple, timeout_s: float) -> Any:
        self._ensure().send((fn, args))
        return self._answer(timeout_s, "")

    def close(self) -> None:
        if self._process is not None:
            if self._process.is_alive():
                kill_descendants(self._process.pid)
                self._process.kill()
            self._process.join()
            self._process = None
        if self._conn is not None:
            self._conn.close()
            self._conn = None


def import_cloudpickle() -> None:
    """A child's warm-up for a function pickled by value (`tool_calls.call_pickled_tool`):
    unpickling it imports Ray's cloudpickle, which should not count against the first call's
    time limit."""
    import ray.cloudpickle  # noqa: F401


def kill_descendants(pid: int) -> None:
    """Kill what process `pid` started (a tool's shell command, a subprocess it waits on): found
    while `pid` still lives, they would otherwise outlive a timed-out call, orphaned, one per call."""
    import psutil

    try:
        descendants = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return
    for p in descendants:
        try:
            p.kill()
        except psutil.Error:
            pass
