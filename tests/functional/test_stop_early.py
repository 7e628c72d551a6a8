"""Stops outside GRPO's training loop: SIGTERM while Ray starts or during the warm-up SFT (at
once, with its message and nothing left running), the job time limit in the warm-up and in the
SFT/DPO/RM loop."""

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
from stop_helpers import ROOT, grpo_command, ray_tmpdir, signal_when  # noqa: F401 (a fixture)

from posttrain.algorithms import sft
from posttrain.config import load_config
from posttrain.logging.jsonl import read_metrics


def _processes_with(env_value: str) -> list[str]:
    """The command lines of the processes whose environment holds `env_value`."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        with contextlib.suppress(psutil.Error):
            if any(env_value in f"{k}={v}" for k, v in p.environ().items()):
                found.append(" ".join(p.info["cmdline"] or []))
    return found


def test_sigterm_while_ray_starts_stops_with_its_message_and_leaves_no_ray_process(tmp_path, ray_tmpdir):
    # Ray's own SIGTERM handler, set first thing in ray.init, exited with status 15: no message,
    # and the node's agents started so far stayed behind, orphaned.
    env = {**os.environ, "RAY_TMPDIR": ray_tmpdir}
    proc = subprocess.Popen(grpo_command(tmp_path, 5), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = signal_when(proc, lambda: any(Path(ray_tmpdir).glob("ray/session_2*/logs/raylet*")), signal.SIGTERM,
                       to_group=False)
    assert proc.returncode == 143, out
    assert "posttrain grpo: interrupted (SIGTERM); stopped at once" in out
    time.sleep(2)
    assert _processes_with(f"RAY_TMPDIR={ray_tmpdir}") == []


def test_sft_honours_the_job_time_limit(ray_session, tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"{a}+{a}="}, {"role": "assistant", "content": str(2 * a)}]}
            for a in range(40)]
    data = tmp_path / "train.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows))
    cfg = load_config("sft", None, [
        "policy.model_name=embedded:tiny", f"data.dataset_name={data}", "sft.max_num_steps=50",
        "sft.val_at_start=false", "sft.val_period=0", "sft.val_at_end=false",
        "policy.train_global_batch_size=4", "policy.train_micro_batch_size=4", "policy.logprob_batch_size=4",
        f"logger.log_dir={tmp_path / 'logs'}", "logger.tensorboard_enabled=false",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", "checkpointing.save_period=1000",
        "checkpointing.checkpoint_must_save_by=00:00:00:00",  # already up: stop after the first step
    ])
    result = sft.run(cfg)
    # Not a signal's stop (exit 0, the export written), but said to be no finished run.
    assert result["step"] == 1 and "stopped_by_signal" not in result and result["stopped_by_time_limit"] is True
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == ["step_1"]


# The check itself: test_grpo.py::test_a_warm_up_that_would_end_after_the_time_limit_stops_naming_it
@pytest.mark.extended
def test_a_warm_up_past_the_time_limit_stops_the_run_with_its_message(tmp_path, ray_tmpdir):
    # The warm-up saves nothing and did not look at the limit: a run whose limit passed inside it
    # saved its first checkpoint long after (a scheduler's kill there lost all of it).
    env = {**os.environ, "RAY_TMPDIR": ray_tmpdir, "COLUMNS": "500"}
    args = [a for a in grpo_command(tmp_path, 2) if not a.startswith("grpo.warmup_sft_steps=")]
    out = subprocess.run([*args, "grpo.warmup_sft_steps=100000", "checkpointing.checkpoint_must_save_by=00:00:00:00"],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 1, out.stdout + out.stderr
    assert "Traceback" not in out.stderr
    assert ("posttrain grpo: checkpointing.checkpoint_must_save_by=00:00:00:00: the warm-up SFT "
            "(grpo.warmup_sft_steps=100000), which saves no checkpoint, would end after it (step 1 after") in out.stderr
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").glob("step_*"))


def test_sigterm_during_the_warm_up_stops_at_once_with_143(tmp_path, ray_tmpdir):
    # Before the training loop takes signals, SIGTERM stops the job as Ctrl-C does. Ray's C++
    # failure handler had it: a stack dump and an abort (exit status 134).
    env = {**os.environ, "RAY_TMPDIR": ray_tmpdir, "COLUMNS": "500"}
    args = [a for a in grpo_command(tmp_path, 2) if not a.startswith("grpo.warmup_sft_steps=")]
    # No time limit: the quickstart's 9 minutes stopped this warm-up at its 10th step (projected past
    # them), and the test passed only when its SIGTERM won the race with that stop's shutdown.
    proc = subprocess.Popen([*args, "grpo.warmup_sft_steps=100000", "checkpointing.checkpoint_must_save_by=null"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    warming_up = lambda: any(r["prefix"] == "warmup_sft" for r in read_metrics(tmp_path / "logs" / "metrics.jsonl"))
    out = signal_when(proc, warming_up, signal.SIGTERM, to_group=False)
    assert proc.returncode == 143, out
    assert "posttrain grpo: interrupted (SIGTERM); stopped at once" in out and "SIGTERM received at time" not in out
    assert not (tmp_path / "ckpt").exists()
