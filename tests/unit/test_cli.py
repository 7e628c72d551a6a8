"""The `posttrain` command: help, --print-config, errors (exit 2, no traceback), dispatch."""

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from posttrain import cli
from posttrain.checkpoint import StopAtOnce

ROOT = Path(__file__).resolve().parents[2]
EXE = Path(sys.executable).parent / "posttrain"


def _run(*args, **kw):
    return subprocess.run([str(EXE), *args], capture_output=True, text=True, timeout=60, cwd=ROOT, **kw)


def _run_probed(*args):
    """`posttrain *args` in this interpreter's process, its stdout the exit status and whether torch
    and transformers were imported by then ("2 False False")."""
    probe = ("import sys\nfrom posttrain.cli import main\ntry:\n    main(sys.argv[1:], supervise=False)\n"
             "except SystemExit as e:\n    print(e.code, 'torch' in sys.modules, 'transformers' in sys.modules)")
    return subprocess.run([sys.executable, "-c", probe, *args], capture_output=True, text=True, timeout=60, cwd=ROOT)


def test_help_lists_algorithms_sections_and_docs():
    out = _run("--help")
    assert out.returncode == 0
    for word in ("grpo", "sft", "dpo", "rm", "eval", "convert", "policy", "checkpointing", "loss_fn",
                 "docs/config.md", "++a.b=1"):
        assert word in out.stdout, word
    sub = _run("grpo", "--help")
    assert sub.returncode == 0 and "--print-config" in sub.stdout and "loss_fn" in sub.stdout
    assert "docs/config.md" in sub.stdout
    assert "dpo " not in sub.stdout.split("config sections:")[1]  # only grpo's sections
    assert "schema defaults run the embedded task" in " ".join(sub.stdout.split())
    assert "YAML config, - for the standard input" in " ".join(sub.stdout.split())
    # DPO has no embedded default to run (the help said it had).
    dpo = " ".join(_run("dpo", "--help").stdout.split())
    assert "the embedded task has no preference pairs (see examples/configs/dpo.yaml)" in dpo


def test_print_config_resolves_overrides_and_needs_no_algorithm_module(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy:\n  max_total_sequence_length: 64\n")
    out = _run("grpo", "policy.model_name=embedded:small", "--config", str(cfg), "--print-config",
               "policy.generation.max_new_tokens=${policy.max_total_sequence_length}")
    assert out.returncode == 0, out.stderr
    data = yaml.safe_load(out.stdout)
    assert data["policy"]["model_name"] == "embedded:small"
    assert data["policy"]["generation"]["max_new_tokens"] == 64
    assert data["grpo"]["num_generations_per_prompt"] == 8  # schema default filled in


def test_print_config_to_a_full_device_says_so_without_traceback():
    with open("/dev/full", "w") as full:
        out = subprocess.run([str(EXE), "grpo", "--print-config"], stdout=full, stderr=subprocess.PIPE, text=True,
                             timeout=60, cwd=ROOT)
    assert out.returncode == 1
    assert out.stderr == ("posttrain grpo: --print-config could not write to standard output: [Errno 28] No space "
                          "left on device\n")


def test_settings_left_unread_warn_on_the_console():
    out = _run("grpo", "policy.lora.rank=4", "--print-config")
    assert out.returncode == 0
    assert ("posttrain.config WARNING: policy.lora.rank (command line): read only with policy.lora.enabled=true; "
            "it is false (the default), so it changes nothing") in out.stderr


def test_config_error_exits_2_without_traceback():
    out = _run("grpo", "policy.max_grad_nrom=1")
    assert out.returncode == 2
    assert "did you mean policy.max_grad_norm?" in out.stderr
    assert "Traceback" not in out.stderr
    out = _run("sft", "--config", "missing.yaml")
    assert out.returncode == 2 and "config file not found" in out.stderr and "Traceback" not in out.stderr


def test_input_errors_exit_2_naming_the_key_file_or_row_without_traceback(tmp_path):
    missing = tmp_path / "missing.jsonl"
    # A file that is not there fails before torch and transformers are imported (~7 s of the start).
    out = _run_probed("sft", f"data.dataset_name={missing}")
    assert out.stdout.split() == ["2", "False", "False"] and "Traceback" not in out.stderr, out
    assert f"posttrain sft: data.dataset_name='{missing}': file not found" in out.stderr
    out = _run_probed("sft", "data.dataset_name=local", f"data.train_data_path={missing}")
    assert out.stdout.split() == ["2", "False", "False"], out
    assert f"data.train_data_path: file not found: {missing}" in out.stderr
    prompt = tmp_path / "prompt.txt"
    out = _run_probed("grpo", f"data.val_data_path={missing}", "data.dataset_name=local",
                      f"data.train_data_path={missing}")
    assert out.stdout.split() == ["2", "False", "False"] and f"data.train_data_path: file not found" in out.stderr
    out = _run_probed("grpo", f"data.prompt_file={prompt}")
    assert out.stdout.split() == ["2", "False", "False"] and f"data.prompt_file: file not found: {prompt}" in out.stderr
    out = _run_probed("grpo", f"data.mixture=[{{dataset_name: arithmetic}}, {{dataset_name: {missing}}}]")
    assert out.stdout.split() == ["2", "False", "False"], out
    assert f"data.mixture[1] ({missing}): data.dataset_name='{missing}': file not found" in out.stderr
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}\n'
                   '{"messages": 5}\n')
    out = _run("sft", f"data.dataset_name={bad}")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{bad} row 2: `messages` must be a non-empty list of messages" in out.stderr
    # A local model folder that is not there: said so, not transformers' "not a valid repo id", and
    # before the imports, as for data files.
    out = _run_probed("grpo", f"policy.model_name={tmp_path / 'no_model'}")
    assert out.stdout.split() == ["2", "False", "False"] and "Traceback" not in out.stderr, out
    assert f"policy.model_name='{tmp_path / 'no_model'}'" in out.stderr and "no such folder" in out.stderr
    out = _run_probed("dpo", "policy.model_name=embedded:tiny", "policy.tokenizer.name=./no_tokenizer",
                      f"data.dataset_name={bad}")
    assert out.stdout.split() == ["2", "False", "False"], out
    assert "policy.tokenizer.name='./no_tokenizer': cannot load a tokenizer from this local folder" in out.stderr


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    from importlib.metadata import version

    assert e.value.code == 0 and capsys.readouterr().out == f"posttrain {version('posttrain')}\n"


def _rm_exit_status(monkeypatch, run, command: str = "rm") -> int:
    """`posttrain rm`'s (or `command`'s) exit status, run in this process, when the algorithm's run() is `run`."""
    algo = type(sys)(f"posttrain.algorithms.{command}")
    algo.run = run
    monkeypatch.setitem(sys.modules, f"posttrain.algorithms.{command}", algo)
    with pytest.raises(SystemExit) as e:
        cli.main([command])
    return e.value.code


def test_input_error_raised_in_a_ray_worker_prints_the_workers_message(monkeypatch, capsys):
    from ray.exceptions import RayTaskError

    from posttrain.config import MissingInputError

    def run(cfg):
        # What RayWorkerGroup.get re-raises: Ray's wrapper, an instance of the worker's error
        # type whose own text is the remote traceback.
        try:
            raise MissingInputError("policy.model_name='/m': cannot load a model config")
        except MissingInputError as cause:
            raise RayTaskError("setup", "Traceback (most recent call last): ...", cause).as_instanceof_cause()

    assert _rm_exit_status(monkeypatch, run) == 2
    assert capsys.readouterr().err == "posttrain rm: policy.model_name='/m': cannot load a model config\n"


@pytest.mark.parametrize("raised,code", [(KeyboardInterrupt, 130), (lambda: StopAtOnce("SIGTERM"), 143),
                                        # Ray's ray.get re-raises a StopAtOnce as a plain KeyboardInterrupt
                                        (lambda: StopAtOnce("SIGTERM") and KeyboardInterrupt(), 143)])
def test_an_interrupt_outside_the_loops_signal_handling_exits_with_its_status_without_traceback(
        monkeypatch, capsys, raised, code):
    def run(cfg):  # Ctrl-C during setup or GRPO's warm-up SFT; or a second stop signal in the loop
        raise raised()

    assert _rm_exit_status(monkeypatch, run) == code
    name = "SIGINT" if code == 130 else "SIGTERM"
    assert capsys.readouterr().err == (f"posttrain rm: interrupted ({name}); stopped at once: nothing was saved "
                                       "now; checkpoints saved before, if any, stay (the same command resumes from "
                                       "the latest, or starts over without one)\n")


@pytest.mark.parametrize("signal_name", ["SIGTERM", "SIGINT"])
def test_a_stop_signal_that_an_import_turned_into_its_own_error_is_still_an_interrupt(monkeypatch, capsys,
                                                                                        signal_name):
    # A signal in the job's first second lands inside transformers' lazy imports, which re-raise
    # it as "Could not import module" (and numpy then as a RecursionError): a crash's traceback.
    def run(cfg):
        try:
            if signal_name == "SIGTERM":
                raise StopAtOnce("SIGTERM")
            raise KeyboardInterrupt
        except KeyboardInterrupt as e:
            raise ModuleNotFoundError("Could not import module 'LlamaConfig'") from e

    assert _rm_exit_status(monkeypatch, run) == (143 if signal_name == "SIGTERM" else 130)
    assert capsys.readouterr().err.startswith(f"posttrain rm: interrupted ({signal_name}); stopped at once: ")


def test_a_signal_while_the_job_exits_ends_it_with_the_runs_status_and_no_traceback():
    # The run was over; Ray's atexit shutdown (~2 s) met the stop handlers: "Exception ignored in
    # atexit callback" with a StopAtOnce traceback, and a finished run interrupted there exited 0.
    script = ("import atexit, os, signal, time\n"
              "from posttrain.checkpoint import stop_at_once_on_sigterm\n"
              "from posttrain.cli import _exit_on_signals_with\n"
              "stop_at_once_on_sigterm()\n"
              "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGTERM), time.sleep(30)))\n"
              "_exit_on_signals_with(3)\n"
              "print('done', flush=True)\n"
              "raise SystemExit(3)\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=25)
    assert (out.returncode, out.stdout, out.stderr) == (3, "done\n", "")


def test_an_interrupted_eval_says_what_it_kept(monkeypatch, capsys):
    # It said "checkpoints saved before stay": eval has none; its finished batches' samples stay.
    def run(cfg):
        raise KeyboardInterrupt

    assert _rm_exit_status(monkeypatch, run, "eval") == 130
    assert capsys.readouterr().err == ("posttrain eval: interrupted (SIGINT); stopped at once: samples.jsonl keeps "
                                       "the samples of the batches that finished; no results.json was written\n")


@pytest.mark.parametrize("in_worker", [False, True])
def test_a_documented_stop_prints_its_message_alone_and_exits_1(monkeypatch, capsys, in_worker):
    # An environment failing step after step ended the run under a 25-line traceback through the
    # loop; its message (why, what to change, what was saved) was the last line of it.
    from ray.exceptions import RayTaskError

    from posttrain.environments.actors import EnvironmentFailure

    message = "environment 'ex': every sample failed in 3 steps in a row (env.ex.max_failed_steps); step 2 is saved"

    def run(cfg):
        try:
            raise EnvironmentFailure(message)
        except EnvironmentFailure as cause:
            if in_worker:
                raise RayTaskError("step", "Traceback (most recent call last): ...", cause).as_instanceof_cause()
            raise

    assert _rm_exit_status(monkeypatch, run) == 1
    assert capsys.readouterr().err == f"posttrain rm: {message}\n"


def test_a_dead_worker_says_the_run_resumes_from_its_checkpoints(monkeypatch, capsys):
    from posttrain.distributed.worker_group import WorkerError

    def run(cfg):
        raise WorkerError("policy worker rank 0 (pid 7, node n) died: killed")

    assert _rm_exit_status(monkeypatch, run) == 1
    assert capsys.readouterr().err == ("posttrain rm: policy worker rank 0 (pid 7, node n) died: killed\nThe "
                                       "checkpoints saved before stay: the same command resumes from the latest.\n")


def test_an_unexpected_error_prints_its_traceback_and_exits_1(monkeypatch, capsys):
    # Printed by the CLI itself: Ray's excepthook would first report it to a Ray node that may be gone.
    def run(cfg):
        raise RuntimeError("policy worker rank 0 died")

    assert _rm_exit_status(monkeypatch, run) == 1
    err = capsys.readouterr().err
    assert err.startswith("Traceback (most recent call last):") and "in run" in err
    assert err.endswith("RuntimeError: policy worker rank 0 died\n")


def test_bad_command_and_option():
    assert _run("ppo").returncode == 2
    out = _run("grpo", "--bogus")
    assert out.returncode == 2 and "--bogus" in out.stderr


def test_config_given_twice_or_empty_is_a_usage_error(tmp_path, capsys):
    # The last --config alone would run (the first one's keys silently lost); an empty one (an
    # unset "$CONFIG") would run the schema defaults.
    for name in ("a", "b"):
        (tmp_path / f"{name}.yaml").write_text("sft: {max_num_steps: 3}\n")
    for argv in (["--config", str(tmp_path / "a.yaml"), f"--config={tmp_path / 'b.yaml'}"], ["--config", ""]):
        with pytest.raises(SystemExit) as e:
            cli.main(["sft", "--print-config", *argv])
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--config given twice (the last one alone would be used); a config inherits another with `defaults:`" in err
    assert "config file not found: ''" in err and "Traceback" not in err


def test_launcher_script_is_the_cli():
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "run_sft.py"), "--print-config", "sft.max_num_steps=3"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["sft"]["max_num_steps"] == 3


def test_python_dash_m_posttrain_is_the_cli():
    # For an environment whose scripts folder is not on PATH (or a checkout that is not installed).
    out = subprocess.run([sys.executable, "-m", "posttrain", "sft", "--print-config", "sft.max_num_steps=3"],
                         capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert yaml.safe_load(out.stdout)["sft"]["max_num_steps"] == 3


@pytest.fixture
def fake_modules(monkeypatch):
    """Recording stand-ins for an algorithm and a converter: these tests are about the
    dispatch (what the CLI hands over), not about training, which has its own tests."""
    calls = {}

    def run(cfg):
        calls["run"] = cfg
        return {"final_loss": 0.5}

    def convert_main(args):
        calls["convert"] = args

    algo = type(sys)("posttrain.algorithms.rm")
    algo.run = run
    conv = type(sys)("posttrain.convert.dcp_to_hf")
    conv.main = convert_main
    monkeypatch.setitem(sys.modules, "posttrain.algorithms.rm", algo)
    monkeypatch.setitem(sys.modules, "posttrain.convert.dcp_to_hf", conv)
    return calls


def test_dispatch_to_algorithm_run(fake_modules, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["rm", "rm.max_num_steps=4"])
    assert e.value.code == 0
    assert fake_modules["run"].rm.max_num_steps == 4
    assert '"final_loss": 0.5' in capsys.readouterr().out


def test_dispatch_convert(fake_modules, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "ck" / "step_3").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", "dcp-to-hf", "--checkpoint", "ck/step_3", "--output", "out"])
    assert e.value.code == 0
    args = fake_modules["convert"]
    assert (args.kind, args.checkpoint, args.output, args.config) == ("dcp-to-hf", "ck/step_3", "out", None)
    # An input that is not there is named before the converter (and torch) is imported.
    fake_modules.pop("convert")
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", "dcp-to-hf", "--checkpoint", "ck/step_4", "--output", "out"])
    assert e.value.code == 2 and "convert" not in fake_modules
    assert capsys.readouterr().err == "posttrain convert: --checkpoint ck/step_4: no such file or folder\n"


def test_convert_requires_its_arguments(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", "llama2c-to-hf", "--model", "m.bin"])
    assert e.value.code == 2
    assert "--tokenizer" in capsys.readouterr().err


def test_convert_llama2c_end_to_end(shared_data, tmp_path):
    model = Path(shared_data) / "models" / "stories260K"
    out = _run("convert", "llama2c-to-hf", "--model", str(model / "stories260K.bin"),
               "--tokenizer", str(model / "tok512.model"), "--output", str(tmp_path / "hf"))
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "hf" / "config.json").is_file()


def test_convert_llama2c_refuses_to_replace_a_folder_that_is_not_a_model(shared_data, tmp_path):
    model = Path(shared_data) / "models" / "stories260K"
    runs = tmp_path / "results"
    (runs / "run1").mkdir(parents=True)
    (runs / "run1" / "metrics.jsonl").write_text("{}\n")
    args = ["convert", "llama2c-to-hf", "--model", str(model / "stories260K.bin"), "--tokenizer",
            str(model / "tok512.model")]
    # Refused before torch and transformers are imported (~7 s of the command's start).
    out = _run_probed(*args, "--output", str(runs))
    assert out.stdout.split() == ["2", "False", "False"] and "Traceback" not in out.stderr, out
    assert f"--output {runs}: an existing folder that is not a model folder" in out.stderr
    assert (runs / "run1" / "metrics.jsonl").read_text() == "{}\n"  # nothing deleted
    # A model folder (an earlier conversion) is replaced, as documented.
    hf = tmp_path / "hf"
    assert _run(*args, "--output", str(hf)).returncode == 0
    (hf / "stale.txt").write_text("old")
    again = _run(*args, "--output", str(hf))
    assert again.returncode == 0, again.stderr
    assert (hf / "config.json").is_file() and not (hf / "stale.txt").exists()
    assert re.search(rf"--output {hf}: replacing the model folder there, with all \d+ files in it", again.stderr)
    # Nor one holding its inputs: the replacement deleted the .bin and tokenizer it had read.
    (hf / "stories260K.bin").write_bytes((model / "stories260K.bin").read_bytes())
    inside = _run("convert", "llama2c-to-hf", "--model", str(hf / "stories260K.bin"), "--tokenizer",
                  str(model / "tok512.model"), "--output", str(hf))
    assert inside.returncode == 2 and "Traceback" not in inside.stderr
    assert f"--output {hf}: holds --model {hf / 'stories260K.bin'}, which replacing the folder would delete" in inside.stderr
    assert (hf / "stories260K.bin").is_file()


def test_convert_refuses_an_output_inside_its_input_folder(tmp_path):
    # `--output <checkpoint>/policy/hf_config` replaced a folder of the checkpoint a resume reads.
    from posttrain.config import InputError
    from posttrain.convert.output import check_replaceable

    step = tmp_path / "ckpt" / "step_3"
    (step / "policy" / "hf_config").mkdir(parents=True)
    (step / "policy" / "hf_config" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(InputError, match=rf"--output {step}/policy/hf_config: is inside --checkpoint {step}, "
                                         "which writing there would change"):
        check_replaceable(step / "policy" / "hf_config", {"--checkpoint": step, "--config": None})
    check_replaceable(tmp_path / "hf", {"--checkpoint": step})  # beside it: fine


def test_convert_llama2c_names_a_tokenizer_that_is_not_sentencepiece(shared_data, tmp_path):
    model = Path(shared_data) / "models" / "stories260K"
    out = _run("convert", "llama2c-to-hf", "--model", str(model / "stories260K.bin"),
               "--tokenizer", str(model / "tok512.bin"), "--output", str(tmp_path / "hf"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert f"{model / 'tok512.bin'}: not a sentencepiece model" in out.stderr
    assert not (tmp_path / "hf").exists()


def test_device_cuda_without_cuda_is_an_input_error(tmp_path):
    import torch

    from posttrain.config import InputError
    from posttrain.runtime import resolve_device

    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    out = _run("eval", "--config", "examples/configs/evals/arithmetic.yaml", "policy.device=cuda",
               f"eval.save_path={tmp_path}", f"logger.log_dir={tmp_path}")
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert "posttrain eval: policy.device=cuda but torch sees no CUDA device" in out.stderr
    with pytest.raises(InputError, match="policy.device=cuda but torch sees no CUDA device"):  # the workers'
        resolve_device("cuda")


@pytest.mark.parametrize("computes_in_driver", [False, True], ids=["models-in-workers", "eval"])
def test_the_driver_runs_on_one_torch_thread_unless_it_computes(monkeypatch, computes_in_driver):
    """The algorithms whose models run in Ray workers get one torch thread in the driver (its
    OpenMP team would spin on the workers' cores); eval, which generates in the driver, keeps
    them; either way the process has its threads back afterwards (`main` run in process)."""
    import torch

    seen = []
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        def run(cfg):
            seen.append(torch.get_num_threads())
            return {}

        algo = type(sys)("posttrain.algorithms.rm")
        algo.run = run
        if computes_in_driver:
            algo.COMPUTES_IN_DRIVER = True
        monkeypatch.setitem(sys.modules, "posttrain.algorithms.rm", algo)
        with pytest.raises(SystemExit) as e:
            cli.main(["rm"])
        assert e.value.code == 0
        assert seen == [2 if computes_in_driver else 1]
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_eval_is_the_algorithm_that_computes_in_the_driver():
    from posttrain.algorithms import eval as eval_algo
    from posttrain.schemas import MASTER_CONFIGS

    computing = [name for name in MASTER_CONFIGS
                 if getattr(__import__(f"posttrain.algorithms.{name}", fromlist=["run"]), "COMPUTES_IN_DRIVER", False)]
    assert computing == ["eval"] and eval_algo.COMPUTES_IN_DRIVER
