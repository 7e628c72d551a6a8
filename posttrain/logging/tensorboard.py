"""TensorBoard backend: scalars as `<prefix>/<metric>`, the config once as text."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


class TensorboardBackend:
    def __init__(self, log_dir: Path, resumed_from: int | None = None) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        # A resumed run relogs the steps after its checkpoint: purge_step makes TensorBoard hide
        # the stopped run's events from there on, which would otherwise show twice per step.
        self._writer = SummaryWriter(log_dir=str(log_dir),
                                     purge_step=None if resumed_from is None else resumed_from + 1)

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str) -> None:
        for key, value in metrics.items():
            self._writer.add_scalar(f"{prefix}/{key}", value, global_step=step)
        self._writer.flush()

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        # Markdown code block keeps the YAML indentation in TensorBoard's text tab.
        text = "```\n" + yaml.safe_dump(hparams, sort_keys=False) + "```"
        self._writer.add_text("config", text, global_step=0)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()
