"""The JSON reports the stages write for DVC (metrics, samples, answers), all in one format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gptlab.checkpoint import atomic_path


def write_json(path: Path | str, data: Any, *, sort_keys: bool = True, allow_nan: bool = True) -> Path:
    """Write `data` as indented UTF-8 JSON with a trailing newline, atomically; returns the path.

    Text stays readable (ensure_ascii=False). `allow_nan=False` makes a nan or inf
    an error instead of the non-standard `NaN`/`Infinity` tokens.
    """
    path = Path(path)
    text = json.dumps(data, indent=2, sort_keys=sort_keys, ensure_ascii=False, allow_nan=allow_nan)
    with atomic_path(path) as tmp:
        tmp.write_text(text + "\n", encoding="utf-8")
    return path
