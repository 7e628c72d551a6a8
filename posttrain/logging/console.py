"""Console backend (rich): a progress bar with ETA and one compact line of key metrics per log call."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table
from rich.text import Text

# Shown first, in this order, when present (matched as whole words of the metric's leaf name).
KEY_METRICS = ("loss", "reward", "accuracy", "kl", "entropy", "grad_norm", "lr", "tokens_per_s")
_MAX_SHOWN = 8
# Shown besides those when not 0: samples a broken verifier scored 0 read like a bad model's otherwise.
ALERT_METRICS = ("env_errors",)
_MAX_CELL = 300


def word_match(key: str, word: str) -> bool:
    """True when `word` is a whole `_`-separated word of the last `/` segment of `key`."""
    # `(^|_)word($|_)` as a plain substring test: a regex per key and word took
    # ~1 ms of each GRPO step's console line.
    return f"_{word}_" in f"_{key.rsplit('/', 1)[-1]}_"


def compact_line(metrics: dict[str, float], step: int, prefix: str, total_steps: int | None) -> str:
    """`[train] step 3/10 | loss 0.693 | reward 0.25 | ... | time 1.2s`: the key metrics of one step."""
    plain = {k: v for k, v in metrics.items() if not k.startswith("timing/")}
    shown: list[str] = []
    for word in KEY_METRICS:
        shown += [k for k in plain if word_match(k, word) and k not in shown]
    if not shown:
        shown = list(plain)
    parts = [f"[bold]{escape(prefix)}[/bold] step {step}" + (f"/{total_steps}" if total_steps else "")]
    alerts = [k for k in plain if k.rsplit("/", 1)[-1] in ALERT_METRICS and plain[k] and k not in shown[:_MAX_SHOWN]]
    parts += [f"{escape(k)} {plain[k]:.4g}" for k in shown[:_MAX_SHOWN] + alerts]
    step_time = sum(v for k, v in metrics.items()
                    if k.startswith("timing/") and k.count("/") == 1 and math.isfinite(v))  # not "time nans"
    if step_time:
        parts.append(f"time {step_time:.3g}s")
    return " | ".join(parts)


class ConsoleBackend:
    def __init__(self, console: Console | None = None) -> None:
        self.console = console or Console()
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        self._total: int | None = None

    def start_progress(self, total_steps: int, initial_step: int = 0) -> None:
        """Show a progress bar over `total_steps`; `initial_step` steps are already done (a resume)."""
        self.stop_progress()
        self._total = total_steps
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("elapsed"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            TextColumn("{task.fields[summary]}"),
            console=self.console,
            # Forced colour (FORCE_COLOR, which many CI runners set) makes rich take a pipe for a
            # terminal: each refresh and each printed line then wrote another frame of the bar
            # into the log. Only a real terminal (or a notebook) shows the bar; the step lines stay.
            disable=not (self.console.is_jupyter or _isatty(self.console.file)),
        )
        self._progress.start()
        self._task = self._progress.add_task("steps", total=total_steps, completed=initial_step, summary="")

    def stop_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def update_progress(self, step: int, summary: dict[str, float] | None = None) -> None:
        """`step` counts completed steps: the bar moves to it (never back); `summary` shows beside it."""
        if self._progress is None or self._task is None:
            return
        done = self._progress.tasks[0].completed
        fields = {"summary": escape("  ".join(f"{k} {v:.4g}" for k, v in summary.items()))} if summary is not None else {}
        self._progress.update(self._task, completed=max(done, step), **fields)

    # soft_wrap: one line per step and per message whatever the width. Written to a file or a pipe,
    # rich took 80 columns and broke them, and `grep 'train step' log | grep grad_norm` missed values.
    def message(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str) -> None:
        self.console.print(compact_line(metrics, step, prefix, self._total), highlight=False, soft_wrap=True)
        self.update_progress(step)

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        """Not printed: the resolved config is in `<run_dir>/config.yaml` (`--print-config` shows it)."""

    def print_samples(self, rows: list[dict[str, Any]], title: str = "samples") -> None:
        if not rows:
            return
        table = Table(title=title, show_lines=True)
        columns = list(dict.fromkeys(k for row in rows for k in row))
        for col in columns:
            table.add_column(Text(col), overflow="fold")
        for row in rows:
            # As Text, not markup: a model's "[/x]" raised MarkupError (the run crashed in its
            # validation) and its "[bold]" vanished from what it wrote.
            table.add_row(*(Text(_cell(row.get(c, ""))) for c in columns))
        self.console.print(table)

    def close(self, failed: bool = False) -> None:
        self.stop_progress()


def _isatty(stream: Any) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _cell(value: Any) -> str:
    text = f"{value:.4g}" if isinstance(value, float) else str(value)
    return text if len(text) <= _MAX_CELL else text[: _MAX_CELL - 3] + "..."
