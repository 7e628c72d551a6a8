"""Ending a run early without losing it: Ctrl-C (SIGINT to the whole process group, as a
terminal sends it) or SIGTERM makes the real `posttrain` command save a checkpoint after the
current step and exit, and the job time limit (`checkpointing.checkpoint_must_save_by`) does
the same in the SFT/DPO/RM loop as in GRPO."""

import contextlib
import json
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

from posttrain.algorithms import sft
from posttrain.config import load_config
from posttrain.logging.jsonl import read_metrics

ROOT = Path(__file__).resolve().parents[2]
EXE = Path(sys.executable).parent / "posttrain"


def _train_steps(log_dir: Path) -> list[int]:
    path = log_dir / "metrics.jsonl"
    if not path.is_file():
        return []
    return [r["step"] for r in read_metrics(path) if r["prefix"] == "train"]


def _grpo(tmp_path: Path, steps: int, val_period: int = 0) -> list[str]:
    return [str(EXE), "grpo", "--config", "examples/configs/grpo_quickstart.yaml",
            "policy.model_name=embedded:tiny", "grpo.num_prompts_per_step=4", "grpo.num_generations_per_prompt=4",
            "grpo.warmup_sft_steps=0", "grpo.val_at_start=false", f"grpo.val_period={val_period}",
            "grpo.val_at_end=false", "data.max_val_samples=8",
            "policy.train_global_batch_size=16", "policy.train_micro_batch_size=16", "policy.logprob_batch_size=16",
            f"grpo.max_num_steps={steps}", "checkpointing.save_period=1000", "checkpointing.export_hf_at_end=true",
            "logger.tensorboard_enabled=false", "cluster.cpus_per_worker=1",
            f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}"]


def _exited(process: psutil.Process) -> bool:
    """Gone, or a zombie (an orphan waits for its reaper, which a container may not run)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _signal_when(proc: subprocess.Popen, ready, sig: signal.Signals, to_group: bool) -> str:
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
        out, _ = proc.communicate(timeout=90)  # the pipe ends when the job has exited too
        assert _exited(job)
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


@pytest.mark.parametrize("sig,to_group", [(signal.SIGINT, True), (signal.SIGTERM, False), (signal.SIGTERM, True),
                                         (signal.SIGKILL, False)],
                         ids=["SIGINT-group", "SIGTERM-driver", "SIGTERM-group", "SIGKILL-supervisor"])
def test_a_stop_signal_saves_after_the_step_and_the_run_resumes_there(tmp_path, ray_tmpdir, sig, to_group):
    env = {**os.environ, "RAY_TMPDIR": ray_tmpdir, "COLUMNS": "500"}  # console lines unwrapped
    # Its own session, so a signal can go to the whole group: SIGINT as a terminal's Ctrl-C sends
    # it, SIGTERM as `kill -TERM -<pgid>` or a job runner ending the job; or SIGTERM to the command
    # alone, as `kill` or `timeout` send it. The command's process supervises the job, which runs
    # in a session of its own (with the Ray node it starts): the group's signal must reach the job
    # through it alone, the Ray node must outlive the checkpoint, and a SIGKILLed supervisor must
    # still leave one (the job then gets SIGTERM).
    proc = subprocess.Popen(_grpo(tmp_path, 1000, val_period=1), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = _signal_when(proc, lambda: len(_train_steps(tmp_path / "logs")) >= 2, sig, to_group)
    assert proc.returncode == (-sig if sig == signal.SIGKILL else 128 + sig.value), out
    if sig == signal.SIGKILL:
        sig = signal.SIGTERM  # what the job got when its supervisor died
    steps = _train_steps(tmp_path / "logs")
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
        resumed = subprocess.run(_grpo(tmp_path, last + 1, val_period=0), cwd=ROOT, env=env, capture_output=True,
                                 text=True, timeout=300)
        assert resumed.returncode == 0, resumed.stdout + resumed.stderr
        assert _train_steps(tmp_path / "logs") == list(range(1, last + 2))
        assert [r["step"] for r in read_metrics(tmp_path / "logs" / "metrics.jsonl") if r["prefix"] == "val"] == val_steps
        return
    if sig != signal.SIGTERM or not to_group:
        return  # the same checkpoint as the group's SIGTERM, whose run resumes below (~20 s saved each)
    resumed = subprocess.run(_grpo(tmp_path, last + 1, val_period=1), cwd=ROOT, env=env, capture_output=True,
                             text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert _train_steps(tmp_path / "logs") == list(range(1, last + 2))  # only the next step ran
    # Every step validated once: the one the stop skipped (unless the signal came during it) at the resume.
    val_steps = [r["step"] for r in read_metrics(tmp_path / "logs" / "metrics.jsonl") if r["prefix"] == "val"]
    assert val_steps == list(range(1, last + 2)), val_steps
    assert "validation_pending" not in json.loads((tmp_path / "ckpt" / f"step_{last}" / "training_info.json").read_text())


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
    proc = subprocess.Popen(_grpo(tmp_path, 5), cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    out = _signal_when(proc, lambda: any(Path(ray_tmpdir).glob("ray/session_2*/logs/raylet*")), signal.SIGTERM,
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


def test_a_warm_up_past_the_time_limit_stops_the_run_with_its_message(tmp_path, ray_tmpdir):
    # The warm-up saves nothing and did not look at the limit: a run whose limit passed inside it
    # saved its first checkpoint long after (a scheduler's kill there lost all of it).
    env = {**os.environ, "RAY_TMPDIR": ray_tmpdir, "COLUMNS": "500"}
    args = [a for a in _grpo(tmp_path, 2) if not a.startswith("grpo.warmup_sft_steps=")]
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
    args = [a for a in _grpo(tmp_path, 2) if not a.startswith("grpo.warmup_sft_steps=")]
    proc = subprocess.Popen([*args, "grpo.warmup_sft_steps=100000"], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    warming_up = lambda: any(r["prefix"] == "warmup_sft" for r in read_metrics(tmp_path / "logs" / "metrics.jsonl"))
    out = _signal_when(proc, warming_up, signal.SIGTERM, to_group=False)
    assert proc.returncode == 143, out
    assert "posttrain grpo: interrupted (SIGTERM); stopped at once" in out and "SIGTERM received at time" not in out
    assert not (tmp_path / "ckpt").exists()
