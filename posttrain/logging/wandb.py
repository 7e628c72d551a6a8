"""Weights & Biases backend.

`logger.wandb.mode` (online/offline/disabled) wins over `WANDB_MODE`; when it is null,
`WANDB_MODE` decides (offline writes `<run_dir>/wandb/offline-run-*` to sync later with
`wandb sync`). Metrics are logged against their own `global_step` axis, so logging a
step that wandb has already seen (a resumed run, validation after training at one step)
is kept rather than dropped. A resumed run continues the stopped run's W&B run (its id,
`resume="allow"`); offline, each process writes its own `offline-run-*` folder with that
id, and `wandb sync` uploads them in order into the one run.

The steps the stopped run logged after the checkpoint a run resumes from, logged again, show
twice on the `global_step` axis: W&B's history is append-only. Its rewind
(`wandb.init(resume_from="<id>?_step=<n>")`) is not used: beta, online only, and on W&B's own
internal `_step`. metrics.jsonl, TensorBoard and the plots show each step once.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from posttrain.config import InputError
from posttrain.schemas import WandbConfig

_STEP_KEY = "global_step"


class WandbBackend:
    def __init__(self, cfg: WandbConfig, run_dir: Path, hparams: dict[str, Any], resume_id: str | None = None) -> None:
        import wandb

        self._wandb = wandb
        mode = cfg.mode or os.environ.get("WANDB_MODE") or None
        try:
            self.run = wandb.init(
                project=cfg.project,
                name=cfg.name or run_dir.name,
                entity=cfg.entity,
                mode=mode,
                dir=str(run_dir),
                config=hparams,
                id=resume_id,
                resume="allow" if resume_id else None,
                settings=wandb.Settings(silent=True, console="off"),
            )
        except wandb.errors.UsageError as e:  # e.g. online without an API key: the user's setup, not a bug
            raise InputError(f"logger.wandb_enabled: W&B cannot start a run: {e} (or set logger.wandb.mode=offline "
                             "to sync later with `wandb sync`)") from None
        self.run.define_metric(_STEP_KEY)
        self.run.define_metric("*", step_metric=_STEP_KEY)

    def log_metrics(self, metrics: dict[str, float], step: int, prefix: str) -> None:
        self.run.log({_STEP_KEY: step, **{f"{prefix}/{k}": v for k, v in metrics.items()}})

    def log_hparams(self, hparams: dict[str, Any]) -> None:
        """Given to `wandb.init(config=...)` at construction."""

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)
