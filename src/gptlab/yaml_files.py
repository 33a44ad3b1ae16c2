"""Reading the YAML files a user edits (params.yaml, profiles, sweeps, baselines), aliases bounded.

YAML aliases let a few hundred bytes stand for billions of nodes (a "billion laughs"):
PyYAML builds them as shared objects at once, but whatever walks the result (flattening
params, comparing them, DVC) expands them, for minutes and gigabytes. `read_yaml` counts
the nodes a document expands to before building anything and refuses more than
MAX_YAML_NODES (params.yaml has a few hundred), naming the file.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from gptlab.typed_config import ConfigError

MAX_YAML_NODES = 100_000


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
    with Path(path).open(encoding="utf-8") as fh:
        try:
            return yaml.load(fh, Loader=_BoundedLoader)  # a SafeLoader: plain data only, as safe_load
        except _Unbounded as exc:
            raise ConfigError(f"{path}: {exc}") from None
