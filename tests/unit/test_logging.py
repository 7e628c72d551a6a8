"""Each logger backend writes something its own reader reads back; the timer; the plots."""

import json
import logging
import math
import struct
import time
from types import SimpleNamespace

import pytest

from posttrain.logging import Logger, Timer
from posttrain.logging.console import compact_line, word_match
from posttrain.logging.plots import plot_pass_at_k
from posttrain.schemas import LoggerConfig

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _cfg(**kw):
    base = dict(console_enabled=False, jsonl_enabled=False, plots_enabled=False)
    base.update(kw)
    return LoggerConfig(**base)


def test_timer_nested_phases_accumulate():
    timer = Timer()
    with timer.time("logprobs"):
        with timer.time("reference"):
            time.sleep(0.02)
        time.sleep(0.01)
    with timer.time("logprobs"):  # entered twice in a step: accumulates
        time.sleep(0.01)
    m = timer.metrics()
    assert set(m) == {"timing/logprobs", "timing/logprobs/reference"}
    assert 0.02 <= m["timing/logprobs/reference"] < m["timing/logprobs"]
    assert m["timing/logprobs"] >= 0.04
    assert set(timer.metrics(prefix="t/")) == {"t/logprobs", "t/logprobs/reference"}
    timer.reset()
    assert timer.metrics() == {}


def test_timer_rejects_reset_inside_phase_and_bad_names():
    timer = Timer()
    with pytest.raises(ValueError):
        with timer.time("a/b"):
            pass
    with timer.time("gen"):
        with pytest.raises(RuntimeError, match="gen"):
            timer.reset()


def test_jsonl_scalars_nonfinite_and_config(tmp_path, caplog):
    import numpy as np
    import torch

    logger = Logger(_cfg(jsonl_enabled=True), tmp_path, hparams={"policy": {"model_name": "m"}})
    logged = logger.log_metrics(
        {"loss": 0.5, "n": 3, "t": torch.tensor(2.5), "np": np.float32(1.5), "text": "x", "vec": torch.ones(3),
         "bad": float("nan")},
        step=1,
    )
    with caplog.at_level("WARNING", logger="posttrain"):
        logger.log_metrics({"bad": float("inf")}, step=2, prefix="validation")
    logger.close()
    assert set(logged) == {"loss", "n", "t", "np", "bad"}
    lines = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [(l["step"], l["prefix"]) for l in lines] == [(1, "train"), (2, "validation")]
    assert lines[0]["loss"] == 0.5 and lines[0]["t"] == 2.5 and lines[0]["np"] == 1.5
    assert math.isnan(lines[0]["bad"]) and math.isinf(lines[1]["bad"])
    assert "text" not in lines[0] and "vec" not in lines[0]
    assert logger.nonfinite_counts == {"train/bad": 1, "validation/bad": 1}
    assert "non-finite" in caplog.text
    assert "model_name: m" in (tmp_path / "config.yaml").read_text()


def test_log_samples_capped(tmp_path):
    with Logger(_cfg(num_samples_to_dump=2), tmp_path) as logger:
        logger.log_samples([{"prompt": f"{i}+1=", "reward": 1.0} for i in range(5)], step=7)
    assert logger._closed
    rows = [json.loads(l) for l in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert rows == [{"step": 7, "prompt": "0+1=", "reward": 1.0}, {"step": 7, "prompt": "1+1=", "reward": 1.0}]


def test_tensorboard_event_reader(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    hparams = {"a": 1, "description": "Lösung 数学"}
    logger = Logger(_cfg(tensorboard_enabled=True), tmp_path, hparams=hparams)
    for step in range(1, 4):
        logger.log_metrics({"loss": 1.0 / step}, step)
    logger.close()
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    events = acc.Scalars("train/loss")
    assert [e.step for e in events] == [1, 2, 3]
    assert [e.value for e in events] == pytest.approx([1.0, 0.5, 1 / 3])
    # The config in the text tab as config.yaml has it (non-ASCII text as written, not escaped).
    (text,) = acc.Tensors("config/text_summary")
    assert text.tensor_proto.string_val[0].decode() == "```\n" + (tmp_path / "config.yaml").read_text() + "```"
    # A resumed run's config at its first step, not a second copy at step 0.
    with Logger(_cfg(tensorboard_enabled=True), tmp_path, hparams={**hparams, "a": 2}, resumed_from=2) as logger:
        logger.log_metrics({"loss": 0.2}, 3)
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [t.step for t in acc.Tensors("config/text_summary")] == [0, 3]


def test_a_saves_time_is_train_timing_checkpoint_in_every_backend_and_a_record_of_its_own(tmp_path, monkeypatch):
    from mlflow.tracking import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from posttrain.logging.jsonl import read_metrics
    from posttrain.logging.plots import series_from_records

    clock = iter([10.0, 12.5, 20.0])
    monkeypatch.setattr("posttrain.logging.time", SimpleNamespace(perf_counter=lambda: next(clock)))
    cfg = _cfg(jsonl_enabled=True, tensorboard_enabled=True, mlflow_enabled=True)
    with Logger(cfg, tmp_path) as logger:
        logger.log_metrics({"loss": 0.5, "timing/training": 1.0}, step=2)
        with logger.timed_save(2):
            pass
        with pytest.raises(OSError), logger.timed_save(3):  # a save that failed took no time to show
            raise OSError("disk full")
        series = series_from_records(logger._records)
        mlflow_backend = logger._backends[-1]
    # metrics.jsonl: still one `train` record per step, the save's seconds beside it.
    assert [(r["prefix"], r["step"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [
        ("train", 2), ("train/timing", 2)]
    assert read_metrics(tmp_path / "metrics.jsonl")[1]["checkpoint"] == 2.5
    # Everywhere else the same name as the step's other phases; timing.png stacks it with them.
    assert series["train/timing/checkpoint"] == {2: 2.5} and series["train/timing/training"] == {2: 1.0}
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("train/timing/checkpoint")] == [(2, 2.5)]
    history = MlflowClient(tracking_uri=mlflow_backend.tracking_uri).get_metric_history(
        mlflow_backend.run_id, "train/timing/checkpoint")
    assert [(m.step, m.value) for m in history] == [(2, 2.5)]


def test_mlflow_client_reads_back(tmp_path):
    from mlflow.tracking import MlflowClient

    logger = Logger(_cfg(mlflow_enabled=True), tmp_path, hparams={"policy": {"max_grad_norm": 1.0}})
    logger.log_metrics({"loss": 0.25, "timing/generation": 1.5}, step=3)
    backend = logger._backends[0]
    logger.close()
    client = MlflowClient(tracking_uri=backend.tracking_uri)
    run = client.get_run(backend.run_id)
    assert run.data.metrics["train/loss"] == 0.25
    assert run.data.params["policy.max_grad_norm"] == "1.0"
    assert [(m.step, m.value) for m in client.get_metric_history(backend.run_id, "train/timing/generation")] == [(3, 1.5)]
    assert run.info.status == "FINISHED"
    assert (tmp_path / "mlflow" / "mlflow.db").is_file()


def test_an_mlflow_tracking_uri_it_cannot_use_is_an_input_error_at_once(tmp_path, monkeypatch):
    import socket

    from posttrain.config import InputError

    # A server that does not answer: MLflow's client retried for minutes, silent, then a traceback.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(InputError, match=rf"logger.mlflow.tracking_uri=http://127.0.0.1:{port}: no MLflow server "
                                         rf"answers at 127.0.0.1:{port}"):
        Logger(_cfg(mlflow_enabled=True, mlflow={"tracking_uri": f"http://127.0.0.1:{port}"}), tmp_path / "a")
    assert time.monotonic() - start < 5
    # A plain-file store, which MLflow 3 refuses unless told otherwise: MLflow's reason, naming the key.
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)
    with pytest.raises(InputError, match=r"logger.mlflow.tracking_uri=.*mlruns: MLflow cannot use it: .*file"):
        Logger(_cfg(mlflow_enabled=True, mlflow={"tracking_uri": str(tmp_path / "mlruns")}), tmp_path / "b")


def test_mlflow_takes_long_and_odd_names_and_values(tmp_path):
    from mlflow.tracking import MlflowClient

    long_a, long_b = "k" * 300 + "a", "k" * 300 + "b"
    hparams = {"env": {"kwargs": {long_a: 1, long_b: 2, "weird key!": "x" * 7000, "items": [1, {"c": 3}]}}}
    logger = Logger(_cfg(mlflow_enabled=True), tmp_path, hparams=hparams)
    logger.log_metrics({f"env/{long_a}": 0.5, f"env/{long_b}": 0.25}, step=1)
    backend = logger._backends[0]
    logger.close()
    run = MlflowClient(tracking_uri=backend.tracking_uri).get_run(backend.run_id)
    params, metrics = run.data.params, run.data.metrics
    assert len(params) == 4 and all(len(k) <= 250 for k in params)
    assert sorted(v for k, v in params.items() if k.startswith("env.kwargs.kkk")) == ["1", "2"]
    assert params["env.kwargs.weird key_"] == "x" * 6000 and params["env.kwargs.items"] == "[1, {'c': 3}]"
    assert sorted(metrics.values()) == [0.25, 0.5] and all(len(k) <= 250 for k in metrics)


def test_a_full_disk_under_tensorboard_drops_it_with_one_warning_and_no_thread_traceback(tmp_path, caplog,
                                                                                         monkeypatch):
    # TensorBoard writes from a thread of its own: its OSError printed a traceback ("Exception in
    # thread Thread-1") that read as the run's crash, before the warning that the run goes on.
    import os
    import threading

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    uncaught = []
    monkeypatch.setattr(threading, "excepthook", uncaught.append)
    logger = Logger(_cfg(tensorboard_enabled=True), tmp_path)
    tb = next(b for b in logger._backends if type(b).__name__ == "TensorboardBackend")
    events = os.fsdecode(tb._writer.file_writer.event_writer._general_file_writer.filename)
    (tmp_path / "full").symlink_to("/dev/full")
    os.replace(tmp_path / "full", events)  # atomically: the writer thread may be writing the file
    with caplog.at_level(logging.WARNING):
        for step in (1, 2, 3):
            logger.log_metrics({"loss": 1.0 / step}, step=step)
    assert caplog.text.count("logging to TensorBoard stopped at step 1: [Errno 28] No space left on device") == 1
    assert tb not in logger._backends and [r["loss"] for r in logger._records] == [1.0, 0.5, 1 / 3]
    logger.close()
    assert uncaught == []
    # Other threads' errors still reach the hook there was.
    thread = threading.Thread(target=lambda: 1 / 0)
    thread.start()
    thread.join()
    assert [a.exc_type for a in uncaught] == [ZeroDivisionError]


def test_mlflow_takes_metric_names_that_are_no_normalised_path_and_any_script(tmp_path):
    from mlflow.tracking import MlflowClient

    # MLflow refused the step's whole batch (the run stopped there) for a name that is not a
    # normalised path; letters of other scripts, which it takes, were all "_": 准确率 and 正确率
    # were one metric.
    logger = Logger(_cfg(mlflow_enabled=True), tmp_path)
    logger.log_metrics({"准确率": 0.5, "正确率": 0.25, "": 1.0, "a//b/": 2.0, "../x": 3.0, "é+1": 4.0}, step=1,
                       prefix="env")
    backend = logger._backends[0]
    logger.close()
    metrics = MlflowClient(tracking_uri=backend.tracking_uri).get_run(backend.run_id).data.metrics
    assert metrics == {"env/准确率": 0.5, "env/正确率": 0.25, "env": 1.0, "env/a/b": 2.0, "env/__/x": 3.0,
                       "env/é_1": 4.0}


def test_a_full_disk_stops_that_log_with_a_warning_naming_the_file_and_the_run_goes_on(tmp_path, caplog):
    # It raised: the run crashed for its logs and lost the steps since its last checkpoint.
    import os

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    for name in ("metrics.jsonl", "samples.jsonl"):
        (tmp_path / name).symlink_to("/dev/full")
    logger = Logger(_cfg(jsonl_enabled=True, tensorboard_enabled=True), tmp_path)
    with caplog.at_level(logging.WARNING):
        for step in (1, 2):
            logger.log_metrics({"loss": 1.0 / step}, step=step)
            logger.log_samples([{"prompt": "1+1="}], step=step)
    assert caplog.text.count("logging to metrics.jsonl stopped at step 1: [Errno 28] No space left on device: "
                             f"'{tmp_path / 'metrics.jsonl'}'; training goes on but metrics.jsonl misses the steps "
                             "from here on") == 1  # no console here to show them
    assert caplog.text.count("writing samples.jsonl stopped at step 1: [Errno 28] No space left on device") == 1
    assert [type(b).__name__ for b in logger._backends] == ["TensorboardBackend"]
    assert [r["loss"] for r in logger._records] == [1.0, 0.5]  # the plots still get every step
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        logger.close()
    # Said again at the end, where it is not scrolled away (it said "resume to log it again",
    # which logs nothing of the steps before the latest checkpoint).
    assert (f"the logs of this run under {tmp_path} are incomplete: metrics.jsonl: no steps from 1 on ([Errno 28] "
            "No space left on device") in caplog.text
    assert "samples.jsonl: no samples from step 1 on ([Errno 28]" in caplog.text


def test_a_backend_failing_to_close_does_not_leave_the_others_open(tmp_path):
    from mlflow.tracking import MlflowClient

    logger = Logger(_cfg(jsonl_enabled=True, mlflow_enabled=True), tmp_path, hparams={"a": 1})
    logger.log_metrics({"loss": 1.0}, step=1)
    jsonl, mlflow_backend = logger._backends

    def disk_full(failed):
        raise OSError(28, "No space left on device")

    jsonl.close = disk_full
    with pytest.raises(OSError, match="No space left"):
        logger.close()
    # The MLflow run after the failing JSONL backend was still ended (it stayed RUNNING).
    run = MlflowClient(tracking_uri=mlflow_backend.tracking_uri).get_run(mlflow_backend.run_id)
    assert run.info.status == "FINISHED"
    logger.close()  # a second close does nothing


def test_a_run_that_crashed_is_failed_in_mlflow_and_one_that_ended_is_finished(tmp_path):
    from mlflow.tracking import MlflowClient

    def status(logger):
        backend = logger._backends[0]
        return MlflowClient(tracking_uri=backend.tracking_uri).get_run(backend.run_id).info.status

    with pytest.raises(RuntimeError):
        with Logger(_cfg(mlflow_enabled=True), tmp_path / "a") as crashed:
            raise RuntimeError("a worker died")
    assert status(crashed) == "FAILED"  # it showed FINISHED, as a run that ended well
    with pytest.raises(RuntimeError):
        try:  # as the runs' shutdown: close in a `finally`
            logger = Logger(_cfg(mlflow_enabled=True), tmp_path / "b")
            raise RuntimeError("a worker died")
        finally:
            logger.close()
    assert status(logger) == "FAILED"
    with Logger(_cfg(mlflow_enabled=True), tmp_path / "c") as ended:
        pass
    assert status(ended) == "FINISHED"


def test_wandb_offline_run_files(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")  # logger.wandb.mode must win over the environment
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(wandb_enabled=True, wandb={"mode": "offline", "project": "t"})
    logger = Logger(cfg, tmp_path, hparams={"lr": 0.1})
    logger.log_metrics({"reward": 0.75}, step=1)
    logger.log_metrics({"reward": 0.5}, step=1, prefix="validation")
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    files = list(runs[0].rglob("*.wandb"))
    assert len(files) == 1
    # wandb's writer is a separate service process that may still be flushing after finish().
    deadline = time.time() + 30
    while b"validation/reward" not in files[0].read_bytes() and time.time() < deadline:
        time.sleep(0.2)
    blob = files[0].read_bytes()
    assert b"train/reward" in blob and b"validation/reward" in blob


def test_a_resumed_run_continues_its_mlflow_and_wandb_runs_and_a_fresh_one_starts_new_ones(tmp_path, monkeypatch, caplog):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = _cfg(mlflow_enabled=True, wandb_enabled=True, wandb={"mode": "offline", "project": "t"})

    def run(hparams, steps, **kw):
        with Logger(cfg, tmp_path, hparams=hparams, **kw) as logger:
            for step in steps:
                logger.log_metrics({"reward": step / 10}, step)
        mlflow_backend, wandb_backend = logger._backends[1], logger._backends[0]
        return mlflow_backend.run_id, wandb_backend.run.id, MlflowClient(tracking_uri=mlflow_backend.tracking_uri)

    first_mlflow, first_wandb, client = run({"lr": 0.1, "steps": 2}, [1, 2], fresh=True)
    with caplog.at_level("WARNING", logger="posttrain"):
        mlflow_id, wandb_id, _ = run({"lr": 0.1, "steps": 4, "seed": 3}, [3, 4], resumed_from=2)
    assert (mlflow_id, wandb_id) == (first_mlflow, first_wandb)
    history = client.get_metric_history(mlflow_id, "train/reward")
    assert [(m.step, m.value) for m in history] == [(1, .1), (2, .2), (3, .3), (4, .4)]
    # MLflow cannot change a parameter: the new one is added, the changed one named.
    params = client.get_run(mlflow_id).data.params
    assert params == {"lr": "0.1", "steps": "2", "seed": "3"}
    assert "changed steps stay at their earlier values" in caplog.text
    assert client.get_run(mlflow_id).info.status == "FINISHED"
    # offline-run-<time>-<id>, and "-<n>" after it when the resumed run starts within the second.
    assert {p.name.split("-")[3] for p in (tmp_path / "wandb").glob("offline-run-*")} == {first_wandb}

    # Started over: new tracker runs; the earlier ids go aside with the earlier logs.
    mlflow_id, wandb_id, _ = run({"lr": 0.2}, [1], fresh=True)
    assert mlflow_id != first_mlflow and wandb_id != first_wandb
    (aside,) = tmp_path.glob("previous-*")
    assert json.loads((aside / "tracker_runs.json").read_text()) == {"wandb": first_wandb, "mlflow": first_mlflow}
    # A resumed run whose ids file is unreadable starts new runs rather than failing.
    (tmp_path / "tracker_runs.json").write_text("{not json")
    mlflow_again, _, _ = run({"lr": 0.2}, [2], resumed_from=1)
    assert mlflow_again not in (mlflow_id, first_mlflow)


def test_wandb_online_without_an_api_key_is_an_input_error(tmp_path, monkeypatch):
    from posttrain.config import InputError

    for var in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc with a key
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    cfg = _cfg(wandb_enabled=True, wandb={"mode": "online", "project": "t"})
    with pytest.raises(InputError, match=r"^logger.wandb_enabled: W&B cannot start a run: No API key .*mode=offline"):
        Logger(cfg, tmp_path)


def test_word_match_takes_whole_underscore_words_of_the_last_segment():
    assert word_match("loss", "loss") and word_match("pg_loss", "loss") and word_match("val/loss_max", "loss")
    assert not word_match("lossy", "loss") and not word_match("gloss", "loss") and not word_match("loss/x", "loss")
    assert word_match("train/grad_norm", "grad_norm") and word_match("grad_norm_max", "grad_norm")
    assert not word_match("grad_normal", "grad_norm") and not word_match("grad", "grad_norm")


def test_console_line_and_progress(tmp_path):
    from rich.console import Console

    line = compact_line({"loss": 0.69314, "reward_mean": 0.25, "foo": 3.0, "timing/gen": 1.0,
                         "timing/train": 0.5, "timing/gen/x": 0.2}, 3, "train", 10)
    assert line.startswith("[bold]train[/bold] step 3/10")
    assert "loss 0.6931" in line and "reward_mean 0.25" in line and "time 1.5s" in line
    assert "foo" not in line  # key metrics only when some are present
    # Environment errors besides them when there are any, also past the cap on shown metrics.
    many = {f"loss_{i}": 1.0 for i in range(10)}
    assert compact_line({**many, "env_errors": 3.0}, 1, "val", None).endswith(" | env_errors 3")
    assert "env_errors" not in compact_line({**many, "env_errors": 0.0}, 1, "val", None)

    logger = Logger(_cfg(console_enabled=True, num_val_samples_to_print=1), tmp_path)
    backend = logger._console
    backend.console = Console(record=True, width=120, force_terminal=False)
    logger.start_progress(10, initial_step=4)
    logger.console("resumed from step 4")
    logger.log_metrics({"loss": 1.0}, step=5)
    assert backend._progress.tasks[0].completed == 5
    logger.update_progress(6, {"reward": 0.5, "text": "skipped"})
    task = backend._progress.tasks[0]
    assert task.completed == 6 and task.fields["summary"] == "reward 0.5"
    logger.update_progress(3)  # the bar never moves back
    assert backend._progress.tasks[0].completed == 6
    logger.print_samples([{"prompt": "1+1=", "response": "2"}, {"prompt": "2+2=", "response": "5"}])
    logger.close()
    out = backend.console.export_text()
    assert "resumed from step 4" in out
    assert "train step 5/10 | loss 1" in out and "1+1=" in out and "2+2=" not in out


def test_no_progress_bar_frames_in_a_piped_log_with_forced_colour(tmp_path):
    import io

    from rich.console import Console

    from posttrain.logging.console import ConsoleBackend

    out = io.StringIO()  # a CI log: not a TTY, but FORCE_COLOR makes rich treat it as a terminal
    backend = ConsoleBackend(Console(file=out, force_terminal=True, width=100))
    backend.start_progress(20)
    for step in range(1, 21):
        backend.log_metrics({"loss": 1.0 / step}, step, "train")
    assert backend._progress.tasks[0].completed == 20  # the bar's state is kept all the same
    backend.close()
    text = out.getvalue()
    assert text.count("step ") == 20 and "steps" not in text  # one line per step, no bar frame


def test_a_step_line_and_a_message_stay_one_line_in_a_narrow_log(tmp_path):
    import io

    from rich.console import Console

    from posttrain.logging.console import ConsoleBackend

    out = io.StringIO()
    backend = ConsoleBackend(Console(file=out, width=80))  # rich's width for a file or a pipe
    metrics = {f"metric_{i}": i / 7 for i in range(12)}
    backend.log_metrics({**metrics, "timing/generation": 1.5, "timing/validation": math.nan}, 3, "train")
    backend.message("resumed from step 3 with 2 config changes since that checkpoint: " + "x" * 80)
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("train step 3 | ") and len(lines[0]) > 80, lines
    assert lines[0].endswith(" | time 1.5s")  # a phase timed NaN is left out, not "time nans"


def test_samples_print_as_the_model_wrote_them(tmp_path):
    from rich.console import Console

    logger = Logger(_cfg(console_enabled=True, num_val_samples_to_print=2), tmp_path)
    logger._console.console = Console(record=True, width=120, force_terminal=False)
    # Rich markup in a response: "[/x]" raised MarkupError, "[bold]" was swallowed.
    logger.print_samples([{"prompt": "xs: list[int] = [/x]", "response": "[bold]4[/bold]\nnext line ✓"}])
    logger.close()
    out = logger._console.console.export_text()
    assert "xs: list[int] = [/x]" in out and "[bold]4[/bold]" in out and "next line ✓" in out


def test_data_counts_are_one_sentence_on_the_console_and_metrics_elsewhere(tmp_path):
    from rich.console import Console

    from posttrain.algorithms.offline import log_data_stats
    from posttrain.logging.jsonl import read_metrics

    logger = Logger(_cfg(console_enabled=True, jsonl_enabled=True), tmp_path)
    logger._console.console = Console(record=True, width=200, force_terminal=False)
    log_data_stats(logger, {"train": {"rows": 10, "kept": 9, "truncated": 1, "dropped": 1, "no_loss": 0}})
    logger.close()
    out = logger._console.console.export_text()
    # Not the step line, which picked `no_loss` out as a "loss" and showed only it.
    assert out.strip() == "data train: 9 of 10 rows kept (1 truncated, 1 dropped as too long, 0 without a loss token)"
    (rec,) = read_metrics(tmp_path / "metrics.jsonl")
    assert rec["prefix"] == "data/train" and (rec["rows"], rec["kept"], rec["no_loss"]) == (10, 9, 0)


def test_most_rows_dropped_as_too_long_is_a_warning(tmp_path, caplog):
    # 264 of 285 DPO pairs dropped went by in the info line alone; TRL truncates instead.
    from posttrain.algorithms.offline import log_data_stats

    logger = Logger(_cfg(), tmp_path)
    with caplog.at_level(logging.WARNING):
        log_data_stats(logger, {"train": {"rows": 10, "kept": 5, "truncated": 0, "dropped": 5, "no_loss": 0}})
        assert caplog.text == ""  # half is not most
        log_data_stats(logger, {"train": {"rows": 285, "kept": 21, "truncated": 0, "dropped": 264, "no_loss": 0}})
    logger.close()
    assert "data train: 264 of 285 rows (93%) are longer than the context and dropped" in caplog.text
    assert "policy.max_total_sequence_length" in caplog.text and "data.truncation=truncate" in caplog.text



def test_data_counts_say_how_many_examples_rows_split_by_turn_became(tmp_path):
    # SFT rows of Qwen3's template are one example per turn: an epoch's steps count examples, not rows.
    from rich.console import Console

    from posttrain.algorithms.offline import log_data_stats

    logger = Logger(_cfg(console_enabled=True), tmp_path)
    logger._console.console = Console(record=True, width=300, force_terminal=False)
    log_data_stats(logger, {"train": {"rows": 4, "kept": 4, "truncated": 0, "dropped": 0, "no_loss": 0, "examples": 9}})
    logger.close()
    assert logger._console.console.export_text().strip() == (
        "data train: 4 of 4 rows kept (0 truncated, 0 dropped as too long, 0 without a loss token), as 9 examples: "
        "one per turn where the chat template re-renders earlier turns")

def test_plots_are_pngs_and_survive_resume(tmp_path):
    cfg = _cfg(jsonl_enabled=True, plots_enabled=True)
    logger = Logger(cfg, tmp_path)
    for step in range(1, 4):
        logger.log_metrics({"loss": 1.0 / step, "reward": step / 3, "kl_penalty": 0.01,
                            "timing/generation": 1.0, "timing/training": 0.5, "timing/training/backward": 0.3}, step)
    logger.log_metrics({"accuracy": 0.5}, step=3, prefix="validation")
    logger.close()
    # A resumed run in the same dir plots the earlier steps too.
    logger = Logger(cfg, tmp_path)
    logger.log_metrics({"entropy": 2.0}, step=4)
    paths = logger.plot()
    logger.close()
    names = sorted(p.name for p in paths)
    assert names == ["entropy.png", "kl.png", "loss.png", "reward.png", "timing.png"]
    for p in paths:
        assert p.read_bytes()[:8] == PNG_MAGIC and p.stat().st_size > 1000
    assert not list((tmp_path / "plots").glob("*.tmp.png"))


def test_plots_are_redrawn_only_when_there_is_something_new(tmp_path, monkeypatch):
    # A run's end right after its last checkpoint plotted the same records twice (~1 s each).
    import posttrain.logging.plots as plots

    calls = []
    draw = plots.plot_history
    monkeypatch.setattr(plots, "plot_history", lambda *a, **k: calls.append(len(a[0])) or draw(*a, **k))
    logger = Logger(_cfg(jsonl_enabled=True, plots_enabled=True), tmp_path)
    logger.log_metrics({"loss": 1.0}, 1)
    first = logger.plot()
    assert logger.plot() == first and calls == [1]
    logger.log_metrics({"loss": 0.5}, 2)
    logger.plot()
    assert calls == [1, 2]
    (tmp_path / "plots" / "loss.png").unlink()  # a plot gone from the folder is drawn again
    assert (tmp_path / "plots" / "loss.png") in logger.plot() and calls == [1, 2, 2]
    logger.close()
    assert (tmp_path / "plots" / "loss.png").read_bytes()[:8] == PNG_MAGIC


def test_a_run_that_fails_gets_its_plots_when_its_logger_closes(tmp_path):
    # The loops draw the plots at their end (and GRPO at each checkpoint): a crash mid-run left
    # a run with metrics.jsonl and no picture.
    logger = Logger(_cfg(jsonl_enabled=True, plots_enabled=True), tmp_path)
    with pytest.raises(RuntimeError, match="worker died"):
        with logger:
            for step in range(1, 4):
                logger.log_metrics({"loss": 1.0 / step}, step)
            raise RuntimeError("worker died")
    assert (tmp_path / "plots" / "loss.png").read_bytes()[:8] == PNG_MAGIC


def test_pass_at_k_plot(tmp_path):
    results = {"num_tests_per_prompt": 4, "greedy": False, "model": "m", "dataset": "d", "num_prompts": 20,
               **{f"pass@{k}": 0.5 + k / 10 for k in range(1, 5)}, **{f"cons@{k}": 0.5 for k in range(1, 5)}}
    path = plot_pass_at_k(results, tmp_path / "eval" / "pass_at_k.png")
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC
    assert struct.unpack(">II", data[16:24]) == (700, 400)  # IHDR: width, height (7 x 4 in at 100 dpi)
    del results["cons@4"]
    with pytest.raises(KeyError, match="cons@4"):  # every k up to n must be in the results
        plot_pass_at_k(results, tmp_path / "again.png")


def test_gpu_monitor_reads_nvidia_smi(tmp_path, monkeypatch):
    # No GPU here: a stand-in nvidia-smi prints what the real one prints for this query.
    fake = tmp_path / "bin" / "nvidia-smi"
    fake.parent.mkdir()
    fake.write_text("#!/bin/sh\necho '0, 87, 40960, 81920'\necho '1, [N/A], 1024, 81920'\n")
    fake.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake.parent}:/usr/bin:/bin")
    logger = Logger(_cfg(jsonl_enabled=True, monitor_gpus=True, gpu_monitoring={"collection_interval": 3600}),
                    tmp_path / "run")
    first = logger.log_metrics({"loss": 1.0}, step=1)
    second = logger.log_metrics({"loss": 1.0}, step=2)  # within the interval: no new reading
    val = logger.log_metrics({"accuracy": 1.0}, step=2, prefix="val")
    logger.close()
    # A field a GPU reports as [N/A] is left out, not its other readings.
    assert first == {"loss": 1.0, "gpu/0/utilization": 87.0, "gpu/0/memory_used_gb": 40.0,
                     "gpu/0/memory_total_gb": 80.0, "gpu/1/memory_used_gb": 1.0, "gpu/1/memory_total_gb": 80.0}
    assert second == {"loss": 1.0} and val == {"accuracy": 1.0}


def test_gpu_monitor_without_nvidia_smi_warns(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("PATH", str(tmp_path))
    with caplog.at_level("WARNING", logger="posttrain"):
        logger = Logger(_cfg(monitor_gpus=True), tmp_path)
    assert logger.log_metrics({"loss": 1.0}, step=1) == {"loss": 1.0}
    assert "nvidia-smi is not on PATH" in caplog.text


def test_a_cpu_run_of_a_gpu_monitoring_config_does_not_warn_about_nvidia_smi(tmp_path, monkeypatch, caplog):
    # grpo_math_1B.yaml (logger.monitor_gpus=true) run on CPUs warned "nvidia-smi is not on PATH".
    from pathlib import Path

    from posttrain.config import load_config

    math = Path(__file__).resolve().parents[2] / "examples/configs/grpo_math_1B.yaml"
    cfg = load_config("grpo", str(math), ["policy.model_name=embedded:tiny", "cluster.gpus_per_node=0",
                                          "policy.generation.colocated.enabled=true", "policy.generation.backend=torch",
                                          "logger.tensorboard_enabled=false"])
    monkeypatch.setenv("PATH", str(tmp_path))
    with caplog.at_level("WARNING", logger="posttrain"):
        Logger(cfg.logger.model_copy(update={"console_enabled": False, "plots_enabled": False}), tmp_path).close()
    assert "nvidia-smi" not in caplog.text


def test_a_resumed_runs_plots_cover_the_stopped_runs_steps_without_metrics_jsonl(tmp_path):
    cfg = _cfg(jsonl_enabled=False, plots_enabled=True)
    with Logger(cfg, tmp_path, hparams={}, fresh=True) as logger:
        for step in range(1, 7):
            logger.log_metrics({"loss": float(step)}, step)
    with Logger(cfg, tmp_path, hparams={}, resumed_from=4) as logger:
        logger.log_metrics({"loss": 105.0}, 5)
        assert [(r["step"], r["loss"]) for r in logger._records] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0)]
        assert [p.name for p in logger.plot()] == ["loss.png"]
    assert not (tmp_path / "metrics.jsonl").exists()  # off, as configured


def test_tensorboard_served_by_its_python_loader_shows_a_relogged_step_once(tmp_path):
    # `tensorboard --load_fast=false` purges at a session start only, and took the first it read
    # for the run's own: without one from the fresh run, the resumed run's purged nothing.
    from tensorboard.backend.event_processing import plugin_event_accumulator
    from tensorboard.util import tensor_util

    cfg = _cfg(tensorboard_enabled=True)
    with Logger(cfg, tmp_path, hparams={}, fresh=True) as logger:
        for step in range(1, 7):
            logger.log_metrics({"loss": float(step)}, step)
    with Logger(cfg, tmp_path, hparams={}, resumed_from=4) as logger:
        for step in (5, 6, 7):
            logger.log_metrics({"loss": 100.0 + step}, step)
    served = plugin_event_accumulator.EventAccumulator(str(tmp_path / "tensorboard"))
    served.Reload()
    assert [(e.step, float(tensor_util.make_ndarray(e.tensor_proto))) for e in served.Tensors("train/loss")] == [
        (1, 1.0), (2, 2.0), (3, 3.0), (4, 4.0), (5, 105.0), (6, 106.0), (7, 107.0)]


def test_a_fresh_run_moves_an_earlier_runs_logs_aside_and_a_resumed_one_continues_them(tmp_path, monkeypatch):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.summary.writer import event_file_writer

    # Event files are read in name order: <seconds>.<host>.<pid>.<writer count of the process>.
    # This test's sessions share a second and a process, so their order is the count's, which
    # sorts as text (".10" before ".9") once earlier tests have opened nine writers. A resumed
    # run is a process of its own, later: its file sorts after the stopped one's.
    monkeypatch.setattr(event_file_writer, "_global_uid", event_file_writer.AtomicCounter(0))

    from posttrain.logging.jsonl import read_metrics

    cfg = _cfg(jsonl_enabled=True, plots_enabled=True, tensorboard_enabled=True)
    with Logger(cfg, tmp_path, hparams={"run": 1}, fresh=True) as logger:
        logger.log_metrics({"rows": 10}, 0, prefix="data/train")  # every start logs its data counts
        for step in (10, 20):  # the warm-up SFT's own steps, before the run's
            logger.log_metrics({"loss": step / 10}, step, prefix="warmup_sft")
        for step in (1, 2, 3):
            logger.log_metrics({"reward": 0.9}, step)
        logger.log_samples([{"prompt": "1+1="}], step=3)
        logger.plot()
    with Logger(cfg, tmp_path, hparams={"run": 1}, resumed_from=3) as logger:  # resumed: continues the same files
        logger.log_metrics({"reward": 0.8}, step=4)
        logger.log_metrics({"reward": 0.7}, step=5)
        logger.log_samples([{"prompt": "2+2="}], step=5)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "prefix": "tr')  # killed mid-line
    # Stopped after step 5, resumed from a checkpoint at step 4: the relogged step 5 is the
    # only one metrics.jsonl, samples.jsonl, TensorBoard and the plots hold. The warm-up's steps
    # 10 and 20, past the checkpoint's step on an axis of their own, are kept whole (they were
    # dropped), and the torn line is gone rather than joined to the next.
    with Logger(cfg, tmp_path, hparams={"run": 1}, resumed_from=4) as logger:
        logger.log_metrics({"rows": 10}, 0, prefix="data/train")  # the stopped run's stands: not twice
        logger.log_metrics({"reward": 0.6}, step=5)
        logger.log_samples([{"prompt": "3+3="}], step=5)
        assert [(r["step"], r.get("reward")) for r in logger._records if r["prefix"] == "train"] == [
            (1, .9), (2, .9), (3, .9), (4, .8), (5, .6)]
        plotted = logger.plot()
    # The warm-up's loss against its own steps, not on the run's axis in loss.png.
    assert sorted(p.name for p in plotted) == ["reward.png", "warmup_sft.png"]
    records = read_metrics(tmp_path / "metrics.jsonl")
    assert [(r["prefix"], r["step"]) for r in records] == [
        ("data/train", 0), ("warmup_sft", 10), ("warmup_sft", 20), *(("train", step) for step in (1, 2, 3, 4, 5))]
    assert records[-1]["reward"] == .6
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert samples == [{"step": 3, "prompt": "1+1="}, {"step": 5, "prompt": "3+3="}]
    acc = EventAccumulator(str(tmp_path / "tensorboard"))
    acc.Reload()
    assert [(e.step, round(e.value, 3)) for e in acc.Scalars("train/reward")] == [
        (1, .9), (2, .9), (3, .9), (4, .8), (5, .6)]
    assert [e.step for e in acc.Scalars("data/train/rows")] == [0]
    warmup = EventAccumulator(str(tmp_path / "tensorboard" / "warmup_sft"))
    warmup.Reload()
    assert [(e.step, e.value) for e in warmup.Scalars("warmup_sft/loss")] == [(10, 1.0), (20, 2.0)]

    # Started over in the same dir: its metrics, samples, events and plots are its own alone.
    with Logger(cfg, tmp_path, hparams={"run": 2}, fresh=True) as logger:
        logger.log_metrics({"reward": 0.1}, step=1)
        logger.plot()
        assert logger.moved_aside is not None
    (aside,) = tmp_path.glob("previous-*")
    assert logger.moved_aside == aside
    assert [(r["step"], r["reward"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(1, 0.1)]
    assert read_metrics(aside / "metrics.jsonl") == records
    assert not (tmp_path / "samples.jsonl").exists() and (aside / "samples.jsonl").is_file()
    # The aside events: one file per run of the log dir, and the warm-up's folder.
    assert len(list((tmp_path / "tensorboard").iterdir())) == 1 and len(list((aside / "tensorboard").iterdir())) == 4
    assert "run: 2" in (tmp_path / "config.yaml").read_text() and "run: 1" in (aside / "config.yaml").read_text()
    assert (tmp_path / "plots" / "reward.png").is_file() and (aside / "plots" / "reward.png").is_file()
    # A fresh run in an empty dir moves nothing.
    with Logger(cfg, tmp_path / "new", fresh=True) as logger:
        assert logger.moved_aside is None


def test_plots_leave_out_the_data_counts(tmp_path):
    from posttrain.algorithms.offline import log_data_stats
    from posttrain.logging.plots import series_from_records

    logger = Logger(_cfg(plots_enabled=True), tmp_path)
    log_data_stats(logger, {"warmup_sft": {"rows": 10, "kept": 9, "truncated": 1, "dropped": 1, "no_loss": 0}})
    logger.log_metrics({"prompts_dropped_overlong": 2}, step=0, prefix="data")
    logger.log_metrics({"reward": 0.5}, step=1)
    # A row count (no_loss) is no loss curve: only the reward figure is drawn.
    assert [p.name for p in logger.plot()] == ["reward.png"]
    assert set(series_from_records(logger._records)) == {"train/reward"}
    logger.close()


def test_plots_break_a_curve_at_the_steps_that_lack_it(tmp_path):
    from posttrain.logging.plots import series_from_records

    logger = Logger(_cfg(plots_enabled=True), tmp_path)
    for step in range(1, 7):
        reward = {} if step in (3, 4) else {"reward": step / 10}
        validation = {"timing/validation": 2.0} if step % 3 == 0 else {}
        logger.log_metrics({**reward, "loss": 1.0, "timing/generation": 1.0, **validation}, step)
        if step % 3 == 0:
            logger.log_metrics({"accuracy": step / 10}, step, prefix="val")
    series = series_from_records(logger._records)
    # Steps 3 and 4 logged no reward: a gap, not a line from step 2's value to step 5's.
    reward = series["train/reward"]
    assert sorted(reward) == [1, 2, 3, 4, 5, 6] and math.isnan(reward[3]) and math.isnan(reward[4])
    assert [reward[s] for s in (1, 2, 5, 6)] == [.1, .2, .5, .6]
    assert series["val/accuracy"] == {3: .3, 6: .6}  # validation every 3 steps: one line through its points
    assert sorted(p.name for p in logger.plot()) == ["loss.png", "reward.png", "timing.png"]
    logger.close()


def test_long_curves_are_drawn_with_their_running_mean(tmp_path):
    from posttrain.logging.plots import plot_history, running_mean

    nan, inf = math.nan, math.inf
    mean = running_mean([1.0, 3.0, nan, 5.0, inf, nan, nan, 7.0], window=2)
    assert [None if math.isnan(v) else v for v in mean] == [1.0, 2.0, 3.0, 5.0, 5.0, None, None, 7.0]
    records = [{"step": s, "prefix": "train", "reward": float(s % 2)} for s in range(1, 1001)]
    assert [p.name for p in plot_history(records, tmp_path)] == ["reward.png"]


def test_the_runs_own_curves_are_drawn_before_their_breakdowns(tmp_path):
    from posttrain.logging.plots import figure_series, plot_history, series_from_records

    # Seven reward functions (TRL's accuracy_reward, format_reward, ...): sorted by name alone,
    # their curves filled the figure's 8 and val/accuracy and val/reward were left out.
    functions = ["accuracy_reward", "format_reward", "len_reward", "reasoning_steps_reward", "tag_count_reward",
                 "cosine_reward", "repetition_penalty_reward"]
    records = [{"step": 1, "prefix": "train", "reward": 0.5, "accuracy": 0.5,
                **{f"reward/{f}": 0.1 for f in functions}},
               {"step": 1, "prefix": "val", "reward": 0.4, "accuracy": 0.4}]
    figures = {name: keys for name, keys, _ in figure_series(series_from_records(records))}
    assert figures["reward"][:5] == ["train/accuracy", "train/reward", "val/accuracy", "val/reward",
                                     "train/reward/accuracy_reward"]
    assert len(figures["reward"]) == 11
    assert [p.name for p in plot_history(records, tmp_path)] == ["reward.png"]


def test_a_training_run_started_over_keeps_the_earlier_export(tmp_path):
    # The final export (hf/) of the earlier run in the same folder was overwritten at the end.
    from posttrain.algorithms.offline import EXPORT_DIR, training_logger
    from posttrain.config import load_config

    (tmp_path / EXPORT_DIR).mkdir()
    (tmp_path / EXPORT_DIR / "config.json").write_text("{}")
    cfg = load_config("sft", None, [f"logger.log_dir={tmp_path}", "logger.console_enabled=false"])
    with training_logger(cfg, checkpointer=None, point=None) as logger:
        assert (logger.moved_aside / EXPORT_DIR / "config.json").is_file()
    assert not (tmp_path / EXPORT_DIR).exists()


def test_a_short_runs_plots_tick_whole_steps(tmp_path, monkeypatch):
    from posttrain.logging import plots

    figures = []
    monkeypatch.setattr(plots, "_save", lambda canvas, fig, path: (figures.append((canvas, fig)), path)[1])
    records = [{"step": s, "prefix": "train", "reward": s / 10, "timing/generation": 1.0} for s in (1, 2)]
    records.append({"step": 0, "prefix": "val", "accuracy": 0.1})
    plots.plot_history(records, tmp_path)
    assert len(figures) == 2  # reward.png, timing.png
    for canvas, fig in figures:
        canvas.draw()
        ticks = [t for t in fig.axes[0].get_xticks() if 0 <= t <= 2]
        # Matplotlib's default put ticks at 0.25, 0.5, ...: steps a run does not have.
        assert ticks and all(t == int(t) for t in ticks), ticks


def test_a_one_step_runs_plots_show_its_step_and_its_time(tmp_path, monkeypatch):
    from posttrain.logging import plots

    figures = {}
    monkeypatch.setattr(plots, "_save", lambda canvas, fig, path: (figures.update({path.name: (canvas, fig)}), path)[1])
    records = [{"step": 1, "prefix": "train", "reward": 0.5, "loss": math.nan, "timing/generation": 1.0,
                "timing/training": 2.0}]
    plots.plot_history(records, tmp_path)
    assert sorted(figures) == ["loss.png", "reward.png", "timing.png"]
    for canvas, fig in figures.values():
        canvas.draw()
        # One step: the locator fell back to fractions (0.945, 0.96, ...) around it.
        ticks = [t for t in fig.axes[0].get_xticks() if fig.axes[0].get_xlim()[0] <= t <= fig.axes[0].get_xlim()[1]]
        assert 1 in ticks and all(t == int(t) for t in ticks), ticks
    # The time breakdown of one step was a stacked area of no width: blank. Now a bar per phase.
    bars = [(p.get_y(), p.get_height()) for p in figures["timing.png"][1].axes[0].patches]
    assert bars == [(0.0, 1.0), (1.0, 2.0)]
    # A curve with no finite value draws nothing: its legend entry says so.
    labels = [t.get_text() for t in figures["loss.png"][1].axes[0].get_legend().get_texts()]
    assert labels == ["train/loss (no finite values)"]


def test_a_resumed_run_sets_another_runs_logs_aside_instead_of_cutting_and_continuing_them(tmp_path, monkeypatch):
    # Run A (checkpoints in one folder) stops at step 4; run B (other checkpoints, the same
    # logger.log_dir) starts fresh and logs 6 steps; A resumes at 4. A cut B's metrics at step 4
    # (B's steps 5-6 were lost) and continued them with its own steps 5-8.
    from posttrain.logging.jsonl import read_metrics

    said = []
    monkeypatch.setattr(Logger, "console", lambda self, text: said.append(text))
    cfg = _cfg(jsonl_enabled=True)

    def run(run_id: str, steps: range, resumed_from=None) -> Logger:
        logger = Logger(cfg, tmp_path, fresh=resumed_from is None, resumed_from=resumed_from, run_id=run_id)
        for step in steps:
            logger.log_metrics({"loss": float(step), "run": 1.0 if run_id == "a" else 2.0}, step)
        logger.close()
        return logger

    run("a", range(1, 5))
    b = run("b", range(1, 7))
    a_logs = b.moved_aside
    resumed = run("a", range(5, 9), resumed_from=4)
    assert [(r["step"], r["run"]) for r in read_metrics(tmp_path / "metrics.jsonl")] == [(s, 1.0) for s in range(5, 9)]
    b_logs = resumed.moved_aside
    assert [r["step"] for r in read_metrics(b_logs / "metrics.jsonl")] == list(range(1, 7))  # nothing of B's lost
    assert said[-1] == (f"the logs in {tmp_path} were another run's (run b; this one is a): moved to {b_logs}; this "
                        f"run's own logs up to its checkpoint are in {a_logs}; it logs its next steps here")
    # Its own logs (the same run id) it continues, cut at its checkpoint.
    run("a", range(7, 9), resumed_from=6)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [5, 6, 7, 8]
    # Logs from before run ids, or a run without one (no checkpoint manager): continued as before.
    (tmp_path / "run_id").unlink()
    run("c", range(9, 10), resumed_from=8)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [5, 6, 7, 8, 9]
    # A checkpoint from before run ids (nothing to compare) continues the logs there and names
    # them with the id its next saves carry, so that its next resume finds them its own.
    Logger(cfg, tmp_path, resumed_from=9, run_id="d", compare_run_id=False).close()
    assert (tmp_path / "run_id").read_text().strip() == "d"
    run("d", range(10, 11), resumed_from=9)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [5, 6, 7, 8, 9, 10]


def test_a_fresh_start_says_where_the_old_checkpoints_went(tmp_path, monkeypatch):
    # It said where the logs went and not the checkpoints, which left the checkpoint folder too.
    from posttrain.algorithms.offline import training_logger
    from posttrain.checkpoint import CheckpointManager
    from posttrain.config import load_config

    said = []
    monkeypatch.setattr(Logger, "console", lambda self, text: said.append(text))
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_2").mkdir(parents=True)
    (ckpt / "step_2" / "COMPLETE").write_text("")
    cfg = load_config("sft", None, [f"logger.log_dir={tmp_path / 'logs'}", f"checkpointing.checkpoint_dir={ckpt}",
                                    "checkpointing.start_fresh=true"])
    checkpointer = CheckpointManager(cfg.checkpointing, {"algorithm": "sft", "model_name": cfg.policy.model_name})
    with training_logger(cfg, checkpointer, point=None):
        pass
    assert said == [f"the earlier run's checkpoints in {ckpt} were moved to {checkpointer.moved_aside} "
                    "(checkpointing.start_fresh=true)"]
    assert (checkpointer.moved_aside / "step_2" / "COMPLETE").is_file()


def test_a_log_dir_that_cannot_be_written_is_named(tmp_path):
    from posttrain.config import MissingInputError

    (tmp_path / "a_file").write_text("")
    with pytest.raises(MissingInputError, match=r"logger.log_dir=.*a_file/run: cannot write it \(Not a directory\)"):
        Logger(LoggerConfig(tensorboard_enabled=False), tmp_path / "a_file" / "run")


def test_plots_that_cannot_be_written_are_a_warning(tmp_path, caplog):
    # A full disk under plots/ stopped the run at its next checkpoint's save.
    logger = Logger(LoggerConfig(tensorboard_enabled=False), tmp_path)
    logger.log_metrics({"reward": 0.5}, step=1, prefix="train")
    (tmp_path / "plots").write_text("a file where the folder goes")
    assert logger.plot() == []
    assert "the plots could not be written" in caplog.text
    # A disk that fills while a PNG is written: the part written went with it (a .tmp.png stayed).
    import os

    if os.path.exists("/dev/full"):
        (tmp_path / "plots").unlink()
        (tmp_path / "plots").mkdir()
        (tmp_path / "plots" / "reward.tmp.png").symlink_to("/dev/full")
        logger.log_metrics({"reward": 0.7}, step=2, prefix="train")
        logger.plot()
        assert not (tmp_path / "plots" / "reward.tmp.png").exists() and not (tmp_path / "plots" / "reward.png").exists()
    logger.close()


def test_a_training_runs_log_dir_is_refused_to_a_second_live_run_until_the_first_closes(tmp_path):
    # Two runs with their own checkpoint_dir but one logger.log_dir: the second moved the first's
    # live logs aside and the two final exports replaced each other's, silently.
    import subprocess
    import sys
    import textwrap

    from posttrain.config import InputError

    run = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import time
        from posttrain.logging import Logger
        from posttrain.schemas import LoggerConfig
        Logger(LoggerConfig(log_dir={str(run)!r}, tensorboard_enabled=False), {str(run)!r}, fresh=True,
               exclusive="logger.log_dir")
        print("ready", flush=True)
        time.sleep(60)
    """)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        (run / "metrics.jsonl").write_text('{"step": 1}\n')
        with pytest.raises(InputError, match=rf"logger.log_dir={run}: another run is using it \(pid {holder.pid} on "):
            Logger(_cfg(log_dir=str(run)), run, fresh=True, exclusive="logger.log_dir")
        # Through a symlink to it (or to its parent) it is the same folder: that run took a lock of its own.
        (tmp_path / "link").symlink_to(run)
        (tmp_path / "parent_link").symlink_to(tmp_path)
        for other in (tmp_path / "link", tmp_path / "parent_link" / "run"):
            # An eval run writing its results there moved the training run's logs aside.
            with pytest.raises(InputError, match=rf"eval.save_path={other}: another run is using it "):
                Logger(_cfg(log_dir=str(other)), other, fresh=True, exclusive="eval.save_path")
        assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'  # nothing moved aside
        Logger(_cfg(log_dir=str(run)), run).close()  # a logger that is not a training run's takes no lock
    finally:
        holder.kill()
        holder.wait()
    first = Logger(_cfg(log_dir=str(run)), run, fresh=True, exclusive="logger.log_dir")
    first.close()  # closed, it frees the folder for the next run (of this process too)
    assert not (run / "metrics.jsonl").exists() and any(run.glob("previous-*"))


def test_a_series_of_another_scale_goes_on_a_right_hand_axis(tmp_path):
    # DPO's sft_loss (a sum over tokens, ~1000) drew the loss (0-3) on the same axis as a flat
    # line at 0; its accuracy (0-1) under rewards of +-20 the same.
    from posttrain.logging.plots import plot_history, series_from_records, split_by_scale

    records = [{"step": s, "prefix": "train", "loss": 0.7 - s / 100, "preference_loss": 0.69, "sft_loss": 900.0 + s,
                "accuracy": s / 10, "rewards_chosen_mean": 2.0 * s, "kl": 1e-6 * s} for s in range(1, 11)]
    series = series_from_records(records)
    assert split_by_scale(series, ["train/loss", "train/preference_loss", "train/sft_loss"]) == (
        ["train/loss", "train/preference_loss"], ["train/sft_loss"])
    assert split_by_scale(series, ["train/accuracy", "train/rewards_chosen_mean"]) == (
        ["train/accuracy"], ["train/rewards_chosen_mean"])
    assert split_by_scale(series, ["train/loss", "train/kl"]) == (["train/loss"], ["train/kl"])  # 1e5 times smaller
    assert split_by_scale(series, ["train/loss"]) == (["train/loss"], [])
    written = plot_history(records, tmp_path)
    assert {p.name for p in written} >= {"loss.png", "reward.png"}
    assert all(p.read_bytes()[:8] == PNG_MAGIC for p in written)


def test_a_full_disk_at_the_start_is_an_input_error_naming_the_log_dir(tmp_path):
    # An empty file still fits on a full disk: the write check passed and the first write of the
    # resumed run's rewrite of metrics.jsonl was a traceback, leaving an empty .tmp behind.
    import os

    from posttrain.config import MissingInputError

    if not os.path.exists("/dev/full"):
        pytest.skip("no /dev/full")
    (tmp_path / ".posttrain-write-check").symlink_to("/dev/full")
    with pytest.raises(MissingInputError, match=rf"^logger.log_dir={tmp_path}: cannot write it \(No space left on"):
        Logger(_cfg(jsonl_enabled=True), tmp_path)
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "prefix": "train", "loss": 1.0}\n{"step": 2, "pre')
    (tmp_path / "metrics.tmp").symlink_to("/dev/full")
    with pytest.raises(MissingInputError, match=rf"^{tmp_path / 'metrics.jsonl'}: cannot rewrite it for the resumed "
                                                r"run \(No space left on device\); it is unchanged"):
        Logger(_cfg(jsonl_enabled=True), tmp_path, resumed_from=1)
    assert not (tmp_path / "metrics.tmp").exists() and (tmp_path / "metrics.jsonl").read_text().endswith('"pre')
