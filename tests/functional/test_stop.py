"""Ending a run early without losing it: Ctrl-C (SIGINT to the whole process group, as a
terminal sends it) or SIGTERM makes the real `posttrain` command save a checkpoint after the
current GRPO step and exit, and the run resumes there (stops outside the loop, and the job time
limit: test_stop_early.py)."""

import json
import os
import signal
import subprocess

import pytest
from stop_helpers import ROOT, grpo_command, ray_tmpdir, signal_when, train_steps  # noqa: F401 (a fixture)

from posttrain.logging.jsonl import read_metrics


# Extended: SIGINT-group (the same handler as SIGTERM-group, with one more resume, ~100 s) and
# SIGTERM-driver (the command forwards it as it does for SIGKILL-supervisor's job, ~50 s).
@pytest.mark.parametrize("sig,to_group", [pytest.param(signal.SIGINT, True, marks=pytest.mark.extended),
                                          pytest.param(signal.SIGTERM, False, marks=pytest.mark.extended),
                                          (signal.SIGTERM, True), (signal.SIGKILL, False)],
                         ids=["SIGINT-group", "SIGTERM-driver", "SIGTERM-group", "SIGKILL-supervisor"])
def test_a_stop_signal_saves_after_the_step_and_the_run_resumes_there(tmp_path, ray_tmpdir, sig, to_group):
    env = {**os.environ, "RAY_TMPDIR": ray_tmpdir, "COLUMNS": "500"}  # console lines unwrapped
    # Its own session, so a signal can go to the whole group: SIGINT as a terminal's Ctrl-C sends
    # it, SIGTERM as `kill -TERM -<pgid>` or a job runner ending the job; or SIGTERM to the command
    # alone, as `kill` or `timeout` send it. The command's process supervises the job, which runs
    # in a session of its own (with the Ray node it starts): the group's signal must reach the job
    # through it alone, the Ray node must outlive the checkpoint, and a SIGKILLed supervisor must
    # still leave one (the job then gets SIGTERM).
    proc = subprocess.Popen(grpo_command(tmp_path, 1000, val_period=1), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = signal_when(proc, lambda: len(train_steps(tmp_path / "logs")) >= 2, sig, to_group)
    assert proc.returncode == (-sig if sig == signal.SIGKILL else 128 + sig.value), out
    if sig == signal.SIGKILL:
        sig = signal.SIGTERM  # what the job got when its supervisor died
    steps = train_steps(tmp_path / "logs")
    last = steps[-1]
    assert f"{sig.name} received at step {last}: saved step_{last} in {tmp_path / 'ckpt'}; stopping" in out
    assert last < 1000 and steps == list(range(1, last + 1))
    assert (tmp_path / "ckpt" / f"step_{last}" / "COMPLETE").is_file()
    assert not (tmp_path / "logs" / "hf").exists()  # a stopped run skips the export at the end
    assert json.loads(out.strip().splitlines()[-1])["result"]["stopped_by_signal"] == sig.name

    if sig == signal.SIGINT:
        # Resumed with validation turned off, a validation the stop skipped is not made up either
        # (the flag set here: whether the signal came during the step's validation is chance).
        info_file = tmp_path / "ckpt" / f"step_{last}" / "training_info.json"
        info_file.write_text(json.dumps({**json.loads(info_file.read_text()), "validation_pending": True}))
        val_steps = [r["step"] for r in read_metrics(tmp_path / "logs" / "metrics.jsonl") if r["prefix"] == "val"]
        resumed = subprocess.run(grpo_command(tmp_path, last + 1, val_period=0), cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert train_steps(tmp_path / "logs") == list(range(1, last + 2))
        assert [r["step"] for r in read_metrics(tmp_path / "logs" / "metrics.jsonl") if r["prefix"] == "val"] == val_steps
        return
    if sig != signal.SIGTERM or not to_group:
        return  # the same checkpoint as the group's SIGTERM, whose run resumes below (~20 s saved each)
    resumed = subprocess.run(grpo_command(tmp_path, last + 1, val_period=1), cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert train_steps(tmp_path / "logs") == list(range(1, last + 2))  # only the next step ran
    # Every step validated once: the one the stop skipped (unless the signal came during it) at the resume.
    val_steps = [r["step"] for r in read_metrics(tmp_path / "logs" / "metrics.jsonl") if r["prefix"] == "val"]
    assert val_steps == list(range(1, last + 2)), val_steps
    assert "validation_pending" not in json.loads((tmp_path / "ckpt" / f"step_{last}" / "training_info.json").read_text())
