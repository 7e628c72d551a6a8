"""JSONL metrics backend: `<run_dir>/metrics.jsonl`, one object per `log_metrics` call.

Each line is `{"step": int, "prefix": str, "time": unix seconds, "<metric>": value, ...}`
with the metric names as given (without the prefix). NaN and inf are written as the
JSON extensions `NaN`/`Infinity`, which Python's `json` reads back.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any


class JsonlBackend:
    def __init__(self, path: Path) -> None:
        self.path = path
        # Line buffered and appended: a resumed run continues the same file; a crash loses no line.
        self._f = open(path, "a", buffering=1)

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str) -> None:
        try:
            self._f.write(json.dumps({"step": step, "prefix": prefix, "time": time.time(), **metrics}) + "\n")
        except OSError as e:  # a write's error names no file: "[Errno 28] No space left on device"
            raise OSError(e.errno, e.strerror, str(self.path)) from e

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        """The config is written whole to `<run_dir>/config.yaml` by the Logger."""

    def close(self, failed: bool = False) -> None:
        self._f.close()


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Every record of a metrics.jsonl file; a torn last line (crash mid-write) is skipped."""
    records = []
    if not path.is_file():
        return records
    for line in path.read_text().splitlines():
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return records
