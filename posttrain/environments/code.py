"""`code`: run the model's Python program against the row's tests; reward 1 when every test
passes (`env.code.cfg.reward: all`) or the fraction that pass (`fraction`).

- Program: the last fenced code block of the model's last message (```python ... ```, or a
  block without a language); a block cut off by the token limit counts up to the end; no
  fence: the whole message.
- Tests: the sample's metadata "tests", Python statements run one by one after the program in
  its namespace (MBPP's `test_list`: `assert add(1, 2) == 3`); one string is one test.
  Optional metadata "setup": code run before the program (imports the task promises), a string
  or a list of lines.
- Each sample runs in a fresh interpreter (`python -I`) in an empty temporary directory, in
  its own process session, under limits on address space (`memory_mb`), CPU seconds and
  written file size. After `timeout_s` (the `env.code.timeout_s` of every environment) the
  whole process group is killed, so what the program started dies with it.
- A program that fails, hangs or breaks a limit is a wrong program: it scores 0 (the
  observation says why) but is no environment error. With `max_attempts` > 1 (and
  `grpo.max_rollout_turns` as many) the failure goes back to the model, which answers again;
  the conversation's reward is its last attempt's score, wherever it ends (the attempt that
  passes, `max_attempts`, the rollout's turns, or the context filled up): each turn's reward is
  its attempt's score less the previous attempt's, and a conversation's turns add up. Only a
  row without tests or a harness that returns nothing counts in `env_errors`.
- Verdict (`CORRECT_KEY`), in both reward modes: correct when every test of the attempt
  passes. With `fraction` a program that passes some tests earns their share of the reward
  but counts as wrong in accuracy and pass@k; over several attempts the last one's verdict is
  the conversation's.
- Not a security sandbox: the program runs as the user running posttrain, with that user's
  network and files. Train on untrusted tasks inside a container.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import tempfile
from typing import Any

from posttrain.environments.interfaces import (
    CORRECT_KEY,
    PerSampleEnvironment,
    StepResult,
    last_assistant_text,
)
from posttrain.schemas import CodeEnvConfig, EnvWorkerConfig

_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON = {"", "python", "py", "python3"}

# Runs in the child: limits first, then the program and each test in one namespace. The
# program's own output goes to /dev/null; the result line goes to a copy of the original
# stdout, after a nonce the program is not given, so its prints cannot pose as a result.
_HARNESS = r"""
import json, os, resource, sys
job = json.loads(sys.stdin.read())
mem = job["memory_mb"] << 20
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (job["cpu_s"], job["cpu_s"] + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (job["file_mb"] << 20, job["file_mb"] << 20))
out = os.fdopen(os.dup(1), "w")
nonce = job.pop("nonce")
sink = open(os.devnull, "w")
os.dup2(sink.fileno(), 1)
os.dup2(sink.fileno(), 2)
sys.stdout = sys.stderr = sink
def describe(e):
    return (type(e).__name__ + ": " + str(e))[:300]
passed, error, ns = 0, None, {"__name__": "__solution__"}
try:
    exec(compile(job["setup"] + "\n" + job["program"], "<program>", "exec"), ns)
except BaseException as e:
    error = "the program raised " + describe(e)
else:
    for i, test in enumerate(job["tests"]):
        try:
            exec(compile(test, "<test %d>" % i, "exec"), ns)
            passed += 1
        except BaseException as e:
            error = error or "test %d (%s) failed: %s" % (i, test[:120], describe(e))
out.write(nonce + json.dumps({"passed": passed, "error": error}) + "\n")
out.flush()
os._exit(0)
"""


def extract_program(text: str) -> str:
    """The last Python (or unlabelled) fenced block of `text`, else `text` itself."""
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in _PYTHON]
    return blocks[-1] if blocks else text


def run_tests(program: str, tests: list[str], *, setup: str = "", timeout_s: float, memory_mb: int,
              file_mb: int = 16) -> tuple[int, str | None]:
    """(tests passed, the first failure or None) of `program` in a fresh, limited interpreter."""
    nonce = secrets.token_hex(16)
    job = {"program": program, "tests": tests, "setup": setup, "nonce": nonce, "memory_mb": memory_mb,
           "cpu_s": max(1, int(timeout_s) + 1), "file_mb": file_mb}
    with tempfile.TemporaryDirectory(prefix="posttrain-code-") as tmp:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        proc = subprocess.Popen([sys.executable, "-I", "-c", _HARNESS], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=tmp, env=env,
                                start_new_session=True)
        try:
            out, _ = proc.communicate(json.dumps(job).encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.communicate()
            return 0, f"timed out after {timeout_s:g} s"
        finally:
            _kill_group(proc)  # whatever the program left running in its session
    for line in reversed(out.decode(errors="replace").splitlines()):
        if line.startswith(nonce):
            result = json.loads(line[len(nonce):])
            return int(result["passed"]), result["error"]
    # No result line: the interpreter died (a limit, os._exit, a segfault) before reporting.
    return 0, f"the program ended the interpreter (exit status {proc.returncode}) before its tests finished"


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class CodeEnvironment(PerSampleEnvironment):
    config_class = CodeEnvConfig

    def __init__(self, cfg: EnvWorkerConfig):
        self.cfg = CodeEnvConfig.model_validate(cfg.cfg)
        self.timeout_s = cfg.timeout_s
        self.parallel_samples = self.cfg.parallel_runs or os.cpu_count() or 1

    def step_one(self, messages: list[dict[str, str]], metadata: dict[str, Any]) -> StepResult:
        tests = metadata.get("tests")
        if isinstance(tests, str):
            tests = [tests]
        if not tests or not all(isinstance(t, str) for t in tests):
            raise ValueError("code: the sample's metadata has no 'tests' (a list of Python statements, e.g. "
                           "\"assert add(1, 2) == 3\")")
        setup = metadata.get("setup") or ""
        if isinstance(setup, list) and all(isinstance(line, str) for line in setup):
            setup = "\n".join(setup)  # lines, as MBPP's test_imports: str() of the list imported nothing
        if not isinstance(setup, str):
            raise ValueError(f"code: the sample's metadata 'setup' is a {type(setup).__name__}, not Python code "
                             "(a string, or a list of lines)")
        program = extract_program(last_assistant_text(messages))
        passed, error = run_tests(program, tests, setup=setup, timeout_s=self.timeout_s, memory_mb=self.cfg.memory_mb)
        total = len(tests)
        attempt = int(metadata.get("attempt", 0)) + 1
        done = passed == total or attempt >= self.cfg.max_attempts
        observation = f"Environment: {passed}/{total} tests passed" + (f"; {error}" if error else "")
        if not done:
            observation += ". Fix the program and answer with all of it again."
        # Rewards add up over a conversation's turns, which may end after any of them (turns or
        # context used up): the score's change since the last attempt keeps the sum at the latest
        # attempt's score. (Scoring only a final attempt lost a half-right one's fraction when
        # the context, not max_attempts, ended the conversation.)
        score = passed / total if self.cfg.reward == "fraction" else float(passed == total)
        return StepResult(observation=observation, reward=score - float(metadata.get("score", 0.0)), terminated=done,
                          metadata={**metadata, "tests_passed": passed, "attempt": attempt, "score": score,
                                    CORRECT_KEY: passed == total},
                          answer=program)
