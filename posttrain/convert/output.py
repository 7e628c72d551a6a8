"""Writing a model folder (an export, a conversion) without losing what was there: a folder named
as the output is replaced whole, so one that is not a model folder, or one holding the
conversion's inputs, is refused first; the new model is written beside it and renamed into place.
No torch here: the `posttrain convert` command checks its --output before importing it."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator

from posttrain.config import InputError

log = logging.getLogger(__name__)


def check_replaceable(out: Path, inputs: dict[str, Path | str | None] | None = None) -> None:
    """A model folder named by `--output` is replaced as a whole: refuse one that is not a model
    folder (a `--output results` meant as `results/stories260K-hf` would delete every run in it),
    and one that holds an input of the conversion (`inputs`: {option: path}), which the
    replacement deleted after reading it."""
    for option, given in (inputs or {}).items():
        if given is not None and Path(given).resolve().is_relative_to(out.resolve()):
            raise InputError(f"--output {out}: holds {option} {given}, which replacing the folder would delete; "
                             "write the model into another folder")
        if given is not None and Path(given).is_dir() and out.resolve().is_relative_to(Path(given).resolve()):
            # `--output <checkpoint>/policy/hf_config` replaced a folder the checkpoint's resume reads.
            raise InputError(f"--output {out}: is inside {option} {given}, which writing there would change; "
                             "write the model into another folder")
    if not out.exists():
        # Its folders are made at the end, after the conversion's work: a file among them fails now.
        blocking = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
        if blocking is not None:
            raise InputError(f"--output {out}: {blocking} is a file, not a folder")
        return
    if not out.is_dir():
        raise InputError(f"--output {out}: exists and is not a folder")
    if any(out.iterdir()) and not _is_model_folder(out):
        raise InputError(f"--output {out}: an existing folder that is not a model folder (no config.json of a "
                         "model), which the converter would replace with all its contents; name a new or empty "
                         "folder, or a model folder to replace")
    if any(out.iterdir()):  # said before the work, not after: every file in it goes, not only the model's
        log.warning("--output %s: replacing the model folder there, with all %d files in it", out,
                    sum(1 for p in out.rglob("*") if p.is_file()))


def _is_model_folder(folder: Path) -> bool:
    """Whether `folder` holds a transformers model (config.json with a model_type) or a PEFT adapter
    (adapter_config.json with a peft_type): any config.json (an app's, a project's) was taken for
    one, and the folder replaced whole."""
    for name, key in (("config.json", "model_type"), ("adapter_config.json", "peft_type")):
        try:
            data = json.loads((folder / name).read_text())
        except (OSError, ValueError):
            continue
        if isinstance(data, dict) and key in data:
            return True
    return False


@contextlib.contextmanager
def writing_folder(out: Path) -> Iterator[Path]:
    """A temp folder beside `out` to write a model into; when the block ends without an error it
    replaces `out` whole, else it is removed. No file of an earlier model in `out` stays beside
    the new one (a sharded index, full weights beside an adapter), and a crash mid-write leaves
    the earlier model intact."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    old = tmp.with_name(tmp.name + "-old")
    try:
        yield tmp
        os.chmod(tmp, 0o755)  # mkdtemp's folder is private; a model folder is an ordinary one
        # The earlier model moves aside by renames only and is deleted once the new one is in
        # place: deleting it first, a failure part way (a file that cannot be removed) lost both.
        if out.exists():
            os.rename(out, old)
        try:
            os.rename(tmp, out)
        except OSError:
            if old.exists():
                os.rename(old, out)
            raise
    finally:
        for leftover in (tmp, old):
            if leftover.exists():
                shutil.rmtree(leftover, ignore_errors=True)
