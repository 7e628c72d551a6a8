"""Checkpoints: atomic `step_N` directories, keep-top-k, resume, and a guard against resuming
into somebody else's run.

Layout of `<checkpointing.checkpoint_dir>/step_N/`:

    config.yaml          the resolved config of the run
    training_info.json   step, epoch, consumed_samples, dataloader state, metric value,
                         best metric so far, timestamp, and the run's signature
                         ({"algorithm": ..., "model_name": ...})
    rng_state.pt         Python, NumPy and torch (CPU and CUDA) RNG states of the driver
    policy/              written by the caller (`policy.save_checkpoint(tmp / "policy")`)
    COMPLETE             written last: only a directory holding it is a checkpoint

Atomicity: a save is written to `step_N.tmp-<pid>` (`begin_save`), then `finish_save`
writes the metadata and the marker, fsyncs every file, and renames the directory to
`step_N` in one `os.replace`. A crash at any point leaves either the previous set of
checkpoints or the new one, never a half-written `step_N`; the temporary directories of
dead processes (or of a killed run whose pid this process has again) are removed on the next start.

Pruning keeps the `keep_top_k` best by `metric_name` (`higher_is_better`), or the newest
when no metric is named, and always the latest one (so at most k+1 remain); checkpoints ranked by
another metric (`metric_name` changed at a resume) are never pruned.
"""

from __future__ import annotations

import contextlib
import difflib
import errno
import json
import logging
import math
import os
import pickle
import random
import re
import shutil
import signal
import threading
import time
import uuid
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.config import ConfigError, InputError, MissingInputError, RunStopped
from posttrain.runtime import STOP_REQUESTED
from posttrain.schemas import CheckpointingConfig, PolicyConfig

log = logging.getLogger(__name__)

# Key of a run's result dict naming the stop signal that ended it early (see stop_on_signals).
STOPPED_BY_SIGNAL = "stopped_by_signal"
# training_info key: the folder the run's final export went to (`record_export`).
EXPORTED_TO = "exported_to"

# The final Hugging Face export's folder in the run directory (checkpointing.export_hf_at_end).
EXPORT_DIR = "hf"


def final_export_dir(cfg: Any) -> Path | None:
    """Where a run of config `cfg` exports its final policy (`EXPORT_DIR` in logger.log_dir), or
    None when checkpointing.export_hf_at_end is off."""
    return Path(cfg.logger.log_dir) / EXPORT_DIR if cfg.checkpointing.export_hf_at_end else None
COMPLETE_MARKER = "COMPLETE"
INFO_FILE = "training_info.json"
# A checkpoint's training_info key: the validation due at its step was skipped by a stop signal
# (its grace period is for the save); the resumed run makes it up (`pending_validation`).
VALIDATION_PENDING = "validation_pending"
CONFIG_FILE = "config.yaml"
RNG_FILE = "rng_state.pt"
# In policy/ (`Policy.save_checkpoint`): the LR scheduler's position and the weights' version.
TRAINER_STATE_FILE = "trainer_state.pt"
_STEP_RE = re.compile(r"^step_(\d+)$")
_TMP_RE = re.compile(r"^step_(\d+)\.tmp-(\d+)$")


def policy_checkpoint_dir(path: str | Path) -> Path | None:
    """The torch.distributed.checkpoint folder of the checkpoint at `path`: a step_N directory's
    policy/, or such a policy/ folder itself; None when `path` is neither."""
    for cand in (Path(path) / "policy", Path(path)):
        if (cand / ".metadata").is_file():
            return cand
    return None


def complete_checkpoints(directory: str | Path) -> list[Path]:
    """The complete step_N checkpoints in `directory` (a checkpointing.checkpoint_dir), oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in directory.iterdir()
             if (m := _STEP_RE.match(p.name)) and p.is_dir() and (p / COMPLETE_MARKER).is_file()]
    return [p for _, p in sorted(found)]


def missing_files(path: Path) -> list[str]:
    """The files a resume reads from the checkpoint `path` that are not there or cannot be read,
    relative to it: a checkpoint copied or cleaned up in part (or to a full disk) still holds its
    COMPLETE marker. Truncated files count: a torch file whose zip directory is gone, a shard
    shorter than the data `.metadata` places in it (torch's "failed finding central directory"
    from a worker, after the workers had started)."""
    from torch.distributed.checkpoint import FileSystemReader

    missing = [name for name in (INFO_FILE, RNG_FILE, f"policy/{TRAINER_STATE_FILE}")
               if not (path / name).is_file()]
    if INFO_FILE not in missing:
        try:
            info = json.loads((path / INFO_FILE).read_text())
        except (ValueError, OSError):  # truncated or not UTF-8
            missing.append(f"{INFO_FILE} (unreadable)")
        else:  # edited by hand: what the resume reads first (it failed as a KeyError's traceback)
            if not isinstance(info, dict):
                missing.append(f"{INFO_FILE} (not a JSON object)")
            elif not isinstance(info.get("step"), int) or isinstance(info.get("step"), bool):
                missing.append(f"{INFO_FILE} (without its 'step')")
    for name in (RNG_FILE, f"policy/{TRAINER_STATE_FILE}"):
        if name not in missing and not _is_zip(path / name):  # torch.save's format: its directory is at the end
            missing.append(f"{name} (unreadable)")
    try:
        # The shards `.metadata` lists (one or more per rank of the run that saved), each as long
        # as the end of the last item in it.
        ends: dict[str, int] = {}
        for s in FileSystemReader(path / "policy").read_metadata().storage_data.values():
            ends[s.relative_path] = max(ends.get(s.relative_path, 0), s.offset + s.length)
    except FileNotFoundError:
        return missing + ["policy/.metadata"]
    except (pickle.UnpicklingError, EOFError, OSError):  # a truncated or foreign file
        return missing + ["policy/.metadata (unreadable)"]
    for name, end in sorted(ends.items()):
        shard = path / "policy" / name
        if not shard.is_file():
            missing.append(f"policy/{name}")
        elif (size := shard.stat().st_size) < end:
            missing.append(f"policy/{name} (truncated: {size} of {end} bytes)")
    return missing


def _is_zip(path: Path) -> bool:
    try:
        with zipfile.ZipFile(path):
            return True
    except (zipfile.BadZipFile, OSError):
        return False


def capture_rng_state() -> dict[str, Any]:
    """The Python, NumPy and torch RNG states of this process."""
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Set the RNGs to a state from `capture_rng_state` (CUDA only when both sides have it)."""
    import numpy as np
    import torch

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _duration_s(text: str) -> float:
    """Seconds of a "DD:HH:MM:SS" duration."""
    days, hours, minutes, seconds = (int(x) for x in text.split(":"))
    return ((days * 24 + hours) * 60 + minutes) * 60 + seconds


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    # Directory fsync makes a rename durable; some filesystems do not support it.
    try:
        _fsync_file(path)
    except OSError:
        pass


def _write(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _config_diff(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[str]:
    """"dotted.key: old -> new" for every leaf that differs; a section only one side has (an
    environment added under env) is one entry, not one per default key inside it."""
    out = []
    for k in sorted(old.keys() | new.keys()):
        a, b = old.get(k, _NOT_SET), new.get(k, _NOT_SET)
        if isinstance(a, dict) and isinstance(b, dict):
            out += _config_diff(a, b, f"{prefix}{k}.")
        elif a != b:
            out.append(f"{prefix}{k}: {_shown(a)} -> {_shown(b)}")
    return out


_NOT_SET = object()
_SHOWN_CHARS = 80


def _shown(value: Any) -> str:
    if value is _NOT_SET:
        return "(not set)"
    text = json.dumps(value)
    return text if len(text) <= _SHOWN_CHARS else text[: _SHOWN_CHARS - 3] + "..."


def _state_layout_changes(saved: dict[str, Any], policy: PolicyConfig) -> list[str]:
    """"policy.key: saved -> now" for each setting of the saved config `saved` that gives this
    run's policy state other tensors than the checkpoint holds, so that it cannot be loaded:
    LoRA adapters or not (and their rank and modules), and the optimizer class (Adam's moments
    are not SGD's momentum)."""
    from posttrain.policy.optim import optimizer_class

    old = saved.get("policy") or {}
    old_lora, new_lora = old.get("lora") or {}, policy.lora.model_dump(mode="json")
    keys = ["enabled"] + (["rank", "target_modules"] if old_lora.get("enabled") and new_lora["enabled"] else [])
    def same_set(value: Any) -> Any:  # target_modules ["q_proj", "v_proj"] adapts what ["v_proj", "q_proj"] does
        return sorted(set(value)) if isinstance(value, list) else value

    changes = [f"policy.lora.{k}: {_shown(old_lora.get(k, _NOT_SET))} -> {_shown(new_lora[k])}"
               for k in keys if same_set(old_lora.get(k, _NOT_SET)) != same_set(new_lora[k])]
    old_name = (old.get("optimizer") or {}).get("name", _NOT_SET)
    try:
        same = optimizer_class(old_name) is optimizer_class(policy.optimizer.name)  # "adamw" is torch.optim.AdamW
    except (ValueError, AttributeError):
        same = old_name == policy.optimizer.name
    if not same:
        changes.append(f"policy.optimizer.name: {_shown(old_name)} -> {_shown(policy.optimizer.name)}")
    return changes


_WAYS_OUT = ("Set checkpointing.start_fresh=true to start over (the old checkpoints are moved aside, not deleted) "
             "or choose another checkpointing.checkpoint_dir.")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_message(reason: str, step: int, cfg: CheckpointingConfig) -> str:
    """What a training loop prints when it ends early for `reason` (`CheckpointManager.stop_reason`)."""
    saved = f"saved step_{step} in {cfg.checkpoint_dir}" if cfg.enabled else "nothing saved (checkpointing.enabled=false)"
    return f"{reason} at step {step}: {saved}; stopping"


class StopAtOnce(KeyboardInterrupt):
    """A stop signal with no step to finish: a second SIGTERM/SIGINT inside
    `CheckpointManager.stop_on_signals`, or SIGTERM before it (`stop_at_once_on_sigterm`).
    `signal_name` says which, so the CLI can exit with 128 + its number."""

    def __init__(self, signal_name: str):
        super().__init__(f"stop signal ({signal_name})")
        self.signal_name = signal_name
        global _last_stop_at_once
        _last_stop_at_once = signal_name


# The signal of the last StopAtOnce: raised while the driver waits in `ray.get`, it reaches the
# CLI as the plain KeyboardInterrupt Ray raises instead, without its name (a SIGTERM in the
# warm-up exited 130, as for Ctrl-C, not 143).
_last_stop_at_once: str | None = None


_run_start: float | None = None  # `mark_run_start`: time.monotonic() when the command started


def mark_run_start() -> None:
    """The command's start (`posttrain <algorithm>`), from which the next CheckpointManager counts
    `checkpointing.checkpoint_must_save_by`: counted from the manager's creation, the limit left
    out the data's loading and tokenization before it (40 s of a 60 s limit in an audit), and the
    last save came after the scheduler's kill. (time.monotonic is one clock for the whole system,
    so the job a supervisor forks keeps it.)"""
    global _run_start
    _run_start = time.monotonic()


def take_stop_at_once() -> str | None:
    """The signal of the last StopAtOnce since the previous call (None: none)."""
    global _last_stop_at_once
    name, _last_stop_at_once = _last_stop_at_once, None
    return name


def stop_at_once_on_sigterm() -> None:
    """From now on (in the main thread) SIGTERM raises `StopAtOnce`, as Ctrl-C raises
    KeyboardInterrupt: the setup's and warm-up's undo steps stop what they started and the CLI
    exits with 143. Called when the job starts, and again after `ray.init` (`cluster.init_ray`,
    which holds a stop signal that comes while Ray starts and acts on it after), whose C++ core
    installs its failure handler for SIGTERM: it printed a stack dump and aborted the driver (exit
    status 134) during the setup or GRPO's warm-up SFT. The training loop's `stop_on_signals` takes SIGTERM over and restores this after."""
    if threading.current_thread() is not threading.main_thread():
        return

    def handle(signum: int, _frame: Any) -> None:
        raise StopAtOnce(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, handle)


class RunAlreadyComplete(Exception):
    """A run started again after it ended (`CheckpointManager.check_complete`): its setup stops
    before Ray starts, and `unless_complete` returns `result`, its final metrics as logged."""

    def __init__(self, message: str, result: dict[str, Any]):
        super().__init__(message)
        self.result = result


def unless_complete(run: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`run()`, or the final metrics of a run that was already complete (`RunAlreadyComplete`)."""
    try:
        return run()
    except RunAlreadyComplete as done:
        log.info("%s", done)
        return done.result


def _saved_config(path: str | Path) -> dict[str, Any] | None:
    """The resolved config the checkpoint at `path` was saved with, or None without its file."""
    import yaml

    saved = Path(path) / CONFIG_FILE
    return (yaml.safe_load(saved.read_text(encoding="utf-8")) or {}) if saved.is_file() else None


def _final_metrics(log_dir: Path, checkpoint: Path, step: int) -> dict[str, Any]:
    """A finished run's result as its loop returned it, from its metrics.jsonl: the last step's
    train/<name>, and the last validation's val/<name> with val/step. Started again with another
    logger.log_dir, the run finds its metrics in the one its checkpoint's config names."""
    from posttrain.logging.jsonl import read_metrics

    records = read_metrics(log_dir / "metrics.jsonl")
    if not records:
        logged_in = ((_saved_config(checkpoint) or {}).get("logger") or {}).get("log_dir")
        records = read_metrics(Path(logged_in) / "metrics.jsonl") if logged_in else []
    train = next((r for r in reversed(records) if r.get("prefix") == "train" and r.get("step") == step), {})
    val = next((r for r in reversed(records) if r.get("prefix") == "val"), None)
    fields = lambda r: {k: v for k, v in r.items() if k not in ("step", "prefix", "time")}  # noqa: E731
    return {"step": step, **{f"train/{k}": v for k, v in fields(train).items()},
            **({f"val/{k}": v for k, v in fields(val).items()} | {"val/step": val["step"]} if val else {}),
            "already_complete": True}


def train_then_export(train: Callable[[], dict[str, Any]], checkpointer: CheckpointManager, policy: Any,
                      export_dir: Path | None, console: Callable[[str], None],
                      shutdown: Callable[[], None]) -> dict[str, Any]:
    """How every algorithm's run ends: `train()` under `checkpointer.stop_on_signals()`; then,
    unless a signal stopped it, `policy.export_hf(export_dir)` (None: no export); `shutdown()`
    always. A stopped run's result names the signal under STOPPED_BY_SIGNAL (the CLI exits with
    128 + its number) and skips the export, which would delay the stop for a non-final policy."""
    try:
        with checkpointer.stop_on_signals():
            result = train()
        if checkpointer.complete_result is not None:  # it trained no step: the last one's result
            result = checkpointer.complete_result
        if checkpointer.stop_signal:
            return {**result, STOPPED_BY_SIGNAL: checkpointer.stop_signal}
        if checkpointer.time_limit_reached:
            # Exported all the same (a job given a time limit still ends with a model to use), but
            # named for what it is: the run continues from its checkpoint when started again.
            result = {**result, "stopped_by_time_limit": True}
        if export_dir is not None:
            try:
                policy.export_hf(export_dir)
            except Exception as e:  # a full disk: Ray's traceback named neither the folder nor what stays
                raise ExportError(checkpointer.export_failed_message(export_dir, e)) from e
            checkpointer.record_export(export_dir)
            console(f"exported the policy to {export_dir} (the run was stopped by checkpointing.checkpoint_must_save_by: "
                    "started again, it resumes from its checkpoint while steps remain)"
                    if checkpointer.time_limit_reached else f"exported the final policy to {export_dir}")
        return result
    finally:
        shutdown()


def _same_signature(stored: Any, current: dict[str, Any]) -> bool:
    """Whether a checkpoint's signature is this run's: the same values, a model folder named
    another way (`x`, `x/`, `./x`, its absolute path) being the same model."""
    if not isinstance(stored, dict) or stored.keys() != current.keys():
        return stored == current

    def same(key: str, a: Any, b: Any) -> bool:
        if a == b:
            return True
        try:
            return key == "model_name" and os.path.samefile(a, b)
        except (OSError, TypeError, ValueError):  # not two existing paths
            return False

    return all(same(k, v, current[k]) for k, v in stored.items())


def lock_beside(folder: Path, key: str, value: Any) -> int:
    """Take the lock of `folder` (the config's `key`=`value`) for this process, or fail naming the
    process that holds it. The lock is the operating system's, on a hidden file beside the folder
    (which a fresh start may move aside), so it ends with the process however it ends. Returns the
    file descriptor that holds it (closing it, or any other of the process's on that file, releases
    it), or -1 on a file system without locks, which is not checked."""
    import fcntl
    import socket

    # Its real path: a run given a symlink to the folder (or to a parent) took a lock of its own.
    folder = Path(os.path.realpath(folder))
    path = folder.parent / f".{folder.name}.lock"
    try:
        folder.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:  # what os.access cannot tell (root on a read-only or virtual file system)
        raise MissingInputError(f"{key}={value}: cannot write beside it ({path}: {e.strerror})") from e
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
        os.close(fd)
        if e.errno not in (errno.EACCES, errno.EAGAIN):
            log.warning("%s: cannot lock it (%s); another run on this %s would not be noticed", path, e.strerror, key)
            return -1
        raise InputError(f"{key}={value}: another run is using it ({holder}); wait for it to end or stop it, or give "
                         f"this run its own {key}") from None
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n".encode(), 0)
    except OSError as e:  # a full disk takes the empty lock file, not its line
        os.close(fd)
        raise MissingInputError(f"{key}={value}: cannot write beside it ({path}: {e.strerror})") from e
    return fd


class MetricNameError(InputError):
    """`checkpointing.metric_name` is a typo of a metric the run logs, found when it first logs
    metrics of that kind: the loops save the step they completed before it stops the run (with
    no validation at step 0, the first one came after `val_period` steps, which it lost)."""


class CheckpointSaveError(RunStopped):
    """Writing a checkpoint failed (`CheckpointManager.save`); the message says why, whether the
    disk is full and which checkpoints stay."""


class ExportError(RunStopped):
    """The HF export at the end of a run failed (`train_then_export`); the message says why,
    whether the disk is full and which checkpoints stay."""


def _nearest_existing(path: Path) -> Path:
    """`path` (absolute) or the nearest folder above it that exists. A folder that cannot be
    searched hides what is under it: os.path.exists says False there, where Path.exists raised
    PermissionError before Python 3.12, in place of the message this path is for."""
    existing = path.absolute()
    while not os.path.exists(existing) and existing != existing.parent:
        existing = existing.parent
    return existing


def exception_chain(err: BaseException | None):
    """`err`, then the exceptions it was raised from or while handling."""
    while err is not None:
        yield err
        err = err.__cause__ or err.__context__


class CheckpointManager:
    """Saves, finds and prunes the checkpoints of one run (see the module docstring)."""

    def __init__(self, cfg: CheckpointingConfig, signature: dict[str, Any], policy: PolicyConfig | None = None) -> None:
        """`signature` names the run a checkpoint must have been made for; `policy`, this run's
        policy settings, is checked against a checkpoint's (see `latest`)."""
        self.cfg = cfg
        self.dir = Path(cfg.checkpoint_dir)
        self.signature = json.loads(json.dumps(signature, default=str))
        self.policy = policy
        # Names the run in its checkpoints and its log folder (`adopt_run_id`): another run's logs
        # in the same logger.log_dir are told apart from the resumed run's own.
        self.run_id = uuid.uuid4().hex
        self.moved_aside: Path | None = None
        self._writing: set[Path] = set()  # the temporary directories of this manager's saves in progress
        # The final metrics of a complete run started again only to export (`check_complete`).
        self.complete_result: dict[str, Any] | None = None
        self._lock_fd: int | None = None
        if cfg.enabled:  # before start_fresh moves anything, which needs the folder writable too
            self._check_writable()
            # The lock lives beside the folder (lock_beside makes its parent: a new results/ or a
            # log dir the Logger creates later), taken now, or a second run could start before the first save.
            self._lock()
        if cfg.enabled and cfg.start_fresh and self.dir.is_dir():
            self.moved_aside = self._move_aside()
        global _run_start
        # The command's start, once (a later run in this process, as tests make them, counts from its own).
        self._started, _run_start = (_run_start if _run_start is not None else time.monotonic()), None
        self.save_deadline_s = _duration_s(cfg.checkpoint_must_save_by) if cfg.checkpoint_must_save_by else None
        self.stop_signal: str | None = None  # "SIGTERM"/"SIGINT" once received (stop_on_signals)
        self.time_limit_reached = False  # stop_reason stopped the run for checkpoint_must_save_by
        self._last_check: float | None = None  # when stop_reason last ran: once a step, before its save
        self._longest_step_s = 0.0  # the longest time between two of them (a step, its validation and save)
        self._metric_kinds_seen: set[str] = set()  # check_metric_name
        self._ranked_otherwise_noted = False  # _prune's warning, once

    def _check_writable(self) -> None:
        """The first save comes `save_period` steps into the run: a checkpoint_dir it could not
        write (under a file, read-only) fails now, not after those steps. Checked on the folder
        itself or the nearest one above it that exists (a run that saves nothing creates nothing)."""
        existing = _nearest_existing(self.dir)
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            what = "not a folder" if not existing.is_dir() else "not writable"
            raise MissingInputError(f"checkpointing.checkpoint_dir={self.cfg.checkpoint_dir}: cannot write it "
                                    f"({existing} is {what})")

    def _lock(self) -> None:
        """One run at a time per checkpoint_dir: a second one (a job restarted while the first still
        runs or saves, the same config started twice) would save the same steps over each other's
        and resume from whichever it read."""
        self._lock_fd = lock_beside(self.dir, "checkpointing.checkpoint_dir", self.cfg.checkpoint_dir)

    # ----------------------------------------------------------------- queries

    def should_save(self, step: int, last: bool = False) -> bool:
        """Whether the loop saves after `step`: every `save_period` steps, and at the `last` step
        (the run's final one, or one after which it stops early), when checkpointing is enabled."""
        return self.cfg.enabled and (last or step % self.cfg.save_period == 0)

    def time_left_s(self) -> float | None:
        """Seconds until `checkpointing.checkpoint_must_save_by` (counted from the command's start,
        `mark_run_start`, else this manager's creation), or None without a limit."""
        return None if self.save_deadline_s is None else self.save_deadline_s - (time.monotonic() - self._started)

    def start_steps(self) -> None:
        """The training loop's first step starts now: `stop_reason` after it measures that step too
        (without this mark, the first projection took a step as 0 s long, and a limit less than one
        step away let the run start a step it could not save before the limit)."""
        self._last_check = time.monotonic()

    def stop_reason(self, last_step: bool = False) -> str | None:
        """Why the run must save a checkpoint and end cleanly after this step, or None: the process
        got SIGTERM or SIGINT (see `stop_on_signals`), or the job's time limit
        (`checkpointing.checkpoint_must_save_by`, counted as `time_left_s` says) would pass
        before the next step and its save end. Called once a step, before the step's save; at the
        run's `last_step` no time limit stops it (it ends anyway: a finished run reported as stopped
        by the limit would be started again by a job loop that resubmits such runs).

        The next step is expected to take as long as the longest so far, validation and save
        included (as NeMo RL fits the last save into the limit): stopping only once the limit had
        passed saved after it, when the scheduler may already have killed the job."""
        now = time.monotonic()
        if self._last_check is not None:
            self._longest_step_s = max(self._longest_step_s, now - self._last_check)
        self._last_check = now
        if self.stop_signal is not None:
            return f"{self.stop_signal} received"
        if self.save_deadline_s is None or last_step:
            return None
        left = self.save_deadline_s - (now - self._started)
        self.time_limit_reached = left <= 0 or left < self._longest_step_s
        if left <= 0:
            return f"checkpointing.checkpoint_must_save_by={self.cfg.checkpoint_must_save_by} reached"
        if left < self._longest_step_s:
            return (f"checkpointing.checkpoint_must_save_by={self.cfg.checkpoint_must_save_by} would pass during "
                    f"the next step ({left:.0f} s left; the longest step so far, with its validation and save, "
                    f"took {self._longest_step_s:.0f} s)")
        return None

    @contextlib.contextmanager
    def stop_on_signals(self):
        """Within this block (a training loop) SIGTERM, which schedulers send before they kill a job,
        and a first Ctrl-C (SIGINT) do not kill the driver mid-step: `stop_reason()` says so and the
        loop saves a checkpoint after the current step and ends (the run then skips its HF export,
        and the CLI exits with 128 + the signal number, as the shell reports a killed command). A
        second signal interrupts at once (`StopAtOnce`, a KeyboardInterrupt); the checkpoints
        already saved stay.
        Only the main thread can take signals, so elsewhere the block changes nothing."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        wanted = (signal.SIGTERM, signal.SIGINT)
        previous = {s: signal.getsignal(s) for s in wanted}

        def handle(signum: int, _frame: Any) -> None:
            name = signal.Signals(signum).name
            if self.stop_signal is not None:
                raise StopAtOnce(name)
            self.stop_signal = name
            STOP_REQUESTED.set()
            if self.cfg.enabled:
                log.warning("%s received: saving a checkpoint after this step and stopping "
                            "(send it again to stop at once, without saving)", name)
            else:
                log.warning("%s received: stopping after this step, without a checkpoint "
                            "(checkpointing.enabled=false; send it again to stop at once)", name)

        STOP_REQUESTED.clear()
        for s in wanted:
            signal.signal(s, handle)
        try:
            yield
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            STOP_REQUESTED.clear()  # after: a signal between the two would set it again for the next run

    def checkpoints(self) -> list[Path]:
        """Complete checkpoints, oldest step first; cleans up what interrupted saves left behind."""
        if not self.dir.is_dir():
            return []
        self._clean()
        return complete_checkpoints(self.dir)

    def latest(self) -> Path | None:
        """The newest complete checkpoint to resume from, or None (also when checkpointing is disabled).

        Raises MissingInputError when it lacks a file a resume reads (`missing_files`), and
        ConfigError when it was made for another algorithm or model, or (given this run's
        `policy` settings) with LoRA or optimizer settings whose saved state this run cannot load.
        """
        if not self.cfg.enabled:
            return None
        ckpts = self.checkpoints()
        if not ckpts:
            return None
        path = ckpts[-1]
        missing = missing_files(path)
        if missing:
            raise MissingInputError(
                f"checkpoint {path} lacks {', '.join(missing)}, so it cannot be resumed from (copied or cleaned up "
                f"in part?): restore the files, or move {path.name} out of {self.dir} to resume from the checkpoint "
                f"before it. {_WAYS_OUT}"
            )
        stored = self.load_info(path).get("signature")
        if not _same_signature(stored, self.signature):
            raise ConfigError(
                f"checkpoint {path} was made for {stored}, but this run is {self.signature}: refusing to "
                f"resume from it. {_WAYS_OUT}"
            )
        saved_cfg = _saved_config(path) if self.policy is not None else None
        if saved_cfg is not None:
            changes = _state_layout_changes(saved_cfg, self.policy)
            if changes:
                raise ConfigError(
                    f"checkpoint {path} holds a model and optimizer state of other settings than this run's "
                    f"({'; '.join(changes)}), which it cannot load: put them back to resume. {_WAYS_OUT}"
                )
            old_lora = (saved_cfg.get("policy") or {}).get("lora") or {}
            if self.policy.lora.enabled and old_lora.get("alpha", self.policy.lora.alpha) != self.policy.lora.alpha:
                # The adapters load, but their update W + (alpha / r) B A is another: not the model saved.
                log.warning("policy.lora.alpha: %s -> %s scales the trained adapters' update by %.4gx: the run goes on "
                            "from another model than the one checkpointed (put it back to continue that one)",
                            old_lora["alpha"], self.policy.lora.alpha, self.policy.lora.alpha / old_lora["alpha"])
        return path

    @staticmethod
    def load_info(path: str | Path) -> dict[str, Any]:
        return json.loads((Path(path) / INFO_FILE).read_text())

    @staticmethod
    def config_changes(path: str | Path, config_yaml: str) -> list[str]:
        """What differs between the resolved config the checkpoint at `path` was saved with and
        `config_yaml` (this run's), one "dotted.key: old -> new" per key, so that a resume shows
        the overrides (or typos) that change the run it continues."""
        import yaml

        saved = _saved_config(path)
        return [] if saved is None else _config_diff(saved, yaml.safe_load(config_yaml) or {})

    def restore_data_position(self, path: Path, loader: Any, config_yaml: str) -> None:
        """Set `loader` (a RowLoader) to the data position of the checkpoint at `path`: called
        before any worker starts, so that data that no longer matches the checkpoint's (another
        file, split or filter) fails at once, naming the config changes that may explain it."""
        state = self.load_info(path).get("dataloader")
        if not isinstance(state, dict):  # edited by hand: it failed as a KeyError's traceback
            raise MissingInputError(f"checkpoint {path} lacks its data position ('dataloader' in {INFO_FILE}), so it "
                                    f"cannot be resumed from: restore it, or move {path.name} out of {self.dir} to "
                                    f"resume from the checkpoint before it. {_WAYS_OUT}")
        try:
            loader.load_state_dict(state)
        except InputError as e:
            changes = self.config_changes(path, config_yaml)
            since = f" Config changes since that checkpoint: {'; '.join(changes)}." if changes else ""
            raise InputError(f"cannot resume from {path}: {e}.{since} {_WAYS_OUT}") from None

    def check_steps_left(self, path: Path, max_steps: int, key: str) -> None:
        """Fail before any worker starts when the checkpoint at `path` is past the run's last
        step (`key`, e.g. grpo.max_num_steps, lowered since): the resume would train nothing and
        end as if the run were done."""
        step = self.load_info(path)["step"]
        if step > max_steps:
            raise ConfigError(f"checkpoint {path} is at step {step}, past {key}={max_steps}: resuming from it would "
                              f"train nothing. Raise {key} above {step} to continue the run. {_WAYS_OUT}")

    @classmethod
    def resume_message(cls, path: str | Path, step: int, config_yaml: str, last_step: int,
                       ends_by: str | None = None) -> str:
        """The console line of a resume from `path`: where from, `config_changes`, and whether
        steps are left before `last_step` (a rerun of a finished run trains nothing), which
        `ends_by` sets when it is not max_num_steps (the epochs of the data: raising the steps
        alone trains nothing more)."""
        changes = cls.config_changes(path, config_yaml)
        done = "" if step < last_step else (
            f" (the run's last step: nothing left to train{f'; {ends_by} ends it' if ends_by else ''})")
        if not changes:
            return f"resumed from {path} at step {step}{done}"
        return (f"resumed from {path} at step {step}{done}, with {len(changes)} config change(s) since that "
                "checkpoint: " + "; ".join(changes))

    @staticmethod
    def load_rng_state(path: str | Path) -> dict[str, Any]:
        import torch

        # Our own file, holding Python/NumPy RNG tuples that weights_only loading refuses.
        return torch.load(Path(path) / RNG_FILE, weights_only=False)

    def check_metric_name(self, logged: dict[str, float], prefix: str) -> None:
        """`Logger.metric_checks` hook: the first time the run logs metrics of the kind of
        `checkpointing.metric_name` ("train" / "val"), a name it lacks but one of them resembles
        is a typo, an InputError then rather than a warning at every save while the top-k
        pruning keeps the newest checkpoints instead of the best."""
        name = self.cfg.metric_name
        if not (self.cfg.enabled and name) or f"{prefix}:" != name[: len(prefix) + 1] or prefix in self._metric_kinds_seen:
            return
        self._metric_kinds_seen.add(prefix)
        names = [f"{prefix}:{k}" for k in logged]
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.8)
        if name not in names and close:
            raise MetricNameError(f"checkpointing.metric_name={name!r} is not a metric this run logs; did you mean "
                             f"{close[0]!r}? (its {prefix}: metrics: {', '.join(sorted(logged))})")
        if name not in names:
            # Like none of them: a metric that may come later, or one this run never logs (val:accuracy
            # of an environment without a notion of correct). Said now, not first at the first save.
            kept = f", and keep_top_k={self.cfg.keep_top_k} keeps the newest of them" if self.cfg.keep_top_k else ""
            log.warning("checkpointing.metric_name=%r is not among the %s: metrics this run logged first (%s): "
                        "checkpoints without it rank below those with it%s", name, prefix, ", ".join(sorted(logged)),
                        kept)

    # ----------------------------------------------------------------- saving

    def save(self, step: int, policy: Any, training_info: dict[str, Any], config_yaml: str,
             metrics: dict[str, float], validation_pending: bool = False) -> Path:
        """Checkpoint `step` of a run: `policy.save_checkpoint(<tmp>/policy)` (model, optimizer,
        scheduler), then the metadata (`finish_save`). `metrics` are keyed "train:<name>" /
        "val:<name>"; `checkpointing.metric_name` picks the one that ranks checkpoints. A metric
        this step did not measure (a val: metric before the first validation, or a misspelt name)
        does not fail the run: the checkpoint is saved, ranked below every measured one, and a
        warning lists the names of its kind there are. `validation_pending`: a stop signal skipped
        the step's validation, which the resumed run makes up (`pending_validation`)."""
        if validation_pending:
            training_info = {**training_info, VALIDATION_PENDING: True}
        name = self.cfg.metric_name
        if name and name not in metrics:
            # The names of its own kind (val: or train:) catch a misspelt one; a step that did not
            # validate (the usual case for a val: name) has none, and all ~40 train: names are noise.
            kind = name.split(":")[0] + ":"
            same = sorted(k for k in metrics if k.startswith(kind))
            log.warning("checkpoint step_%d: checkpointing.metric_name=%r not measured at this step, so it ranks "
                        "below measured ones (%s)", step, name,
                        f"measured: {', '.join(same)}" if same else f"no {kind} metric at this step")
        tmp = self._tmp_dir(step)
        try:
            tmp = self.begin_save(step)  # its mkdir fails on a disk full to the last block, too
            policy.save_checkpoint(tmp / "policy")
            return self.finish_save(tmp, step, training_info, config_yaml, metrics.get(name) if name else None)
        except Exception as e:
            self.abort_save(tmp)  # also frees the space a disk-full save took
            raise CheckpointSaveError(self._save_failed_message(step, e)) from e
        except BaseException:
            self.abort_save(tmp)
            raise

    def _save_failed_message(self, step: int, err: BaseException) -> str:
        """What `save` raises when writing `step` failed: `_write_failed`'s line and the
        checkpoints that stay."""
        kept = self.checkpoints()
        stays = (f"the checkpoints saved before stay ({', '.join(p.name for p in kept)}); the next start resumes "
                 f"from {kept[-1].name}" if kept else "no checkpoint was saved before")
        last_size = sum(f.stat().st_size for f in kept[-1].rglob("*") if f.is_file()) if kept else None
        failed = self._write_failed(f"saving checkpoint step_{step} in {self.dir}", self.dir, err, last_size,
                                    kept[-1].name if kept else "")
        return f"{failed}\n{stays}"

    def export_failed_message(self, export_dir: Path, err: BaseException) -> str:
        """What the end of a run raises when its HF export to `export_dir` failed (`train_then_export`)."""
        kept = self.checkpoints() if self.cfg.enabled and self.dir.is_dir() else []
        stays = (f"the checkpoints stay ({', '.join(p.name for p in kept)}); the same command started again "
                 f"resumes from {kept[-1].name} and exports at its end (free the space first if the disk is full)"
                 if kept else "no checkpoint holds the trained policy (" + (
                     "none was saved)" if self.cfg.enabled else "checkpointing.enabled=false)"))
        return f"{self._write_failed(f'exporting the policy to {export_dir}', export_dir, err)}\n{stays}"

    @staticmethod
    def _write_failed(what: str, where: Path, err: BaseException, needs: int | None = None,
                      needed_by: str = "") -> str:
        """"<what> failed (<the disk's state at `where`>): <the error's line>". A full disk often
        shows only as torch's zip writer's "unexpected pos 704 vs 598" (DCP), so free space is
        checked as well as ENOSPC: less than `needs` bytes (what `needed_by`, the latest checkpoint,
        took; None: only ENOSPC tells) is a full disk too."""
        from posttrain.distributed.worker_group import WorkerError

        # A worker's error ends with its exception; a WorkerError (a worker died) starts with the
        # worker it names, and ends with that worker's log.
        lines = [ln for ln in str(err).splitlines() if ln.strip()]
        cause = (lines[0] if isinstance(err, WorkerError) else lines[-1]).strip() if lines else type(err).__name__
        free = shutil.disk_usage(_nearest_existing(Path(where))).free
        full = "No space left on device" in str(err) or any(
            isinstance(x, OSError) and x.errno == errno.ENOSPC for x in exception_chain(err))
        disk = f" ({free / 2**20:.1f} MiB free there)"
        if full or (needs is not None and free < needs):
            disk = (f" (the disk is full: {free / 2**20:.1f} MiB free there"
                    + (f", {needed_by} took {needs / 2**20:.1f} MiB" if needs is not None else "") + ")")
        elif isinstance(err, WorkerError):  # a worker died: the free space pointed at the disk for nothing
            disk = ""
        return f"{what} failed{disk}: {cause}"

    def _tmp_dir(self, step: int) -> Path:
        """Where this process writes checkpoint `step` before `finish_save` renames it (`_TMP_RE`)."""
        return self.dir / f"step_{step}.tmp-{os.getpid()}"

    def begin_save(self, step: int) -> Path:
        """A fresh temporary directory for checkpoint `step`; write `policy/` into it, then `finish_save`."""
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.cfg.enabled and self._lock_fd is None:
            self._lock()
        tmp = self._tmp_dir(step)
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
        self._writing.add(tmp)
        return tmp

    def abort_save(self, tmp: Path) -> None:
        """Drop a save that failed between `begin_save` and `finish_save`."""
        self._writing.discard(tmp)
        shutil.rmtree(tmp, ignore_errors=True)

    def finish_save(
        self,
        tmp: Path,
        step: int,
        training_info: dict[str, Any],
        config_yaml: str,
        metric_value: float | None = None,
        rng_state: dict[str, Any] | None = None,
    ) -> Path:
        """Write the metadata, make it durable, rename `tmp` to `step_N`, prune; return the checkpoint path.

        `training_info` holds the caller's resume state (epoch, consumed_samples, the
        dataloader's `state_dict()`, ...); `rng_state` defaults to this process's RNGs.
        """
        import torch

        if not tmp.is_dir():
            raise FileNotFoundError(f"{tmp}: not a directory from begin_save()")
        if metric_value is not None and not math.isfinite(float(metric_value)):
            metric_value = None  # a NaN metric must not win or lose the top-k by accident
        best_step, best_value = self._best(extra=(step, metric_value))
        info = {
            **training_info,
            "step": step,
            "metric_name": self.cfg.metric_name,
            "metric_value": metric_value,
            "best_step": best_step,
            "best_metric_value": best_value,
            "timestamp": time.time(),
            "signature": self.signature,
            "run_id": self.run_id,
        }
        _write(tmp / INFO_FILE, json.dumps(info, indent=2, default=str))
        _write(tmp / CONFIG_FILE, config_yaml)
        torch.save(rng_state if rng_state is not None else capture_rng_state(), tmp / RNG_FILE)
        for root, _, files in os.walk(tmp):
            for name in files:
                _fsync_file(Path(root) / name)
        _write(tmp / COMPLETE_MARKER, f"{step}\n")
        _fsync_dir(tmp)

        final = self.dir / f"step_{step}"
        replaced = None
        if final.exists():  # saving a step again (e.g. after a resume): the new one replaces it
            # Renamed aside, not deleted, until the new one is in: a crash in between leaves the
            # complete new save, which the next start's `_clean` puts in place.
            replaced = final.with_name(f"{final.name}.deleting-{os.getpid()}")
            os.replace(final, replaced)
        os.replace(tmp, final)
        self._writing.discard(tmp)
        _fsync_dir(self.dir)
        if replaced is not None:
            shutil.rmtree(replaced, ignore_errors=True)
        self._prune(latest=final)
        return final

    def adopt_run_id(self, latest: Path | None) -> str | None:
        """The run id of the run resumed from checkpoint `latest` (None: a fresh run's new one),
        which this manager's saves then carry on; None for a checkpoint saved before run ids."""
        if latest is None:
            return self.run_id
        stored = self.load_info(latest).get("run_id")
        if stored is not None:
            self.run_id = str(stored)
        return stored

    def pending_validation(self, step: int) -> Path | None:
        """The checkpoint of `step` (the one a run resumes from) when its validation is pending."""
        path = self.dir / f"step_{step}"
        try:
            return path if step and self.load_info(path).get(VALIDATION_PENDING) else None
        except (OSError, json.JSONDecodeError):
            return None

    def record_export(self, export_dir: Path) -> None:
        """Note in the latest checkpoint (the policy's last save) that `export_dir` holds its
        weights as exported at the run's end, which `check_complete` reads."""
        ckpts = self.checkpoints() if self.cfg.enabled else []
        if ckpts:
            self._write_info(ckpts[-1], {**self.load_info(ckpts[-1]), EXPORTED_TO: str(Path(export_dir).resolve())})

    def check_complete(self, path: Path, last_step: int, key: str, export_dir: Path | None,
                       log_dir: Path) -> None:
        """Raise `RunAlreadyComplete` when the checkpoint at `path` is the run's last step and its
        final export is done (`export_dir`, None: none asked): started again, the run loaded its
        workers, re-exported the same weights and printed an empty result (~40 s for nothing)."""
        info = self.load_info(path)
        if info["step"] < last_step or info.get(VALIDATION_PENDING):
            return
        if export_dir is not None and not (info.get(EXPORTED_TO) == str(Path(export_dir).resolve())
                                           and (Path(export_dir) / "config.json").is_file()):
            # Stopped between its last save and the export (or the export deleted): the run loads
            # its workers to export it now, and trains nothing, so its result is the one logged.
            self.complete_result = _final_metrics(log_dir, path, info["step"])
            return
        where = f", its final policy in {export_dir}" if export_dir is not None else ""
        raise RunAlreadyComplete(
            f"the run is complete: {path} is its last step ({key}={last_step}){where}; nothing to do (raise {key} "
            "to train on, or set checkpointing.start_fresh=true to start over)",
            _final_metrics(log_dir, path, info["step"]))

    def _write_info(self, path: Path, info: dict[str, Any]) -> None:
        """Replace the checkpoint's training info, atomically."""
        tmp = path / f"{INFO_FILE}.tmp"
        _write(tmp, json.dumps(info, indent=2, default=str))
        os.replace(tmp, path / INFO_FILE)
        _fsync_dir(path)

    def record_validation(self, path: Path, metrics: dict[str, float]) -> None:
        """Give the checkpoint at `path`, saved with its validation pending (`VALIDATION_PENDING`:
        a stop signal skipped it), the validation `metrics` ("val:<name>") measured after the
        resume, and rank it again: left unmeasured, it ranked below every measured checkpoint,
        and the top-k pruned what may be the run's best."""
        info = self.load_info(path)
        info.pop(VALIDATION_PENDING, None)
        name = self.cfg.metric_name
        if name and name.startswith("val:"):
            value = metrics.get(name)
            value = value if value is not None and math.isfinite(float(value)) else None
            # With its name: one changed at the resume left the stopped run's, and `_metric_of`
            # read the checkpoint as unmeasured, so the next save pruned the best one.
            info["metric_name"], info["metric_value"] = name, value
            info["best_step"], info["best_metric_value"] = self._best(extra=(info["step"], value))
        self._write_info(path, info)
        self._prune(latest=path)

    # ----------------------------------------------------------------- internals

    def _metric_of(self, path: Path) -> float | None:
        """The checkpoint's value of this run's `metric_name`, or None. A checkpoint saved while
        another metric was named (changed at a resume) holds that one's value, which must not
        be ranked as this one's (a loss of 2.0 beat every accuracy and pruned the new checkpoints)."""
        return self._ranking_of(path)[1]

    def _ranking_of(self, path: Path) -> tuple[str | None, float | None]:
        """(the other metric the checkpoint was ranked by, else None; its value of this run's
        `metric_name`, else None), from one read of its training info."""
        try:
            info = self.load_info(path)
        except (OSError, ValueError):  # a damaged older checkpoint ranks unmeasured: it failed every later save
            return None, None
        if not isinstance(info, dict):
            return None, None
        name, value = info.get("metric_name"), info.get("metric_value")
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            value = None  # edited by hand ("4.2"): no value, as one not measured
        if name != self.cfg.metric_name:
            return (name if isinstance(name, str) and name and value is not None else None), None
        return None, (float(value) if value is not None and math.isfinite(value) else None)

    def _rank(self, items: list[tuple[int, float | None]]) -> list[tuple[int, float | None]]:
        """Best first: by metric (missing values last), newest first when no metric is named."""
        if self.cfg.metric_name is None:
            return sorted(items, key=lambda x: -x[0])
        sign = -1.0 if self.cfg.higher_is_better else 1.0
        return sorted(items, key=lambda x: (x[1] is None, sign * x[1] if x[1] is not None else 0.0, -x[0]))

    def _best(self, extra: tuple[int, float | None]) -> tuple[int | None, float | None]:
        if self.cfg.metric_name is None:
            return None, None
        items = [(int(_STEP_RE.match(p.name).group(1)), self._metric_of(p)) for p in self.checkpoints()]
        items = [i for i in items if i[0] != extra[0]] + [extra]
        best = self._rank(items)[0]
        return (best[0], best[1]) if best[1] is not None else (None, None)

    def _prune(self, latest: Path) -> None:
        k = self.cfg.keep_top_k
        if k is None:
            return
        ckpts = {int(_STEP_RE.match(p.name).group(1)): p for p in self.checkpoints()}
        # Checkpoints ranked by another metric (metric_name changed at a resume) are not pruned: ranked
        # as unmeasured by this one, the earlier run's best went at the next save, without a word.
        ranking = {s: self._ranking_of(p) for s, p in ckpts.items()}
        other = {s: name for s, (name, _) in ranking.items() if name is not None}
        ranked = self._rank([(s, value) for s, (name, value) in ranking.items() if name is None])
        keep = {s for s, _ in ranked[:k]} | {int(_STEP_RE.match(latest.name).group(1))} | set(other)
        for step, path in ckpts.items():
            if step not in keep:
                self._remove(path)
        if other and not self._ranked_otherwise_noted:
            self._ranked_otherwise_noted = True
            log.warning("checkpoints %s were ranked by %s, not checkpointing.metric_name=%r: kept, outside "
                        "keep_top_k's pruning (delete them yourself when done with them)",
                        ", ".join(ckpts[s].name for s in sorted(other)), " / ".join(sorted(set(other.values()))),
                        self.cfg.metric_name)

    def _remove(self, path: Path) -> None:
        # Rename first so that a crash during rmtree leaves no complete-looking step_N.
        doomed = path.with_name(f"{path.name}.deleting-{os.getpid()}")
        os.replace(path, doomed)
        shutil.rmtree(doomed, ignore_errors=True)

    def _clean(self) -> None:
        """Remove the temp dirs of killed saves (`_stale_save`), but put one that was complete (killed
        while it replaced its step_N) in place; move marker-less step_N dirs aside (never delete them)."""
        for p in self.dir.iterdir():
            m = _TMP_RE.match(p.name)
            stale = m is not None and self._stale_save(p, int(m.group(2)))
            final = self.dir / f"step_{m.group(1)}" if m else None
            if stale and (p / COMPLETE_MARKER).is_file() and not final.exists():
                os.replace(p, final)
            elif stale or re.search(r"\.deleting-\d+$", p.name):
                shutil.rmtree(p, ignore_errors=True)
            elif _STEP_RE.match(p.name) and p.is_dir() and not (p / COMPLETE_MARKER).is_file():
                aside = p.with_name(f"{p.name}.incomplete-{int(time.time())}")
                os.replace(p, aside)
                # Said: the run resumes from an earlier step, and the folder (a whole checkpoint's size)
                # is never pruned.
                log.warning("checkpoint %s has no %s marker (a copy or save that did not finish): moved aside to %s, "
                            "not resumed from; delete it when you do not need it", p, COMPLETE_MARKER, aside.name)

    def _stale_save(self, tmp: Path, pid: int) -> bool:
        """Whether the temporary directory `tmp` of process `pid` is what a killed save left.
        One of this process's pid but not of its saves in progress is too: a job restarted in
        a new container often gets the killed driver's pid again, and kept it for good."""
        return tmp not in self._writing if pid == os.getpid() else not _pid_alive(pid)

    def _move_aside(self) -> Path | None:
        """start_fresh: move every step_* entry into `<checkpoint_dir>/previous-<time>/`."""
        return move_aside(self.dir, [p for p in self.dir.iterdir() if p.name.startswith("step_")])


def move_aside(parent: Path, entries: list[Path]) -> Path | None:
    """Move `entries` (files or folders in `parent`) into a new `<parent>/previous-<time>/`, which
    is returned (None when there is nothing to move): what a new run would overwrite is kept."""
    if not entries:
        return None
    aside = parent / time.strftime("previous-%Y%m%d-%H%M%S")
    n = 1
    while aside.exists():
        aside = parent / f"{time.strftime('previous-%Y%m%d-%H%M%S')}-{n}"
        n += 1
    aside.mkdir()
    for p in entries:
        os.replace(p, aside / p.name)
    return aside
