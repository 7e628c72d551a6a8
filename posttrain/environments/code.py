"""`code`: run the model's Python program against the row's tests; reward 1 when every test
passes (`env.code.cfg.reward: all`) or the fraction that pass (`fraction`).

- Program: the last fenced code block of the model's last message (```python ... ```, or a
  block without a language); a block cut off by the token limit counts up to the end; no
  fence: the whole message.
- Tests: the sample's metadata "tests", Python statements run one by one (MBPP's `test_list`:
  `assert add(1, 2) == 3`); one string is one test. Optional metadata "setup": code run before
  the program and before the tests (imports the task promises), a string or a list of lines.
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

How a sample runs, and why: an RL policy learns whatever makes the tests "pass", so the
program must not be able to make them pass without computing the answers. Two interpreters
(`python -I`, in an empty temporary directory, in a process group of their own) run each sample:

- The program's interpreter runs the setup and the program, under limits on address space
  (`memory_mb`), CPU seconds, written file size, and processes: RLIMIT_NPROC 0, so it can
  start no process or thread (the kernel does not apply this limit to root). Its stdin, stdout
  and stderr are /dev/null.
- The tests' interpreter runs the tests, with its own builtins and modules, and calls the
  program's functions over a pipe: arguments go and results come back as plain data (None,
  bool, int, float, complex, str, bytes, list, tuple, dict, set, frozenset, range, rebuilt
  by the tests' side from the pipe's text; a NumPy scalar, such as the np.int64 of `np.sum`,
  goes as its Python value). Anything else the program returns (an instance of
  its class, a generator) stays in the program's interpreter; the tests hold a handle they
  may call, iterate, index, take the len, str or an attribute of, or pass back to the
  program, but not compare or test for truth (that raises). So an object whose `==` is always
  true, patched builtins, `AssertionError` or modules, an exit at import, printed or written
  "results" reach no test: a test passes only on the plain values the program computed.
  Arguments are passed by value, and only plain data and handles can be: a test that hands
  the program a lambda fails, and one that checks a list the program changed in place does
  not see the change; a namedtuple comes back as a tuple (no `.x`). The program's top-level
  names are visible to the tests, except names a builtin or the setup already defines (a test
  sees the builtin, or the setup's); a standard-library module the program imported is
  imported again on the tests' side; a top-level container of more than 100,000 items (a
  precomputed table) stays a handle, which a test can index, iterate and take the len of.
- The program never holds the tests: they reach only the tests' interpreter, which has read
  them before the program's code runs and is not dumpable (its /proc files and memory are
  closed to its user). The program sees the arguments of its calls, no expected value.
- The tests' interpreter counts the passing tests and writes the count to the parent after a
  nonce the program is never given; the parent reads at most `_MAX_REPORT` bytes of it, within
  `timeout_s` (the `env.code.timeout_s` of every environment), then kills the process group.

Not guaranteed: this is not a security sandbox against malicious code. The program runs as
the user running posttrain, with that user's files (the data set's tests among them), network
and processes: it can kill them (this run included), and, as root or where that user may
ptrace its processes, read another process's memory, the parent's nonce included, and so
forge a result; as root it can start processes, and one that leaves its parent (a daemon's
double fork) outlives the kill. Train on untrusted tasks, or with a policy that might find such
a way, inside a container or sandbox that confines each program.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

from posttrain.environments.interfaces import (
    CORRECT_KEY,
    PerSampleEnvironment,
    StepResult,
    last_assistant_text,
)
from posttrain.environments.timeout import kill_descendants
from posttrain.schemas import CodeEnvConfig, EnvWorkerConfig

_FENCE = re.compile(r"```[ \t]*([\w+.-]*)[^\n]*\n(.*?)(?:```|\Z)", re.DOTALL)
_PYTHON = {"", "python", "py", "python3"}
# Both interpreters: isolated (no PYTHONPATH, user site or script directory), and without
# `site`'s start-up (-S), whose .pth files (an editable install's import hook) cost about 25 ms
# an interpreter; _CODEC puts the installed packages back on sys.path.
_PYTHON_FLAGS = ("-I", "-S", "-c")
# The tests' report is one short line; more is something else writing to the parent's pipe.
_MAX_REPORT = 64 << 10

# Plain data over the pipe, in both interpreters: JSON scalars as themselves, containers as a
# list led by a tag. `encode` takes a builtin type's subclass as its base type (a namedtuple
# goes as a tuple, a Counter as a dict) and a NumPy scalar as its Python value (a program's
# `np.sum` gives an np.int64, no int, which a test compares with one), and hands anything else
# to `other`; `decode` builds only builtin types, whatever the text, and hands a handle
# ["h", id, type name] to `handle`.
_CODEC = r"""
import json, os, resource, site, sys
sys.path.extend(site.getsitepackages())
sys.set_int_max_str_digits(0)
_CONTAINERS = ((tuple, "t"), (list, "l"), (frozenset, "f"), (set, "s"))
_BUILD = {"t": tuple, "l": list, "f": frozenset, "s": set}
def encode(v, other):
    if v is None or v is True or v is False:
        return v
    if isinstance(v, int):
        return int.__int__(v)
    if isinstance(v, float):
        return float.__float__(v)
    if isinstance(v, str):
        return str.__str__(v)
    if isinstance(v, dict):
        return ["d"] + [encode(x, other) for kv in dict.items(v) for x in kv]
    for base, tag in _CONTAINERS:
        if isinstance(v, base):
            return [tag] + [encode(x, other) for x in base.__iter__(v)]
    if isinstance(v, (bytes, bytearray)):
        return ["b", bytes(v).decode("latin-1")]
    if isinstance(v, complex):
        return ["c", complex.__complex__(v).real, complex.__complex__(v).imag]
    if isinstance(v, range):
        return ["r", v.start, v.stop, v.step]
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(v, numpy.generic):
        return encode(v.item(), other)
    return other(v)
def decode(x, handle):
    if type(x) is not list:
        if type(x) not in (type(None), bool, int, float, str):
            raise TypeError("not plain data: " + type(x).__name__)
        return x
    tag, items = x[0], x[1:]
    if tag == "h":
        return handle(*items)
    if tag == "b":
        return str.encode(items[0], "latin-1")
    if tag == "c":
        return complex(float(items[0]), float(items[1]))
    if tag == "r":
        return range(*[int(i) for i in items])
    items = [decode(i, handle) for i in items]
    if tag == "d":
        return dict(zip(items[::2], items[1::2]))
    return _BUILD[tag](items)
def describe(e):
    try:
        return (type(e).__name__ + ": " + str(e))[:300]
    except BaseException:
        return type(e).__name__
def limit(job, *names):
    for name, soft in (("AS", job["memory_mb"] << 20), ("CPU", job["cpu_s"]), ("FSIZE", job["file_mb"] << 20),
                       ("NPROC", 0)):
        if name in names:
            hard = soft + 1 if name == "CPU" else soft
            resource.setrlimit(getattr(resource, "RLIMIT_" + name), (soft, hard))
def send(pipe, msg):
    pipe.write(json.dumps(msg).encode() + b"\n")
    pipe.flush()
"""

# The program's interpreter: its job (program, setup, limits) is the first line on stdin; then
# it answers each request [op, handle, args...] from the tests with ["ok", value] or
# ["raise", exception type, message]. Nothing it sends is trusted by the tests' side.
_PROGRAM_SIDE = _CODEC + r"""
requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb")
null = os.open(os.devnull, os.O_RDWR)
for fd in (0, 1, 2):
    os.dup2(null, fd)
sys.stdin, sys.stdout, sys.stderr = open(os.devnull), open(os.devnull, "w"), open(os.devnull, "w")
job = json.loads(requests.readline())
limit(job, "AS", "CPU", "FSIZE", "NPROC")
objects = []
def keep(v):
    objects.append(v)
    return ["h", len(objects) - 1, type(v).__name__]
def encode_name(v):
    # A top-level table of many items (a precomputed sieve) stays here as a handle: copied, its
    # JSON took the tests' time limit (10^7 ints: 5 s). Tests index, iterate or measure it.
    if isinstance(v, (list, tuple, dict, set, frozenset)) and len(v) > 100_000:
        objects.append(v)
        return ["h", len(objects) - 1, "%s of %d items (not copied to the tests)" % (type(v).__name__, len(v))]
    return encode(v, keep)
ns = {"__name__": "__solution__"}
try:
    exec(compile(job.pop("setup") + "\n" + job.pop("program"), "<program>", "exec"), ns)
    names = [(k, v) for k, v in list(ns.items()) if not k.startswith("__")]
    reply = ["ok", ["d"] + [x for k, v in names if type(v) is not type(sys) for x in (k, encode_name(v))],
             {k: v.__name__ for k, v in names if type(v) is type(sys)}]
except BaseException as e:
    reply = ["raise", describe(e)]
send(replies, reply)
while True:
    line = requests.readline()
    if not line:
        os._exit(0)
    try:
        op, obj, *args = json.loads(line)
        obj = objects[obj]
        args = [decode(a, lambda i, *_: objects[i]) for a in args]
        if op == "call":
            v = obj(*args[0], **args[1])
        elif op == "getattr":
            v = getattr(obj, args[0])
        elif op == "iter":
            v = iter(obj)
        elif op == "next":
            v = next(obj)
        elif op == "len":
            v = len(obj)
        elif op == "getitem":
            v = obj[args[0]]
        else:
            v = str(obj)
        reply = ["ok", encode(v, keep)]
    except BaseException as e:
        reply = ["raise", type(e).__name__, describe(e)[len(type(e).__name__) + 2:]]
    send(replies, reply)
"""

# The tests' interpreter: not dumpable, so its user's other processes (the program's) cannot
# read its memory or open its pipes through /proc. It starts the program's interpreter first
# (its source is argv[1], its flags argv[2:]), reads its own job to EOF (the parent has then closed its end), and only
# then sends the program on; it writes nonce + {"passed", "error"} to its stdout.
_TESTS_SIDE = r"""
import os, sys
null = os.open(os.devnull, os.O_RDWR)
program_stdin, requests = os.pipe()
replies, program_stdout = os.pipe()
pid = os.posix_spawn(sys.executable, [sys.executable, *sys.argv[2:], sys.argv[1]], os.environ, file_actions=[
    (os.POSIX_SPAWN_DUP2, program_stdin, 0), (os.POSIX_SPAWN_DUP2, program_stdout, 1),
    (os.POSIX_SPAWN_DUP2, null, 2)])
os.close(program_stdin)
os.close(program_stdout)
""" + _CODEC + r"""
import builtins, importlib, signal
requests, replies = os.fdopen(requests, "wb"), os.fdopen(replies, "rb")
import ctypes  # while the program's interpreter starts: it runs no program before it is sent one
try:
    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0
except (OSError, AttributeError):
    pass
job = json.loads(sys.stdin.buffer.read())
limit(job, "AS")
report = os.fdopen(os.dup(1), "w")
for fd in (0, 1, 2):
    os.dup2(null, fd)
sys.stdin, sys.stdout, sys.stderr = open(os.devnull), open(os.devnull, "w"), open(os.devnull, "w")
ended = []
def kill_program():
    # The program's interpreter and every process below it, stopped as found (so none forks on)
    # through /proc, then killed: one that left the group (os.setsid(), which root may follow with
    # a fork) was orphaned by a kill of the interpreter alone, and then no longer found by the parent.
    tree, grew = {pid}, True
    while grew:
        grew = False
        for p in list(tree):
            try:
                os.kill(p, signal.SIGSTOP)
            except OSError:
                pass
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) in tree:
                continue
            try:
                with open("/proc/" + entry + "/stat", "rb") as f:
                    stat = f.read()
                parent = int(stat[stat.rindex(b")") + 2:].split()[1])
            except (OSError, ValueError, IndexError):
                continue
            if parent in tree:
                tree.add(int(entry))
                grew = True
    for p in tree:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
def program_ended():
    if not ended:
        kill_program()  # a program that closed its pipe but still runs
        status = os.waitpid(pid, 0)[1]
        ended.append(os.waitstatus_to_exitcode(status))
    return ended[0]
class ProgramEnded(Exception):
    pass
class ProgramError(Exception):
    pass
def ask(*msg):
    try:
        send(requests, list(msg))
        line = replies.readline()
    except BrokenPipeError:
        line = b""
    if not line:
        raise ProgramEnded("the program's interpreter ended (exit status %d)" % program_ended())
    reply = json.loads(line)
    if reply[0] == "ok":
        return decode(reply[1], Handle)
    name, message = str(reply[1]), str(reply[2])
    cls = getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, BaseException):
        raise cls(message)  # StopIteration ends a loop over the program's iterator
    raise ProgramError(name + ": " + message)
class Handle:
    # The program's object that is not plain data, named by its index in the program's process.
    __slots__ = ("_id", "_type")
    def __init__(self, i, type_name):
        object.__setattr__(self, "_id", int(i))
        object.__setattr__(self, "_type", str(type_name)[:100])
    def __call__(self, *args, **kwargs):
        return ask("call", self._id, encode(args, self._plain), encode(kwargs, self._plain))
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return ask("getattr", self._id, name)
    def __iter__(self):
        return ask("iter", self._id)
    def __next__(self):
        return ask("next", self._id)
    def __len__(self):
        return ask("len", self._id)
    def __getitem__(self, key):
        return ask("getitem", self._id, encode(key, self._plain))
    def __str__(self):
        return ask("str", self._id)
    def __repr__(self):
        return "<the program's %s>" % self._type
    def _refuse(self, *args):
        raise TypeError("the program's %s is not plain data: a test cannot compare it or take its truth" % self._type)
    __eq__ = __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __bool__ = _refuse
    __hash__ = object.__hash__
    @staticmethod
    def _plain(v):
        if type(v) is Handle:
            return ["h", v._id]
        raise TypeError("a test passes a %s to the program, which takes only plain data" % type(v).__name__)
passed, error = 0, None
try:
    send(requests, {k: job[k] for k in ("program", "setup", "memory_mb", "cpu_s", "file_mb")})
    line = replies.readline()
except BrokenPipeError:
    line = b""
try:
    if not line:
        raise ProgramEnded("the program ended the interpreter (exit status %d) before its tests ran" % program_ended())
    reply = json.loads(line)
    if reply[0] != "ok":
        raise ProgramEnded("the program raised " + str(reply[1])[:300])
    names = decode(reply[1], Handle)
    ns = {"__name__": "__tests__"}
    exec(compile(job["setup"], "<setup>", "exec"), ns)
    for name, module in reply[2].items():  # the tests' own copy of a standard module the program imported
        if str(module).partition(".")[0] in sys.stdlib_module_names:
            names[name] = importlib.import_module(module)
    for name, value in names.items():
        if isinstance(name, str) and name not in ns and not hasattr(builtins, name):
            ns[name] = value
except BaseException as e:
    error = str(e) if isinstance(e, ProgramEnded) else "the program's names could not be read: " + describe(e)
else:
    for i, test in enumerate(job["tests"], 1):  # counted from 1, as the data errors count rows
        try:
            exec(compile(test, "<test %d>" % i, "exec"), ns)
            passed += 1
        except BaseException as e:
            error = error or "test %d (%s) failed: %s" % (i, test[:120], describe(e))
report.write(job["nonce"] + json.dumps({"passed": passed, "error": error}) + "\n")
report.flush()
if not ended:
    kill_program()
os._exit(0)
"""


# The conversation's state in its metadata, under names of its own: a row's own `score` or
# `attempt` (its metadata comes from the data) was taken for it, and scored a passing program 0.3.
_ATTEMPT, _SCORE = "code_attempt", "code_score"


def _remove_tree(path: str) -> None:
    """Delete a program's folder, whatever it made there: shutil.rmtree recurses, and a tree
    1,200 folders deep raised RecursionError (no OSError), which turned a passing program into
    an environment error and left the folder behind."""
    try:
        shutil.rmtree(path, ignore_errors=True)
    except RecursionError:
        subprocess.run(["rm", "-rf", "--", path], check=False)


def extract_program(text: str) -> str:
    """The last Python (or unlabelled) fenced block of `text`, else `text` itself."""
    blocks = [body for lang, body in _FENCE.findall(text) if lang.lower() in _PYTHON]
    return blocks[-1] if blocks else text


def run_tests(program: str, tests: list[str], *, setup: str = "", timeout_s: float, memory_mb: int,
              file_mb: int = 16) -> tuple[int, str | None]:
    """(tests passed, the first failure or None) of `program`, run against `tests` as the module
    docstring says."""
    nonce = secrets.token_hex(16)
    job = {"program": program, "tests": tests, "setup": setup, "nonce": nonce, "memory_mb": memory_mb,
           "cpu_s": max(1, int(timeout_s) + 1), "file_mb": file_mb}
    tmp = tempfile.mkdtemp(prefix="posttrain-code-")
    try:
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": tmp, "TMPDIR": tmp, "LANG": "C.UTF-8"}
        with subprocess.Popen([sys.executable, *_PYTHON_FLAGS, _TESTS_SIDE, _PROGRAM_SIDE, *_PYTHON_FLAGS], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=tmp, env=env,
                              start_new_session=True) as proc:
            try:
                out, failure = _exchange(proc, json.dumps(job).encode(), timeout_s)
                if failure is None:  # its stdout closed: the tests' interpreter is exiting
                    try:
                        proc.wait(timeout=1.0)
                    except subprocess.TimeoutExpired:
                        pass
            finally:
                _kill_all(proc)  # the program's interpreter, and whatever it left running
    finally:
        _remove_tree(tmp)
    if failure is not None:
        return 0, failure
    for line in out.decode(errors="replace").splitlines():
        if line.startswith(nonce):
            result = json.loads(line[len(nonce):])
            return int(result["passed"]), result["error"]
    # No report: the tests' interpreter died (its memory limit, the program killed it).
    return 0, f"the tests' interpreter ended (exit status {proc.returncode}) before its report"


def _exchange(proc: subprocess.Popen, data: bytes, timeout_s: float) -> tuple[bytes, str | None]:
    """Writes `data` to `proc`'s stdin and reads its stdout to the end, like `communicate`, but
    gives up (with why) after `timeout_s` or past `_MAX_REPORT` bytes: the program may hold the
    parent's end of the pipe open or fill it through /proc, and must not hang or flood the actor."""
    deadline = time.monotonic() + timeout_s
    out, pending = bytearray(), memoryview(data)
    os.set_blocking(proc.stdin.fileno(), False)
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdin, selectors.EVENT_WRITE)
        sel.register(proc.stdout, selectors.EVENT_READ)
        while sel.get_map():
            left = deadline - time.monotonic()
            if left <= 0:
                return bytes(out), f"timed out after {timeout_s:g} s"
            for key, _ in sel.select(left):
                if key.fileobj is proc.stdin:
                    try:
                        pending = pending[os.write(key.fd, pending[:1 << 16]):]
                    except BrokenPipeError:  # it died; its stdout tells the rest
                        pending = pending[:0]
                    if not pending:
                        sel.unregister(proc.stdin)
                        proc.stdin.close()
                    continue
                chunk = os.read(key.fd, 1 << 16)
                if not chunk:
                    sel.unregister(proc.stdout)
                out += chunk
                if len(out) > _MAX_REPORT:
                    return bytes(out), f"more than {_MAX_REPORT} bytes came back instead of the tests' report"
    return bytes(out), None


def _kill_all(proc: subprocess.Popen) -> None:
    """Kill the tests' interpreter's descendants, then its process group. The program's
    interpreter may leave the group (`os.setsid()`, no privilege needed) and so outlived a kill of
    the group alone, asleep past every CPU limit; it is still the tests' interpreter's child."""
    kill_descendants(proc.pid)
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
            what = "has no 'tests'" if not tests else f"'tests' hold a non-string ({tests!r:.80})"
            raise ValueError(f"code: the sample's metadata {what} (a list of Python statements, e.g. "
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
        attempt = int(metadata.get(_ATTEMPT, 0)) + 1
        done = passed == total or attempt >= self.cfg.max_attempts
        observation = f"Environment: {passed}/{total} tests passed" + (f"; {error}" if error else "")
        if not done:
            observation += ". Fix the program and answer with all of it again."
        # Rewards add up over a conversation's turns, which may end after any of them (turns or
        # context used up): the score's change since the last attempt keeps the sum at the latest
        # attempt's score. (Scoring only a final attempt lost a half-right one's fraction when
        # the context, not max_attempts, ended the conversation.)
        score = passed / total if self.cfg.reward == "fraction" else float(passed == total)
        return StepResult(observation=observation, reward=score - float(metadata.get(_SCORE, 0.0)), terminated=done,
                          metadata={**metadata, "tests_passed": passed, _ATTEMPT: attempt, _SCORE: score,
                                    CORRECT_KEY: passed == total},
                          answer=program)
