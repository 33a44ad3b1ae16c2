"""The logic of each pipeline stage, one module per stage, each exposing `run(params)`.

The scripts in the project's stages/ folder are thin wrappers around these:
they parse the command line and call `stage_main`. A stage that fails exits
non-zero with the message, so DVC never caches a broken output.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

from gptlab.config import PARAMS_FILE, ConfigError, Params, load_params
from gptlab.fetch import FetchError


def stage_main(run: Callable[[Params], object], description: str, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--params",
        type=Path,
        default=PARAMS_FILE,
        help="params file to read (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        run(load_params(args.params))
    except (ConfigError, FetchError, FileNotFoundError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(1)
