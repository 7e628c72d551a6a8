"""TensorBoard backend: scalars as `<prefix>/<metric>`, the config as text at the run's first
step (a resumed run's at its own first step: not a second copy at step 0). The prefixes
on a step axis of their own (the warm-up SFT's steps) go to a TensorBoard run of their own,
`<log_dir>/<prefix>`, out of reach of a resumed run's purge."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from posttrain.config import to_yaml


def _quiet_writer_thread_errors() -> None:
    """Keep an OSError of TensorBoard's writer thread (a full disk) from printing its traceback:
    the thread keeps the error, the next write raises it in the main thread, and the Logger drops
    this backend with a one-line warning. Printed too, the traceback read as the run's crash."""
    previous = threading.excepthook
    if getattr(previous, "_posttrain_tensorboard", False):
        return

    def hook(args: threading.ExceptHookArgs) -> None:
        if not (type(args.thread).__module__.startswith("tensorboard.") and issubclass(args.exc_type, OSError)):
            previous(args)

    hook._posttrain_tensorboard = True  # type: ignore[attr-defined]
    threading.excepthook = hook


class TensorboardBackend:
    def __init__(self, log_dir: Path, resumed_from: int | None = None, own_step_axes: tuple[str, ...] = ()) -> None:
        from torch.utils.tensorboard import SummaryWriter

        _quiet_writer_thread_errors()
        self.log_dir = log_dir
        # A resumed run relogs the steps after its checkpoint: purge_step makes TensorBoard hide
        # the stopped run's events from there on, which would otherwise show twice per step. It
        # hides every tag's, so the warm-up's (steps 10..warmup_sft_steps) are written elsewhere.
        # A fresh run starts its session at step 0 too: TensorBoard's Python loader
        # (--load_fast=false) takes the first session start it reads for the run's own, not a
        # restart, and purged nothing at a resume after a run that wrote none.
        self._writer = SummaryWriter(log_dir=str(log_dir), purge_step=0 if resumed_from is None else resumed_from + 1)
        self._first_step = 0 if resumed_from is None else resumed_from + 1
        self._own_step_axes = own_step_axes
        self._axis_writers: dict[str, SummaryWriter] = {}

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str) -> None:
        writer = self._writer
        if prefix in self._own_step_axes:
            from torch.utils.tensorboard import SummaryWriter

            if prefix not in self._axis_writers:
                self._axis_writers[prefix] = SummaryWriter(log_dir=str(self.log_dir / prefix))
            writer = self._axis_writers[prefix]
        for key, value in metrics.items():
            writer.add_scalar(f"{prefix}/{key}", value, global_step=step)
        writer.flush()

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        # Markdown code block keeps the YAML indentation in TensorBoard's text tab; the YAML is
        # config.yaml's (safe_dump wrote non-ASCII text as escapes, "L\xF6sung").
        text = "```\n" + to_yaml(hparams) + "```"
        self._writer.add_text("config", text, global_step=self._first_step)
        self._writer.flush()

    def close(self, failed: bool = False) -> None:
        for writer in (self._writer, *self._axis_writers.values()):
            writer.close()
