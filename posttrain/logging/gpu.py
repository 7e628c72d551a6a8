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
            fields = [f.strip() for f in line.split(",")]
            try:
                index, util, used, total = fields[0], float(fields[1]), float(fields[2]), float(fields[3])
            except (IndexError, ValueError):
                continue  # "[N/A]" on GPUs that do not report a field
            metrics[f"gpu/{index}/utilization"] = util
            metrics[f"gpu/{index}/memory_used_gb"] = used / 1024
            metrics[f"gpu/{index}/memory_total_gb"] = total / 1024
        return metrics
