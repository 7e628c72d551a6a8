"""Config loading: YAML with `defaults:` inheritance, command-line overrides, interpolation,
and validation against the typed schemas of `posttrain.schemas`.

Override forms (the Hydra ones NeMo RL users type):
    a.b=1        set a key (the schema rejects keys that do not exist)
    +a.b=1       add a key that must not be set yet
    ++a.b=1      add or set, whatever is there
    ~a.b         remove a key (it falls back to the schema default), or a list item (`~a.0`)
    ~a.b=1       remove it only if it holds that value (else an error)
A list item is named `a.0.b` or `a[0].b`. A mapping (`a={x: 1}`) is merged into the mapping at
`a`, as in Hydra (`~a a={x: 1}` replaces it whole); any other value replaces what is there.
Values are parsed as YAML: `[1,2]`, `null`, `true`, `1e-3`, `'quoted'`. Interpolations such
as `${policy.model_name}` and `${mul:${policy.max_total_sequence_length},${grpo.seed}}`
(also unquoted inside a list or mapping, `[${grpo.seed}, 2]`) resolve after all merging,
against the config with every schema default filled in (so they may name keys the YAML does
not set).

Every problem of one config is reported in one `ConfigError`: each line names the dotted
key, where it was set (file:line or the command line), the bad value, what was expected and
the closest valid key.

This module imports only pyyaml, omegaconf and pydantic (no torch), so a bad config fails
in well under a second.
"""

from __future__ import annotations

import difflib
import functools
import logging
import os
import re
from pathlib import Path
from typing import Any, Callable, Collection, Iterable, TypeVar, get_args, get_type_hints

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

T = TypeVar("T", bound=BaseModel)

_CMDLINE = "command line"


class InputError(ValueError):
    """Bad user input (a config key or value, a file that is not there, a malformed data row),
    with a message that names the key, file or row. The CLI prints the message alone, without
    a traceback: the traceback would point into posttrain, where nothing needs fixing."""


class RunStopped(RuntimeError):
    """A condition the docs name ended the run (an environment that keeps failing, dynamic
    sampling that found nothing to train on, a checkpoint that could not be written, a worker
    that died), with a message that says why, what to change and what was saved. The CLI prints
    the message alone and exits with status 1: a traceback through the training loop would
    bury it; then `after`, what a kind of stop adds to every message."""

    after = ""


class ConfigError(InputError):
    """A config problem, with a message that names the file, line or dotted key."""


class MissingInputError(InputError, FileNotFoundError):
    """A file or folder the config names does not exist or cannot be read."""


# --------------------------------------------------------------------------- resolvers


def _num(x: Any) -> int | float:
    if isinstance(x, bool):
        raise ValueError(f"expected a number, got {x!r}")
    if isinstance(x, (int, float)):
        return x
    s = str(x).strip()
    try:
        return int(s)
    except ValueError:
        return float(s)


def _mul(*xs: Any) -> int | float:
    out: int | float = 1
    for x in xs:
        out *= _num(x)
    return out


def _add(*xs: Any) -> int | float:
    return sum(_num(x) for x in xs)


def _sub(a: Any, b: Any) -> int | float:
    return _num(a) - _num(b)


def _div(a: Any, b: Any) -> float:
    return _num(a) / _num(b)


def _floordiv(a: Any, b: Any) -> int | float:
    return _num(a) // _num(b)


def _max(*xs: Any) -> int | float:
    return max(_num(x) for x in xs)


def _min(*xs: Any) -> int | float:
    return min(_num(x) for x in xs)


def _int(a: Any) -> int:
    return int(_num(a))


# NeMo RL configs use `mul` (e.g. `${mul:${policy.max_total_sequence_length}, 4}`); the
# others cover the arithmetic people write next.
RESOLVERS = {
    "mul": _mul,
    "add": _add,
    "sub": _sub,
    "div": _div,
    "floordiv": _floordiv,
    "max": _max,
    "min": _min,
    "int": _int,
}
for _name, _fn in RESOLVERS.items():
    if not OmegaConf.has_resolver(_name):
        OmegaConf.register_resolver(_name, _fn, annotation_validation="off")


# --------------------------------------------------------------------------- YAML files


class _Loader(yaml.SafeLoader):
    """SafeLoader that also reads `1e-6` and `1.0e5` as floats.

    PyYAML follows YAML 1.1, where an exponent needs a dot and a signed exponent, so
    `lr: 1e-6` (as NeMo RL configs and users write it) would be the string "1e-6".
    """


class _Dumper(yaml.SafeDumper):
    """SafeDumper that quotes the strings `_Loader` reads as floats (`"1e5"`), so that a config
    it writes (--print-config, the run directory's config.yaml) reads back the same."""


for _cls in (_Loader, _Dumper):
    _cls.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
# YAML 1.1 reads `2024-01-01` (a run name, a description) as a date, which no config key takes
# and OmegaConf cannot hold: it failed as "Value 'date' is not a supported primitive type",
# without the line. And it reads `1:00:00:00` (checkpointing.checkpoint_must_save_by's
# DD:HH:MM:SS) or `12:30` as base-60 numbers (216000, 750: "got 216000, expected a valid
# string"), which YAML 1.2 dropped. And a zero-padded number (`0123`, a seed; `007`, a run
# name) as octal: 83, where 09 was 9, and a name "got 7". All are the text as written (the first
# matching resolver wins); a number key reads the padded one as decimal, as YAML 1.2 does.
_AS_TEXT = re.compile(r"^[-+]?(?:[0-9][0-9_]*(?::[0-5]?[0-9])+(?:\.[0-9_]*)?|0[0-9_]+)$")
_Loader.yaml_implicit_resolvers = {
    first: [("tag:yaml.org,2002:str", _AS_TEXT)] * (first is not None and first in "-+0123456789")
    + [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:timestamp"]
    for first, resolvers in _Loader.yaml_implicit_resolvers.items()
}


def _yaml_problem(e: yaml.YAMLError) -> str:
    """What PyYAML found wrong, on one line (its own text spans several, quoting the input)."""
    problem = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    return problem + (f" ({context})" if context else "")


def _yaml_load(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)  # noqa: S506 (a SafeLoader subclass)


def _read_yaml(path: Path, origins: dict[str, str]) -> dict[str, Any]:
    """Parse one file; record `dotted key -> "file:line"` in `origins`; reject duplicate keys."""
    if path.is_dir():
        raise ConfigError(f"{path} is a folder, not a config file")
    if not path.exists():  # a pipe is no regular file, but read (`--config <(...)`)
        raise ConfigError(f"config file not found: {path}{_closest_file(path)}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:  # e.g. a checkpoint or model file named by mistake
        raise ConfigError(f"{path}: cannot read the config as UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise ConfigError(f"{path}: cannot read the config: {e.strerror}") from None
    try:
        node = yaml.compose(text, Loader=_Loader)
        data = _yaml_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        raise ConfigError(f"YAML syntax error at {where}: {_yaml_problem(e)}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level of a config must be a mapping, got {type(data).__name__}")
    _walk_node(node, "", path, origins)
    return data


def _closest_file(path: Path) -> str:
    """" (did you mean <file>?)" naming the YAML file in `path`'s folder whose name is closest
    to its name (`grpo_quickstrat.yaml`), or "" when none is close or the folder is not there."""
    try:
        names = [p.name for p in path.parent.iterdir() if p.suffix in (".yaml", ".yml") and p.is_file()]
    except OSError:
        return ""
    match = difflib.get_close_matches(path.name, names, n=1, cutoff=0.75)
    return f" (did you mean {path.parent / match[0]}?)" if match else ""


def _walk_node(node: yaml.Node, prefix: str, path: Path, origins: dict[str, str]) -> None:
    if isinstance(node, yaml.MappingNode):
        seen: dict[str, int] = {}
        for key_node, value_node in node.value:
            key = str(key_node.value)
            line = key_node.start_mark.line + 1
            if key_node.tag == "tag:yaml.org,2002:null":
                # `null: 2`, `~: 2`: it failed as OmegaConf's "Incompatible key type 'NoneType'", with a
                # traceback at the top level. (A list or mapping as a key is YAML's "unhashable key".)
                raise ConfigError(f"{path}:{line}: a key under {prefix[:-1] or 'the top level'} reads as null, "
                                  "not a name; quote it if that is the name")
            if key in seen:
                raise ConfigError(
                    f"{path}:{line}: duplicate key {prefix + key!r} (first set at line {seen[key]}); "
                    "YAML would silently keep only the last one"
                )
            seen[key] = line
            origins[prefix + key] = f"{path}:{line}"
            _walk_node(value_node, f"{prefix}{key}.", path, origins)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            origins[f"{prefix[:-1]}[{i}]"] = f"{path}:{item.start_mark.line + 1}"
            _walk_node(item, f"{prefix[:-1]}[{i}].", path, origins)


def _load(path: Path, seen: tuple[Path, ...], origins: dict[str, str],
          sections: frozenset[str] = frozenset()) -> DictConfig:
    # Resolved (the `defaults:` cycle check compares files), unless that names nothing: the shell's
    # `--config <(...)` is /dev/fd/N, which resolves to a "pipe:[...]" name that is no path.
    resolved = path.resolve()
    path = resolved if resolved.exists() else path.absolute()
    if path in seen:
        chain = " -> ".join(str(p) for p in (*seen, path))
        raise ConfigError(f"`defaults:` cycle: {chain}")
    own_origins: dict[str, str] = {}
    data = _read_yaml(path, own_origins)
    parents = data.pop("defaults", None)
    if parents is None:
        parents = []
    elif isinstance(parents, str):
        parents = [parents]
    elif not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        bad = next((i for i, p in enumerate(parents) if not isinstance(p, str)), None) \
            if isinstance(parents, list) else None
        where = own_origins.get(f"defaults[{bad}]", own_origins.get("defaults", path))
        what = f" (item {bad + 1} is {parents[bad]!r})" if bad is not None else ""
        raise ConfigError(f"{where}: `defaults` must be a file path or a list of file paths{what}")
    # Relative to the file that names them; a config read from a pipe (`--config -`, `--config <(...)`,
    # /dev/stdin) has no folder of its own (/dev, /proc/...): its parents are found from the working one.
    base = path.parent if path.is_file() else Path.cwd()
    merged = OmegaConf.create({})
    for parent in parents:
        parent_path = (base / os.path.expanduser(parent)).resolve()
        if not parent_path.exists():
            raise ConfigError(
                f"{own_origins.get('defaults', path)}: `defaults` names {parent!r}, but {parent_path} does not "
                f"exist{_closest_file(parent_path)}"
                + ("" if base == path.parent else " (a config read from a pipe names its parents relative to the "
                   "working folder)")
            )
        merged = _merge_over(merged, _load(parent_path, (*seen, path), origins, sections))
    _keep_inherited_sections(data, merged, sections)
    try:
        own = OmegaConf.create(data)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {e}") from None
    # The file's own keys override its parents', so their origins do too.
    origins.update({k: v for k, v in own_origins.items() if k != "defaults"})
    return _merge_over(merged, own)


def _merge_over(base: DictConfig, over: DictConfig) -> DictConfig:
    """`over` merged onto `base`, a list where `base` has a mapping (or the reverse) replacing it, as
    a number does: OmegaConf's merge raised "Cannot merge incompatible container types" (a NeMo RL
    file's list of schedulers under a child's `scheduler: {name: ...}`) with a traceback."""
    plain = OmegaConf.to_container(base, resolve=False)

    def drop_clashes(under: Any, above: Any) -> None:
        for key, value in above.items():
            if key in under and isinstance(value, (dict, list)) and isinstance(under[key], (dict, list)):
                if type(value) is not type(under[key]):
                    del under[key]
                elif isinstance(value, dict):
                    drop_clashes(under[key], value)

    drop_clashes(plain, OmegaConf.to_container(over, resolve=False))
    return OmegaConf.merge(OmegaConf.create(plain), over)  # type: ignore[return-value]


def _keep_inherited_sections(data: dict[str, Any], inherited: DictConfig, sections: frozenset[str],
                             prefix: str = "") -> None:
    """Drop from a file's `data` the sections it leaves empty (`policy:` with nothing, or only
    comments, under it) where its parents set them: an empty section adds nothing, as one over
    the schema defaults keeps them. OmegaConf's merge put the null over the parents' mapping, and
    every key they set there fell back to the schema default without a word. `sections`: the
    dotted keys of the schema's sections (`plain_sections`); a key that may be null (a
    `data.column_map`) is none, so null still drops an inherited one."""
    for key in list(data):
        dotted, value = f"{prefix}{key}", data[key]
        there = inherited.get(key)
        if value is None and (dotted in sections or prefix + ENTRY in sections) and isinstance(there, DictConfig):
            del data[key]
        elif isinstance(value, dict) and isinstance(there, DictConfig):
            _keep_inherited_sections(value, there, sections, dotted + ".")


@functools.lru_cache(maxsize=None)
def plain_sections(schema: type[BaseModel], prefix: str = "") -> frozenset[str]:
    """The dotted keys of `schema` whose value is a section (a model) that cannot be null (cached:
    `load_config` asks for every override)."""
    keys: set[str] = set()
    for name, field in schema.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            keys.add(prefix + name)
            keys |= plain_sections(field.annotation, f"{prefix}{name}.")
    # A section of named entries, each a section (`env.<name>`): `env.<name>` stands for them all.
    entry_type = get_args(get_type_hints(schema).get("__pydantic_extra__"))[-1:]
    if entry_type and isinstance(entry_type[0], type) and issubclass(entry_type[0], BaseModel):
        keys.add(prefix.rstrip(".") + "." + ENTRY if prefix else ENTRY)
    return frozenset(keys)


def load_yaml_with_defaults(
    path: str | os.PathLike, origins: dict[str, str] | None = None, schema: type[BaseModel] | None = None
) -> DictConfig:
    """Load a YAML file, merging it over the files named by its `defaults:` key (recursively).

    `defaults` is a path or a list of paths, relative to the file that names them (to the working
    folder for a config read from a pipe; `~` is the home folder); later entries and the file
    itself override earlier ones. `path` "-" is the standard input. When `origins` is
    given it is filled with `dotted key -> "file:line"` of the file that set each key last. With
    the config's `schema`, a section a file leaves empty keeps what its parents set there.
    """
    # `~` expanded: the shell leaves it in `--config=~/x.yaml`; `-` is the standard input, as for most tools.
    path = "/dev/stdin" if str(path) == "-" else os.path.expanduser(path)
    return _load(Path(path), (), origins if origins is not None else {},
                 plain_sections(schema) if schema is not None else frozenset())


# --------------------------------------------------------------------------- overrides


def _parse_value(text: str, override: str) -> Any:
    """The YAML value of an override; interpolations stay strings that OmegaConf resolves later."""
    if text == "":
        return ""
    if text.startswith("${") and text.endswith("}"):
        return text  # a whole interpolation; `${mul: 2, 3}` would otherwise read as a YAML mapping
    try:
        node = yaml.compose(text, Loader=_Loader)
        value = _yaml_load(text)
    except yaml.YAMLError as e:
        if "${" in text:
            # Interpolations inside a list or mapping (`[${grpo.seed}, 2]`, as Hydra's grammar
            # takes them) are not YAML; else a string that OmegaConf may still read (`a ${x}: b`).
            return _parse_with_interpolations(text)
        mark = getattr(e, "problem_mark", None)
        at = f" at character {mark.index + 1}" if mark is not None else ""
        raise ConfigError(f"override {override!r}: cannot parse value {text!r} as YAML{at}: {_yaml_problem(e)}") \
            from None
    dropped = text[node.end_mark.index if node is not None else 0 :].strip()
    if dropped:  # only a comment follows a value: YAML would drop it (`run #1` is "run") without a word
        fix = "remove it"  # from a list or mapping; a string keeps it when quoted
        if node is None or isinstance(node, yaml.ScalarNode):
            fix = f"quote the value: {override.split('=', 1)[0]}={text.strip()!r}"
        raise ConfigError(f"override {override!r}: YAML reads {dropped!r} as a comment; {fix}")
    try:  # a key twice in a mapping (`{temperature: 0.5, temperature: 0.7}`) kept the last without a word
        _walk_node(node, "", Path("override"), {})
    except ConfigError as e:
        raise ConfigError(f"override {override!r}: {str(e).split(': ', 1)[1]}") from None
    if (glued := _glued_mapping_key(node)) is not None:
        # Hydra's grammar reads `{a:b}` as {a: b}; YAML as the key "a:b" without a value, which
        # the schema then named as an unknown key or a None, not why.
        key, _, value = glued.partition(":")
        raise ConfigError(f"override {override!r}: YAML reads {glued!r} as a key without a value; write "
                          f"{{{key}: {value}}} (a space after ':')")
    return value


def _glued_mapping_key(node: Any) -> str | None:
    """The first key of a flow mapping in `node` written `a:b` with no value (`{a:b}`), or None."""
    if isinstance(node, yaml.MappingNode):
        for key, value in node.value:
            if (isinstance(key, yaml.ScalarNode) and not key.style and ":" in key.value
                    and isinstance(value, yaml.ScalarNode) and value.value == "" and not value.style):
                return key.value
    if isinstance(node, (yaml.MappingNode, yaml.SequenceNode)):
        children = [n for pair in node.value for n in pair] if isinstance(node, yaml.MappingNode) else node.value
        return next((g for g in map(_glued_mapping_key, children) if g is not None), None)
    return None


_PLACEHOLDER = "__posttrain_interpolation_{}__"


def _parse_with_interpolations(text: str) -> Any:
    """`text` parsed as YAML with each `${...}` (nested ones in one piece) read as a string in
    its place; `text` itself if it is not YAML even so."""
    spans: list[str] = []
    out: list[str] = []
    i = 0
    while (start := text.find("${", i)) >= 0:
        depth, end = 0, start + 1
        while end < len(text):
            depth += {"{": 1, "}": -1}.get(text[end], 0)
            if depth == 0:
                break
            end += 1
        if depth:  # an unclosed `${`: for OmegaConf to report
            return text
        out += [text[i:start], _PLACEHOLDER.format(len(spans))]
        spans.append(text[start : end + 1])
        i = end + 1
    try:
        value = _yaml_load("".join(out) + text[i:])
    except yaml.YAMLError:
        return text
    placeholder = re.compile(_PLACEHOLDER.format(r"(\d+)"))
    return _map_strings(value, lambda s: placeholder.sub(lambda m: spans[int(m.group(1))], s), keys=True)


def _map_strings(node: Any, fn: Callable[[str], str], keys: bool = False) -> Any:
    """`node` (YAML data: dicts, lists, scalars) with `fn` applied to each string value, and
    with `keys` to each mapping key too."""
    if isinstance(node, dict):
        return {(_map_strings(k, fn, keys) if keys else k): _map_strings(v, fn, keys) for k, v in node.items()}
    if isinstance(node, list):
        return [_map_strings(v, fn, keys) for v in node]
    return fn(node) if isinstance(node, str) else node


def _key_parts(key: str) -> list[str]:
    """The segments of a dotted key; a list item may be named `a.0.b` or `a[0].b`."""
    return re.sub(r"\[(-?\d+)\]", r".\1", key).split(".")


def _find(cfg: DictConfig, parts: list[str]) -> tuple[str, bool, Any]:
    """The key of `parts` as origins and validation errors name it, list items as `a[0].b` (so
    that a value set by `a.0.b=...` is blamed on the command line, not on the file that set it),
    whether `cfg` holds it, and its value there (None if not). Not resolved: a value may
    interpolate a schema default that `cfg` does not hold."""
    key, node, found = "", OmegaConf.to_container(cfg, resolve=False), True
    for part in parts:
        if isinstance(node, list):
            if not (re.fullmatch(r"-?\d+", part) and -len(node) <= int(part) < len(node)):
                raise ConfigError(f"{key} is a list of {len(node)} items: {part!r} is not one of its indices")
            index = int(part) % len(node)  # -1: the last item
            key, node = f"{key}[{index}]", node[index]
        else:
            key = f"{key}.{part}" if key else part
            found = found and isinstance(node, dict) and part in node
            node = node.get(part) if isinstance(node, dict) else None
    return key, found, node


def _apply_one(cfg: DictConfig, ov: str, sections: frozenset[str] = frozenset()) -> list[str]:
    """Apply one override; return the dotted keys it set (none for a removal). `sections`:
    `plain_sections` of the config's schema, which refuse null."""
    if ov.startswith("~"):
        key, has_value, value_text = ov[1:].partition("=")
        parts = _key_parts(key)
        try:
            _, exists, current = _find(cfg, parts)
        except ConfigError:
            exists = False
        if not exists:
            raise ConfigError(f"override {ov!r}: cannot remove {key!r}, it is not set in the config")
        if has_value and _parse_value(value_text, ov) != current:
            # Hydra's meaning (removed only if it holds that value): it was removed whatever it held.
            raise ConfigError(f"override {ov!r}: {key} is {current!r}, not {value_text}; ~{key}=<value> removes it "
                              f"only when it holds that value, ~{key} whatever it holds")
        parent = OmegaConf.select(cfg, ".".join(parts[:-1])) if parts[:-1] else cfg
        del parent[int(parts[-1]) if isinstance(parent, ListConfig) else parts[-1]]
        return []
    if "=" not in ov:
        # `posttrain grpo my.yaml`: a config file is given with --config.
        is_file = ov.endswith((".yaml", ".yml")) or Path(ov).is_file()
        hint = f" (a config file is given as --config {ov})" if is_file else ""
        raise ConfigError(f"override {ov!r} is not of the form key=value, +key=value, ++key=value or ~key{hint}")
    key, value_text = ov.split("=", 1)
    mode = "set"
    if key.startswith("++"):
        key, mode = key[2:], "force"
    elif key.startswith("+"):
        key, mode = key[1:], "add"
    parts = _key_parts(key)
    if not all(parts):
        raise ConfigError(f"override {ov!r}: empty key")
    value = _parse_value(value_text, ov)
    try:
        # Setting a value changes no list's length: the name found now is the one it ends up at.
        name, exists, current = _find(cfg, parts)
    except ConfigError as e:
        raise ConfigError(f"override {ov!r}: {e}") from None
    if mode == "add" and exists:
        raise ConfigError(f"override {ov!r}: {key!r} is already set; use {key}=... or ++{key}=... to change it")
    if value is None and name in sections:
        # It dropped every key the config set there, for the schema defaults, without a word.
        raise ConfigError(f"override {ov!r}: {key!r} is a section and cannot be null; ~{key} resets it to the "
                          "schema defaults")
    # A mapping is merged into the mapping there, as Hydra (and so NeMo RL) does:
    # `policy.generation={temperature: 0.5}` changes that key and keeps the file's others (they
    # fell back to the schema defaults). `~key` first replaces it whole.
    merge = isinstance(value, dict) and isinstance(current, dict)
    try:
        OmegaConf.update(cfg, key, value, merge=merge, force_add=True)
    except OmegaConfBaseException as e:  # e.g. a path through a value (`a.b.c` where a.b is a number)
        raise ConfigError(f"override {ov!r}: {str(e).splitlines()[0]}") from None
    return _leaf_keys(name, value) if merge else [name]


def _leaf_keys(key: str, value: Any) -> list[str]:
    """The dotted keys below `key` that merging the mapping `value` there sets."""
    if not isinstance(value, dict):
        return [key]
    return [leaf for k, v in value.items() for leaf in _leaf_keys(f"{key}.{k}", v)]


def apply_overrides(
    cfg: DictConfig, overrides: Iterable[str], origins: dict[str, str] | None = None,
    schema: type[BaseModel] | None = None,
) -> DictConfig:
    """Apply Hydra-style overrides in order (see the module docstring); one error lists every bad
    one. With the config's `schema`, a section set to null is one."""
    problems: list[str] = []
    sections = plain_sections(schema) if schema is not None else frozenset()
    for ov in overrides:
        ov = ov.strip()
        if not ov:
            continue
        try:
            keys = _apply_one(cfg, ov, sections)
        except ConfigError as e:
            problems.append(str(e))
            continue
        for key in keys if origins is not None else ():
            for k in [k for k in origins if k == key or k.startswith(key + ".") or k.startswith(key + "[")]:
                del origins[k]
            origins[key] = f"{_CMDLINE} ({ov})"
    if problems:
        if len(problems) == 1:
            raise ConfigError(problems[0])
        raise ConfigError("bad overrides:\n  - " + "\n  - ".join(problems))
    return cfg


# --------------------------------------------------------------------------- suggestions


# Stands for the user's name of an entry in a section of named entries (`env.<name>.num_workers`).
ENTRY = "<name>"


def schema_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key a schema accepts (nested sections included; list items as `a.b.c`;
    the entries of a section of named entries as `env.<name>.num_workers`)."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        sub = _submodel(field.annotation)
        if sub is not None:
            keys.extend(schema_keys(sub, dotted + "."))
    entry = _entry_model(model)
    if entry is not None:
        keys.append(prefix + ENTRY)
        keys.extend(schema_keys(entry, f"{prefix}{ENTRY}."))
    return keys


def _entry_model(model: type[BaseModel]) -> type[BaseModel] | None:
    """The schema of the named entries of a section that takes them (typed extra keys), or None."""
    if model.model_config.get("extra") != "allow":
        return None
    return _submodel(get_type_hints(model).get("__pydantic_extra__"))


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _submodel(arg)
        if found is not None:
            return found
    return None


# Names other libraries give settings (Hugging Face Trainer and TRL configs, LLaMA-Factory, NeMo RL
# recipes of other versions): the key they were written for carries this leaf, and spelling
# matches mislead there (`lr` -> policy.lora, `per_device_train_batch_size` -> val_micro_batch_size, which
# nothing reads).
# Each leaf: posttrain's candidate keys, the first this command has (its own section of several),
# and what to know when the two differ. A leaf posttrain uses itself never gets here.
_ALGOS = ("grpo", "sft", "dpo", "kto", "rm", "eval")
_FOREIGN_KEYS: dict[str, tuple[tuple[str, ...], str]] = {
    **dict.fromkeys(("learning_rate", "lr"), (("policy.optimizer.kwargs.lr",), "")),
    "weight_decay": (("policy.optimizer.kwargs.weight_decay",), ""),
    **dict.fromkeys(("adam_beta1", "adam_beta2"), (("policy.optimizer.kwargs.betas",), "a pair, [0.9, 0.999]")),
    "adam_epsilon": (("policy.optimizer.kwargs.eps",), ""),
    **dict.fromkeys(("optim", "optimizer_type"), (("policy.optimizer.name",), "")),
    **dict.fromkeys(("per_device_train_batch_size", "micro_batch_size"), (("policy.train_micro_batch_size",), "")),
    "per_device_eval_batch_size": (("grpo.val_batch_size", "policy.logprob_batch_size"), ""),
    "gradient_accumulation_steps": (("policy.train_global_batch_size",), "the samples of one optimizer step; "
                                    "the accumulation is that over policy.train_micro_batch_size and the workers"),
    **dict.fromkeys(("num_train_epochs", "num_epochs", "epochs"), (tuple(f"{a}.max_num_epochs" for a in _ALGOS), "")),
    "max_steps": (tuple(f"{a}.max_num_steps" for a in _ALGOS), ""),
    **dict.fromkeys(("warmup_ratio", "warmup_steps", "lr_scheduler_type", "lr_scheduler"),
                    (("policy.scheduler",), "stages of torch.optim.lr_scheduler classes, e.g. a LinearLR warm-up "
                                            "then a CosineAnnealingLR (docs/config.md)")),
    **dict.fromkeys(("max_seq_length", "max_length", "cutoff_len", "model_max_length", "max_seq_len"),
                    (("policy.max_total_sequence_length",), "")),
    "max_prompt_length": (("data.max_input_seq_length",), ""),
    "max_completion_length": (("policy.generation.max_new_tokens",), ""),
    "packing": (("policy.sequence_packing.enabled",), ""),
    **dict.fromkeys(("completion_only_loss", "assistant_only_loss", "train_on_prompt", "mask_history"),
                    ((), "posttrain has no such setting: assistant turns alone get loss (of a prompt/completion "
                         "row, its completion; a message of OpenAI's weight 0, none), and plain `text` rows all")),
    "beta": (("dpo.reference_policy_kl_penalty", "kto.reference_policy_kl_penalty",
              "loss_fn.reference_policy_kl_penalty"), ""),
    "pref_beta": (("dpo.reference_policy_kl_penalty", "kto.reference_policy_kl_penalty"), ""),
    **dict.fromkeys(("loss_type", "pref_loss"), (("dpo.loss.name", "loss_fn.token_level_loss"),
                                                 "DPO's are TRL's names (those posttrain has); GRPO's TRL "
                                                 "loss_type 'grpo' is token_level_loss false, 'dapo' and 'bnpo' "
                                                 "true, 'dr_grpo' true with grpo.adv_estimator=dr_grpo "
                                                 "(docs/losses.md)")),
    **dict.fromkeys(("rpo_alpha", "pref_ftx"), (("dpo.sft_loss_weight",), "")),
    **dict.fromkeys(("num_generations", "rollout_n"), (("grpo.num_generations_per_prompt",), "")),
    **dict.fromkeys(("epsilon", "clip_ratio_low", "clip_ratio", "ratio_clip_low"), (("loss_fn.ratio_clip_min",), "")),
    **dict.fromkeys(("epsilon_high", "clip_ratio_high", "ratio_clip_high"), (("loss_fn.ratio_clip_max",), "")),
    "clip_ratio_c": (("loss_fn.ratio_clip_c",), ""),
    "importance_sampling_level": (("loss_fn.sequence_level_importance_ratios",), "true for TRL's \"sequence\" (GSPO)"),
    # verl's algorithm.kl_ctrl.kl_coef and OpenRLHF's init_kl_coef weigh a KL in the reward; TRL's
    # beta and verl's kl_loss_coef, one in the loss.
    **dict.fromkeys(("kl_coef", "init_kl_coef", "use_kl_in_reward"),
                    (("grpo.reward_kl_penalty",), "a KL term of the reward (beta; > 0 turns it on); "
                                                  "loss_fn.reference_policy_kl_penalty weighs one of the loss")),
    "kl_loss_coef": (("loss_fn.reference_policy_kl_penalty",), ""),
    **dict.fromkeys(("kl_loss_type", "kl_estimator"), (("loss_fn.reference_policy_kl_type",), "")),
    "loss_agg_mode": (("loss_fn.token_level_loss",), "true for \"token-mean\", false for \"seq-mean-token-mean\""),
    # NeMo RL keys of other versions that posttrain does without.
    **dict.fromkeys(("in_flight_weight_updates", "recompute_kv_cache_after_weight_updates"),
                    ((), "NeMo RL's async GRPO setting, not needed here: posttrain's generation takes the new weights "
                         "between steps, and grpo.async_grpo.max_trajectory_age_steps bounds how old a trajectory "
                         "may be")),
    "skip_reference_policy_logprobs_calculation": ((), "NeMo RL's; posttrain computes reference logprobs only for "
                                                       "a KL penalty (loss_fn.reference_policy_kl_penalty > 0) or a "
                                                       "distillation teacher"),
    "scale_rewards": (("grpo.normalize_rewards",), ""),
    "mask_truncated_completions": (("grpo.overlong_filtering",), ""),
    **dict.fromkeys(("model_name_or_path", "model", "model_path"), (("policy.model_name",), "")),
    "output_dir": (("logger.log_dir",), "checkpoints go to checkpointing.checkpoint_dir"),
    **dict.fromkeys(("bf16", "fp16", "torch_dtype", "dtype"), (("policy.precision",), "")),
    "save_steps": (("checkpointing.save_period",), ""),
    "save_total_limit": (("checkpointing.keep_top_k",), ""),
    "eval_steps": (tuple(f"{a}.val_period" for a in _ALGOS), ""),
    **dict.fromkeys(("dataset", "dataset_path", "data_path", "train_file"), (("data.dataset_name",), "")),
}


def foreign_key_hint(bad: str, valid: list[str]) -> str | None:
    """"posttrain's name for it: <key>[; note]" when `bad`'s last part is another library's name of
    a setting this command has (`_FOREIGN_KEYS`), its note alone for one posttrain has no need of;
    None otherwise."""
    known = _FOREIGN_KEYS.get(re.sub(r"\[\d+\]", "", bad).rsplit(".", 1)[-1])
    if known is None:
        return None
    keys, note = known
    if not keys:  # a setting of theirs that posttrain does not need
        return note
    # A key inside a dict setting (policy.optimizer.kwargs.lr) is the dict's.
    found = next((k for k in keys if k in valid or k.rpartition(".")[0] in valid), None)
    if found is None:
        return None
    return f"posttrain's name for it: {found}" + (f"; {note}" if note else "")


def suggest_key(bad: str, valid: list[str]) -> str | None:
    """The closest valid dotted key to `bad`.

    In order: the same leaf name in another section (a misplaced key, e.g.
    `grpo.max_grad_norm` -> `policy.max_grad_norm`), then a segment-by-segment fuzzy
    correction (`polcy.max_grad_nrom` -> `policy.max_grad_norm`; list items keep their index,
    `policy.scheduler[0].kwargz` -> `policy.scheduler[0].kwargs`), then the closest leaf name
    anywhere.
    """
    given, bad = bad, re.sub(r"\[\d+\]", "", bad)
    leaf = bad.rsplit(".", 1)[-1]
    by_leaf = [k for k in valid if k.rsplit(".", 1)[-1] == leaf and k != bad]
    if by_leaf:
        return max(by_leaf, key=lambda k: difflib.SequenceMatcher(None, k, bad).ratio())

    children: dict[str, list[str]] = {}
    for k in valid:
        parent, _, name = k.rpartition(".")
        children.setdefault(parent, []).append(name)
    fixed, shown = "", ""  # the schema's key (with <name>) and the same key with the user's names and indices
    for segment in given.split("."):
        part = segment.split("[", 1)[0]
        options = children.get(fixed, [])
        if part in options:
            choice = part
        elif options == [ENTRY]:  # any name is valid here
            choice = ENTRY
        else:
            match = difflib.get_close_matches(part, options, n=1, cutoff=0.6)
            if not match:
                break
            choice = match[0]
        fixed = f"{fixed}.{choice}" if fixed else choice
        name = (part if choice == ENTRY else choice) + segment[len(part):]  # `[0]`: the user's index
        shown = f"{shown}.{name}" if shown else name
    else:
        if fixed in valid and shown != given:
            return shown

    leaves: dict[str, str] = {}
    for k in valid:
        leaves.setdefault(k.rsplit(".", 1)[-1], k)
    match = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)
    return leaves[match[0]] if match else None


# --------------------------------------------------------------------------- validation


# Why a value the user wrote as a word (`yes`, `off`) reached a key as True/False.
YAML_BOOLEANS = "YAML reads true/false, yes/no, on/off as booleans"

# Tags pydantic puts in an error location for the member of a union that failed.
_TYPE_TAGS = {"int", "float", "str", "bool", "none", "dict", "list", "literal", "is-instance"}


def _loc_to_key(loc: tuple[Any, ...], schema: type[BaseModel]) -> str:
    """Dotted key of a pydantic error location, dropping union-member tags such as 'list[str]'."""
    parts: list[str] = []
    model: type[BaseModel] | None = schema
    for i, p in enumerate(loc):
        if isinstance(p, int):
            parts.append(f"[{p}]")
            continue
        field = model.model_fields.get(p) if model is not None else None
        entry = _entry_model(model) if field is None and model is not None else None
        if entry is not None:  # the user's name of an entry (env.<name>), whatever it looks like
            parts.append(("." if parts else "") + p)
            model = entry
            continue
        # The last part under a section is the user's unknown key, whatever it looks like
        # (grpo.max-num-steps was reported as "unknown key 'grpo'").
        user_key = model is not None and i == len(loc) - 1
        if field is None and not user_key and (any(c in p for c in "[]-") or p in _TYPE_TAGS):
            continue
        parts.append(("." if parts else "") + p)
        model = _submodel(field.annotation) if field is not None else None
    return "".join(parts)


def _origin_of(key: str, origins: dict[str, str]) -> str | None:
    """Where `key` (or its nearest enclosing key) was set."""
    below = [v for k, v in origins.items() if k.startswith(key + ".") or k.startswith(key + "[")]
    if key not in origins and below:
        return below[0]  # an unknown section: where its first key was set
    while key:
        if key in origins:
            return origins[key]
        parent = re.sub(r"(\.[^.\[\]]+|\[\d+\])$", "", key)
        key = "" if parent == key else parent
    return None


def _owners_hint(key: str, schema: type[BaseModel]) -> str:
    """For a top-level section of other commands only (`grpo` under `posttrain sft`): whose it is."""
    from posttrain.schemas import MASTER_CONFIGS

    commands = {cls: name for name, cls in MASTER_CONFIGS.items()}
    owners = [f"`posttrain {name}`" for cls, name in commands.items() if key in cls.model_fields]
    if schema not in commands or not owners:
        return ""
    return f" (a section of {' and '.join(owners)}, not of `posttrain {commands[schema]}`)"


def format_errors(
    err: ValidationError, schema: type[BaseModel], origins: dict[str, str] | None = None, skip: Collection[str] = (),
    prefix: str = "",
) -> list[str]:
    """One line per key of `err` (unknown keys with the closest valid one), each with where the
    key was set when `origins` says; keys in `skip` are left out. `prefix`: where `schema` sits
    in the whole config (`env.story.cfg.` for an environment's own settings)."""
    origins = origins or {}
    valid = schema_keys(schema)
    by_key: dict[str, list[dict[str, Any]]] = {}
    for e in err.errors():
        key = _loc_to_key(tuple(e["loc"]), schema)
        if key not in skip:  # already reported as an interpolation that did not resolve
            by_key.setdefault(key, []).append(e)

    def full_key(inner: str) -> str:
        return prefix + inner if inner else prefix.rstrip(".")

    def as_written(item: tuple[str, Any]) -> tuple[int, str, int]:
        # In the order the keys were written: file by file, line by line, then the command line's.
        where = _origin_of(full_key(item[0]), origins)
        path, _, line = (where or "").rpartition(":")
        if where is None or where.startswith(_CMDLINE) or not line.isdigit():
            return (1 if where else 2, "", 0)
        return (0, path, int(line))

    lines = []
    for inner, errs in sorted(by_key.items(), key=as_written):
        first, key = errs[0], full_key(inner)
        if first["type"] == "extra_forbidden":
            # A misspelt section holding one key (`polcy.max_grad_nrom=1`): the whole key is
            # suggested (policy.max_grad_norm), not the section alone and the next typo later.
            given, node = inner, first.get("input")
            while isinstance(node, dict) and len(node) == 1:
                (name, node), = node.items()
                given += f".{name}"
            owners = _owners_hint(key, schema)
            foreign = None if owners else foreign_key_hint(given, valid)
            hint = None if owners or foreign else suggest_key(given, valid) or suggest_key(inner, valid)
            leaf = str(first["loc"][-1])
            if foreign:
                msg = f"unknown key {key!r} ({foreign})"
            elif "." in leaf and hint == inner:
                # `grpo.max_num_steps: 5` in a YAML file is one key with dots in its name, not a path:
                # "did you mean grpo.max_num_steps?" named itself.
                msg = (f"unknown key {key!r}: a key with dots in a YAML file is one key, not a path; nest it "
                       f"({leaf.split('.')[0]}: {{{leaf.split('.', 1)[1]}: ...}})")
            else:
                msg = f"unknown key {key!r}" + (f" (did you mean {prefix}{hint}?)" if hint else owners)
        elif first["type"] == "invalid_key":  # `1: 2` or `yes: 1` in YAML: an int or bool key, not a name
            parent, given = prefix + _loc_to_key(tuple(first["loc"][:-1]), schema), first["input"]
            # The loader recorded its line under the key as written (`policy.yes`, `policy.1`).
            above = f"{parent}." if parent else ""
            written = [k[len(above):] for k in origins if k.startswith(above) and "." not in k[len(above):]
                       and repr(yaml.safe_load(k[len(above):])) == repr(given)]
            name = written[0] if written else str(given)
            key = f"{above}{name}"
            kind = f"a boolean ({YAML_BOOLEANS})" if isinstance(given, bool) else "a number"
            msg = f"{parent or 'top level'}: key {name!r} reads as {kind}, not a name; quote it if that is the name"
        elif first["type"] == "missing":
            msg = f"missing required key {key!r}"
        elif first["type"] in ("value_error", "assertion_error") and isinstance(first.get("input"), (dict, list)):
            # A cross-field check of a whole section: its message already names the keys, and
            # where each of them was set is what to look at, not where the section starts.
            text = first["msg"].removeprefix("Value error, ")
            # An entry's own errors (env.<name>'s, by format_errors) come whole: "unknown key 'env.math.cfg.x'"
            # or "env.math.cfg.x: got ...", not "env: " in front of them.
            nested = key and re.match(rf"unknown key '{re.escape(key)}\.[^']+'|{re.escape(key)}\.[\w.\[\]-]+: ", text)
            msg = (f"{key}: " if key and not nested else "") + text
            named = [k for k in dict.fromkeys(re.findall(r"[a-z_]+(?:\.[a-z_0-9]+)+", msg)) if k in origins]
            if named:
                lines.append(msg + "  [" + "; ".join(f"{k} set at {origins[k]}" for k in named) + "]")
                continue
        elif first["type"] == "value_error":
            # A check of one key (a field validator): its message says what is wrong with the value.
            text = first["msg"].removeprefix("Value error, ")
            msg = text if text.startswith(f"{key}=") else f"{key}: {text}"
        else:
            # A union reports one error per member: say all that would have been accepted.
            expected = " or ".join(dict.fromkeys(
                "true, false" if e["type"] in ("bool_parsing", "bool_type") else e["msg"].removeprefix("Input should be ")
                for e in errs))
            msg = f"{key or '<root>'}: got {first.get('input')!r}, expected {expected}"
            if isinstance(first.get("input"), bool):  # `name: yes`, `mode: off`: the user wrote no True
                msg += f" ({YAML_BOOLEANS}: quote the text)"
        where = _origin_of(key, origins)
        if (isinstance(first.get("input"), list) and where and where.startswith(f"{_CMDLINE} (")
                and where.split("=", 1)[-1].lstrip().startswith("-")):
            # `data.task_name=- x`, `log_dir=-`: a leading dash is a YAML list item
            msg += " (a value starting with '-' is a YAML list: quote the text)"
        lines.append(msg + (f"  [set at {where}]" if where else ""))
    return lines


def _defaults_of(schema: type[BaseModel]) -> DictConfig:
    return OmegaConf.create(schema().model_dump(mode="json"))


def _pick(user: Any, resolved: Any) -> Any:
    """Keep the user's structure (only keys the user set), with values from the resolved config."""
    if isinstance(user, dict) and isinstance(resolved, dict):
        return {k: _pick(v, resolved.get(k)) for k, v in user.items()}
    return resolved


def _interpolation_paths(node: Any, prefix: str = "") -> list[str]:
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _interpolation_paths(v, f"{prefix}{k}.")]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _interpolation_paths(v, f"{prefix[:-1]}[{i}].")]
    return [prefix[:-1]] if isinstance(node, str) and "${" in node else []


def _resolve(
    cfg: DictConfig, schema: type[BaseModel], origins: dict[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """Resolve interpolations against the config over the schema defaults.

    Returns the data and `{dotted key: problem}` for interpolations that did not resolve.
    """
    user = OmegaConf.to_container(cfg, resolve=False)
    assert isinstance(user, dict)
    paths = _interpolation_paths(user)
    if not paths:
        return user, {}
    try:
        merged = _merge_over(_defaults_of(schema), cfg)
    except (OmegaConfBaseException, ValidationError):
        # A type clash (reported better by the schema) or a schema with required keys:
        # resolve against the given config alone.
        merged = cfg
    problems = {}
    for path in paths:
        try:
            OmegaConf.select(merged, path, throw_on_resolution_failure=True)
        except OmegaConfBaseException as e:
            where = _origin_of(path, origins)
            reason = str(e).splitlines()[0]
            problems[path] = f"{path}: cannot resolve the interpolation: {reason}"
            if where:
                problems[path] += f"  [set at {where}]"
    if problems:
        return user, problems
    resolved = OmegaConf.to_container(merged, resolve=True)
    return _pick(user, resolved), {}


def validate(
    cfg: DictConfig | dict[str, Any],
    schema: type[T],
    source: str = "config",
    origins: dict[str, str] | None = None,
    prior_problems: Iterable[str] = (),
) -> T:
    """Resolve interpolations and validate against `schema`, raising one ConfigError listing every problem."""
    origins = origins or {}
    problems = list(prior_problems)
    unresolved: dict[str, str] = {}
    if isinstance(cfg, (DictConfig, ListConfig)):
        data, unresolved = _resolve(cfg, schema, origins)  # type: ignore[arg-type]
        problems += unresolved.values()
    else:
        data = cfg
    result = None
    try:
        result = schema.model_validate(data)
    except ValidationError as e:
        problems += format_errors(e, schema, origins, set(unresolved))
    if problems or result is None:
        raise ConfigError(f"invalid config ({source}):\n" + "\n".join(f"  - {p}" for p in problems))
    return result


def load_config(
    algorithm: str, config_path: str | os.PathLike | None = None, overrides: Iterable[str] = ()
) -> BaseModel:
    """Load, merge, override and validate the config of `algorithm` ('grpo', 'sft', ...)."""
    from posttrain.schemas import MASTER_CONFIGS

    if algorithm not in MASTER_CONFIGS:
        raise ConfigError(f"unknown algorithm {algorithm!r}; valid: {', '.join(MASTER_CONFIGS)}")
    if config_path is not None and not str(config_path):  # e.g. an unset "$CONFIG": not the defaults
        raise ConfigError("config file not found: '' (an empty path)")
    overrides = list(overrides)
    origins: dict[str, str] = {}
    schema = MASTER_CONFIGS[algorithm]
    cfg = load_yaml_with_defaults(config_path, origins, schema) if config_path is not None else OmegaConf.create({})
    override_problems: list[str] = []
    for ov in overrides:
        # One at a time so that every bad override is reported along with the schema's errors.
        try:
            apply_overrides(cfg, [ov], origins, schema)
        except ConfigError as e:
            override_problems.append(str(e))
    source = {None: "schema defaults", "-": "standard input"}.get(str(config_path) if config_path else None,
                                                                   str(config_path))
    if overrides:
        source += " + overrides"
    result = validate(cfg, schema, source, origins, override_problems)
    from posttrain.schemas import unread_settings

    for keys, why in unread_settings(result):
        named = ", ".join(k + (" (command line)" if origins.get(k, "").startswith(_CMDLINE) else
                               f" (set at {origins[k]})" if k in origins else "") for k in keys)
        logging.getLogger(__name__).warning("%s: %s, so %s nothing", named, why,
                                            "it changes" if len(keys) == 1 else "they change")
    return result


def _escape_interpolations(node: Any) -> Any:
    """`node` with every `${` in its strings escaped as OmegaConf reads it back literally: a
    resolved value may hold one (`\\${x}` in the YAML is the text `${x}`), which the loader
    would otherwise take for an interpolation. Backslashes right before a `${` are doubled, as
    OmegaConf reads `\\\\` there as one backslash."""
    return _map_strings(node, lambda s: re.sub(r"(\\*)\$\{", lambda m: m.group(1) * 2 + "\\${", s))


def to_yaml(config: BaseModel | dict[str, Any]) -> str:
    """The fully resolved config (every default filled in, or its `model_dump(mode="json")`) as
    YAML that `load_config` reads back the same, for the run directory. Non-ASCII text stays as
    it is (a Chinese system prompt, not "\\u7CFB..."): write it as UTF-8, as the loader reads."""
    data = config.model_dump(mode="json") if isinstance(config, BaseModel) else config
    return yaml.dump(_escape_interpolations(data), Dumper=_Dumper, sort_keys=False, allow_unicode=True)
