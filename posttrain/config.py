"""Config loading: YAML with `defaults:` inheritance, command-line overrides, interpolation,
and validation against the typed schemas of `posttrain.schemas`.

Override forms (the Hydra ones NeMo RL users type):
    a.b=1        set a key (the schema rejects keys that do not exist)
    +a.b=1       add a key that must not exist yet
    ++a.b=1      add or set, whatever is there
    ~a.b         remove a key (it falls back to the schema default)
Values are parsed as YAML: `[1,2]`, `null`, `true`, `1e-3`, `'quoted'`; interpolations such
as `${policy.model_name}` and `${mul:${a},${b}}` resolve after all merging.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Iterable, TypeVar

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ValidationError

T = TypeVar("T", bound=BaseModel)


class ConfigError(ValueError):
    """A config problem, with a message that names the file, line or dotted key."""


def _register_resolvers() -> None:
    resolvers = {
        "mul": lambda *a: _num(a[0]) * (_num(a[1]) if len(a) == 2 else _prod(a[1:])),
        "add": lambda *a: sum(_num(x) for x in a),
        "sub": lambda a, b: _num(a) - _num(b),
        "div": lambda a, b: _num(a) / _num(b),
        "floordiv": lambda a, b: _num(a) // _num(b),
        "max": lambda *a: max(_num(x) for x in a),
        "min": lambda *a: min(_num(x) for x in a),
        "int": lambda a: int(_num(a)),
    }
    for name, fn in resolvers.items():
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn)


def _num(x: Any) -> int | float:
    if isinstance(x, (int, float)):
        return x
    s = str(x).strip()
    try:
        return int(s)
    except ValueError:
        return float(s)


def _prod(xs: Iterable[Any]) -> int | float:
    out: int | float = 1
    for x in xs:
        out *= _num(x)
    return out


_register_resolvers()


# --------------------------------------------------------------------------- YAML files


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"config file not found: {path}")
    text = path.read_text()
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
        problem = getattr(e, "problem", None) or str(e)
        raise ConfigError(f"YAML syntax error at {where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level of a config must be a mapping, got {type(data).__name__}")
    return data


def load_yaml_with_defaults(path: str | os.PathLike, _seen: tuple[Path, ...] = ()) -> DictConfig:
    """Load a YAML file, merging it over the files named by its `defaults:` key (recursively).

    `defaults` is a path or a list of paths, relative to the file that names them; later
    entries and the file itself override earlier ones.
    """
    path = Path(path).resolve()
    if path in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, path))
        raise ConfigError(f"`defaults:` cycle: {chain}")
    data = _read_yaml(path)
    parents = data.pop("defaults", None)
    if parents is None:
        parents = []
    elif isinstance(parents, str):
        parents = [parents]
    elif not isinstance(parents, list) or not all(isinstance(p, str) for p in parents):
        raise ConfigError(f"{path}: `defaults` must be a file path or a list of file paths")
    merged = OmegaConf.create({})
    for parent in parents:
        parent_path = (path.parent / parent).resolve()
        if not parent_path.is_file():
            raise ConfigError(f"{path}: `defaults` names {parent!r}, but {parent_path} does not exist")
        merged = OmegaConf.merge(merged, load_yaml_with_defaults(parent_path, (*_seen, path)))
    try:
        own = OmegaConf.create(data)
    except OmegaConfBaseException as e:
        raise ConfigError(f"{path}: {e}") from None
    return OmegaConf.merge(merged, own)  # type: ignore[return-value]


# --------------------------------------------------------------------------- overrides


def _parse_value(text: str, override: str) -> Any:
    if "${" in text:
        return text  # an interpolation: OmegaConf resolves it after merging
    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override {override!r}: cannot parse value {text!r}: {e}") from None


def apply_overrides(cfg: DictConfig, overrides: Iterable[str]) -> DictConfig:
    """Apply Hydra-style overrides in order; see the module docstring for the forms."""
    for ov in overrides:
        ov = ov.strip()
        if not ov:
            continue
        if ov.startswith("~"):
            key = ov[1:].split("=", 1)[0]
            parent_key, _, leaf = key.rpartition(".")
            parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
            if not isinstance(parent, DictConfig) or leaf not in parent:
                raise ConfigError(f"override {ov!r}: cannot remove {key!r}, it is not set in the config")
            del parent[leaf]
            continue
        if "=" not in ov:
            raise ConfigError(f"override {ov!r} is not of the form key=value, +key=value, ++key=value or ~key")
        key, value_text = ov.split("=", 1)
        mode = "set"
        if key.startswith("++"):
            key, mode = key[2:], "force"
        elif key.startswith("+"):
            key, mode = key[1:], "add"
        if not key or any(not part for part in key.split(".")):
            raise ConfigError(f"override {ov!r}: empty key")
        value = _parse_value(value_text, ov)
        exists = OmegaConf.select(cfg, key, default="__missing__", throw_on_missing=False) != "__missing__"
        if mode == "add" and exists:
            raise ConfigError(f"override {ov!r}: {key!r} already exists; use {key}=... or ++{key}=... to change it")
        try:
            OmegaConf.update(cfg, key, value, merge=False, force_add=True)
        except OmegaConfBaseException as e:
            raise ConfigError(f"override {ov!r}: {e}") from None
    return cfg


# --------------------------------------------------------------------------- validation


def schema_keys(model: type[BaseModel], prefix: str = "") -> list[str]:
    """Every dotted key a schema accepts (nested sections included)."""
    keys: list[str] = []
    for name, field in model.model_fields.items():
        dotted = f"{prefix}{name}"
        keys.append(dotted)
        sub = _submodel(field.annotation)
        if sub is not None:
            keys.extend(schema_keys(sub, dotted + "."))
    return keys


def _submodel(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()) or ():
        found = _submodel(arg)
        if found is not None:
            return found
    return None


def suggest_key(bad: str, valid: list[str]) -> str | None:
    """The closest valid dotted key to `bad`: same section first, then anywhere (a misplaced key)."""
    leaf = bad.rsplit(".", 1)[-1]
    parent = bad.rsplit(".", 1)[0] if "." in bad else ""
    siblings = [k for k in valid if k.rsplit(".", 1)[0] == parent] if parent else [k for k in valid if "." not in k]
    match = difflib.get_close_matches(bad, siblings, n=1, cutoff=0.6)
    if match:
        return match[0]
    # A right name in the wrong section (e.g. grpo.max_grad_norm -> policy.max_grad_norm).
    by_leaf = [k for k in valid if k.rsplit(".", 1)[-1] == leaf]
    if by_leaf:
        return by_leaf[0]
    leaves = {k.rsplit(".", 1)[-1]: k for k in valid}
    match = difflib.get_close_matches(leaf, list(leaves), n=1, cutoff=0.75)
    return leaves[match[0]] if match else None


def _loc_to_key(loc: tuple[Any, ...]) -> str:
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif isinstance(p, str) and p.startswith("function-") or p in ("list[...]",):
            continue
        else:
            parts.append(("." if parts else "") + str(p))
    return "".join(parts)


def _format_errors(err: ValidationError, schema: type[BaseModel], source: str) -> str:
    valid = schema_keys(schema)
    lines = []
    for e in err.errors():
        key = _loc_to_key(tuple(e["loc"]))
        if e["type"] == "extra_forbidden":
            hint = suggest_key(key, valid)
            msg = f"unknown key {key!r}" + (f" (did you mean {hint}?)" if hint else "")
        elif e["type"] == "missing":
            msg = f"missing required key {key!r}"
        else:
            shown = e.get("input")
            msg = f"{key or '<root>'}: got {shown!r}, expected: {e['msg']}"
        lines.append(f"  - {msg}")
    return f"invalid config ({source}):\n" + "\n".join(lines)


def validate(cfg: DictConfig | dict[str, Any], schema: type[T], source: str = "config") -> T:
    """Resolve interpolations and validate against `schema`, raising one ConfigError listing every problem."""
    if isinstance(cfg, (DictConfig, ListConfig)):
        try:
            data = OmegaConf.to_container(cfg, resolve=True)
        except OmegaConfBaseException as e:
            key = getattr(e, "full_key", None)
            raise ConfigError(f"invalid config ({source}): cannot resolve {key or ''}: {e.msg if hasattr(e, 'msg') else e}") from None
    else:
        data = cfg
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_errors(e, schema, source)) from None


def load_config(
    algorithm: str, config_path: str | os.PathLike | None = None, overrides: Iterable[str] = ()
) -> BaseModel:
    """Load, merge, override and validate the config of `algorithm` ('grpo', 'sft', ...)."""
    from posttrain.schemas import MASTER_CONFIGS

    if algorithm not in MASTER_CONFIGS:
        raise ConfigError(f"unknown algorithm {algorithm!r}; valid: {', '.join(MASTER_CONFIGS)}")
    overrides = list(overrides)
    cfg = load_yaml_with_defaults(config_path) if config_path else OmegaConf.create({})
    cfg = apply_overrides(cfg, overrides)
    source = str(config_path) if config_path else "defaults"
    if overrides:
        source += " + overrides " + " ".join(overrides)
    return validate(cfg, MASTER_CONFIGS[algorithm], source)


def to_yaml(config: BaseModel) -> str:
    """The fully resolved config (every default filled in) as YAML, for the run directory."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
