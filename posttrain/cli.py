"""The `posttrain` command.

    posttrain <grpo|sft|dpo|rm|kto|eval> [--config FILE] [--print-config] [overrides...]
    posttrain convert dcp-to-hf --checkpoint DIR --output DIR [--config FILE]
    posttrain convert llama2c-to-hf --model X.bin --tokenizer tok512.model --output DIR

The config is loaded and validated before torch, transformers or Ray are imported (they
come with `posttrain.algorithms.<algo>`, imported only after validation), so a typo in a
key fails in well under a second. Bad input (`InputError`: a config key or value, a missing
file or model, a malformed data row, also when a Ray worker finds it) prints its message
alone, without a traceback, and exits with status 2; so does a stop the docs name (`RunStopped`:
an environment that keeps failing, dynamic sampling exhausted, a failed checkpoint save, a dead
worker), with status 1.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import threading
import traceback
from typing import Any, Sequence

from posttrain.config import InputError, RunStopped, load_config, to_yaml
from posttrain.schemas import MASTER_CONFIGS, DataConfig, PolicyConfig

DOCS = "docs/config.md"
EXIT_INPUT_ERROR = 2

_ALGO_HELP = {
    "grpo": "GRPO-family RL (GRPO, DAPO, GSPO, Dr.GRPO; single and multi-turn)",
    "sft": "supervised fine-tuning",
    "dpo": "direct preference optimisation (DPO, cDPO, rDPO, IPO, SLiC, SimPO, ORPO)",
    "rm": "reward-model training (Bradley-Terry)",
    "kto": "Kahneman-Tversky optimisation on responses labelled desirable or not",
    "eval": "evaluation (pass@k, cons@k)",
}

_OVERRIDE_HELP = """\
overrides (Hydra style, as in NeMo RL):
  a.b=1          set a key                       policy.max_grad_norm=0.5
  +a.b=1         add a key that is not set yet   +policy.generation.top_k=50
  ++a.b=1        add or set                      ++logger.wandb.name=run1
  ~a.b           remove a key the --config file  ~grpo.max_num_steps
                 sets (back to the default)
  values are YAML: [1,2], null, true, 1e-3, {x: 1} (merged into the mapping there);
  interpolation: ${policy.model_name}, ${mul:${policy.max_total_sequence_length},2}
"""


def _sections_help(algorithm: str | None) -> str:
    """The config sections (from `posttrain.schemas`) of one algorithm, or of all of them."""
    algos = [algorithm] if algorithm else list(MASTER_CONFIGS)
    lines = ["config sections:"]
    sections: dict[str, list[str]] = {}
    for algo in algos:
        for name, field in MASTER_CONFIGS[algo].model_fields.items():
            sections.setdefault(name, []).append(algo)
    for name, used_by in sections.items():
        annotation = MASTER_CONFIGS[used_by[0]].model_fields[name].annotation
        sub = getattr(annotation, "model_fields", None)
        if sub:
            keys = ", ".join(sub)
        elif sub is not None:  # a section of user-named entries (env.<name>.*)
            keys = f"{name}.<name>.<key>: one entry per name"
        else:
            keys = "(a single value)"
        if len(keys) > 70:
            keys = keys[:67].rsplit(",", 1)[0] + ", ..."
        scope = "" if algorithm or len(used_by) == len(algos) else f" [{', '.join(used_by)}]"
        lines.append(f"  {name:<14}{keys}{scope}")
    lines.append(f"every key, its default and meaning: {DOCS}")
    return "\n".join(lines)


def _top_parser() -> argparse.ArgumentParser:
    commands = "\n".join(f"  {a:<14}{h}" for a, h in _ALGO_HELP.items())
    commands += "\n  convert       checkpoint conversion (dcp-to-hf, llama2c-to-hf)"
    return argparse.ArgumentParser(
        prog="posttrain",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="posttrain <command> [--config FILE] [--print-config] [overrides...]",
        description="Post-training for language models, from a laptop CPU to a GPU cluster.",
        epilog=f"commands:\n{commands}\n\n{_sections_help(None)}\n\n{_OVERRIDE_HELP}"
        "\n`posttrain <command> --help` lists that command's sections; `posttrain --version` prints the version.",
    )


class _Once(argparse.Action):
    """An option given at most once: argparse would keep the last `--config` and drop the others."""

    def __call__(self, parser, namespace, values, option_string=None):  # type: ignore[no-untyped-def]
        if getattr(namespace, self.dest) is not None:
            parser.error(f"{option_string} given twice (the last one alone would be used); "
                         "a config inherits another with `defaults:`")
        setattr(namespace, self.dest, values)


def _algo_parser(algorithm: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"posttrain {algorithm}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_ALGO_HELP[algorithm],
        epilog=f"{_sections_help(algorithm)}\n\n{_OVERRIDE_HELP}",
    )
    # DPO and RM need preference pairs, KTO labelled responses, which the embedded task has not.
    data = "labelled responses" if algorithm == "kto" else "preference pairs"
    without = ("without it the schema defaults run the embedded task" if algorithm in ("grpo", "sft", "eval")
               else f"needed: the embedded task has no {data} (see examples/configs/{algorithm}.yaml)")
    p.add_argument("--config", metavar="FILE", action=_Once,
                   help=f"YAML config, - for the standard input (may inherit others with `defaults:`); {without}")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as YAML and exit")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides (see below)")
    return p


def _convert_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="posttrain convert", description="Convert checkpoints to Hugging Face format.")
    sub = p.add_subparsers(dest="kind", required=True, metavar="{dcp-to-hf,llama2c-to-hf}")
    dcp = sub.add_parser("dcp-to-hf", help="a posttrain step_N checkpoint (torch.distributed.checkpoint) -> HF folder")
    dcp.add_argument("--checkpoint", required=True, help="a step_N directory (or its policy/ folder)")
    dcp.add_argument("--output", required=True, help="output folder (a model folder there is replaced)")
    dcp.add_argument("--config", default=None, help="the run's config, read only for a checkpoint without "
                     "hf_config/ (default: the checkpoint's config.yaml)")
    l2c = sub.add_parser("llama2c-to-hf", help="a llama2.c .bin model + sentencepiece tokenizer -> HF Llama folder")
    l2c.add_argument("--model", required=True, help="llama2.c checkpoint (.bin)")
    l2c.add_argument("--tokenizer", required=True, help="sentencepiece model (e.g. tok512.model)")
    l2c.add_argument("--output", required=True, help="output directory (a model folder there is replaced)")
    return p


def _split_overrides(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse options anywhere on the line; everything else is an override (`~a.b` and `+a=1` included)."""
    args, rest = parser.parse_known_args(argv)
    unknown = [a for a in rest if a.startswith("-")]
    if unknown:
        parser.error(f"unrecognized option(s): {' '.join(unknown)}")
    args.overrides = list(args.overrides) + rest
    return args


def _setup_logging() -> None:
    """Show posttrain's INFO messages (rows dropped, resumes, caps...); other libraries keep their defaults."""
    import logging

    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s: %(message)s", "%H:%M:%S"))
    root = logging.getLogger("posttrain")
    root.setLevel(logging.INFO)
    root.addHandler(handler)
    root.propagate = False


def _run_algorithm(algorithm: str, argv: Sequence[str], supervise: bool) -> int:
    args = _split_overrides(_algo_parser(algorithm), argv)
    _setup_logging()  # before the config loads: it warns of settings the run leaves unread
    cfg = load_config(algorithm, args.config, args.overrides)
    if args.print_config:
        try:
            sys.stdout.write(to_yaml(cfg))
            sys.stdout.flush()
        except OSError as e:
            # Python's flush at exit would fail again (a traceback after ours): stdout goes nowhere now.
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            if isinstance(e, BrokenPipeError):  # `| head`: the reader has what it wanted
                return 0
            print(f"posttrain {algorithm}: --print-config could not write to standard output: {e}", file=sys.stderr)
            return 1
        return 0
    # A data file or local model folder that is not there fails here, in a second, not after the imports.
    if isinstance(getattr(cfg, "data", None), DataConfig):
        from posttrain.data.datasets import check_files

        check_files(cfg.data)
    if isinstance(policy := getattr(cfg, "policy", None), PolicyConfig):
        from posttrain.embedded import check_local_model

        for key, name, what in (("policy.model_name", policy.model_name, "a model"),
                                ("policy.tokenizer.name", policy.tokenizer.name, "a tokenizer"),
                                ("policy.reference_model_name", policy.reference_model_name, "a model")):
            if name:
                check_local_model(key, name, what)
    if supervise:  # so that a signal to our process group spares the Ray node (see its docstring)
        from posttrain.runtime import supervise_in_own_session

        supervise_in_own_session()
    from posttrain.checkpoint import stop_at_once_on_sigterm

    # A SIGTERM while the data loads ended the job with no word of what was stopped or kept.
    stop_at_once_on_sigterm()
    import importlib

    from posttrain.runtime import single_threaded_driver

    module = importlib.import_module(f"posttrain.algorithms.{algorithm}")
    # Only `posttrain eval` computes in this process (it generates here); the others hand every
    # model pass to Ray workers, and the driver's own torch threads would compete with theirs.
    with contextlib.nullcontext() if getattr(module, "COMPUTES_IN_DRIVER", False) else single_threaded_driver():
        result: dict[str, Any] = module.run(cfg)
    print(json.dumps({"result": result}, default=str))
    from posttrain.checkpoint import STOPPED_BY_SIGNAL

    # Ended early by SIGTERM/SIGINT (after saving): the status the shell gives a command it killed.
    stopped = result.get(STOPPED_BY_SIGNAL)
    return 128 + signal.Signals[stopped].value if stopped else 0


def _run_convert(argv: Sequence[str]) -> int:
    args = _convert_parser().parse_args(argv)
    # Inputs that are not there fail before torch is imported (13-25 s on a loaded machine).
    inputs = {"--checkpoint": args.checkpoint, "--config": args.config} if args.kind == "dcp-to-hf" else \
        {"--model": args.model, "--tokenizer": args.tokenizer}
    from posttrain.config import MissingInputError

    for option, path in inputs.items():
        if path is not None and not os.path.exists(os.path.expanduser(path)):
            raise MissingInputError(f"{option} {path}: no such file or folder")
    import importlib

    _setup_logging()
    module = importlib.import_module(
        {"dcp-to-hf": "posttrain.convert.dcp_to_hf", "llama2c-to-hf": "posttrain.convert.llama2c"}[args.kind]
    )
    module.main(args)
    return 0


def main(argv: Sequence[str] | None = None, supervise: bool | None = None) -> None:
    """Entry point of `posttrain` (and of the thin launchers in examples/). With `supervise`
    (default: when `argv` is taken from sys.argv, i.e. run as the program), an algorithm's job
    runs in a child process of its own session under this one
    (`runtime.supervise_in_own_session`); otherwise in this process."""
    from posttrain.checkpoint import mark_run_start, take_stop_at_once

    mark_run_start()  # checkpointing.checkpoint_must_save_by counts from here
    if supervise is None:
        supervise = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    top = _top_parser()
    if not argv or argv[0] in ("-h", "--help"):
        top.print_help()
        sys.exit(0 if argv else EXIT_INPUT_ERROR)
    if argv[0] in ("-V", "--version"):
        from importlib.metadata import version

        print(f"posttrain {version('posttrain')}")
        sys.exit(0)
    command, rest = argv[0], argv[1:]
    take_stop_at_once()  # one an earlier run in this process stopped with is not this run's
    try:
        if command in MASTER_CONFIGS:
            code = _run_algorithm(command, rest, supervise)
        elif command == "convert":
            code = _run_convert(rest)
        else:
            top.error(f"unknown command {command!r}; choose from {', '.join([*MASTER_CONFIGS, 'convert'])}")
    except InputError as e:
        # Raised in a Ray worker, it arrives as Ray's wrapper (an instance of both) whose text
        # is the worker's traceback: print the worker's own message.
        print(f"posttrain {command}: {getattr(e, 'cause', None) or e}", file=sys.stderr)
        code = EXIT_INPUT_ERROR
    except RunStopped as e:  # its message says why and what was saved; as for InputError, Ray's wrapper has `cause`
        print(f"posttrain {command}: {getattr(e, 'cause', None) or e}" + (f"\n{e.after}" if e.after else ""),
              file=sys.stderr)
        code = 1
    except KeyboardInterrupt as e:
        # Ctrl-C or SIGTERM before the training loop takes signals (setup, GRPO's warm-up SFT) or a
        # second stop signal inside it: stop at once, as asked, without a traceback. The loop's first
        # SIGINT/SIGTERM never gets here: it saves and returns (see CheckpointManager.stop_on_signals).
        # checkpoint.StopAtOnce names its signal (also when Ray re-raised it as a plain KeyboardInterrupt)
        code = _stopped_at_once(command, getattr(e, "signal_name", None) or take_stop_at_once() or "SIGINT")
    except Exception as e:  # noqa: BLE001
        # A stop signal inside an import (the first second of a job) came out as the import's error:
        # a RecursionError in numpy's __getattr__ over transformers' "Could not import module".
        from posttrain.checkpoint import exception_chain

        name = take_stop_at_once() or next(
            ("SIGINT" for x in exception_chain(e) if isinstance(x, KeyboardInterrupt)), None)
        if name:
            code = _stopped_at_once(command, name)
        else:
            # Printed here, not by Ray's excepthook, which first reports the error to the Ray node and,
            # when that node is gone, blocks for 60 s and is then aborted without printing anything.
            traceback.print_exc()
            code = 1
    if supervise:
        _exit_on_signals_with(code)
    sys.exit(code)


def _stopped_at_once(command: str, name: str) -> int:
    kept = ("samples.jsonl keeps the samples of the batches that finished; no results.json was written"
            if command == "eval" else "nothing was saved now; checkpoints saved before, if any, stay (the same command "
            "resumes from the latest, or starts over without one)")
    print(f"posttrain {command}: interrupted ({name}); stopped at once: {kept}", file=sys.stderr)
    return 128 + signal.Signals[name].value


def _exit_on_signals_with(code: int) -> None:
    """From now on a SIGINT or SIGTERM ends the process at once with `code`, the run's own status:
    the run is over, and what remains is Ray's shutdown at exit (about 2 s), through which the
    stop handlers raised StopAtOnce: "Exception ignored in atexit callback" with a traceback, and
    a completed run interrupted there exited 0 or said "nothing was saved". The supervisor
    (`runtime.supervise_in_own_session`) kills what the job leaves in its process group."""
    if threading.current_thread() is not threading.main_thread():
        return

    def leave(_signum: int, _frame: Any) -> None:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)

    for s in (signal.SIGINT, signal.SIGTERM):
        signal.signal(s, leave)


if __name__ == "__main__":
    main()
