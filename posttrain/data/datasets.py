"""Dataset loading: one entry point, `load_rows(data_cfg, split) -> list[dict]`.

`data.dataset_name` is, in this order:
1. a registered name (`REGISTRY`): "arithmetic" (embedded synthetic task), "gsm8k",
   "math500" (RL/eval rows), "squad", "alpaca" (SFT rows), "local" (the files named by
   `data.train_data_path` / `data.val_data_path`);
2. a local .jsonl / .json / .parquet file;
3. a Hugging Face hub dataset name (when a hub is reachable), or a folder of data files
   `datasets.load_dataset` reads (`data.dataset_kwargs` go to it), or a folder `save_to_disk`
   wrote.

Registered shared-data sets read `$POSTTRAIN_SHARED_DATA` (default: `../shared/data` beside
the project) unless `data.train_data_path` / `data.val_data_path` name other files. Relative
paths resolve against the working directory, then the project root.

Local files are read through `datasets` (arrow), each row is normalised by
`posttrain.data.formats` into a canonical row, and every error names the file and the row.
When a dataset has no validation file (or split), a seeded `data.val_split_fraction` of its
rows is held out, so "train" and "val" never share a row. `data.prompt_file` (a template with
one `{}`) wraps the first user message; `data.system_prompt_file` adds a system message to
rows that have none.
"""

from __future__ import annotations

import csv
import itertools
import json
import logging
import math
import os
import random
import string
from pathlib import Path
from typing import Any, Callable, Iterator

from posttrain.config import InputError, MissingInputError
from posttrain.data.formats import (DataFormatError, SourcedRow, detect_format, normalize_row, row_name, where,
                                    with_fields)
from posttrain.embedded import cache_root, offline_if_hub_unreachable
from posttrain.schemas import DataConfig

log = logging.getLogger(__name__)
# What `_warn_once` said in this process.
_warned: set[str] = set()


def _warn_once(msg: str, *args: Any) -> None:
    """Log a warning about a file once: a file that holds out its own validation rows is read for
    each split, and its skipped rows were reported twice."""
    text = msg % args
    if text not in _warned:
        _warned.add(text)
        log.warning(text)

SPLITS = ("train", "val", "validation")  # "validation" is an alias of "val"
_FILE_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")
# `datasets` value types that hold JSON values as written.
_JSON_VALUE_TYPES = ("string", "large_string", "int64", "bool", "null")
_PROJECT_ROOT = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------- paths


def shared_data_dir() -> Path:
    """`$POSTTRAIN_SHARED_DATA`, else `../shared/data` beside the project."""
    env = os.environ.get("POSTTRAIN_SHARED_DATA")
    return Path(env) if env else (_PROJECT_ROOT.parent / "shared" / "data")


def resolve_path(path: str | os.PathLike) -> Path:
    """A data path as given, else relative to the project root; the given one if neither exists."""
    p = Path(os.path.expanduser(str(path)))
    if p.is_absolute() or p.exists():
        return p
    under_root = _PROJECT_ROOT / p
    return under_root if under_root.exists() else p


def _existing(path: str | os.PathLike, what: str) -> Path:
    p = resolve_path(path)
    if p.is_dir():
        raise InputError(f"{what}: {path} is a folder, not a file")
    if not p.is_file():
        hint = ""
        if p.is_relative_to(shared_data_dir()):
            hint = (f"; registered datasets read $POSTTRAIN_SHARED_DATA (now {shared_data_dir()}): set it, or "
                    "name the files with data.train_data_path / data.val_data_path")
        if not p.is_absolute():  # a relative path (resolve_path returns it as given): where it was looked for
            hint = f" (looked in {' and '.join(dict.fromkeys(map(str, (Path.cwd(), _PROJECT_ROOT))))}){hint}"
        raise MissingInputError(f"{what}: file not found: {path}{hint}")
    return p


# --------------------------------------------------------------------------- raw rows from a file


def read_file(path: Path) -> tuple[list[dict[str, Any]], str, list[int]]:
    """Raw rows of a .jsonl/.json/.parquet/.csv file, the label errors use to name it, and the number
    errors give each row: its line in a JSON-lines or CSV file (whose blank lines are no rows),
    else its 1-based position.

    A JSON file whose top level is an object holding a `data` list (SQuAD) is read from that
    list (rows under another key are refused); SQuAD's official nested layout
    (data/paragraphs/qas) is flattened to one row per question.
    """
    import datasets

    suffix = path.suffix.lower()
    if suffix not in _FILE_SUFFIXES:
        raise InputError(f"{path}: unsupported data file type {suffix!r}; use one of {', '.join(_FILE_SUFFIXES)}")
    if suffix == ".csv":
        return _read_csv(path)
    kwargs: dict[str, Any] = {}
    if suffix == ".json" and _top_level_is_object_with_data(path):
        kwargs["field"] = "data"
    builder = "parquet" if suffix == ".parquet" else "json"
    if builder == "parquet" and _parquet_rows(path) == 0:  # datasets failed on it: "BatchSize must be greater than 0"
        return [], str(path), []
    # Its JSON reader logs its own error for a bad line ("in row 2", counted otherwise) before the
    # one below that names the line: quiet, so that a user reads one error.
    json_log = logging.getLogger("datasets.packaged_modules.json.json")
    level = json_log.level
    json_log.setLevel(logging.CRITICAL)
    try:
        ds = datasets.load_dataset(
            builder, data_files=str(path), split="train", cache_dir=str(cache_root() / "datasets"), **kwargs
        )
        # A JSON column of mixed types (an `answer` that is 26 in one row and "025" in another)
        # becomes a `Json` feature, which decodes its strings as JSON: "025" came back as 25, "true"
        # as True. One of integers and decimals becomes floats: 26 came back as 26.0 (the answer
        # "26.0"), 10000000000000001 as 1e16; one of dates written as strings becomes timestamps
        # (a datetime, which no format takes as text). The plain parse keeps every value as written.
        rows = None if builder == "json" and _changes_values(ds.features) else ds.to_list()
    except Exception as e:  # noqa: BLE001 - re-raised with the bad line, or replaced by a plain parse
        if builder != "json":
            raise DataFormatError(f"{path}: cannot read the file: {e}") from e
        # Invalid JSON (name the line), or rows arrow cannot give one schema (mixed types):
        # the plain parse then hands them to the row normaliser, which names the bad row.
        rows = None
    finally:
        json_log.setLevel(level)
    if rows is None:
        rows = _parse_json_rows(path, kwargs.get("field"))
    numbers = list(range(1, len(rows) + 1))
    if suffix == ".json" and "field" not in kwargs and len(rows) == 1:
        _refuse_row_holder(rows[0], path)
    if rows and isinstance(rows[0], dict) and "paragraphs" in rows[0]:
        rows = _flatten_squad(rows, path)
        numbers = list(range(1, len(rows) + 1))
    elif builder == "json" and "field" not in kwargs:
        lines = _json_line_numbers(path)
        numbers = lines if len(lines) == len(rows) else numbers
    return rows, str(path), numbers


def _read_csv(path: Path) -> tuple[list[dict[str, Any]], str, list[int]]:
    """Rows of a CSV file with a header line, each cell as written (a string; an empty one None), and
    the line each row starts on. Not through `datasets`, whose pandas reader types the columns: an
    answer "025" came back as 25."""
    rows, numbers = [], []
    # A cell may hold a whole document: the module's limit (131,072 characters) refused valid files.
    csv.field_size_limit(max(csv.field_size_limit(), 1 << 30))
    start = 1  # the line the row being read starts on, which an error names
    try:
        with open(path, encoding="utf-8-sig", newline="") as f:  # -sig: a spreadsheet's byte-order mark
            reader = csv.DictReader(f, strict=True)  # strict: an unclosed quote is an error, not the rest of the file
            header = reader.fieldnames or []  # reads the header line
            if len(set(header)) < len(header):  # DictReader keeps the last of two same-named columns
                dup = sorted({h for h in header if header.count(h) > 1})
                raise DataFormatError(f"{path} line 1: the header names {', '.join(map(repr, dup))} twice")
            start = reader.line_num + 1
            for raw in reader:
                if None in raw:  # more cells than the header has columns: malformed (skipped under skip)
                    rows.append(_UnreadableLine(f"{len(header) + len(raw[None])} cells, but the header names "
                                                f"{len(header)} columns ({', '.join(header)})"))
                    numbers.append(start)
                elif any(v for v in raw.values()):  # a line of empty cells is no row
                    rows.append({k: (v if v != "" else None) for k, v in raw.items()})
                    numbers.append(start)
                start = reader.line_num + 1
    except csv.Error as e:
        raise DataFormatError(f"{path} line {start}: cannot read the file as CSV: {e}") from None
    except UnicodeDecodeError as e:
        line = path.read_bytes()[: e.start].count(b"\n") + 1
        raise DataFormatError(f"{path} line {line}: not UTF-8 text ({e.reason} at byte {e.start}); save the file as "
                              "UTF-8") from None
    return rows, str(path), numbers


def _parquet_rows(path: Path) -> int | None:
    """The row count in a parquet file's footer; None when it is no parquet file (read_file says so)."""
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # noqa: BLE001 - not parquet, unreadable: the reader's own error names it
        return None


def _refuse_row_holder(top: Any, path: Path) -> None:
    """Stop at a .json file that is one object holding its rows under a key other than `data`
    ({"train": [...]}): read as one row of no format, it was refused as "row 1"."""
    holders = [k for k, v in top.items() if isinstance(v, list) and v and all(isinstance(x, dict) for x in v)] \
        if isinstance(top, dict) else []
    if not holders:
        return
    try:
        detect_format(top)
    except DataFormatError:
        raise DataFormatError(
            f"{path}: the file is one JSON object whose {', '.join(f'`{k}`' for k in holders)} "
            f"{'holds' if len(holders) == 1 else 'hold'} rows, not a list of rows: write them as a JSON list or JSON "
            "lines, or under the key `data`"
        ) from None


def _changes_values(feature: Any) -> bool:
    """Whether a `datasets` feature (a Features dict, a List of ..., a leaf) holds one that may give
    JSON values other than those written (see `read_file`): a `Json` one, or a leaf of another type
    than JSON's strings, integers, booleans and nulls (floats, timestamps)."""
    import datasets

    if isinstance(feature, datasets.Json):
        return True
    if isinstance(feature, datasets.Value):
        return feature.dtype not in _JSON_VALUE_TYPES
    if isinstance(feature, dict):
        return any(_changes_values(f) for f in feature.values())
    if isinstance(feature, (list, tuple)):
        return any(_changes_values(f) for f in feature)
    sub = getattr(feature, "feature", None)  # List, LargeList, Sequence
    return sub is not None and _changes_values(sub)


def _json_line_numbers(path: Path) -> list[int]:
    """The 1-based numbers of the non-blank lines of a JSON-lines file, streamed: the file may be
    larger than a second in-memory copy of its text. Empty for a file that is a JSON array."""
    numbers: list[int] = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, start=1):
            line = raw.strip()
            if not numbers and line.lstrip(b"\xef\xbb\xbf").startswith(b"["):
                return []  # one JSON array: rows are numbered by position
            if line:
                numbers.append(n)
    return numbers


def _top_level_is_object_with_data(path: Path) -> bool:
    # A peek only: bytes that are not UTF-8 are reported by `_read_text`, with their line.
    with open(path, encoding="utf-8-sig", errors="replace") as f:
        head = f.read(1 << 16).lstrip()
    if not head.startswith("{"):
        return False
    try:
        top = json.loads(_read_text(path))
    except json.JSONDecodeError:
        return False  # JSON lines in a .json file
    return isinstance(top, dict) and isinstance(top.get("data"), list)


def _read_text(path: Path) -> str:
    """The text of a data or prompt file: UTF-8, with or without the byte-order mark Windows editors write."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise DataFormatError(
            f"{path} line {line}: not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); "
            "save the file as UTF-8"
        ) from None


def _parse_json_rows(path: Path, field: str | None) -> list[Any]:
    text = _read_text(path)
    try:
        top = json.loads(text)
        return top[field] if field else (top if isinstance(top, list) else [top])
    except json.JSONDecodeError as whole_err:
        if text.lstrip().startswith("["):
            raise DataFormatError(
                f"{path} line {whole_err.lineno}: invalid JSON: {whole_err.msg}"
            ) from None
    rows: list[Any] = []
    for _, line in _json_lines(text):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as e:
            # "Unterminated string starting at" names its own position: where the string starts.
            where = f"{e.msg} column {e.colno}" if e.msg.endswith(" at") else f"{e.msg} at column {e.colno}"
            rows.append(_UnreadableLine(f"invalid JSON: {where}"))
    return rows


class _UnreadableLine:
    """A JSON-lines line that is not JSON, in its row's place: `normalize_rows` stops at it as at
    any malformed row, or skips and counts it under `data.on_malformed_row: skip` (it used to stop
    the run whatever that said)."""

    def __init__(self, error: str):
        self.error = error


def _readable(row: Any, loc: str) -> Any:
    if isinstance(row, _UnreadableLine):
        raise DataFormatError(f"{loc}: {row.error}")
    return row


def _json_lines(text: str) -> list[tuple[int, str]]:
    """The non-blank lines of JSON-lines text with their 1-based numbers. Split at "\\n" only, as
    JSON-lines readers split: `str.splitlines` also splits at U+2028 and others inside strings."""
    return [(n, line) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]


def _flatten_squad(articles: list[dict[str, Any]], path: Path) -> list[dict[str, Any]]:
    rows, unanswerable = [], 0
    for a, article in enumerate(articles, start=1):
        for paragraph in article.get("paragraphs") or []:
            for qa in paragraph.get("qas") or []:
                if qa.get("is_impossible"):
                    unanswerable += 1
                    continue
                rows.append({"context": paragraph.get("context"), "question": qa.get("question"),
                             "answers": qa.get("answers"), "id": qa.get("id")})
    if not rows:
        raise DataFormatError(f"{path}: SQuAD file holds no answerable question")
    if unanswerable:  # SQuAD v2 holds a third of them: a run on fewer rows than the file says why
        _warn_once("%s: skipped %d unanswerable SQuAD questions (is_impossible) of %d", path, unanswerable,
                    unanswerable + len(rows))
    return rows


# --------------------------------------------------------------------------- normalisation


def normalize_rows(
    raw: list[Any], source: str, cfg: DataConfig, numbers: list[int] | None = None
) -> list[dict[str, Any]]:
    """Canonical rows from raw ones (format from `data.format` or the first row's keys);
    malformed rows stop with the file and row, or are skipped and counted (`data.on_malformed_row`).
    `numbers`: each row's number in errors (`read_file`'s); null: its 1-based position."""
    if not raw:
        raise DataFormatError(f"{source}: the dataset is empty")
    raw = _rename_columns(raw, cfg.column_map, source)
    numbers = numbers or list(range(1, len(raw) + 1))
    fmt = cfg.format or _format_of_rows(raw, source, numbers, skip=cfg.on_malformed_row == "skip")
    rows, skipped, first_error = [], 0, None
    for n, r in zip(numbers, raw):
        try:
            loc = where(source, n)
            rows.append(SourcedRow(normalize_row(_readable(r, loc), fmt, loc, cfg.task_name), loc))
        except DataFormatError as e:
            if cfg.on_malformed_row == "error":
                raise
            skipped += 1
            first_error = first_error or str(e)
    if skipped:
        _warn_once("%s: skipped %d malformed %s rows of %d (first: %s)", source, skipped, fmt, len(raw), first_error)
    if not rows:
        raise DataFormatError(f"{source}: every row is malformed ({skipped} skipped); first error: {first_error}")
    return rows


def _rename_columns(raw: list[Any], mapping: dict[str, str], source: str) -> list[Any]:
    """`raw` with its columns renamed by `data.column_map` ({the data's name: posttrain's}). A name
    no row has (a typo; unless the rows have its new name), or a new name the data already uses
    for a column it keeps, is an error: either would leave the rows as they were, or lose a column,
    without a word."""
    if not mapping:
        return raw
    # `datasets` gives every row every column, None where a row has none: count only values.
    present = {k for r in raw if isinstance(r, dict) for k, v in r.items() if v is not None}
    # A file that has the new name and not the old one already uses posttrain's (a validation
    # file beside a training file of other names): that entry is not for it.
    mapping = {old: new for old, new in mapping.items() if old in present or new not in present}
    absent = [old for old in mapping if old not in present]
    if absent:
        raise InputError(f"{source}: data.column_map renames {', '.join(map(repr, absent))}, which no row has "
                         f"(its columns: {', '.join(sorted(present))})")
    taken = [f"{old!r} -> {new!r}" for old, new in mapping.items() if new in present and new not in mapping]
    if taken:
        raise InputError(f"{source}: data.column_map renames {', '.join(taken)}, a column the data already has; "
                         "rename that one too (or away), or drop the entry")
    return [{mapping.get(k, k): v for k, v in r.items()} if isinstance(r, dict) else r for r in raw]


def _format_of_rows(raw: list[Any], source: str, numbers: list[int], skip: bool) -> str:
    """The format of the first row; with `skip`, of the first row whose format can be told: a
    malformed first row (one without its answer) is skipped and counted with the others, not the
    end of the run."""
    first_error = None
    for n, r in zip(numbers, raw):
        try:
            return detect_format(_readable(r, where(source, n)), where(source, n))
        except DataFormatError as e:
            if not skip:
                raise
            first_error = first_error or e
    raise first_error


def load_file(path: str | os.PathLike, cfg: DataConfig, key: str) -> list[dict[str, Any]]:
    """Canonical rows of one local file; `key` is the config key that named it (for errors)."""
    if resolve_path(path).is_dir():  # not "file not found": it is there
        raise InputError(
            f"{key}: {path} is a folder, not a {'/'.join(_FILE_SUFFIXES)} file: name one of its files, or the "
            "folder itself as data.dataset_name (a folder of data files, or one save_to_disk wrote)"
        )
    raw, source, numbers = read_file(_existing(path, key))
    return normalize_rows(raw, source, cfg, numbers)


def _held_out(rows: list[dict[str, Any]], split: str, cfg: DataConfig, source: str) -> list[dict[str, Any]]:
    """The `split` side of a seeded train/val split of `rows` (val = `data.val_split_fraction`):
    training rows in the file's order, without copies of validation rows; validation rows in the
    seeded order."""
    n_val = max(1, math.ceil(len(rows) * cfg.val_split_fraction))
    if n_val >= len(rows):
        raise InputError(
            f"{source}: {len(rows)} rows are too few to hold out {n_val} for validation; "
            "set data.val_data_path or lower data.val_split_fraction"
        )
    order = list(range(len(rows)))
    random.Random(cfg.seed).shuffle(order)
    if split == "val":
        # In the seeded order: a cap (data.max_val_samples, grpo.max_val_samples) then takes a random
        # sample of them, not the ones nearest the top of a file sorted by subject or difficulty.
        return [rows[i] for i in order[:n_val]]
    # A row a file repeats could land on both sides, validated on after being trained on (4 of the
    # 15 rows held out of the shared glaive_toolcall demo): its copies leave training.
    held = {json.dumps(rows[i], sort_keys=True, default=str) for i in order[:n_val]}
    train = [rows[i] for i in sorted(order[n_val:]) if json.dumps(rows[i], sort_keys=True, default=str) not in held]
    if not train:
        raise InputError(f"{source}: every training row is a copy of a row held out for validation (the file repeats "
                         "one row); set data.val_data_path")
    if len(train) < len(rows) - n_val:
        log.warning("%s: left out %d training rows that are copies of validation rows", source,
                    len(rows) - n_val - len(train))
    return train


def _files(train_path: str | os.PathLike | None, val_path: str | os.PathLike | None) -> Callable:
    """A loader for a dataset stored as a train file and an optional validation file."""

    def load(cfg: DataConfig, split: str, whole: bool = False) -> list[dict[str, Any]]:
        train = cfg.train_data_path or train_path
        val = cfg.val_data_path or val_path
        if train is None and not (split == "val" and val):
            raise InputError(f"data.dataset_name={cfg.dataset_name!r} needs data.train_data_path")
        named_by = f"data.dataset_name={cfg.dataset_name!r}"
        if split == "val" and val:
            return load_file(val, cfg, "data.val_data_path" if cfg.val_data_path else f"{named_by} (validation)")
        rows = load_file(train, cfg, "data.train_data_path" if cfg.train_data_path else named_by)
        return rows if val or whole else _held_out(rows, split, cfg, str(train))

    return load


def _shared(relative: str) -> Path:
    return shared_data_dir() / relative


def _shared_files(train: str, val: str | None = None) -> Callable[..., list[dict[str, Any]]]:
    """The loader of a dataset of the shared data folder: its training file and validation file
    (relative to it; None: a held-out fraction), read when called."""
    return lambda cfg, split, whole=False: _files(_shared(train), _shared(val) if val else None)(cfg, split, whole)


def _arithmetic(cfg: DataConfig, split: str) -> list[dict[str, Any]]:
    from posttrain.data.arithmetic import make_arithmetic_rows

    train, val = make_arithmetic_rows(cfg.num_digits, cfg.operations, cfg.num_train, cfg.num_val, cfg.seed,
                                      cfg.zero_pad, cfg.demo_carry_error_rate, cfg.demo_tool_rate)
    if split == "train":
        return train
    if len(val) < cfg.num_val:
        log.info("data.num_val=%d: %d-digit %s problems allow %d held out (the rest stay for training)",
                 cfg.num_val, cfg.num_digits, "/".join(cfg.operations), len(val))
    return val


# Registered datasets whose settings are `data.dataset_kwargs` (a hub dataset's go to `datasets.load_dataset`).
_READS_DATASET_KWARGS = ("sliding_puzzle",)
# Registered datasets made from settings, which read no data files.
_GENERATED = ("arithmetic", "sliding_puzzle", "stories")
# The data keys of those settings, and the datasets that read each.
_SETTINGS_READ_BY = {
    **{key: ("arithmetic",) for key in ("num_digits", "operations", "zero_pad", "demo_carry_error_rate",
                                        "demo_tool_rate")},
    "demo_puzzle_error_rate": ("sliding_puzzle",),
    "num_train": _GENERATED,
    "num_val": _GENERATED,
}

# name -> loader(cfg, split), and for the sets read from files loader(cfg, split, whole) (see
# `load_rows`); paths are resolved when called, so POSTTRAIN_SHARED_DATA set after import still applies.
REGISTRY: dict[str, Callable[..., list[dict[str, Any]]]] = {
    "arithmetic": _arithmetic,
    "gsm8k": _shared_files("gsm8k/train.jsonl", "gsm8k/test.jsonl"),
    # MATH-500 is a test set: RL on it and evaluation both read the same 500 problems.
    "math500": _shared_files("math500/test.jsonl", "math500/test.jsonl"),
    "squad": _shared_files("squad/sample_v2_transformers_fixture.json"),
    "alpaca": _shared_files("llamafactory_demo/alpaca_en_demo.json"),
    # LLaMA-Factory's demo sets, by its names for them.
    **{name: _shared_files(f"llamafactory_demo/{name}.json")
       for name in ("dpo_en_demo", "kto_en_demo", "glaive_toolcall_en_demo")},
    "local": lambda cfg, split, whole=False: _files(None, None)(cfg, split, whole),
    "sliding_puzzle": lambda cfg, split: _sliding_puzzle(cfg, split),
    "stories": lambda cfg, split: _stories(cfg, split),
}


def _sliding_puzzle(cfg: DataConfig, split: str) -> list[dict[str, Any]]:
    """Seeded puzzles (`data.dataset_kwargs` = the puzzle settings, as `env.sliding_puzzle.cfg`);
    validation puzzles come from another seed. The training rows' demonstrations have the
    teacher's blind spot (`data.demo_puzzle_error_rate`)."""
    from posttrain.environments.sliding_puzzle import make_sliding_puzzle_rows
    from posttrain.schemas import SlidingPuzzleEnvConfig

    puzzle = SlidingPuzzleEnvConfig.model_validate(cfg.dataset_kwargs)
    if split == "train":
        return make_sliding_puzzle_rows(cfg.num_train, puzzle, cfg.seed, cfg.demo_puzzle_error_rate)
    return make_sliding_puzzle_rows(cfg.num_val, puzzle, cfg.seed + 1_000_003)


def _stories(cfg: DataConfig, split: str) -> list[dict[str, Any]]:
    from posttrain.environments.story import make_story_rows

    return make_story_rows(cfg, split)


def _folder_error(cfg: DataConfig, folder: Path, error: Exception) -> InputError:
    """Why `datasets.load_dataset` could not read a local folder of data files, naming the file: it
    says "An error occurred while generating the dataset" (its cause names a row, not the file).
    Each file read on its own names its bad line; files that each read but whose columns differ
    are listed with their columns."""
    key = f"data.dataset_name={cfg.dataset_name!r}"
    columns: dict[str, list[str]] = {}
    for path in sorted(p for p in folder.rglob("*") if p.suffix.lower() in _FILE_SUFFIXES and p.is_file()):
        try:
            rows, source, numbers = read_file(path)
            for n, row in zip(numbers, rows):
                _readable(row, where(source, n))
        except InputError as e:
            return InputError(f"{key}: the folder's file {e}")
        columns[str(path.relative_to(folder))] = sorted(rows[0]) if rows and isinstance(rows[0], dict) else []
    if len({tuple(c) for c in columns.values()}) > 1:
        listed = "; ".join(f"{name}: {', '.join(c)}" for name, c in columns.items())
        return InputError(f"{key}: the folder's files have different columns, which one dataset cannot hold ({listed})")
    cause = error
    while cause.__cause__ is not None or cause.__context__ is not None:
        cause = cause.__cause__ or cause.__context__
    return InputError(f"{key}: datasets.load_dataset cannot read the folder {folder}: {type(error).__name__}: {error}"
                      + (f" ({type(cause).__name__}: {cause})" if cause is not error else ""))


def _hub(cfg: DataConfig, split: str, whole: bool = False) -> list[dict[str, Any]]:
    """Split `split` of a hub dataset, of a folder of data files `datasets.load_dataset` reads, or
    of a folder written by `save_to_disk`: its "train" split, its "validation" (else "valid", "val",
    "dev", "eval", "test") split; a dataset without either holds out `data.val_split_fraction` of its train rows, which
    then leave the train side, as of a file (`whole`: it does not, and either split is every
    row). A folder holding one saved split is its train rows."""
    import datasets

    folder = resolve_path(cfg.dataset_name)
    if not folder.exists():  # a hub name: fails at once offline (or loads from the cache), not after retries
        offline_if_hub_unreachable()
    try:
        saved = (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()
        if saved:
            # What `save_to_disk` writes (a DatasetDict, or one Dataset), which load_dataset refuses.
            splits = datasets.load_from_disk(str(folder))
        else:
            splits = datasets.load_dataset(cfg.dataset_name, **cfg.dataset_kwargs)
    except Exception as e:  # noqa: BLE001 - offline, unknown name, a folder it cannot read: said with the cause
        if folder.is_dir():
            raise _folder_error(cfg, folder, e) from None
        raise InputError(
            f"data.dataset_name={cfg.dataset_name!r} is not a registered dataset ({', '.join(REGISTRY)}), not a "
            f"local {'/'.join(_FILE_SUFFIXES)} file, and loading it from the hub failed: {type(e).__name__}: {e}"
        ) from None
    if isinstance(splits, datasets.Dataset):
        splits = {"train": splits}
    # How errors name the rows' source: a local folder read as one, not as "hub:" (which reads as a download).
    source = str(folder) if folder.is_dir() else f"hub:{cfg.dataset_name}"
    own_files = folder.is_dir() and not saved  # a folder of data files, which read_file reads too

    def split_rows(name: str) -> list[dict[str, Any]]:
        """The canonical rows of split `name`. A folder's data files are read one by one, as a file
        is (`read_file`): errors name the file and line ("row 23" counted across the files joined,
        and a byte that is not UTF-8 failed as datasets' UnicodeDecodeError, naming neither), CSV
        cells stay as written (typed per file, a later file's "02108" came back as 2108, "NA" as
        missing) and so do JSON values ("025" came back as 25.0, 26 as 26.0 from the features
        datasets inferred)."""
        if own_files:
            # `split` is load_dataset's alone (the builder refuses it): the split it names is the rows read.
            kwargs = dict(cfg.dataset_kwargs)
            picked = kwargs.pop("split", None)
            files = datasets.load_dataset_builder(str(folder), **kwargs).config.data_files.get(
                picked if isinstance(picked, str) else name, [])
            if files and all(Path(f).suffix.lower() in _FILE_SUFFIXES for f in files):
                read = [read_file(Path(f)) for f in files]
                rows = [row for raw, label, numbers in read if raw for row in normalize_rows(raw, label, cfg, numbers)]
                if not rows:
                    raise DataFormatError(f"{source}[{name}]: the dataset is empty ({len(files)} empty files)")
                return rows
        return normalize_rows(splits[name].to_list(), f"{source}[{name}]", cfg)

    # The names datasets gives a folder's validation files, and what `save_to_disk` dicts use too.
    val_split = next((s for s in ("validation", "valid", "val", "dev", "eval", "test") if s in splits), None)
    if split == "val" and val_split is not None:
        return split_rows(val_split)
    if "train" not in splits:
        raise InputError(f"data.dataset_name={cfg.dataset_name!r} has no train split (splits: {', '.join(splits)}); "
                         f"name the one to train on, e.g. data.dataset_kwargs={{split: {next(iter(splits))}}} (a "
                         "fraction is then held out of it for validation), or give each split its files with "
                         "data.dataset_kwargs={data_files: {train: ..., test: ...}}")
    rows = split_rows("train")
    return rows if val_split is not None or whole else _held_out(rows, split, cfg, source)


# --------------------------------------------------------------------------- entry point


def _note_settings_unread(cfg: DataConfig, names: list[str]) -> None:
    """Warn (once) about settings of the generated datasets that none of the datasets `names` reads:
    data.num_train=5 with gsm8k trained on all its 7,473 rows without a word. A warning, not an
    error: a config inheriting the quickstart's arithmetic settings for data of its own is common."""
    defaults = DataConfig.model_construct()
    unread = [key for key, readers in _SETTINGS_READ_BY.items()
              if not set(names) & set(readers) and getattr(cfg, key) != getattr(defaults, key)]
    if unread:
        readers = sorted({r for key in unread for r in _SETTINGS_READ_BY[key]})
        which = f"data.dataset_name={names[0]!r} reads" if len(names) == 1 else f"data.mixture's {names} read"
        _warn_once("%s: settings of the generated datasets (%s), left unread: %s none of them (data.max_train_samples "
                   "/ data.max_val_samples cap any dataset's rows)", ", ".join(f"data.{k}={getattr(cfg, k)!r}"
                                                                          for k in unread),
                   ", ".join(readers), which)


def load_rows(cfg: DataConfig, split: str, *, in_mixture: bool = False, whole: bool = False) -> list[dict[str, Any]]:
    """Canonical rows of `split` ("train" or "val"/"validation") of the dataset `cfg` names.

    Returns SFT rows `{"messages"}`, preference rows `{"prompt_messages", "chosen",
    "rejected"}` or RL/eval rows `{"messages", "answer", "task_name", "metadata"}`, with the
    prompt and system-prompt files applied and capped at `data.max_train_samples` /
    `data.max_val_samples`. `in_mixture`: `cfg` is an entry of data.mixture (whose settings were
    looked at as a whole). `whole`: a local file, a folder or a hub dataset without a split for
    validation gives every row for either split, none held out (what eval scores).
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; valid: {', '.join(SPLITS)}")
    split = "val" if split == "validation" else split
    if cfg.mixture is not None:
        _note_settings_unread(cfg, [entry.dataset_name for entry in cfg.mixture])
        return _mixture_rows(cfg, split, whole)
    name = cfg.dataset_name
    local_file = _names_a_file(name)
    if cfg.dataset_kwargs and (local_file or name in REGISTRY) and name not in _READS_DATASET_KWARGS:
        # Left unread, keys meant to pick a file's columns or a subset changed nothing, and no error said so.
        raise InputError(
            f"data.dataset_kwargs {sorted(cfg.dataset_kwargs)}: data.dataset_name={name!r} reads none; they go to "
            "`datasets.load_dataset` for a hub dataset or a folder (e.g. {\"name\": \"full\"}) and set "
            f"{', '.join(_READS_DATASET_KWARGS)}; a file's columns are told by data.format and renamed by data.column_map. "
            "Set by a config this one inherits (defaults:), for its hub set? Drop them: '~data.dataset_kwargs'"
        )
    if not in_mixture:
        _note_settings_unread(cfg, [name])
    if cfg.column_map and name in _GENERATED:
        raise InputError(f"data.column_map: data.dataset_name={name!r} is made from its settings, with no columns "
                         "to rename")
    paths = [key for key in ("train_data_path", "val_data_path") if getattr(cfg, key)]
    if paths and not local_file and (name not in REGISTRY or name in _GENERATED):
        # Left unread, a validation file named for a hub set or the arithmetic task was not what
        # validation scored, and no error said so.
        why = ("made from its settings" if name in REGISTRY else
               "a folder: its files' names give its splits, e.g. train.jsonl and test.jsonl"
               if resolve_path(name).is_dir() else "its splits come from datasets")
        raise InputError(
            f"data.{paths[0]}: data.dataset_name={name!r} reads no data files ({why}); name the file as "
            "data.dataset_name, or set data.dataset_name=local with data.train_data_path / data.val_data_path"
        )
    if name in REGISTRY:
        # A generated set's validation rows are its own, made apart; the others' held-out ones
        # are `whole`'s to keep (dropped, "local" and the shared files held out a fraction of a
        # run that never validates, and a one-row file could not train).
        rows = REGISTRY[name](cfg, split) if name in _GENERATED else REGISTRY[name](cfg, split, whole)
    elif local_file:
        rows = _files(name, None)(cfg, split, whole)
    else:
        rows = _hub(cfg, split, whole)
    cap = cfg.max_train_samples if split == "train" else cfg.max_val_samples
    rows = rows[:cap] if cap else rows
    if cfg.task_name is not None:  # RL/eval rows (the ones with a task_name) go to this environment
        rows = [with_fields(r, task_name=cfg.task_name) if "task_name" in r else r for r in rows]
    return apply_prompts(rows, cfg)


def run_rows(cfg: DataConfig, loop: Any) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A training run's train and validation rows (`load_rows`); `loop` is its section (grpo, sft,
    ...). A run that never validates (val_period 0, neither at its start nor its end) holds
    nothing out of a file, folder or hub set, and has no validation rows: the rows held out were
    neither trained on nor validated, and a one-row file could not train."""
    if loop.val_period or loop.val_at_start or loop.val_at_end:
        return load_rows(cfg, "train"), load_rows(cfg, "val")
    return load_rows(cfg, "train", whole=True), []


def _names_a_file(name: str) -> bool:
    """Whether data.dataset_name `name` is a file of the user's (else a registered set or a hub one)."""
    return name not in REGISTRY and (resolve_path(name).suffix.lower() in _FILE_SUFFIXES or resolve_path(name).is_file())


def check_files(cfg: DataConfig) -> None:
    """Raise the error `load_rows` would, naming the key, for a file of the user's that `cfg` names
    and that is not there (a data file, data.prompt_file, data.system_prompt_file). Run before the
    algorithm's setup, it fails in a second where loading the rows fails after torch and the
    tokenizer have loaded (~7 s); the rows themselves are read and checked there."""
    if cfg.mixture is not None:
        for i, entry, sub in _mixture_entries(cfg):
            try:
                check_files(sub)
            except InputError as e:
                raise type(e)(f"data.mixture[{i}] ({entry.dataset_name}): {e}") from e
        return
    paths = {}
    if _names_a_file(cfg.dataset_name) or cfg.dataset_name == "local":  # the ones that read data.*_data_path
        if cfg.train_data_path or cfg.dataset_name == "local":
            paths["data.train_data_path"] = cfg.train_data_path
        else:
            paths[f"data.dataset_name={cfg.dataset_name!r}"] = cfg.dataset_name
        paths["data.val_data_path"] = cfg.val_data_path
    paths |= {f"data.{key}": getattr(cfg, key) for key in ("prompt_file", "system_prompt_file")}
    for key, path in paths.items():
        if path:
            _existing(path, key)


def shared_rows_note(train: list[dict[str, Any]], val: list[dict[str, Any]]) -> str | None:
    """A note when validation rows are also training rows (the same prompt, or the same whole
    row for preference data): MATH-500, a test set, is both splits of `math500`, and a file
    named as both data.train_data_path and data.val_data_path is too; the held-out numbers
    then measure fit, and nothing said so."""
    def key(row: dict[str, Any]) -> str:
        return json.dumps(row.get("messages") or row, sort_keys=True, default=str)

    seen = {key(r) for r in train}
    shared = sum(key(r) in seen for r in val)
    if not shared:
        return None
    return (f"{shared} of the {len(val)} validation rows are training rows too: the validation metrics measure "
            "fit to the training data, not generalization (set data.val_data_path to held-out rows)")


def _mixture_entries(cfg: DataConfig) -> Iterator[tuple[int, Any, DataConfig]]:
    """Each entry of data.mixture: its index, the entry, and `cfg` with the entry's keys (one dataset)."""
    for i, entry in enumerate(cfg.mixture):
        keys = {k: v for k, v in entry.model_dump(exclude={"weight"}).items() if v is not None}
        yield i, entry, cfg.model_copy(update={"mixture": None, **keys})


def _mixture_rows(cfg: DataConfig, split: str, whole: bool) -> list[dict[str, Any]]:
    """`data.mixture`: each dataset's rows as `load_rows` reads them under its own keys; training rows
    weighted (each row `int(weight)` times, plus a seeded share `weight % 1` of them once more),
    validation rows as they are, taken from the entries in turn (one of each, then the next of
    each, ...): entry after entry, a cap on them (grpo.max_val_samples, eval.max_samples) left the
    later entries unvalidated. Errors name the entry."""
    parts: list[list[dict[str, Any]]] = []
    counts = []
    for i, entry, sub in _mixture_entries(cfg):
        try:
            rows = load_rows(sub, split, in_mixture=True, whole=whole)
        except InputError as e:
            raise type(e)(f"data.mixture[{i}] ({entry.dataset_name}): {e}") from e
        if split == "train":
            times, part = divmod(entry.weight, 1.0)
            extra = random.Random(f"{cfg.seed}:{i}").sample(range(len(rows)), round(part * len(rows)))
            weighted = rows * int(times) + [rows[j] for j in sorted(extra)]
            if not weighted:
                raise InputError(f"data.mixture[{i}] ({entry.dataset_name}): weight {entry.weight} of its "
                                 f"{len(rows)} training rows leaves none; raise it")
            rows = weighted
        counts.append((entry.dataset_name, len(rows)))
        parts.append(rows)
    if split == "train":
        out = [row for rows in parts for row in rows]
    else:
        out = [row for turn in itertools.zip_longest(*parts) for row in turn if row is not None]
    log.info("data.mixture, %s rows: %s", split, ", ".join(f"{n} {c} ({c / len(out):.0%})" for n, c in counts))
    return out


def _prompt_text(path: str, key: str) -> str:
    """A prompt file's text, read as the data files are (a byte-order mark, which Windows editors
    write, went into every prompt), with its line ends read as "\n" as Python reads text files."""
    return _read_text(_existing(path, key)).replace("\r\n", "\n").replace("\r", "\n")


def apply_prompts(rows: list[dict[str, Any]], cfg: DataConfig) -> list[dict[str, Any]]:
    """Wrap each row's first user message in `data.prompt_file` and add `data.system_prompt_file`."""
    if not cfg.prompt_file and not cfg.system_prompt_file:
        return rows
    template = _prompt_text(cfg.prompt_file, "data.prompt_file") if cfg.prompt_file else None
    system = _prompt_text(cfg.system_prompt_file, "data.system_prompt_file").strip() if cfg.system_prompt_file else None
    if system == "":  # it added no system message, and said nothing
        raise InputError(f"data.system_prompt_file {cfg.system_prompt_file}: the file is empty")
    if template is not None:
        # Without a `{}` the template replaced every question with its own text, and no error said so.
        try:
            fields = [name for _, name, _, _ in string.Formatter().parse(template) if name is not None]
            problem = None if fields in ([""], ["0"]) else f"found {len(fields)} fields {fields}"
        except ValueError as e:
            problem = str(e)
        if problem:
            raise InputError(
                f"data.prompt_file {cfg.prompt_file}: must hold exactly one `{{}}` for the user message "
                f"(write literal braces as `{{{{` and `}}}}`): {problem}"
            )
    out = []
    for row in rows:
        row = with_fields(row)
        if "text" in row:  # plain text: no messages to wrap, trained as written
            given = "data.prompt_file" if template is not None else "data.system_prompt_file"
            raise InputError(f"{given}: {row_name(row, 'a row')} is plain text (`text`), which has no user message "
                             "or system prompt: it trains as written, without a chat template; unset it")
        key = "prompt_messages" if "prompt_messages" in row else "messages"
        msgs = [dict(m) for m in row[key]]
        if template is not None:
            first_user = next((m for m in msgs if m["role"] == "user"), None)
            if first_user is not None:
                first_user["content"] = template.format(first_user["content"])
        if system and msgs[0]["role"] != "system":
            msgs.insert(0, {"role": "system", "content": system})
        row[key] = msgs
        out.append(row)
    return out
