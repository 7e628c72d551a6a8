"""GPU monitoring for `logger.monitor_gpus`: utilisation and memory of every GPU of this node.

Read with `nvidia-smi` rather than from torch because the GPUs belong to the Ray worker
processes, not to the driver that logs; `nvidia-smi` sees all of them. Readings are taken at
most every `logger.gpu_monitoring.collection_interval` seconds and logged with the step's
training metrics as `gpu/<index>/utilization` (%), `gpu/<index>/memory_used_gb` and
`gpu/<index>/memory_total_gb`.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import time

from posttrain.schemas import GpuMonitoringConfig

log = logging.getLogger("posttrain")

QUERY = ["--query-gpu=index,utilization.gpu,memory.used,memory.total", "--format=csv,noheader,nounits"]
# The metric and its divisor of each value the query asks for after the index (MiB -> GiB).
_FIELDS = (("utilization", 1), ("memory_used_gb", 1024), ("memory_total_gb", 1024))


class GpuMonitor:
    def __init__(self, cfg: GpuMonitoringConfig) -> None:
        self.cfg = cfg
        self.exe = shutil.which("nvidia-smi")
        self._last = -float("inf")
        if self.exe is None:
            log.warning("logger.monitor_gpus=true but nvidia-smi is not on PATH: no GPU metrics will be logged")

    def read(self) -> dict[str, float]:
        """The current readings, or {} when the interval has not passed or nvidia-smi is unavailable."""
        now = time.monotonic()
        if self.exe is None or now - self._last < self.cfg.collection_interval:
            return {}
        self._last = now
        try:
            out = subprocess.run([self.exe, *QUERY], capture_output=True, text=True, timeout=10, check=True).stdout
        except (subprocess.SubprocessError, OSError) as e:
            log.warning("nvidia-smi failed (%s): skipping this GPU reading", e)
            return {}
        metrics: dict[str, float] = {}
        for line in out.strip().splitlines():
            index, *fields = [f.strip() for f in line.split(",")]
            # Each field on its own: a GPU that reports one as "[N/A]" (utilisation on a MIG
            # instance) still has the others (its memory was dropped with it).
            for (name, scale), field in zip(_FIELDS, fields):
                try:
                    metrics[f"gpu/{index}/{name}"] = float(field) / scale
                except ValueError:
                    continue
        return metrics
