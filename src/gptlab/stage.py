"""The entry point every script in the project's stages/ folder shares.

It parses `--params`, loads and checks params.yaml before any work, runs the
stage, and turns an expected failure into one line on stderr and exit code 2,
so DVC never caches a broken output. Under torchrun only rank 0 prints.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path

import yaml

from gptlab.config import PARAMS_FILE, Params, load_params
from gptlab.errors import EXIT_USAGE, GptlabError, describe_failure


def stage_parser(description: str | None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument(
        "--params",
        type=Path,
        default=PARAMS_FILE,
        help="params file to read (default: %(default)s)",
    )
    return parser


def answer_arguments_first(module: str, description: str | None) -> None:
    """Parse a stage script's arguments before its heavy imports: `--help` (or a typo) answers at once.

    Called at the top of each script with its `__name__`: imported (by tests, by another
    module), it does nothing.
    """
    if module == "__main__":
        stage_parser(description).parse_args()


def stage_main(
    run: Callable[[Params], object], description: str | None, argv: list[str] | None = None
) -> None:
    args = stage_parser(description).parse_args(argv)
    from gptlab.distributed import is_main  # torch: not before the arguments were read

    if not is_main():  # another torchrun process: rank 0 speaks for all of them
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    try:
        run(load_params(args.params))
    except (GptlabError, OSError, yaml.YAMLError) as exc:  # expected: one line; anything else is a bug
        print(f"error: {describe_failure(exc)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
