"""JSONL metrics backend: `<run_dir>/metrics.jsonl`, one object per `log_metrics` call.

Each line is `{"step": int, "prefix": str, "time": unix seconds, "<metric>": value, ...}`
with the metric names as given (without the prefix). NaN and inf are written as the
JSON extensions `NaN`/`Infinity`, which Python's `json` reads back.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Any, Iterator


class JsonlBackend:
    def __init__(self, path: Path) -> None:
        self.path = path
        # Line buffered and appended: a resumed run continues the same file; a crash loses no line.
        self._f = open(path, "a", buffering=1)

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str) -> None:
        with naming_file(self.path):
            self._f.write(json.dumps({"step": step, "prefix": prefix, "time": time.time(), **metrics}) + "\n")

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        """The config is written whole to `<run_dir>/config.yaml` by the Logger."""

    def close(self, failed: bool = False) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl file; a torn last line (crash mid-write) is skipped."""
    return parse_lines(path.read_text().splitlines()) if path.is_file() else []


def parse_lines(lines: list[str]) -> list[Any]:
    """The JSON value of each line of a JSONL file; a torn line (a crash mid-write) is skipped."""
    records = []
    for line in lines:
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records


@contextlib.contextmanager
def naming_file(path: Path) -> Iterator[None]:
    """Re-raise a write's OSError naming `path`: its own names no file ("[Errno 28] No space
    left on device"), not which of the run's files, and so which disk, it was."""
    try:
        yield
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(path)) from e
