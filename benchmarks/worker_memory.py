"""Memory of a long GRPO run's policy worker, step by step, per size of torch's CPU kernel caches.

    python benchmarks/worker_memory.py [--steps 150] [--capacities 1024,256,64] [--out FILE]

Each capacity runs the quickstart (`posttrain grpo --config examples/configs/grpo_quickstart.yaml`,
20 warm-up SFT steps, no checkpoints) for `--steps` GRPO steps with ONEDNN_PRIMITIVE_CACHE_CAPACITY
and LRU_CACHE_CAPACITY (oneDNN's primitive cache and ideep's, 1024 entries each by default) set
to it, samples the resident memory of the policy worker (the `ray::_WorkerHost` process under
the command) every second, and reports it at a few steps with the run's median step time.
Both caches keep an entry per matmul shape, and a GRPO step's shapes change with its batch
(rows left out for a zero gradient, the longest response), so with large caches the worker's
memory grows for the first several hundred steps.
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import torch

from posttrain.logging.jsonl import read_metrics

ROOT = Path(__file__).resolve().parents[1]
REPORT_STEPS = (1, 10, 25, 50, 100, 150, 200, 300, 400, 600)


def _worker_rss_mb(root: int) -> float | None:
    """RSS of the policy worker below `root` (MB), None before it starts."""
    for proc in psutil.Process(root).children(recursive=True):
        try:
            if any("_WorkerHost" in part for part in proc.cmdline()):
                return proc.memory_info().rss / 2**20
        except psutil.Error:  # gone between the listing and the read
            continue
    return None


def _train_records(log_dir: Path) -> list[dict]:
    return [r for r in read_metrics(log_dir / "metrics.jsonl") if r.get("prefix") == "train"]


def run(capacity: str, steps: int, work: Path) -> dict:
    log_dir = work / f"cap{capacity}"
    env = {**os.environ, "ONEDNN_PRIMITIVE_CACHE_CAPACITY": capacity, "LRU_CACHE_CAPACITY": capacity,
           "RAY_AUTH_MODE": os.environ.get("RAY_AUTH_MODE", "disabled"),
           "RAY_TMPDIR": tempfile.mkdtemp(prefix="wm-ray-", dir="/tmp")}
    cmd = [str(ROOT / ".venv" / "bin" / "posttrain"), "grpo", "--config", "examples/configs/grpo_quickstart.yaml",
           f"grpo.max_num_steps={steps}", "grpo.warmup_sft_steps=20", "grpo.val_period=0", "grpo.val_at_start=false",
           "grpo.val_at_end=false", "checkpointing.enabled=false", f"logger.log_dir={log_dir}",
           "logger.plots_enabled=false"]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    rss_at: dict[int, float] = {}
    try:
        while proc.poll() is None:
            time.sleep(1.0)
            rss, done = _worker_rss_mb(proc.pid), len(_train_records(log_dir))
            if rss is not None:
                rss_at.setdefault(done, rss)  # the first sample after the step's record
                rss_at[-1] = rss
    finally:
        if proc.poll() is None:
            proc.terminate()
        _, err = proc.communicate()
    if proc.returncode != 0:
        sys.exit(f"capacity {capacity}: the run failed ({proc.returncode}):\n{err[-3000:]}")
    records = _train_records(log_dir)
    if -1 in rss_at:  # the run's last sample: the last step's (the run ends within a second of it)
        rss_at.setdefault(len(records), rss_at.pop(-1))
    reported = {s: next(rss_at[k] for k in sorted(rss_at) if k >= s) for s in REPORT_STEPS
                if s <= steps and any(k >= s for k in rss_at)}
    return {"capacity": capacity, "rss": reported,
            "step_s": statistics.median(r["step_time_s"] for r in records),
            "train_s": statistics.median(r["timing/training"] for r in records)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--capacities", default="1024,256,64", help="comma-separated cache sizes (entries)")
    ap.add_argument("--out", default=None, help="also write the markdown table here")
    args = ap.parse_args()
    t0 = time.time()
    with tempfile.TemporaryDirectory(prefix="worker-memory-") as work:
        results = [run(c, args.steps, Path(work)) for c in args.capacities.split(",")]
    shown = [s for s in REPORT_STEPS if any(s in r["rss"] for r in results)]
    lines = [f"machine: {platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}, load average at "
             f"end {os.getloadavg()[0]:.1f}; wall time {time.time() - t0:.0f} s", "",
             "| cache capacity | " + " | ".join(f"RSS MB, step {s}" for s in shown)
             + " | median step s | median training s |",
             "|---|" + "---|" * len(shown) + "---|---|"]
    for r in results:
        lines.append(f"| {r['capacity']} | " + " | ".join(f"{r['rss'][s]:.0f}" if s in r["rss"] else "-" for s in shown)
                     + f" | {r['step_s']:.3f} | {r['train_s']:.3f} |")
    print("\n".join(lines))
    if args.out:
        Path(args.out).write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
