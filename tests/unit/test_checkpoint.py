"""CheckpointManager: layout, top-k, resume, signature guard, start_fresh, atomicity under crashes."""

import contextlib
import errno
import json
import logging
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from posttrain.checkpoint import TRAINER_STATE_FILE, CheckpointManager, CheckpointSaveError, capture_rng_state, restore_rng_state, stop_message
from posttrain.config import ConfigError
from posttrain.schemas import CheckpointingConfig

SIG = {"algorithm": "grpo", "model_name": "embedded:tiny"}


def _mgr(tmp_path, **kw):
    return CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"), **kw), SIG)


def _write_policy(path):
    """What Policy.save_checkpoint writes, in miniature: a DCP checkpoint and the trainer state."""
    import torch.distributed.checkpoint as dcp

    dcp.save({"w": torch.ones(3)}, checkpoint_id=path, no_dist=True)
    torch.save({"scheduler": {}, "weights_version": 0}, path / TRAINER_STATE_FILE)


def _save(mgr, step, metric=None, **info):
    tmp = mgr.begin_save(step)
    _write_policy(tmp / "policy")
    return mgr.finish_save(tmp, step, {"epoch": 0, "consumed_samples": step * 8, **info}, "a: 1\n", metric)


def _steps(mgr):
    return [int(p.name.split("_")[1]) for p in mgr.checkpoints()]


def test_layout_and_info(tmp_path):
    mgr = _mgr(tmp_path, metric_name="val:accuracy")
    path = _save(mgr, 10, 0.5, dataloader={"epoch": 0, "position": 80})
    assert path.name == "step_10"
    assert sorted(p.name for p in path.iterdir()) == [
        "COMPLETE", "config.yaml", "policy", "rng_state.pt", "training_info.json"]
    info = mgr.load_info(path)
    assert info["step"] == 10 and info["consumed_samples"] == 80 and info["dataloader"] == {"epoch": 0, "position": 80}
    assert info["metric_value"] == 0.5 and info["best_metric_value"] == 0.5 and info["best_step"] == 10
    assert info["signature"] == SIG
    assert (path / "config.yaml").read_text() == "a: 1\n"
    assert not list((tmp_path / "ckpt").glob("*.tmp-*"))


def test_top_k_by_metric_keeps_latest(tmp_path):
    mgr = _mgr(tmp_path, metric_name="val:accuracy", higher_is_better=True, keep_top_k=2)
    for step, acc in [(1, 0.1), (2, 0.9), (3, 0.5), (4, 0.7), (5, 0.2)]:
        _save(mgr, step, acc)
    # Best two are steps 2 (0.9) and 4 (0.7); step 5 is the latest and always kept.
    assert _steps(mgr) == [2, 4, 5]
    assert mgr.load_info(mgr.latest())["best_step"] == 2
    _save(mgr, 6, None)  # a missing metric ranks last, but the latest is kept
    assert _steps(mgr) == [2, 4, 6]


def test_top_k_lower_is_better_and_no_metric(tmp_path):
    mgr = _mgr(tmp_path / "a", metric_name="val:loss", higher_is_better=False, keep_top_k=1)
    for step, loss in [(1, 2.0), (2, 1.0), (3, 3.0)]:
        _save(mgr, step, loss)
    assert _steps(mgr) == [2, 3]
    mgr = _mgr(tmp_path / "b", keep_top_k=2)
    for step in range(1, 5):
        _save(mgr, step)
    assert _steps(mgr) == [3, 4]
    # Of equal values the newer checkpoint ranks first (it has trained more for the same score).
    mgr = _mgr(tmp_path / "c", metric_name="val:loss", higher_is_better=False, keep_top_k=1)
    for step, loss in [(1, 1.0), (2, 1.0), (3, 2.0)]:
        _save(mgr, step, loss)
    assert _steps(mgr) == [2, 3]


def test_steps_are_ordered_as_numbers_not_as_names(tmp_path):
    # By name step_10 comes before step_9: a resume took step_9, and pruning dropped step_10.
    mgr = _mgr(tmp_path, keep_top_k=2)
    for step in (8, 9, 10):
        _save(mgr, step)
    assert mgr.latest().name == "step_10" and _steps(mgr) == [9, 10]


def test_top_k_ignores_the_values_of_a_metric_named_before_a_resume(tmp_path, caplog):
    first = _mgr(tmp_path, metric_name="val:loss", higher_is_better=False, keep_top_k=2)
    _save(first, 1, 2.0)
    _save(first, 2, 1.0)
    # Resumed ranking by accuracy: the old losses are no accuracies (2.0 would beat every one).
    mgr = _mgr(tmp_path, metric_name="val:accuracy", higher_is_better=True, keep_top_k=2)
    with caplog.at_level(logging.WARNING):
        for step, acc in [(3, 0.5), (4, 0.6), (5, 0.4)]:
            _save(mgr, step, acc)
    # Nor are they pruned as unmeasured: the earlier run's best (step 2) went at the next save.
    assert _steps(mgr) == [1, 2, 3, 4, 5]
    assert caplog.text.count("checkpoints step_1, step_2 were ranked by val:loss, not "
                             "checkpointing.metric_name='val:accuracy': kept, outside keep_top_k's pruning") == 1
    _save(mgr, 6, 0.7)
    assert _steps(mgr) == [1, 2, 4, 6]
    info = mgr.load_info(mgr.latest())
    assert (info["best_step"], info["best_metric_value"]) == (6, 0.7)


def test_resume_latest_and_rng(tmp_path):
    mgr = _mgr(tmp_path, keep_top_k=None)
    random.seed(1); np.random.seed(1); torch.manual_seed(1)
    _save(mgr, 1)
    expected = (random.random(), np.random.rand(), torch.rand(1).item())
    _save(mgr, 2)
    # A new process (here: a new manager) resumes from the newest complete checkpoint.
    again = _mgr(tmp_path)
    latest = again.latest()
    assert latest.name == "step_2"
    restore_rng_state(again.load_rng_state(tmp_path / "ckpt" / "step_1"))
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == expected


def test_signature_mismatch_names_both_and_the_fix(tmp_path):
    _save(_mgr(tmp_path), 1)
    other = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt")),
                              {"algorithm": "sft", "model_name": "Qwen/Qwen2.5-1.5B"})
    with pytest.raises(ConfigError) as e:
        other.latest()
    msg = str(e.value)
    assert "grpo" in msg and "sft" in msg and "Qwen/Qwen2.5-1.5B" in msg
    assert "checkpointing.start_fresh=true" in msg and "checkpoint_dir" in msg


def test_resume_names_the_config_keys_that_changed_since_the_checkpoint(tmp_path):
    from posttrain.config import load_config, to_yaml

    saved = load_config("grpo", None, ["grpo.max_num_steps=3"])
    mgr = _mgr(tmp_path)
    tmp = mgr.begin_save(3)
    path = mgr.finish_save(tmp, 3, {"epoch": 0}, to_yaml(saved), None)
    assert mgr.config_changes(path, to_yaml(saved)) == []
    assert mgr.resume_message(path, 3, to_yaml(saved), 5) == f"resumed from {path} at step 3"
    # A rerun of the finished run says it has nothing left to do.
    assert mgr.resume_message(path, 3, to_yaml(saved), 3) == (f"resumed from {path} at step 3 (the run's last "
                                                              "step: nothing left to train)")
    now = load_config("grpo", None, ["grpo.max_num_steps=5", "grpo.num_prompts_per_step=4",
                                     "policy.optimizer.kwargs={lr: 1e-4}", "+env.calc.target=tools.py:calc"])
    changes = mgr.config_changes(path, to_yaml(now))
    assert changes[1:] == ["grpo.max_num_steps: 3 -> 5", "grpo.num_prompts_per_step: 16 -> 4",
                           "policy.optimizer.kwargs.lr: 5e-06 -> 0.0001",
                           "policy.optimizer.kwargs.weight_decay: 0.01 -> (not set)"]
    # An added section is one entry (cut to 80 characters), not one per default key inside it.
    assert changes[0].startswith('env.calc: (not set) -> {"num_workers": 1,') and changes[0].endswith("...")
    assert mgr.resume_message(path, 3, to_yaml(now), 5) == (f"resumed from {path} at step 3, with {len(changes)} config "
                                                         "change(s) since that checkpoint: " + "; ".join(changes))


def test_a_checkpoint_past_the_runs_last_step_is_refused(tmp_path):
    # max_num_steps lowered below the checkpoint's step: the resume would train nothing and end
    # as if done, so it fails (before any worker starts) naming the key and the way on.
    mgr = _mgr(tmp_path)
    path = mgr.finish_save(mgr.begin_save(4), 4, {"epoch": 0}, "{}", None)
    mgr.check_steps_left(path, 4, "sft.max_num_steps")  # the finished run: a rerun is fine
    mgr.check_steps_left(path, 10, "sft.max_num_steps")
    with pytest.raises(ConfigError, match=r"step_4 is at step 4, past sft.max_num_steps=3: resuming from it would "
                                          r"train nothing. Raise sft.max_num_steps above 4 .*start_fresh=true"):
        mgr.check_steps_left(path, 3, "sft.max_num_steps")


def test_resume_refuses_a_checkpoint_of_other_lora_or_optimizer_settings_before_any_worker_starts(tmp_path, caplog):
    from posttrain.config import load_config, to_yaml

    def policy(*overrides):
        return load_config("grpo", None, list(overrides)).policy

    saved = load_config("grpo", None, ["policy.optimizer.name=adamw"])
    tmp = _mgr(tmp_path).begin_save(2)
    _write_policy(tmp / "policy")
    _mgr(tmp_path).finish_save(tmp, 2, {"epoch": 0}, to_yaml(saved), None)

    def latest(*overrides):
        return CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt")), SIG,
                                 policy(*overrides)).latest()

    # Settings the saved tensors do not depend on resume (the same class under another name too).
    assert latest("policy.optimizer.name=torch.optim.AdamW", "policy.lora.rank=4",
                  "policy.optimizer.kwargs.lr=1e-3").name == "step_2"
    with pytest.raises(ConfigError) as e:
        latest("policy.lora.enabled=true", "policy.optimizer.name=sgd")
    msg = str(e.value)
    assert "policy.lora.enabled: false -> true; policy.optimizer.name: \"adamw\" -> \"sgd\"" in msg
    assert "put them back to resume" in msg and "checkpointing.start_fresh=true" in msg
    # LoRA target modules listed in another order adapt the same layers: they resume (they were refused).
    lora = ["policy.lora.enabled=true", "policy.lora.target_modules=[q_proj,v_proj]"]
    tmp = _mgr(tmp_path / "lora").begin_save(2)
    _write_policy(tmp / "policy")
    _mgr(tmp_path / "lora").finish_save(tmp, 2, {"epoch": 0}, to_yaml(load_config("grpo", None, lora)), None)
    again = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "lora" / "ckpt")), SIG,
                              policy("policy.lora.enabled=true", "policy.lora.target_modules=[v_proj,q_proj]"))
    assert again.latest().name == "step_2"
    # Another alpha loads the same tensors, into another model: resumed, with a warning.
    with caplog.at_level(logging.WARNING):
        assert CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "lora" / "ckpt")), SIG,
                                 policy(*lora, "policy.lora.alpha=64")).latest().name == "step_2"
    assert "policy.lora.alpha: 16.0 -> 64.0 scales the trained adapters' update by 4x" in caplog.text
    with pytest.raises(ConfigError, match=r'policy.lora.target_modules: \["q_proj", ?"v_proj"\] -> \["q_proj"\]'):
        CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "lora" / "ckpt")), SIG,
                          policy("policy.lora.enabled=true", "policy.lora.target_modules=[q_proj]")).latest()


def test_start_fresh_moves_old_checkpoints_aside(tmp_path):
    _save(_mgr(tmp_path), 1)
    fresh = CheckpointManager(
        CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"), start_fresh=True), {"algorithm": "sft", "model_name": "x"})
    assert fresh.latest() is None
    assert (fresh.moved_aside / "step_1" / "COMPLETE").is_file()  # kept, not deleted
    _save(fresh, 1)
    assert fresh.latest().name == "step_1"


def test_disabled_never_resumes(tmp_path):
    _save(_mgr(tmp_path), 1)
    mgr = _mgr(tmp_path, enabled=False)
    assert mgr.latest() is None and not mgr.should_save(10) and not mgr.should_save(3, last=True)
    assert _mgr(tmp_path, save_period=5).should_save(10)
    assert not _mgr(tmp_path, save_period=5).should_save(7)
    assert _mgr(tmp_path, save_period=5).should_save(7, last=True)


def test_exception_between_begin_and_finish(tmp_path, caplog):
    mgr = _mgr(tmp_path)
    _save(mgr, 1)

    def failing_save():
        tmp = mgr.begin_save(2)
        (tmp / "policy").mkdir()
        raise RuntimeError("out of disk while writing the policy")

    with pytest.raises(RuntimeError):
        failing_save()
    tmp = tmp_path / "ckpt" / f"step_2.tmp-{os.getpid()}"
    assert tmp.is_dir()
    assert mgr.latest().name == "step_1"
    # An incomplete step_N (no marker, e.g. copied by hand) is ignored and moved aside, not deleted.
    (tmp_path / "ckpt" / "step_3").mkdir()
    with caplog.at_level(logging.WARNING):
        assert mgr.latest().name == "step_1"
    (aside,) = (tmp_path / "ckpt").glob("step_3.incomplete-*")
    assert f"has no COMPLETE marker (a copy or save that did not finish): moved aside to {aside.name}" in caplog.text
    mgr.abort_save(tmp)
    assert not tmp.exists()


CRASH_SCRIPT = textwrap.dedent("""
    import sys, time
    import torch
    import torch.distributed.checkpoint as dcp
    from posttrain.checkpoint import TRAINER_STATE_FILE, CheckpointManager
    from posttrain.schemas import CheckpointingConfig
    mgr = CheckpointManager(CheckpointingConfig(checkpoint_dir=sys.argv[1]), {"algorithm": "grpo", "model_name": "embedded:tiny"})
    tmp = mgr.begin_save(1)
    dcp.save({"w": torch.ones(3)}, checkpoint_id=tmp / "policy", no_dist=True)
    torch.save({}, tmp / "policy" / TRAINER_STATE_FILE)
    mgr.finish_save(tmp, 1, {"epoch": 0}, "a: 1\\n")
    tmp = mgr.begin_save(2)
    with open(tmp / "weights.bin", "wb") as f:
        f.write(b"x" * 1000)
        f.flush()
        print("writing", flush=True)
        time.sleep(60)
""")


def test_sigkill_mid_save_resumes_from_previous(tmp_path):
    ckpt = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", CRASH_SCRIPT, str(ckpt)], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert (ckpt / f"step_2.tmp-{proc.pid}").is_dir()  # the crash left a partial save
    mgr = _mgr(tmp_path)
    assert mgr.latest().name == "step_1"
    assert not (ckpt / f"step_2.tmp-{proc.pid}").exists()  # cleaned: its process is dead
    assert json.loads((ckpt / "step_1" / "training_info.json").read_text())["step"] == 1


@pytest.mark.parametrize("damage", ["policy/__0_0.distcp", "policy/trainer_state.pt", "policy/.metadata",
                                    "rng_state.pt", "training_info.json", "truncated training_info.json",
                                    "truncated policy/.metadata", "truncated policy/__0_0.distcp",
                                    "truncated policy/trainer_state.pt", "truncated rng_state.pt"])
def test_a_complete_checkpoint_missing_a_file_fails_before_any_worker_starts_naming_it(tmp_path, damage):
    from posttrain.config import MissingInputError

    mgr = _mgr(tmp_path)
    _save(mgr, 1)
    path = _save(mgr, 2)
    name = damage.removeprefix("truncated ")
    if damage.startswith("truncated"):
        (path / name).write_bytes((path / name).read_bytes()[:20])
    else:
        (path / name).unlink()
    with pytest.raises(MissingInputError) as e:
        mgr.latest()
    assert f"step_2 lacks {name}" in str(e.value) and "move step_2 out of" in str(e.value)
    assert bool(re.search(rf"{re.escape(name)} \((unreadable|truncated: 20 of \d+ bytes)\)", str(e.value))) \
        == damage.startswith("truncated")
    os.replace(path, tmp_path / "step_2.bad")  # the way out it names: resume from the one before
    assert mgr.latest().name == "step_1"


@pytest.mark.parametrize("edit, named", [
    (lambda info: [], "training_info.json (not a JSON object)"),
    (lambda info: {k: v for k, v in info.items() if k != "step"}, "training_info.json (without its 'step')"),
])
def test_a_hand_edited_training_info_fails_naming_the_checkpoint(tmp_path, edit, named):
    # They failed as tracebacks of a KeyError or an AttributeError, naming no checkpoint.
    from posttrain.config import MissingInputError

    mgr = _mgr(tmp_path)
    path = _save(mgr, 2, dataloader={"epoch": 0, "index": 16})
    info_file = path / "training_info.json"
    info = json.loads(info_file.read_text())
    info_file.write_text(json.dumps({k: v for k, v in info.items() if k != "dataloader"}))
    with pytest.raises(MissingInputError, match=r"step_2 lacks its data position \('dataloader' in "
                                                r"training_info.json\).*move step_2 out of"):
        mgr.restore_data_position(path, None, "a: 1\n")
    info_file.write_text(json.dumps(edit(info)))
    with pytest.raises(MissingInputError, match=rf"step_2 lacks {re.escape(named)}"):
        mgr.latest()


def test_a_damaged_training_info_of_an_older_checkpoint_ranks_it_unmeasured(tmp_path):
    # Read to rank the checkpoints at every save: a bad UTF-8 byte or a metric value of text made
    # every later save fail (its error naming neither the file nor the folder).
    mgr = _mgr(tmp_path, metric_name="val:loss", higher_is_better=False, keep_top_k=2)
    first = _save(mgr, 1, 2.0)
    _save(mgr, 2, 1.0)
    for damage in (b"\x93not json", json.dumps({**json.loads((first / "training_info.json").read_text()),
                                                 "metric_value": "4.2"}).encode()):
        (first / "training_info.json").write_bytes(damage)
        assert mgr._ranking_of(first) == (None, None)
    _save(mgr, 3, 1.5)  # ranks beside step_2; the unmeasured step_1 goes
    assert _steps(mgr) == [2, 3]


def test_a_killed_save_of_an_earlier_run_with_this_process_pid_is_cleaned_up(tmp_path):
    # A job restarted in a new container often gets the killed driver's pid again.
    mgr = _mgr(tmp_path)
    _save(mgr, 1)
    killed = tmp_path / "ckpt" / f"step_2.tmp-{os.getpid()}"
    _write_policy(killed / "policy")
    restarted = _mgr(tmp_path)
    assert restarted.latest().name == "step_1" and not killed.exists()
    writing = restarted.begin_save(3)  # this manager's own save in progress stays
    assert restarted.latest().name == "step_1" and writing.is_dir()
    restarted.abort_save(writing)


def test_saving_a_step_again_keeps_the_old_one_until_the_new_one_is_in(tmp_path):
    mgr = _mgr(tmp_path)
    _save(mgr, 1)
    _save(mgr, 2, 0.1)
    assert _save(mgr, 2, 0.7).name == "step_2"  # a resumed run saves step 2 again
    ckpt = tmp_path / "ckpt"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_1", "step_2"]
    assert mgr.load_info(ckpt / "step_2")["metric_value"] == 0.7
    # Killed between moving the old step_2 aside and renaming the new one in: the next start puts
    # the complete new save in place (before, the old one was deleted first, and the new one
    # then cleaned up as a killed save: both lost).
    new = ckpt / f"step_2.tmp-{os.getpid()}"
    shutil.copytree(ckpt / "step_2", new)
    os.replace(ckpt / "step_2", ckpt / f"step_2.deleting-{os.getpid()}")
    restarted = _mgr(tmp_path)
    assert restarted.latest().name == "step_2" and sorted(p.name for p in ckpt.iterdir()) == ["step_1", "step_2"]
    # A killed save without its marker is still removed, the complete step_2 kept.
    partial = ckpt / f"step_2.tmp-{os.getpid()}"
    _write_policy(partial / "policy")
    assert _mgr(tmp_path).latest().name == "step_2" and not partial.exists()


def test_a_checkpoint_dir_that_cannot_be_written_fails_at_the_start_not_at_the_first_save(tmp_path, monkeypatch):
    from posttrain.config import MissingInputError

    (tmp_path / "a_file").write_text("")
    with pytest.raises(MissingInputError, match=r"checkpoint_dir=.*a_file/ckpt: cannot write it \(.*a_file is not a folder\)"):
        CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "a_file" / "ckpt")), SIG)
    read_only = tmp_path / "read_only"
    read_only.mkdir(mode=0o555)
    if not os.access(read_only, os.W_OK):  # root writes anyway
        with pytest.raises(MissingInputError, match=r"read_only is not writable"):
            CheckpointManager(CheckpointingConfig(checkpoint_dir=str(read_only / "runs" / "ckpt")), SIG)
    # A folder this user cannot search (root can: its stat stands in) hides what is under it:
    # Path.exists raised PermissionError there before Python 3.12, in place of this message.
    locked = tmp_path / "locked"
    locked.mkdir()
    real_stat = os.stat
    def stat(p, *a, **k):
        if str(p).startswith(f"{locked}/"):
            raise PermissionError(13, "Permission denied", str(p))
        return real_stat(p, *a, **k)
    monkeypatch.setattr(os, "stat", stat)
    monkeypatch.setattr(os, "access", lambda p, mode: str(p) != str(locked))
    with pytest.raises(MissingInputError, match=r"locked/inner/ckpt: cannot write it \(.*/locked is not writable\)"):
        CheckpointManager(CheckpointingConfig(checkpoint_dir=str(locked / "inner" / "ckpt")), SIG)
    monkeypatch.undo()
    CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "new" / "ckpt")), SIG)
    assert not (tmp_path / "new" / "ckpt").exists()  # the folder itself comes with the first save
    # What os.access passes and the file system refuses (root in /proc): the lock file beside it.
    with pytest.raises(MissingInputError, match=r"checkpoint_dir=/proc/ckpt: cannot write"):
        CheckpointManager(CheckpointingConfig(checkpoint_dir="/proc/ckpt"), SIG)
    # start_fresh, which moves the old checkpoints aside in it, is refused the same way (it failed
    # with the OSError of its move). os.access stands in for a read-only mount, which root meets too.
    _save(_mgr(tmp_path), 1)
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode: False if str(p) == str(tmp_path / "ckpt") else real_access(p, mode))
    with pytest.raises(MissingInputError, match=r"ckpt is not writable"):
        _mgr(tmp_path, start_fresh=True)
    assert (tmp_path / "ckpt" / "step_1" / "COMPLETE").is_file() and not list((tmp_path / "ckpt").glob("previous-*"))
    # Disabled, it is neither written nor checked.
    CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "a_file" / "ckpt"), enabled=False), SIG)


def test_rng_capture_restore_roundtrip():
    state = capture_rng_state()
    a = (random.random(), np.random.rand(), torch.rand(2).tolist())
    restore_rng_state(state)
    assert (random.random(), np.random.rand(), torch.rand(2).tolist()) == a


def test_a_model_folder_named_another_way_resumes_and_another_model_does_not(tmp_path, monkeypatch):
    # `x`, `x/` and `./x` were three models to the resume, which refused the checkpoint.
    from posttrain.config import ConfigError

    (tmp_path / "model").mkdir()
    (tmp_path / "other").mkdir()
    monkeypatch.chdir(tmp_path)
    cfg = CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt"))
    _save(CheckpointManager(cfg, {"algorithm": "sft", "model_name": "model"}), 1)
    for name in ("model/", "./model", str(tmp_path / "model")):
        assert CheckpointManager(cfg, {"algorithm": "sft", "model_name": name}).latest().name == "step_1"
    for sig in ({"algorithm": "sft", "model_name": "other"}, {"algorithm": "dpo", "model_name": "model"},
                {"algorithm": "sft", "model_name": "embedded:tiny"}):
        with pytest.raises(ConfigError, match="refusing to resume"):
            CheckpointManager(cfg, sig).latest()


def test_a_second_run_on_a_checkpoint_dir_in_use_is_refused_until_the_first_ends(tmp_path):
    # Two runs on one folder (a job restarted while the first still ran or saved) both resumed
    # from the same step and saved the same steps over each other's.
    from posttrain.config import InputError

    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import sys, time
            from posttrain.checkpoint import CheckpointManager
            from posttrain.schemas import CheckpointingConfig
            CheckpointManager(CheckpointingConfig(checkpoint_dir={str(tmp_path / "ckpt")!r}), {{}})
            print("ready", flush=True)
            time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        with pytest.raises(InputError, match=rf"checkpoint_dir={re.escape(str(tmp_path / 'ckpt'))}: another run is "
                                             rf"using it \(pid {holder.pid} on "):
            _mgr(tmp_path)
        _mgr(tmp_path, enabled=False)  # a run that saves nothing takes no lock
    finally:
        holder.kill()
        holder.wait()
    _mgr(tmp_path)  # the lock ended with its process, however it ended
    _mgr(tmp_path)  # and one process may open the folder again (a resume in the same process)
    # A run whose folder's parent does not exist yet makes it and locks at once: it locked only at
    # its first save, and a second run started before then trained into the same folder.
    CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "new" / "ckpt")), SIG)
    assert (tmp_path / "new" / ".ckpt.lock").read_text().startswith(f"pid {os.getpid()} on ")
    assert not (tmp_path / "new" / "ckpt").exists()


def test_checkpoint_must_save_by_stops_when_the_next_step_would_not_end_in_time(tmp_path, monkeypatch):
    # It stopped only after the limit had passed, so the last save came after it: with a scheduler
    # killing the job at that limit, the steps since the last periodic save were lost.
    import posttrain.checkpoint as ckpt

    clock = [1000.0]
    monkeypatch.setattr(ckpt.time, "monotonic", lambda: clock[0])
    mgr = _mgr(tmp_path, checkpoint_must_save_by="00:00:01:40")  # 100 s
    reasons = []
    for step_s in (10, 30, 10, 10, 10, 10, 10):  # the step at 30 s: its validation and save
        clock[0] += step_s
        reasons.append(mgr.stop_reason())
    # At 70 s, 30 s are left: time for one more step as long as the 30-s one. At 80 s, 20 s: stop and save.
    assert reasons[:5] == [None] * 5
    assert reasons[5] == ("checkpointing.checkpoint_must_save_by=00:00:01:40 would pass during the next step (20 s "
                          "left; the longest step so far, with its validation and save, took 30 s)")
    clock[0] += 30
    assert mgr.stop_reason() == "checkpointing.checkpoint_must_save_by=00:00:01:40 reached"
    # The first step counts too, from the loop's start (it was taken as 0 s long: with 25 s of setup and
    # a 60-s first step, 15 s left, the run started a second 60-s step and saved it after the limit).
    clock[0] = 1000.0
    mgr = _mgr(tmp_path, checkpoint_must_save_by="00:00:01:40")
    clock[0] += 25
    mgr.start_steps()
    clock[0] += 60
    assert mgr.stop_reason() == ("checkpointing.checkpoint_must_save_by=00:00:01:40 would pass during the next step "
                                 "(15 s left; the longest step so far, with its validation and save, took 60 s)")


def test_checkpoint_must_save_by_counts_from_the_commands_start_and_never_stops_the_last_step(tmp_path, monkeypatch):
    # Counted from the manager's creation, the limit left out the data's loading before it (40 s of
    # a 60-s limit in an audit); and a run whose limit passed in its last step, done, was reported
    # as stopped by it ("stopped_by_time_limit": a job loop resubmitted the finished run).
    import posttrain.checkpoint as ckpt

    clock = [1000.0]
    monkeypatch.setattr(ckpt.time, "monotonic", lambda: clock[0])
    ckpt.mark_run_start()
    clock[0] += 50  # loading and tokenizing the data
    mgr = _mgr(tmp_path, checkpoint_must_save_by="00:00:01:00")
    assert mgr.time_left_s() == 10
    assert _mgr(tmp_path / "next", checkpoint_must_save_by="00:00:01:00").time_left_s() == 60  # a later run's own
    clock[0] += 20
    assert mgr.stop_reason(last_step=True) is None and not mgr.time_limit_reached
    assert mgr.stop_reason() == "checkpointing.checkpoint_must_save_by=00:00:01:00 reached" and mgr.time_limit_reached


def test_checkpoint_must_save_by(tmp_path):
    mgr = _mgr(tmp_path, checkpoint_must_save_by="00:00:00:00")
    assert mgr.save_deadline_s == 0
    assert mgr.stop_reason() == "checkpointing.checkpoint_must_save_by=00:00:00:00 reached"
    mgr = _mgr(tmp_path, checkpoint_must_save_by="01:02:03:04")
    assert mgr.save_deadline_s == 93784 and mgr.stop_reason() is None
    assert _mgr(tmp_path).stop_reason() is None
    with pytest.raises(ValueError, match="should match pattern"):
        CheckpointingConfig(checkpoint_must_save_by="3h")


@pytest.mark.parametrize("first", [signal.SIGTERM, signal.SIGINT])
def test_stop_signals_end_the_run_after_the_step_and_a_second_one_at_once(tmp_path, first):
    mgr = _mgr(tmp_path)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with mgr.stop_on_signals():
        assert mgr.stop_reason() is None and mgr.stop_signal is None
        os.kill(os.getpid(), first)  # delivered to this (main) thread before kill returns
        assert mgr.stop_reason() == f"{first.name} received" and mgr.stop_signal == first.name
        with pytest.raises(KeyboardInterrupt, match=r"stop signal \(SIGTERM\)"):
            os.kill(os.getpid(), signal.SIGTERM)
    assert {s: signal.getsignal(s) for s in before} == before  # the handlers are put back
    assert stop_message(mgr.stop_reason(), 7, mgr.cfg) == (
        f"{first.name} received at step 7: saved step_7 in {mgr.cfg.checkpoint_dir}; stopping")


def test_a_stop_signal_promises_no_checkpoint_when_checkpointing_is_off(tmp_path, caplog):
    mgr = _mgr(tmp_path, enabled=False)
    with caplog.at_level("WARNING", logger="posttrain.checkpoint"), mgr.stop_on_signals():
        os.kill(os.getpid(), signal.SIGINT)
    assert "SIGINT received: stopping after this step, without a checkpoint (checkpointing.enabled=false" in caplog.text
    assert "saving a checkpoint" not in caplog.text


class _Policy:
    """What CheckpointManager.save needs of a policy: save_checkpoint(dir)."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def save_checkpoint(self, path):
        path.mkdir(parents=True)
        _write_policy(path)
        if self.fail:
            raise OSError("disk full")


def test_save_ranks_a_metric_this_step_did_not_measure_below_measured_ones(tmp_path, caplog):
    mgr = _mgr(tmp_path, metric_name="val:loss", higher_is_better=False, keep_top_k=1)
    with caplog.at_level("WARNING", logger="posttrain.checkpoint"):
        first = mgr.save(1, _Policy(), {"epoch": 0}, "a: 1\n", {"train:loss": 2.0})  # no validation yet
    assert "metric_name='val:loss' not measured at this step" in caplog.text and "(no val: metric at this step)" in caplog.text
    assert "train:loss" not in caplog.text  # the train: names are no help for a val: one
    assert (first / "COMPLETE").is_file() and (first / "policy" / ".metadata").is_file()
    assert json.loads((first / "training_info.json").read_text())["metric_value"] is None
    mgr.save(2, _Policy(), {"epoch": 0}, "a: 1\n", {"val:loss": 3.0})
    mgr.save(3, _Policy(), {"epoch": 0}, "a: 1\n", {"val:loss": 4.0})
    # keep_top_k=1: the best measured (step 2) and the latest (step 3); the unmeasured one goes first.
    assert [p.name for p in mgr.checkpoints()] == ["step_2", "step_3"]
    caplog.clear()
    with caplog.at_level("WARNING", logger="posttrain.checkpoint"):  # a misspelt name: the measured ones of its kind
        mgr.save(4, _Policy(), {"epoch": 0}, "a: 1\n", {"train:loss": 2.0, "val:los": 1.0, "val:accuracy": 0.5})
    assert "metric_name='val:loss' not measured at this step, so it ranks below measured ones (measured: " \
           "val:accuracy, val:los)" in caplog.text


def test_save_that_fails_leaves_no_checkpoint_behind(tmp_path):
    mgr = _mgr(tmp_path)
    with pytest.raises(CheckpointSaveError, match="saving checkpoint step_1 in .* failed .*: disk full\n"
                                                  "no checkpoint was saved before") as err:
        mgr.save(1, _Policy(fail=True), {"epoch": 0}, "a: 1\n", {})
    assert isinstance(err.value.__cause__, OSError)  # the original error stays in the traceback
    assert mgr.checkpoints() == [] and list((tmp_path / "ckpt").iterdir()) == []


@pytest.mark.parametrize("error", [RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
                                   OSError(errno.ENOSPC, "No space left on device")])
def test_a_save_on_a_full_disk_says_so_and_names_the_checkpoints_that_stay(tmp_path, monkeypatch, error):
    """DCP's writer (torch's zip writer) reports a full disk as "unexpected pos 704 vs 598" alone:
    the error must say the disk is full, and what a restart resumes from."""
    mgr = _mgr(tmp_path)
    _save(mgr, 1)
    _save(mgr, 2)

    class FullDisk(_Policy):
        def save_checkpoint(self, path):
            super().save_checkpoint(path)
            raise error

    # Free space: none left while the save ran; after its partial files are removed, less than a checkpoint.
    monkeypatch.setattr("posttrain.checkpoint.shutil.disk_usage", lambda _: shutil._ntuple_diskusage(1, 1, 100))
    with pytest.raises(CheckpointSaveError) as err:
        mgr.save(3, FullDisk(), {"epoch": 0}, "a: 1\n", {})
    assert re.match(rf"saving checkpoint step_3 in {re.escape(str(mgr.dir))} failed \(the disk is full: 0.0 MiB free "
                    rf"there, step_2 took [0-9.]+ MiB\): .*{re.escape(str(error).splitlines()[-1])}\n"
                    r"the checkpoints saved before stay \(step_1, step_2\); the next start resumes from step_2$",
                    str(err.value)), str(err.value)
    assert _steps(mgr) == [1, 2] and sorted(p.name for p in mgr.dir.iterdir()) == ["step_1", "step_2"]
    # A disk full to its last block fails the save's first mkdir already: named the same way.
    real_mkdir = type(mgr.dir).mkdir

    def mkdir(self, *a, **k):
        if ".tmp-" in self.name:
            raise OSError(errno.ENOSPC, "No space left on device", str(self))
        return real_mkdir(self, *a, **k)

    monkeypatch.setattr(type(mgr.dir), "mkdir", mkdir)
    with pytest.raises(CheckpointSaveError, match=r"step_3 .* failed \(the disk is full: .*\n.*resumes from step_2$"):
        mgr.save(3, _Policy(), {"epoch": 0}, "a: 1\n", {})
    assert _steps(mgr) == [1, 2]


def test_an_export_that_fails_names_its_folder_the_disk_and_what_stays(tmp_path):
    # A full disk at the final export was Ray's traceback of a SafetensorError: no folder, nothing
    # on the checkpoints that hold the policy or on how to finish the export.
    import os

    from posttrain.checkpoint import ExportError, train_then_export

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")

    class Exporting(_Policy):
        def export_hf(self, path):
            with open(os.path.join(path, "model.safetensors"), "wb") as f:
                f.write(bytes(1 << 16))

    mgr = _mgr(tmp_path)
    _save(mgr, 1)
    _save(mgr, 2)
    export = tmp_path / "hf"
    export.mkdir()
    (export / "model.safetensors").symlink_to("/dev/full")
    shut = []
    with pytest.raises(ExportError) as err:
        train_then_export(lambda: {"step": 2}, mgr, Exporting(), export, print, lambda: shut.append(True))
    assert re.match(rf"exporting the policy to {re.escape(str(export))} failed \(the disk is full: [0-9.]+ MiB free "
                    r"there\): .*No space left on device.*\n"
                    r"the checkpoints stay \(step_1, step_2\); the same command started again resumes from step_2 and "
                    r"exports at its end", str(err.value)), str(err.value)
    assert shut == [True] and _steps(mgr) == [1, 2]
    # Another error is no full disk, however large the checkpoints (they hold the optimizer too), and a
    # run that saves none (checkpointing.enabled=false) is told that its steps in the folder are not its.
    off = _mgr(tmp_path, enabled=False)
    message = off.export_failed_message(export, PermissionError(13, "Permission denied"))
    assert re.fullmatch(rf"exporting the policy to {re.escape(str(export))} failed \([0-9.]+ MiB free there\): "
                        r"\[Errno 13\] Permission denied\n"
                        r"no checkpoint holds the trained policy \(checkpointing.enabled=false\)", message), message


def test_a_save_a_dead_worker_ends_names_the_worker_not_its_last_log_line(tmp_path):
    from posttrain.distributed.worker_group import WorkerError

    class Killed(_Policy):
        def save_checkpoint(self, path):
            raise WorkerError("policy worker rank 1 (pid 7, node n) died: The actor died unexpectedly\n"
                              "last lines of its log /x/rank1.log:\n11:38:53 rank 1: save_checkpoint\n")

    mgr = _mgr(tmp_path)
    # Without the free disk space, which pointed at the disk for nothing.
    with pytest.raises(CheckpointSaveError, match=r"step_1 in .* failed: policy worker rank 1 "
                                                  r"\(pid 7, node n\) died: The actor died unexpectedly\n"):
        mgr.save(1, Killed(), {"epoch": 0}, "a: 1\n", {})


def test_metric_name_must_name_a_train_or_val_metric():
    assert CheckpointingConfig(metric_name="val:accuracy").metric_name == "val:accuracy"
    with pytest.raises(ValueError, match="should match pattern"):
        CheckpointingConfig(metric_name="accuracy")


def test_dcp_to_hf_names_the_checkpoints_of_a_checkpoint_dir_and_refuses_a_file_as_output(tmp_path):
    from posttrain.config import InputError, MissingInputError
    from posttrain.convert.dcp_to_hf import convert

    for step in (1, 2):
        (tmp_path / "ckpt" / f"step_{step}" / "policy").mkdir(parents=True)
        (tmp_path / "ckpt" / f"step_{step}" / "policy" / ".metadata").write_text("")
        (tmp_path / "ckpt" / f"step_{step}" / "COMPLETE").write_text(f"{step}\n")
    with pytest.raises(MissingInputError, match=r"it holds the checkpoints step_1, step_2: pass one, e.g. "
                                                 rf"--checkpoint {tmp_path / 'ckpt' / 'step_2'}$"):
        convert(tmp_path / "ckpt", tmp_path / "hf")
    (tmp_path / "notes.txt").write_text("keep")
    with pytest.raises(InputError, match="--output .*notes.txt: exists and is not a folder"):
        convert(tmp_path / "ckpt" / "step_2", tmp_path / "notes.txt")
    # A file on the way to a new folder: refused before the conversion's work, not as a
    # FileExistsError traceback when the folders are made at its end.
    with pytest.raises(InputError, match=r"--output .*notes.txt/hf: .*notes.txt is a file, not a folder"):
        convert(tmp_path / "ckpt" / "step_2", tmp_path / "notes.txt" / "hf")
    assert (tmp_path / "notes.txt").read_text() == "keep"


def test_replacing_a_model_folder_keeps_the_new_model_when_the_old_cannot_be_deleted(tmp_path, monkeypatch):
    # The export and both converters write through writing_folder. It deleted the earlier model
    # first: a file that could not be removed stopped it there, and the new model, already
    # written, was deleted too.
    import shutil

    from posttrain.convert import output

    real_rmtree = shutil.rmtree

    def rmtree(path, ignore_errors=False):  # removes all but a file named "locked"
        for f in os.listdir(path):
            if f != "locked":
                os.remove(os.path.join(path, f))
        if not os.listdir(path):
            return real_rmtree(path)
        if not ignore_errors:
            raise PermissionError(f"{path}/locked")

    monkeypatch.setattr(output.shutil, "rmtree", rmtree)
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("old")
    (out / "locked").write_text("")
    with output.writing_folder(out) as tmp:
        (tmp / "config.json").write_text("new")
    assert sorted(os.listdir(out)) == ["config.json"] and (out / "config.json").read_text() == "new"
    # A write that fails leaves the earlier model as it was.
    with pytest.raises(RuntimeError), output.writing_folder(out) as tmp:
        (tmp / "config.json").write_text("newer")
        raise RuntimeError("cut short")
    assert (out / "config.json").read_text() == "new"


def test_dcp_to_hf_reads_the_model_name_of_a_config_as_the_run_did(tmp_path):
    # Without hf_config/ in the checkpoint, the model comes from the run's config: read through
    # `defaults:` and interpolations, with the schema default when the config does not name one.
    from posttrain.config import ConfigError, MissingInputError
    from posttrain.convert.dcp_to_hf import _model_source

    policy = tmp_path / "step_1" / "policy"
    policy.mkdir(parents=True)
    (tmp_path / "base.yaml").write_text("policy: {model_name: embedded:small}\n")
    (tmp_path / "run.yaml").write_text("defaults: base.yaml\ngrpo: {seed: 1}\n"
                                       "policy: {tokenizer: {chat_template: '{{ messages[0].content }}'}}\n")
    (tmp_path / "plain.yaml").write_text("description: ${policy.model_name}\ndata: {add_bos: false}\n")
    (tmp_path / "list.yaml").write_text("- policy\n")
    # And the tokenizer the run exported: its template, not its base model's (which the export wrote).
    assert _model_source(policy, str(tmp_path / "run.yaml")) == ("embedded:small", {
        "tokenizer": "embedded:small", "chat_template": "{{ messages[0].content }}", "add_bos": True, "add_eos": True})
    assert _model_source(policy, str(tmp_path / "plain.yaml")) == ("embedded:tiny", {
        "tokenizer": "embedded:tiny", "chat_template": None, "add_bos": False, "add_eos": True})
    with pytest.raises(ConfigError, match="list.yaml: the top level of a config must be a mapping"):
        _model_source(policy, str(tmp_path / "list.yaml"))
    # A --config that is not there is named, also when the checkpoint has hf_config/ (it was ignored).
    from posttrain.convert.dcp_to_hf import convert

    (policy / "hf_config").mkdir()
    (policy / "hf_config" / "config.json").write_text("{}")
    with pytest.raises(MissingInputError, match=r"--config .*nowhere.yaml: no such file"):
        convert(tmp_path / "step_1", tmp_path / "out", str(tmp_path / "nowhere.yaml"))
    import shutil

    shutil.rmtree(policy / "hf_config")
    (tmp_path / "step_1" / "config.yaml").write_text("policy: {model_name: embedded:small}\n")
    assert _model_source(policy, None)[0] == "embedded:small"  # the config the run saved with its checkpoint


def test_a_rerun_of_an_offline_run_whose_epochs_ran_out_says_it_has_nothing_left_to_train(tmp_path):
    from types import SimpleNamespace

    from posttrain.algorithms import offline
    from posttrain.config import load_config
    from posttrain.data.loader import RowLoader

    rows = [{"i": i} for i in range(10)]
    first = RowLoader(rows, 2, max_epochs=1)
    for _ in range(5):  # the one epoch, well before sft.max_num_steps=50
        next(first)
    mgr = CheckpointManager(CheckpointingConfig(checkpoint_dir=str(tmp_path / "ckpt")), {**SIG, "algorithm": "sft"})
    path = _save(mgr, 5, dataloader=first.state_dict())
    lines = []
    policy, logger = SimpleNamespace(load_checkpoint=lambda p: None), SimpleNamespace(console=lines.append)
    cfg = load_config("sft", None, ["sft.max_num_steps=50"])
    for max_epochs, note in ((1, True), (2, False)):
        loader = RowLoader(rows, 2, max_epochs=max_epochs)
        loader.load_state_dict(first.state_dict())
        point = offline.ResumePoint(path, mgr.load_info(path), loader.last_step(50, 5))
        assert point.last_step == (5 if note else 10)  # 5 steps per epoch
        assert offline.resume(point, policy, mgr, logger, cfg, loader, 50) == 5
        # named for what ends it: raising sft.max_num_steps alone would train nothing more
        assert ("at step 5 (the run's last step: nothing left to train; sft.max_num_epochs=1 ends it)"
                in lines[-1]) == note, lines[-1]


def test_a_run_is_complete_at_its_last_step_once_its_export_is_recorded(tmp_path):
    from posttrain.checkpoint import RunAlreadyComplete

    mgr, logs, hf = _mgr(tmp_path), tmp_path / "logs", tmp_path / "logs" / "hf"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"step": 4, "prefix": "val", "loss": 1.5}, {"step": 5, "prefix": "train", "loss": 1.25}]))
    path = _save(mgr, 5)
    mgr.check_complete(path, 6, "sft.max_num_steps", None, logs)  # a step left: nothing said
    assert mgr.complete_result is None
    mgr.check_complete(path, 5, "sft.max_num_steps", hf, logs)  # its export not made: the run makes it
    # ... training nothing: its result is the one logged (it printed {"result": {}}).
    assert mgr.complete_result == {"step": 5, "train/loss": 1.25, "val/loss": 1.5, "val/step": 4,
                                   "already_complete": True}
    hf.mkdir()
    (hf / "config.json").write_text("{}")
    mgr.record_export(hf)
    with pytest.raises(RunAlreadyComplete, match=rf"the run is complete: {path} is its last step "
                                                 rf"\(sft.max_num_steps=5\), its final policy in {hf}; nothing to do") as done:
        mgr.check_complete(path, 5, "sft.max_num_steps", hf, logs)
    assert done.value.result == {"step": 5, "train/loss": 1.25, "val/loss": 1.5, "val/step": 4, "already_complete": True}
    # Started again with another logger.log_dir: the metrics are read where its checkpoint's config logged them.
    (path / "config.yaml").write_text(f"logger:\n  log_dir: {logs}\n")
    with pytest.raises(RunAlreadyComplete) as again:
        mgr.check_complete(path, 5, "sft.max_num_steps", hf, tmp_path / "new_logs")
    assert again.value.result == done.value.result
    mgr.check_complete(path, 5, "sft.max_num_steps", tmp_path / "elsewhere", logs)  # exported to another folder
    # Stopped at its last step before the validation due there: the resume makes it up.
    info = json.loads((path / "training_info.json").read_text())
    (path / "training_info.json").write_text(json.dumps({**info, "validation_pending": True}))
    mgr.check_complete(path, 5, "sft.max_num_steps", hf, logs)


def test_a_stop_signal_during_a_step_saves_it_without_running_its_validation_first(tmp_path):
    """A scheduler kills the job a grace period after its SIGTERM: a long validation due at the
    step must not run before the save (the validation of a step without a signal still runs).
    The resumed run makes it up, logged at that step and ranking its checkpoint, before it trains:
    it was never run, and the top-k pruned the checkpoint, which may have been the best."""
    from types import SimpleNamespace

    from posttrain.algorithms import offline
    from posttrain.config import load_config
    from posttrain.data.loader import RowLoader

    mgr = _mgr(tmp_path, metric_name="val:loss", higher_is_better=False, keep_top_k=1)
    validated, logged = [], []

    class Policy(_Policy):
        def train(self, batch, loss_fn):
            if len(validated) == 1 and mgr.stop_signal is None and not logged:  # step 2: the signal arrives
                mgr.stop_signal = "SIGTERM"
            return {"loss": 1.0, "num_tokens": 8.0}

        def sync_reference_if_due(self, step):  # policy.reference_sync is off
            return False

    logger = SimpleNamespace(start_progress=lambda *a: None, update_progress=lambda *a: None, plot=lambda: None,
                             console=lambda m: None, log_metrics=lambda m, step, prefix: None,
                             timed_save=lambda step: contextlib.nullcontext())
    cfg = load_config("sft", None, ["sft.val_period=1", "sft.val_at_start=false"])
    s = SimpleNamespace(run=SimpleNamespace(policy=Policy(), logger=logger, checkpointer=mgr), cfg=cfg,
                        loader=RowLoader([{"i": i} for i in range(10)], 2), loss_fn=None, start_step=0, total_steps=5)
    result = offline.offline_train(s, cfg.sft, lambda rows: rows, lambda: validated.append(1) or {"loss": 2.0},
                                   show="loss")
    assert result["step"] == 2 and len(validated) == 1  # step 1 validated; step 2 saved at once
    assert _steps(mgr) == [2]
    info = mgr.load_info(tmp_path / "ckpt" / "step_2")
    assert info["validation_pending"] and info["metric_value"] is None
    # The resume (a new manager, as a new process has): step 2's validation first, then the steps.
    mgr = _mgr(tmp_path, metric_name="val:loss", higher_is_better=False, keep_top_k=1)
    logger.log_metrics = lambda m, step, prefix: logged.append((prefix, step, dict(m)))
    s.run.checkpointer, s.start_step, s.total_steps = mgr, 2, 3
    losses = iter([0.5, 0.9])  # step 2's made-up validation, then step 3's
    result = offline.offline_train(s, cfg.sft, lambda rows: rows, lambda: {"loss": next(losses)}, show="loss")
    assert [(p, step) for p, step, _ in logged] == [("val", 2), ("val", 3), ("train", 3)]
    info = mgr.load_info(tmp_path / "ckpt" / "step_2")
    assert "validation_pending" not in info and info["metric_value"] == 0.5 and info["best_step"] == 2
    # The top-1 keeps step 2, the best, beside the latest (unmeasured, it was pruned by step 3's save).
    assert result["val/step"] == 3 and _steps(mgr) == [2, 3]
    assert mgr.load_info(tmp_path / "ckpt" / "step_3")["best_step"] == 2


@pytest.mark.parametrize("name", ["train:step_time_s", "train:timing/training"])
def test_every_logged_train_metric_can_rank_the_checkpoints(tmp_path, name):
    # check_metric_name accepts what the run logs; the step time and the timings were logged but
    # not saved with the checkpoint, which every save then called "not measured".
    from types import SimpleNamespace

    from posttrain.algorithms import offline
    from posttrain.config import load_config
    from posttrain.data.loader import RowLoader

    mgr = _mgr(tmp_path, metric_name=name, higher_is_better=False, keep_top_k=1)

    class Policy(_Policy):
        def train(self, batch, loss_fn):
            return {"loss": 1.0, "num_tokens": 8.0}

        def sync_reference_if_due(self, step):
            return False

    logged = []
    logger = SimpleNamespace(start_progress=lambda *a: None, update_progress=lambda *a: None, plot=lambda: None,
                             console=lambda m: None, timed_save=lambda step: contextlib.nullcontext(),
                             log_metrics=lambda m, step, prefix: logged.append(dict(m)))
    cfg = load_config("sft", None, ["sft.val_period=0", "sft.val_at_start=false", "sft.val_at_end=false"])
    s = SimpleNamespace(run=SimpleNamespace(policy=Policy(), logger=logger, checkpointer=mgr), cfg=cfg,
                        loader=RowLoader([{"i": i} for i in range(10)], 2), loss_fn=None, start_step=0, total_steps=2)
    offline.offline_train(s, cfg.sft, lambda rows: rows, lambda: {}, show="loss")
    info = mgr.load_info(tmp_path / "ckpt" / "step_2")
    value = logged[-1][name.removeprefix("train:")]
    assert value > 0 and info["metric_value"] == pytest.approx(value)


def test_a_made_up_validation_ranks_by_the_metric_the_resumed_run_names(tmp_path):
    # The stopped run ranked by val:loss; the resumed one by val:accuracy. Recorded under the old
    # name, step 4's accuracy read as unmeasured and step 6's save pruned the best checkpoint.
    mgr = _mgr(tmp_path, metric_name="val:loss", higher_is_better=False, keep_top_k=1)
    mgr.save(2, _Policy(), {}, "a: 1\n", {"val:loss": 3.0})
    mgr.save(4, _Policy(), {}, "a: 1\n", {}, validation_pending=True)
    mgr = _mgr(tmp_path, metric_name="val:accuracy", higher_is_better=True, keep_top_k=1)
    mgr.record_validation(tmp_path / "ckpt" / "step_4", {"val:accuracy": 0.9, "val:loss": 1.0})
    mgr.save(6, _Policy(), {}, "a: 1\n", {"val:accuracy": 0.5})
    # (step 2, ranked by val:loss, stays outside the pruning)
    assert _steps(mgr) == [2, 4, 6] and mgr.load_info(tmp_path / "ckpt" / "step_6")["best_step"] == 4
    # Back on val:loss, step 4's accuracy is no loss.
    assert _mgr(tmp_path, metric_name="val:loss")._metric_of(tmp_path / "ckpt" / "step_4") is None


def test_a_model_in_the_runs_own_final_export_is_refused_before_anything_moves_it(tmp_path):
    # The advice for a run folder given as a model is its hf/ export; with the same config, a fresh
    # start moved that folder aside and then failed to load "no such folder".
    from posttrain.algorithms import offline
    from posttrain.config import load_config

    export = tmp_path / "logs" / "hf"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")

    def cfg(*overrides):
        return load_config("sft", None, [f"logger.log_dir={tmp_path / 'logs'}", f"policy.model_name={export}",
                                         f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}", *overrides])

    with pytest.raises(ConfigError, match=rf"policy.model_name={re.escape(str(export))} is in .*logger.log_dir=.*"
                                          r"would move aside as an earlier run's.*another logger.log_dir"):
        offline.training_logger(cfg(), CheckpointManager(cfg().checkpointing, SIG), None)
    assert (export / "config.json").is_file() and not list((tmp_path / "logs").glob("previous-*"))
    # A resume moves nothing, but the export at its end would replace the model it trains.
    with pytest.raises(ConfigError, match=r"would replace with its own \(checkpointing.export_hf_at_end\)"):
        offline.check_export_is_not_an_input(cfg("checkpointing.export_hf_at_end=true"), fresh=False)
    offline.check_export_is_not_an_input(cfg(), fresh=False)
    offline.check_export_is_not_an_input(cfg(f"logger.log_dir={tmp_path / 'other'}"), fresh=True)


def test_dcp_to_hf_of_a_truncated_weights_file_names_the_error_without_a_traceback(tmp_path, tiny_model_path):
    # dcp raises a CheckpointException whose text is every rank's whole traceback: the one-line
    # input error quoted all of it.
    import warnings

    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from posttrain.config import InputError
    from posttrain.convert.dcp_to_hf import HF_CONFIG_DIR, convert

    policy = tmp_path / "step_1" / "policy"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(policy))
    model.config.save_pretrained(policy / HF_CONFIG_DIR)
    AutoTokenizer.from_pretrained(tiny_model_path).save_pretrained(policy / HF_CONFIG_DIR)
    (weights,) = policy.glob("*.distcp")
    weights.write_bytes(weights.read_bytes()[:5000])
    with pytest.raises(InputError) as err:
        convert(tmp_path / "step_1", tmp_path / "hf")
    assert re.fullmatch(rf"cannot read the checkpoint in {re.escape(str(policy))} \([A-Za-z]+Error[^\n]*\); "
                        r"a save cut short or files copied in part\? Convert another step_N", str(err.value))
    assert not (tmp_path / "hf").exists()


def test_a_misspelt_metric_name_fails_when_the_run_first_logs_its_kind(tmp_path, caplog):
    # It was a warning at each save (the quickstart's first: step 50), while the top-k pruning kept
    # the newest checkpoints instead of the best.
    from posttrain.config import InputError
    from posttrain.logging import Logger
    from posttrain.schemas import LoggerConfig

    logger = Logger(LoggerConfig(tensorboard_enabled=False), tmp_path / "logs")
    logger.metric_checks.append(_mgr(tmp_path, metric_name="val:acuracy").check_metric_name)
    logger.log_metrics({"reward": 0.5}, step=1, prefix="train")  # another kind: not checked
    with pytest.raises(InputError, match=r"checkpointing.metric_name='val:acuracy' is not a metric this run logs; "
                                         r"did you mean 'val:accuracy'\? \(its val: metrics: accuracy, reward\)"):
        logger.log_metrics({"accuracy": 0.9, "reward": 0.8}, step=2, prefix="val")
    logger.close()
    # A name like none of them (a metric that may come later) passes with a warning at once, a right
    # one without.
    for name in ("val:bleu", "val:accuracy"):
        caplog.clear()
        check = _mgr(tmp_path, metric_name=name).check_metric_name
        check({"accuracy": 0.9}, "val")
        check({"accuracy": 0.9}, "val")  # said once
        warned = [r.getMessage() for r in caplog.records if "metric_name" in r.getMessage()]
        assert warned == ([] if name == "val:accuracy" else [
            "checkpointing.metric_name='val:bleu' is not among the val: metrics this run logged first (accuracy): "
            "checkpoints without it rank below those with it, and keep_top_k=3 keeps the newest of them"])


def test_a_resumed_run_keeps_its_run_id_in_the_checkpoints_it_saves(tmp_path):
    first = _mgr(tmp_path)
    assert first.adopt_run_id(None) == first.run_id  # a fresh run: its own new id
    _save(first, 1)
    assert first.load_info(tmp_path / "ckpt" / "step_1")["run_id"] == first.run_id
    resumed = _mgr(tmp_path)
    assert resumed.run_id != first.run_id and resumed.adopt_run_id(resumed.latest()) == first.run_id
    _save(resumed, 2)
    assert resumed.load_info(tmp_path / "ckpt" / "step_2")["run_id"] == first.run_id
    # A checkpoint from before run ids names none: the logs it finds are taken as its own.
    info_file = tmp_path / "ckpt" / "step_2" / "training_info.json"
    info_file.write_text(json.dumps({k: v for k, v in json.loads(info_file.read_text()).items() if k != "run_id"}))
    assert _mgr(tmp_path).adopt_run_id(tmp_path / "ckpt" / "step_2") is None


def test_a_made_up_validation_a_stop_cuts_short_stays_pending(tmp_path):
    # A stop during the resume's make-up validation (its environments' scoring abandoned): it was
    # logged and recorded, the checkpoint no longer pending, and the next resume never validated it.
    from types import SimpleNamespace

    from posttrain.algorithms.offline import made_up_validation

    logged, recorded = [], []
    logger = SimpleNamespace(console=lambda m: None, log_metrics=lambda m, step, prefix: logged.append(m))
    checkpointer = SimpleNamespace(stop_signal=None, record_validation=lambda path, m: recorded.append(m))

    # GRPO's validate says None when a stop came while it ran (grpo._unless_stopped).
    assert made_up_validation(checkpointer, logger, tmp_path, 2, lambda: None) == {}
    assert logged == [] and recorded == []
    assert made_up_validation(checkpointer, logger, tmp_path, 2, lambda: {"accuracy": 0.5}) == {"accuracy": 0.5}
    assert logged == [{"accuracy": 0.5}] and recorded == [{"val:accuracy": 0.5}]
