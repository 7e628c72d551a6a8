"""What the functional tests check of the docs against a real run's output."""

import re
from pathlib import Path

from posttrain.logging.jsonl import read_metrics

METRICS_DOC = Path(__file__).parents[2] / "docs" / "metrics.md"


def undocumented_metrics(log_dir) -> list[str]:
    """The `<prefix>/<key>`s of `log_dir`'s metrics.jsonl that docs/metrics.md never names: a
    metric added without its line there is one nobody can read. A key is named in full, with
    its prefix, as a `timing/<phase>`'s phase, or as a row's `name`, `_min`, `_max`."""
    names = set(re.findall(r"`([^`\s]+)`", METRICS_DOC.read_text()))

    def documented(prefix: str, key: str) -> bool:
        stem, _, extreme = key.rpartition("_")
        return bool({key, f"{prefix}/{key}", key.removeprefix("timing/")} & names) or (
            extreme in ("min", "max") and stem in names and f"_{extreme}" in names)

    return sorted({f"{r['prefix']}/{k}" for r in read_metrics(Path(log_dir) / "metrics.jsonl")
                   for k in r if not documented(r["prefix"], k)})
