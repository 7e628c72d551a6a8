"""Helpers of the stop tests (test_stop.py, test_stop_early.py): the real `posttrain grpo`
command on embedded:tiny, signalled once it is ready."""

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from posttrain.logging.jsonl import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXE = Path(sys.executable).parent / "posttrain"


def train_steps(log_dir: Path) -> list[int]:
    path = log_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r["step"] for r in read_metrics(path) if r["prefix"] == "train"]


def grpo_command(tmp_path: Path, steps: int, val_period: int = 0) -> list[str]:
    return [str(EXE), "grpo", "--config", "examples/configs/grpo_quickstart.yaml",
            "policy.model_name=embedded:tiny", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
            "grpo.warmup_sft_steps=0", "grpo.val_at_start=false", f"grpo.val_period={val_period}", "data.num_train=256",
            "grpo.val_at_end=false", "data.max_val_samples=8",
            "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16", "policy.logprob_batch_size=16",
            f"grpo.max_num_steps={steps}", "checkpointing.save_period=1000", "checkpointing.export_hf_at_end=true",
            "logger.tensorboard_enabled=false", "logger.plots_enabled=false", "cluster.cpus_per_worker=1",
            f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"]


def _left(proc: subprocess.Popen, job: psutil.Process) -> str:
    """What keeps a signalled command's output open: the processes still in its or its job's
    session, with their state (a rare failure; this says which process and where)."""
    sessions = {proc.pid, job.pid}
    left = []
    for p in psutil.process_iter(["pid", "status", "cmdline"]):
        with contextlib.suppress(psutil.Error, ProcessLookupError):
            if os.getsid(p.pid) in sessions:
                left.append(f"{p.pid} {p.info['status']} {' '.join(p.info['cmdline'] or [])[:200]}")
    return "; ".join(left) or "no process left"


def exited(process: psutil.Process) -> bool:
    """Gone, or a zombie (an orphan waits for its reaper, which a container may not run)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def signal_when(proc: subprocess.Popen, ready, sig: signal.Signals, to_group: bool) -> str:
    """Once `ready()`, send `sig` to the command (`to_group`: to its process group) and return its
    output when it and its job have exited; whatever is left is killed."""
    job = None
    try:
        deadline = time.monotonic() + 240
        while not ready() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert proc.poll() is None, proc.stdout.read()
        [job] = psutil.Process(proc.pid).children()
        assert os.getsid(job.pid) == job.pid != os.getsid(proc.pid)
        os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
        try:
            out, _ = proc.communicate(timeout=90)  # the pipe ends when the job has exited too
        except subprocess.TimeoutExpired as e:
            raise AssertionError(f"no end 90 s after {sig.name}: {_left(proc, job)}") from e
        assert exited(job)
        return out
    finally:
        for pgid in (proc.pid, job and job.pid):
            if pgid:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(pgid, signal.SIGKILL)


@pytest.fixture
def ray_tmpdir():
    """A short RAY_TMPDIR for the command's own Ray cluster (its socket paths must fit 107 bytes)."""
    path = tempfile.mkdtemp(prefix="pt-ray-", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)
