"""Reading and writing recipes: YAML in, `--set key=value` overrides, unknown keys and wrong types refused
with an error that names the key and the file (or the --set that carried it); a Recipe back out as YAML.
The schema itself, and each field's validation, is `headstart.config`.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
import reprlib
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml

from headstart.config import Recipe, _FieldError
from headstart.errors import ConfigError


def load_recipe(path: str | Path, overrides: list[str] | None = None) -> Recipe:
    """Read a YAML recipe, apply `--set key=value` overrides, validate, and build the Recipe."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text (byte {e.start})") from None
    if raw is None:  # an empty file (or only comments) is a mistake, not a wish for every default (that is `{}`)
        raise ConfigError(f"{path}: the recipe is empty; a recipe describes a run completely (target, data, head, "
                          "train, ...): start from a copy of recipes/quickstart.yaml")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe is a mapping of sections, got {type(raw).__name__}")
    overridden = apply_overrides(raw, overrides or [])
    return recipe_from_dict(raw, source=str(path), overridden=overridden)


def recipe_from_dict(raw: dict[str, Any], source: str = "<dict>", overridden: set[str] | None = None) -> Recipe:
    def where(key: str) -> str:
        return f"--set {key}" if overridden and key in overridden else source

    try:
        return _build(Recipe, raw, "", where)
    except _FieldError as e:
        raise ConfigError(f"{where(e.key)}: '{e.key}' {e}") from None


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> set[str]:
    """Apply `a.b=c` strings to a raw recipe dict in place; returns the dotted keys set."""
    keys = set()
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"--set {_REPR.repr(item)}: expected key=value, e.g. --set data.limit=200")
        key, _, text = item.partition("=")
        key = key.strip()
        _check_key_path(key)
        try:
            value = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError:
            value = text
        node = raw
        parts = key.split(".")
        for part in parts[:-1]:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[parts[-1]] = value
        keys.add(key)
    return keys


def _check_key_path(key: str) -> None:
    cls: Any = Recipe
    done = []
    for part in key.split("."):
        if not (dataclasses.is_dataclass(cls) and isinstance(cls, type)):
            raise ConfigError(f"--set {key}: '{'.'.join(done)}' is a value, not a section")
        names = {f.name: f for f in dataclasses.fields(cls)}
        if part not in names:
            raise ConfigError(f"--set {key}: {_unknown(part, names, '.'.join(done))}")
        done.append(part)
        cls = typing.get_type_hints(cls)[part]


def _unknown(name: str, known: dict[str, Any], section: str) -> str:
    name = name if len(name) <= 60 else name[:60] + "…"
    full = f"{section}.{name}" if section else name
    hint = difflib.get_close_matches(name, list(known), n=1)
    msg = f"unknown key '{full}'"
    if hint:
        msg += f"; did you mean '{section + '.' if section else ''}{hint[0]}'?"
    return msg + f" (known in {'section ' + repr(section) if section else 'the top level'}: {', '.join(known)})"


def _build(cls: type, raw: Any, prefix: str, where: typing.Callable[[str], str]) -> Any:
    section = prefix.rstrip(".")
    if not isinstance(raw, dict):
        raise ConfigError(f"{where(section)}: '{section}' must be a mapping, got {_show(raw)}")
    hints = typing.get_type_hints(cls)
    names = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in raw.items():
        if not isinstance(key, str) or key not in names:
            full = prefix + str(key)
            raise ConfigError(f"{where(full)}: {_unknown(str(key), names, section)}")
        kwargs[key] = _coerce(hints[key], value, prefix + key, where)
    return cls(**kwargs)


def _coerce(tp: Any, value: Any, key: str, where: typing.Callable[[str], str]) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value if value is not None else {}, key + ".", where)
    if origin in (typing.Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(arg, value, key, where)
            except ConfigError as e:
                errors.append(e)
        raise errors[0]
    if origin is Literal:
        choices = typing.get_args(tp)
        if value not in choices:
            raise ConfigError(f"{where(key)}: '{key}' must be one of {list(choices)}, got {_show(value)}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where(key)}: '{key}' must be a list, got {_show(value)}")
        (item,) = typing.get_args(tp)
        return [_coerce(item, v, f"{key}[{i}]", where) for i, v in enumerate(value)]
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        if isinstance(value, str) and _NUMBER.fullmatch(value.strip()):
            return float(value)  # YAML 1.1 reads 1e-4 (no dot) as a string
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp in (str, bool):
        if isinstance(value, tp):
            return value
    else:
        raise TypeError(f"recipe schema: unsupported field type {tp!r} for {key}")
    raise ConfigError(f"{where(key)}: '{key}' must be {tp.__name__}, got {_show(value)}")


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_REPR = reprlib.Repr()  # attributes, not keyword arguments: Python 3.10/3.11 take none
_REPR.maxlevel, _REPR.maxlist, _REPR.maxdict, _REPR.maxstring, _REPR.maxother = 2, 4, 4, 60, 60


def _show(value: Any) -> str:
    """A short, bounded rendering of a bad value: a YAML alias bomb or a 100 KB string never reaches
    the message whole (reprlib stops at a fixed depth, length and width)."""
    return f"{type(value).__name__} {_REPR.repr(value)}" if value is not None else "null"


def dump_recipe(recipe: Recipe) -> str:
    return yaml.safe_dump(recipe.to_dict(), sort_keys=False)
