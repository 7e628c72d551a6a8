"""The logger facade and the phase timer.

    logger = Logger(cfg.logger, run_dir, hparams=cfg.model_dump(mode="json"))
    logger.start_progress(total_steps, initial_step)
    logger.console("resumed from step 10")   # a message line above the bar
    logger.log_metrics({"loss": 0.7, **timer.metrics()}, step, prefix="train")
    logger.update_progress(step, {"reward": 0.5})   # moves the bar, shows these beside it
    logger.log_samples(rows, step)      # <run_dir>/samples.jsonl
    logger.print_samples(rows)          # rich table, num_val_samples_to_print rows
    logger.plot()                       # <run_dir>/plots/*.png
    logger.close()

Backends are chosen by `logger.*_enabled`: console (rich), JSONL (`<run_dir>/metrics.jsonl`),
TensorBoard (`<run_dir>/tensorboard`), Weights & Biases (`<run_dir>/wandb`), MLflow (a local
store under `<run_dir>/mlflow` unless `logger.mlflow.tracking_uri` is set); with
`logger.monitor_gpus`, GPU readings join the training metrics. The resolved
config is written once to `<run_dir>/config.yaml` and logged once to each backend.
"""

from __future__ import annotations

import contextlib
import json
import logging as _stdlib_logging
import math
import os
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Protocol

from posttrain.checkpoint import lock_beside, move_aside
from posttrain.config import MissingInputError, to_yaml
from posttrain.logging.jsonl import naming_file, parse_lines
from posttrain.logging.timer import Timer
from posttrain.schemas import LoggerConfig

__all__ = ["Logger", "Timer"]

_log = _stdlib_logging.getLogger("posttrain")

# The W&B and MLflow run ids of this run dir, so that a resumed run logs into the same
# tracker runs instead of starting new ones beside them.
_TRACKER_RUNS = "tracker_runs.json"
# The id of the run whose logs the run dir holds (CheckpointManager.run_id).
_RUN_ID = "run_id"
# What a run writes into its run dir that a later run would append to or mix with its own.
_RUN_LOGS = ("metrics.jsonl", "samples.jsonl", "config.yaml", "plots", "tensorboard", _TRACKER_RUNS, _RUN_ID)
# Prefixes whose steps count something else than the run's steps: the warm-up SFT's, which only
# a fresh run logs. A resume keeps them whole, whatever step its checkpoint is at.
_OWN_STEP_AXES = ("warmup_sft",)
# The record of a checkpoint's save time (`timed_save`): the backends name it `train/timing/checkpoint`,
# beside the step's other phases, while metrics.jsonl keeps one `train` record per step.
_SAVE_TIMING_PREFIX = "train/timing"


class _Backend(Protocol):
    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str) -> None: ...
    def log_hparams(self, hparams: dict[str, Any]) -> None: ...
    def close(self, failed: bool) -> None: ...


# How warnings name a backend.
_BACKEND_NAMES = {"JsonlBackend": "metrics.jsonl", "TensorboardBackend": "TensorBoard", "WandbBackend": "W&B",
                  "MlflowBackend": "MLflow", "ConsoleBackend": "the console"}


def _scalar(value: Any) -> float | None:
    """A float for Python/NumPy/torch scalars and one-element arrays; None for anything else."""
    if isinstance(value, (bool, int, float)):
        return float(value)
    item = getattr(value, "item", None)
    if callable(item):
        try:
            value = item()
        except (ValueError, RuntimeError):  # more than one element
            return None
        if isinstance(value, (bool, int, float)):
            return float(value)
    return None


def _read_tracker_runs(path: Path) -> dict[str, str]:
    """The tracker run ids a stopped run left; {} when it left none or the file is unreadable
    (the resumed run then starts new tracker runs: its metrics are not lost, only split)."""
    try:
        runs = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in runs.items() if isinstance(v, str)} if isinstance(runs, dict) else {}


def _drop_after(path: Path, step: int | None) -> list[dict[str, Any]]:
    """Rewrite the JSONL file at `path` without its lines of steps after `step` (a resumed run logs
    them again: they would be there twice) and without a line a crash left torn, which the next
    line appended would join and make unreadable too. Lines of `_OWN_STEP_AXES` prefixes stay.
    Returns the records kept."""
    if not path.is_file():
        return []
    text = path.read_text()
    lines = text.splitlines()
    kept = [rec for rec in parse_lines(lines) if isinstance(rec, dict) and (
        step is None or not isinstance(rec.get("step"), int) or rec["step"] <= step
        or rec.get("prefix") in _OWN_STEP_AXES)]
    if len(kept) < len(lines) or not text.endswith("\n"):
        tmp = path.with_suffix(".tmp")
        try:
            tmp.write_text("".join(json.dumps(rec) + "\n" for rec in kept))  # as written: json.dumps lines
            tmp.replace(path)  # a crash here leaves the old file whole, never half of it
        except OSError as e:  # a full disk: a traceback, and the empty .tmp left on it
            tmp.unlink(missing_ok=True)
            raise MissingInputError(f"{path}: cannot rewrite it for the resumed run ({e.strerror or e}); it is "
                                    "unchanged: free the space under logger.log_dir") from None
    return kept


def _read_run_id(path: Path) -> str | None:
    """The run id in `path` (None: no such file, from before run ids)."""
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


def _check_writable(run_dir: Path) -> None:
    """Create `run_dir` and write in it, or fail naming logger.log_dir (a permission error from deep
    inside the logger was a traceback; root passes os.access on a read-only or immutable folder)."""
    probe = run_dir / ".posttrain-write-check"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe.write_bytes(b"x")  # a byte, not just a name: a full disk still takes an empty file
    except OSError as e:
        raise MissingInputError(f"logger.log_dir={run_dir}: cannot write it ({e.strerror or e})") from None
    finally:
        with contextlib.suppress(OSError):
            probe.unlink()


class Logger:
    def __init__(self, cfg: LoggerConfig, run_dir: str | Path, hparams: dict[str, Any] | None = None,
                 fresh: bool = False, also_move: tuple[str, ...] = (), resumed_from: int | None = None,
                 exclusive: str | None = None, run_id: str | None = None, compare_run_id: bool = True) -> None:
        """`fresh`: the run starts over (no checkpoint to resume from), so the logs an earlier run
        left in `run_dir` (and the files named in `also_move`, which the caller writes beside them)
        are moved into `<run_dir>/previous-<time>/`; otherwise the run continues them.
        `resumed_from`: the step of the checkpoint a resumed run continues from. What the stopped
        run logged after it is replaced by this run's steps: metrics.jsonl and samples.jsonl drop
        those lines, TensorBoard hides those events and the plots leave them out; what this run
        logs again at a step the stopped run's records keep (the data counts every start logs at
        step 0) is not written twice. The W&B and MLflow runs of the stopped run are continued
        rather than new ones started; their stores cannot delete a logged value, so the steps the
        stopped run logged after the checkpoint stay there beside the ones logged again.
        `exclusive`: the config key naming `run_dir` ("logger.log_dir"), whose lock the logger holds
        until `close`: a second live run there moved the first's logs aside and replaced its final
        export (an eval run there, a training run's logs). None: no lock.
        `run_id`: the run's (CheckpointManager.run_id), kept in `run_dir`. A resumed run that finds
        another run's logs there (a run with other checkpoints, the same logger.log_dir) moves
        them aside as a fresh start does, instead of cutting them at its step and continuing
        them: its own earlier logs were moved aside by that run (the message says where).
        `compare_run_id` False: a checkpoint from before run ids, whose run cannot be told apart;
        its logs are continued and take `run_id`, which its next saves carry."""
        self.cfg = cfg
        self.run_dir = Path(run_dir)
        _check_writable(self.run_dir)
        self._lock_fd = lock_beside(self.run_dir, exclusive, str(run_dir)) if exclusive else -1
        # The records a resumed run reads back for its plots to cover the stopped run's steps:
        # metrics.jsonl, or without it (logger.jsonl_enabled=false) a file kept for the plots alone.
        self.metrics_path = self.run_dir / ("plots/history.jsonl" if cfg.plots_enabled and not cfg.jsonl_enabled
                                            else "metrics.jsonl")
        logged_by = _read_run_id(self.run_dir / _RUN_ID)
        another_runs = (compare_run_id and resumed_from is not None and None not in (run_id, logged_by)
                        and logged_by != run_id)
        if another_runs:
            fresh, resumed_from = True, None
        # Appended to, the earlier run's metrics, samples and TensorBoard events would mix with
        # this run's at the same steps (and its later steps would stay in this run's plots).
        self.moved_aside = move_aside(self.run_dir, [self.run_dir / n for n in dict.fromkeys((*_RUN_LOGS, *also_move))
                                                     if (self.run_dir / n).exists()]) if fresh else None
        _drop_after(self.run_dir / "samples.jsonl", resumed_from)
        # Earlier records of this run dir (a resumed run) so that the plots cover the whole run.
        self._records: list[dict[str, Any]] = _drop_after(self.metrics_path, resumed_from)
        # What every start logs (the data counts at step 0) a resumed run logs again: the stopped
        # run's records at those steps stand, so that each step is in every backend once.
        self._kept = set() if resumed_from is None else {(r.get("prefix"), r.get("step")) for r in self._records}
        # The plots last drawn and how many records they show: the end of a run right after its
        # last checkpoint's plots has nothing new to draw (~1 s of matplotlib per call).
        self._drawn: tuple[int, list[Path]] = (-1, [])
        self.nonfinite_counts: dict[str, int] = {}
        # Called with (logged scalars, prefix) after each log_metrics (a check of a config key
        # that names metrics, such as checkpointing.metric_name).
        self.metric_checks: list[Any] = []
        self._closed = False
        hparams = json.loads(json.dumps(hparams or {}, default=str))

        tracker_runs_path = self.run_dir / _TRACKER_RUNS
        earlier_runs = _read_tracker_runs(tracker_runs_path) if resumed_from is not None else {}
        self._console = None
        self._backends: list[_Backend] = []
        self._unwritable: set[Path] = set()  # log_samples' files a write failed on
        # The logs a write failed on (a full disk): name -> from which step they miss what (`close` says so).
        self.incomplete: dict[str, str] = {}
        if cfg.console_enabled:
            from posttrain.logging.console import ConsoleBackend

            self._console = ConsoleBackend()
            self._backends.append(self._console)
        if cfg.jsonl_enabled or cfg.plots_enabled:
            from posttrain.logging.jsonl import JsonlBackend

            self.metrics_path.parent.mkdir(exist_ok=True)
            self._backends.append(JsonlBackend(self.metrics_path))
        if cfg.tensorboard_enabled:
            from posttrain.logging.tensorboard import TensorboardBackend

            self._backends.append(TensorboardBackend(self.run_dir / "tensorboard", resumed_from, _OWN_STEP_AXES))
        if cfg.wandb_enabled:
            from posttrain.logging.wandb import WandbBackend

            wandb_backend = WandbBackend(cfg.wandb, self.run_dir, hparams, resume_id=earlier_runs.get("wandb"))
            self._backends.append(wandb_backend)
            earlier_runs["wandb"] = wandb_backend.run.id
        if cfg.mlflow_enabled:
            from posttrain.logging.mlflow import MlflowBackend

            mlflow_backend = MlflowBackend(cfg.mlflow, self.run_dir, resume_id=earlier_runs.get("mlflow"))
            self._backends.append(mlflow_backend)
            earlier_runs["mlflow"] = mlflow_backend.run_id
        if earlier_runs:
            tracker_runs_path.write_text(json.dumps(earlier_runs))

        self._gpu_monitor = None
        if cfg.monitor_gpus:
            from posttrain.logging.gpu import GpuMonitor

            self._gpu_monitor = GpuMonitor(cfg.gpu_monitoring)

        if run_id is not None:
            (self.run_dir / _RUN_ID).write_text(run_id + "\n")
        if another_runs:
            own = [d for d in sorted(self.run_dir.glob("previous-*")) if _read_run_id(d / _RUN_ID) == run_id]
            self.console(f"the logs in {self.run_dir} were another run's (run {logged_by}; this one is {run_id}): "
                         f"moved to {self.moved_aside}; this run's own logs up to its checkpoint "
                         + (f"are in {own[-1]}" if own else "are not there") + "; it logs its next steps here")
        elif self.moved_aside is not None:
            self.console(f"the earlier run's logs in {self.run_dir} were moved to {self.moved_aside}")
        if hparams:
            (self.run_dir / "config.yaml").write_text(to_yaml(hparams), encoding="utf-8")
            for backend in self._backends:
                backend.log_hparams(hparams)

    # ----------------------------------------------------------------- metrics

    def console(self, message: str) -> None:
        """Print a one-line message (above the progress bar) when the console backend is on."""
        if self._console is not None:
            self._console.message(message)

    def start_progress(self, total_steps: int, initial_step: int = 0) -> None:
        """A console progress bar with ETA over `total_steps` (no-op without the console backend)."""
        if self._console is not None:
            self._console.start_progress(total_steps, initial_step)

    def update_progress(self, step: int, metrics: dict[str, Any] | None = None) -> None:
        """Move the bar to `step` completed steps and show `metrics` (a few scalars) beside it."""
        if self._console is not None:
            scalars = {k: v for k, v in ((k, _scalar(v)) for k, v in (metrics or {}).items()) if v is not None}
            self._console.update_progress(step, scalars)

    def log_metrics(self, metrics: dict[str, Any], step: int, prefix: str = "train",
                    console: bool = True) -> dict[str, float]:
        """Log the scalar values of `metrics` at `step` under `prefix`; return what was logged.
        `console=False`: every backend but the console's (the caller prints its own line).

        Non-scalar values (strings, lists, multi-element tensors) are skipped. NaN and inf
        are logged as they are (hiding them would hide the bug; MLflow's store keeps +-inf as
        +-1.8e308), and counted in `nonfinite_counts` with a warning naming the keys.
        """
        scalars = {k: v for k, v in ((k, _scalar(v)) for k, v in metrics.items()) if v is not None}
        if (prefix, step) in self._kept:
            return scalars
        if self._gpu_monitor is not None and prefix == "train":
            scalars.update(self._gpu_monitor.read())
        bad = [k for k, v in scalars.items() if not math.isfinite(v)]
        for k in bad:
            name = f"{prefix}/{k}"
            self.nonfinite_counts[name] = self.nonfinite_counts.get(name, 0) + 1
        if bad:
            _log.warning(
                "step %d: non-finite %s values: %s (non-finite so far: %s)", step, prefix,
                ", ".join(f"{k}={scalars[k]}" for k in bad),
                ", ".join(f"{k} x{n}" for k, n in self.nonfinite_counts.items()),
            )
        for backend in list(self._backends):
            if console or backend is not self._console:
                try:
                    backend.log_metrics(scalars, step, prefix)
                except OSError as e:
                    self._drop_backend(backend, e, step)
        self._records.append({"step": step, "prefix": prefix, **scalars})
        for check in self.metric_checks:
            check(scalars, prefix)
        return scalars

    def _drop_backend(self, backend: _Backend, error: OSError, step: int) -> None:
        """Stop logging to `backend`, whose file could not be written (a full disk under
        logger.log_dir), with a warning: the run goes on, and its checkpoints hold the model (it
        crashed, losing the steps since its last checkpoint, for its logs). The steps from here
        on are missing from that backend for good (a resumed run starts at its latest checkpoint,
        not where the logs stopped); its other backends still get them, and `close` says again
        which logs are incomplete."""
        self._backends.remove(backend)
        with contextlib.suppress(Exception):
            backend.close(True)
        what = _BACKEND_NAMES.get(type(backend).__name__, type(backend).__name__)
        self.incomplete[what] = f"no steps from {step} on ({error})"
        console = ", and the console still shows each step," if self._console in self._backends else ""
        _log.warning("logging to %s stopped at step %d: %s; training goes on%s but %s misses the steps from here on "
                     "(free the space under logger.log_dir)", what, step, error, console, what)

    @contextlib.contextmanager
    def timed_save(self, step: int) -> Iterator[None]:
        """Time the block, the checkpoint of `step`, and log its seconds as `train/timing/checkpoint`
        at `step` (metrics.jsonl: a record of prefix `train/timing`, key `checkpoint`).

        The loops log a step's metrics and samples before its checkpoint: a process killed after
        the save (SIGKILL, the OOM killer) resumes after that step and never logs it again, so
        logged after, its metrics were lost from every backend. The save's time is measured only
        once it is done, hence a record of its own; a kill before it is logged loses that alone."""
        start = time.perf_counter()
        yield
        self.log_metrics({"checkpoint": time.perf_counter() - start}, step, prefix=_SAVE_TIMING_PREFIX,
                         console=False)

    def log_samples(self, rows: list[dict[str, Any]], step: int, name: str = "samples") -> None:
        """Append up to `logger.num_samples_to_dump` rows, each with its step, to `<run_dir>/<name>.jsonl`."""
        rows = rows[: self.cfg.num_samples_to_dump]
        if not rows:
            return
        path = self.run_dir / f"{name}.jsonl"
        if path in self._unwritable:
            return
        try:
            with naming_file(path), open(path, "a") as f:
                for row in rows:
                    f.write(json.dumps({"step": step, **row}, default=str) + "\n")
        except OSError as e:  # as for a backend's file (`_drop_backend`): the samples stop, the run goes on
            self._unwritable.add(path)
            self.incomplete[path.name] = f"no samples from step {step} on ({e})"
            _log.warning("writing %s stopped at step %d: %s; training goes on", path.name, step, e)

    def print_samples(self, rows: list[dict[str, Any]], title: str = "samples") -> None:
        """Print up to `logger.num_val_samples_to_print` rows as a table (console backend only)."""
        if self._console is not None and self.cfg.num_val_samples_to_print:
            self._console.print_samples(rows[: self.cfg.num_val_samples_to_print], title)

    def plot(self) -> list[Path]:
        """Write PNGs of the main curves to `<run_dir>/plots/` (when `logger.plots_enabled`). A file
        system that refuses them (a full disk) is a warning: they are drawn from metrics.jsonl,
        which holds the numbers, and a run stopped by its pictures (at a checkpoint's save) loses more."""
        if not self.cfg.plots_enabled:
            return []
        from posttrain.logging.plots import plot_history

        drawn, paths = self._drawn
        if drawn == len(self._records) and all(p.exists() for p in paths):
            return paths
        try:
            paths = plot_history(self._records, self.run_dir / "plots", _OWN_STEP_AXES)
            self._drawn = (len(self._records), paths)
            return paths
        except OSError as e:
            _log.warning("the plots could not be written to %s: %s", self.run_dir / "plots", e)
            return []

    def __enter__(self) -> "Logger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()  # also on an exception: stops the progress bar, finishes the W&B/MLflow runs

    def close(self) -> None:
        """Close every backend, also when one fails (a full disk under metrics.jsonl): the others
        still flush their files and end their W&B/MLflow runs; the first error is raised after.
        Called while an exception propagates (a crash: the runs close their logger in a `finally`
        or an `except`), it marks the W&B and MLflow runs failed rather than finished."""
        if self._closed:
            return
        self._closed = True
        failed = sys.exc_info()[1] is not None
        if failed and self._records:
            # A crashed run gets its curves up to its last logged step too (a finished one drew
            # them at its end); best effort: the crash is the error to show.
            try:
                self.plot()
            except Exception as e:  # noqa: BLE001
                _log.warning("the plots of the failed run could not be drawn: %s", e)
        if self.incomplete:
            _log.warning("the logs of this run under %s are incomplete: %s", self.run_dir,
                         "; ".join(f"{name}: {what}" for name, what in self.incomplete.items()))
        error: Exception | None = None
        for backend in self._backends:
            try:
                backend.close(failed)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the other backends closed
                error = error or e
        if self._lock_fd >= 0:  # logger.log_dir is free for the next run
            os.close(self._lock_fd)
            self._lock_fd = -1
        if error is not None:
            raise error
