"""Typed, frozen config objects built from plain YAML data, with errors that name the key.

Generic: any frozen dataclass whose fields are ints, floats, strings, bools,
Literals, optionals, lists, dicts or other such dataclasses, or Any (the value
as YAML reads it, for a field the dataclass checks itself). Unknown keys,
missing keys and wrong types are refused with the full key path and what was
expected, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import contextlib
import dataclasses
import decimal
import functools
import io
import math
import re
import types
import typing
import unicodedata
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar

import yaml

from gptlab.errors import InputError

T = TypeVar("T")

# A number in exponent notation, as YAML leaves 1e9 and 5e-5 (strings: YAML 1.1 floats need a dot).
_EXPONENT = re.compile(r"[-+]?(?:\d+\.?\d*|\.\d+)[eE][-+]?\d+")

# Field metadata key: {old value: (new value, what it means)}, see `renamed`.
_RENAMED = "gptlab.renamed"


class ConfigError(InputError):
    """A config value that cannot be used; the message names the key."""


class FieldError(ConfigError):
    """A config's own check of one of its fields; `build` names it by its full key."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field = field
        self.problem = problem


def require(condition: bool, field: str, problem: str) -> None:
    """For __post_init__ checks: raise FieldError(field, problem) unless `condition` holds."""
    if not condition:
        raise FieldError(field, problem)


def renamed(spellings: Mapping[str, tuple[str, str]]) -> Any:
    """A required field whose old values are refused naming their new spelling: {old: (new, meaning)}.

    So a params file written for an older vocabulary stops with the fix, not just the choices.
    """
    return dataclasses.field(metadata={_RENAMED: dict(spellings)})


def build(cls: type[T], data: Any, path: str) -> T:
    """Build dataclass `cls` from a mapping, checking every key and type."""
    where = path or "params.yaml"
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where}: expected a mapping, got {_describe(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    moved: Mapping[str, str] = getattr(cls, "MOVED_KEYS", {})  # old key -> where it lives now
    if unknown and unknown[0] in moved:
        raise ConfigError(f"{_join(path, str(unknown[0]))}: moved to {moved[unknown[0]]}")
    if unknown:
        raise ConfigError(f"{_join(path, str(unknown[0]))}: unknown key; expected one of {sorted(fields)}")
    kwargs: dict[str, Any] = {}
    for name, field in fields.items():
        key = _join(path, name)
        if name not in data:
            no_default = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
            if no_default:
                raise ConfigError(f"{key}: missing key")
            continue
        value, old_spellings = data[name], field.metadata.get(_RENAMED, {})
        if isinstance(value, str) and value in old_spellings:
            new, meaning = old_spellings[value]
            raise ConfigError(f"{key}: {value!r} is now spelled {new!r} ({meaning})")
        kwargs[name] = _convert(value, hints[name], key)
    try:
        return cls(**kwargs)
    except FieldError as exc:
        raise ConfigError(f"{_join(path, exc.field)}: {exc.problem}") from None
    except ConfigError as exc:
        # __post_init__ messages name keys by their section ("train.lr: ..."); give the full path.
        message, section = str(exc), path.rpartition(".")[2]
        if section and message.startswith(f"{section}."):
            raise ConfigError(_join(path, message[len(section) + 1 :])) from None
        raise ConfigError(f"{path}: {message}" if path else message) from None


def _convert(value: Any, annotation: Any, key: str) -> Any:
    if annotation is Any:
        return value
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        for option in (a for a in args if a is not type(None)):
            try:
                return _convert(value, option, key)
            except ConfigError:
                # A mapping where a config may stand is that config: its own error names what is wrong.
                if isinstance(value, Mapping) and dataclasses.is_dataclass(option):
                    raise
        expected = " or ".join(_type_name(a) for a in args)
        raise ConfigError(f"{key}: expected {expected}, got {_describe(value)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{key}: expected one of {list(args)}, got {_describe(value)}")
        return value
    if origin is dict:
        key_type, value_type = args
        if not isinstance(value, Mapping):
            raise ConfigError(f"{key}: expected a mapping, got {_describe(value)}")
        return {
            _convert(k, key_type, key): _convert(v, value_type, _join(key, str(k))) for k, v in value.items()
        }
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(f"{key}: expected a list, got {_describe(value)}")
        return [_convert(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)]
    if dataclasses.is_dataclass(annotation):
        return build(annotation, value, key)
    if annotation is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {_describe(value)}")
        return value
    if annotation is int:
        # YAML reads 1e9 (no dot, no sign) as a string, as it does 5e-5 for a float: a whole number in
        # exponent notation is that integer, read exactly (1e30 too), so both kinds of field take "1e9".
        if isinstance(value, str) and _EXPONENT.fullmatch(value.strip()):
            exact = decimal.Decimal(value)
            if exact.adjusted() > 100 or exact != exact.to_integral_value():  # 1e999999999: no such count
                raise ConfigError(f"{key}: expected an integer, got {_describe(value)} (not a whole number)")
            return int(exact)
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {_describe(value)}")
        return value
    if annotation is float:
        # YAML reads 5e-5 (no dot) as a string; accept it as the number it obviously is.
        number = value
        if isinstance(value, str):
            with contextlib.suppress(ValueError):
                number = float(value)
        if isinstance(number, bool) or not isinstance(number, int | float):
            raise ConfigError(f"{key}: expected a float, got {_describe(value)}")
        if not math.isfinite(number):
            raise ConfigError(f"{key}: expected a finite float, got {_describe(value)}")
        return float(number)
    if annotation is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {_describe(value)}")
        return value
    raise AssertionError(f"{key}: config type {annotation!r} is not supported by the loader")


def flatten(config: Any, prefix: str = "") -> dict[str, Any]:
    """Flat `section.key` view of a config, as logged to MLflow."""
    items = dataclasses.asdict(config) if dataclasses.is_dataclass(config) else config
    flat: dict[str, Any] = {}
    for name, value in items.items():
        key = _join(prefix, str(name))
        if isinstance(value, Mapping):
            flat.update(flatten(value, key))
        else:
            flat[key] = value
    return flat


def nested(flat: Mapping[str, Any]) -> dict[str, Any]:
    """{a.b: 1} -> {a: {b: 1}}: the inverse of `flatten`, a flat view laid out like params.yaml again."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        *parents, last = key.split(".")
        functools.reduce(lambda node, part: node.setdefault(part, {}), parents, tree)[last] = value
    return tree


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _type_name(annotation: Any) -> str:
    if annotation is type(None):
        return "null"
    return {int: "an integer", float: "a float", str: "a string", bool: "true or false"}.get(
        annotation, getattr(annotation, "__name__", str(annotation))
    )


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, Mapping):
        return "a mapping"
    if isinstance(value, list):
        return "a list"
    return repr(value)


# --------------------------------------------------------------------------- #
# YAML files: Reading the YAML files a user edits (params.yaml, profiles, sweeps, baselines), aliases bounded.
# --------------------------------------------------------------------------- #

MAX_YAML_NODES = 100_000

# The largest YAML file read at all (params.yaml is some 10 KB, the book's figures 100 KB): checked
# before parsing, which takes minutes for tens of MB.
MAX_YAML_BYTES = 1 << 20


class _Unbounded(Exception):
    """What `_BoundedLoader` found; `read_yaml` names the file."""


class _BoundedLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, refusing a document whose aliases expand past MAX_YAML_NODES."""

    def compose_document(self) -> yaml.Node:
        node = super().compose_document()
        _expanded_size(node, {})
        return node


def _expanded_size(node: yaml.Node, sizes: dict[int, int | None]) -> int:
    """Nodes under `node` with every alias expanded, each shared node counted once per use."""
    key = id(node)
    if key in sizes:
        size = sizes[key]
        if size is None:
            raise _Unbounded(f"line {node.start_mark.line + 1}: an alias refers to itself (endless data)")
        return size
    sizes[key] = None  # in progress: meeting it again below means a cycle
    size = 1
    if isinstance(node, yaml.SequenceNode):
        size += sum(_expanded_size(item, sizes) for item in node.value)
    elif isinstance(node, yaml.MappingNode):
        size += sum(_expanded_size(k, sizes) + _expanded_size(v, sizes) for k, v in node.value)
    if size > MAX_YAML_NODES:
        raise _Unbounded(
            f"line {node.start_mark.line + 1}: its aliases expand to more than {MAX_YAML_NODES:,} nodes "
            "(an alias bomb?); write the values out"
        )
    sizes[key] = size
    return size


def read_yaml(path: Path) -> Any:
    """The data of YAML file `path`, as yaml.safe_load reads it; ConfigError if it expands too far.

    Syntax errors stay yaml.YAMLError, which callers report with the file's line.
    """
    with Path(path).open("rb") as fh:  # a pipe too: read at most one byte past the cap
        data = fh.read(MAX_YAML_BYTES + 1)
    if len(data) > MAX_YAML_BYTES:
        raise ConfigError(
            f"{path}: larger than {MAX_YAML_BYTES // (1 << 20)} MiB, far more than any params, profile or "
            "sweep file needs; refused before parsing"
        )
    stream = io.StringIO(data.decode("utf-8"))  # UTF-8, as the file was opened before the cap
    stream.name = str(path)  # type: ignore[attr-defined] - what YAML's errors name, as for the file
    try:
        return yaml.load(stream, Loader=_BoundedLoader)  # a SafeLoader: plain data only, as safe_load
    except _Unbounded as exc:
        raise ConfigError(f"{path}: {exc}") from None


# --------------------------------------------------------------------------- #
# Caps and checks shared by the params sections
# --------------------------------------------------------------------------- #

# Caps on the params that size memory or work, named in each refusal: far above any setting that
# runs on one machine, so a typo (an extra few zeros) stops at load, not minutes into a stage.
MAX_BATCH_SIZE = 65536


MAX_ROUNDS = 10_000  # epochs, evaluation batches


MAX_NEW_TOKENS = 10_000


MAX_NAME_LENGTH = 250  # MLflow experiment and run names
# Unicode's control, format (bidi overrides, zero widths) and line/paragraph separator characters:
# shown raw, they hide or reorder what a terminal prints.
CONTROL_CATEGORIES = ("Cc", "Cf", "Zl", "Zp")


def is_control(char: str) -> bool:
    """Whether `char` is a control character (NUL, a line break, a bidi override)."""
    return unicodedata.category(char) in CONTROL_CATEGORIES


def name_problem(value: str) -> str | None:
    """Why `value` cannot name an experiment or a run (None when it can): blank, too long, or holding
    a control character (NUL, a line break, a bidi override: stored as is, shown misleadingly)."""
    if value.strip() == "" or len(value) > MAX_NAME_LENGTH:
        shown = repr(value) if len(value) <= MAX_NAME_LENGTH else f"{len(value):,} characters"
        return f"expected a name of 1 to {MAX_NAME_LENGTH} characters, got {shown}"
    if control := next((c for c in value if is_control(c)), None):
        return f"control character U+{ord(control):04X} ({unicodedata.name(control, 'unnamed')}) in {value!r}: use printable characters"
    return None


# Sampling temperatures: below the floor, logits / temperature overflow to inf; 0 is greedy.
TEMPERATURE_RANGE = (0.01, 100.0)


def require_count(value: int, field: str, cap: int, alternative: str = "") -> None:
    """A count in [1, cap] (`alternative`, e.g. " or null", is named in the refusal)."""
    require(value > 0, field, f"expected a positive integer{alternative}, got {value}")
    require(value <= cap, field, f"expected 1 to {cap}{alternative}, got {value}")


def is_sha256(value: str) -> bool:
    """64 lowercase hex digits, as sha256sum prints a digest."""
    return len(value) == 64 and all(c in "0123456789abcdef" for c in value)
