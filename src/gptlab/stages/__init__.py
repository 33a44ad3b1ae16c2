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

import yaml

from gptlab.config import PARAMS_FILE, Params, load_params
from gptlab.errors import EXIT_USAGE, GptlabError, describe_failure


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
    except (GptlabError, OSError, yaml.YAMLError) as exc:  # expected: one line; anything else is a bug
        print(f"error: {describe_failure(exc)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
