"""Loading a RunConfig: YAML text, dotted `--set` overrides, typed coercion, and unknown keys
answered with the nearest valid one."""

from __future__ import annotations

import dataclasses
import difflib
import os
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from replayrl.config.run import SECTIONS, RunConfig, apply_arm, validate
from replayrl.errors import ReplayRLError


def nearest(key: str, valid: list[str]) -> str:
    """' Did you mean ...?' with the closest of `valid`, else the list of them."""
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.4)
    return f" Did you mean '{match[0]}'?" if match else f" Valid keys: {', '.join(sorted(valid))}."


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Check `value` against a dataclass field annotation; convert int -> float and str
    numbers from --set; raise ReplayRLError naming the key and the expected type."""
    tp = annotation
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _coerce(value, non_none[0], where)
    if tp is Any:
        return value
    if origin is dict or tp is dict:
        if value is None:
            return {}
        if not isinstance(value, dict):
            raise ReplayRLError(f"{where} must be a mapping, got {value!r}.")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "false", "yes", "no", "1", "0"):
            return value.lower() in ("true", "yes", "1")
        raise ReplayRLError(f"{where} must be true or false, got {value!r}.")
    if tp is int:
        if isinstance(value, bool):
            raise ReplayRLError(f"{where} must be an integer, got {value!r}.")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.replace("_", ""))
            except ValueError:
                pass
        raise ReplayRLError(f"{where} must be an integer, got {value!r}.")
    if tp is float:
        if isinstance(value, bool):
            raise ReplayRLError(f"{where} must be a number, got {value!r}.")
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ReplayRLError(f"{where} must be a number, got {value!r}.")
    if tp is str:
        if isinstance(value, str):
            return value
        if isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        raise ReplayRLError(f"{where} must be a string, got {value!r}.")
    return value


def _build(cls: type, data: Any, where: str) -> Any:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ReplayRLError(f"'{where or 'config'}' must be a mapping of keys, got {data!r}.")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        dotted = f"{where}.{key}" if where else str(key)
        if key not in fields:
            raise ReplayRLError(f"Unknown config key '{dotted}'.{nearest(str(key), list(fields))}")
        if key in SECTIONS and cls is RunConfig:
            kwargs[key] = _build(SECTIONS[key], value, key)
        else:
            kwargs[key] = _coerce(value, hints[key], dotted)
    return cls(**kwargs)


def _set_dotted(tree: dict[str, Any], dotted: str, raw: str) -> None:
    parts = dotted.split(".")
    node = tree
    for part in parts[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ReplayRLError(f"--set {dotted}: '{part}' is not a section.")
        node = child
    try:
        value = yaml.safe_load(raw) if raw != "" else ""
    except yaml.YAMLError:
        value = raw
    node[parts[-1]] = value


def parse_overrides(items: list[str] | None) -> list[tuple[str, str]]:
    out = []
    for item in items or []:
        if "=" not in item:
            raise ReplayRLError(f"--set expects section.key=value, got '{item}'.")
        key, raw = item.split("=", 1)
        out.append((key.strip(), raw.strip()))
    return out


def _read_text(path: Path) -> str:
    """The config file's text; a file that cannot be read or is not UTF-8 is one line naming
    it (and, for bytes that are not UTF-8, where they are)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ReplayRLError(f"Cannot read config file '{path}': {e.strerror or e}.") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        column = e.start - (data.rfind(b"\n", 0, e.start) + 1) + 1
        raise ReplayRLError(
            f"Config file '{path}' is not UTF-8 text: byte 0x{data[e.start]:02x} at line "
            f"{line}, column {column}. Save it as UTF-8."
        ) from None


def load_config(
    path: str | os.PathLike[str] | None = None,
    *,
    overrides: list[str] | None = None,
    arm: str | None = None,
    text: str | None = None,
) -> RunConfig:
    """Load a RunConfig from a YAML file (or YAML `text`), apply `--set` overrides, choose the
    arm, and validate. Raises ReplayRLError with the fix for anything a user got wrong."""
    if text is None and path is not None:
        p = Path(path)
        if not p.is_file():
            raise ReplayRLError(
                f"Config file '{path}' does not exist; pass a YAML file such as configs/tiny-cpu.yaml."
            )
        text = _read_text(p)
    try:
        tree = yaml.safe_load(text) if text else {}
    except yaml.YAMLError as e:
        where = f"'{path}'" if path else "config text"
        mark = getattr(e, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ReplayRLError(f"Malformed YAML in {where}{at}: {getattr(e, 'problem', e)}.") from None
    if tree is None:
        tree = {}
    if not isinstance(tree, dict):
        raise ReplayRLError(
            "The config must be a YAML mapping of sections (model, task, rollout, ...)."
        )
    for key, raw in parse_overrides(overrides):
        _set_dotted(tree, key, raw)
    if arm is not None:
        tree["arm"] = arm
    cfg = _build(RunConfig, tree, "")
    cfg = apply_arm(cfg)
    validate(cfg)
    return cfg


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Rebuild a RunConfig from `to_dict()` output (e.g. a stored config.yaml)."""
    cfg = _build(RunConfig, data, "")
    validate(cfg)
    return cfg
