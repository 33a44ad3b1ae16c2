"""`gptlab`: run the pipeline's profiles and sweeps, use its trained models, check its metrics.

The stages themselves run through `dvc repro`; the help says which command to run when.
Each subcommand lives in its own module of gptlab.cli, whose top level
imports only what its arguments need (torch and the model load when it runs),
so `gptlab --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import os
import sys

import yaml

from gptlab.environment import VERBOSE_ENV
from gptlab.errors import EXIT_USAGE, GptlabError, describe_failure

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "export": ("gptlab.cli.export", "write a checkpoint as a Hugging Face GPT-2 folder"),
    "classify": ("gptlab.cli.classify", "label messages as spam or ham with the fine-tuned classifier"),
    "chat": ("gptlab.cli.chat", "answer an instruction with the instruction-tuned model"),
    "run": ("gptlab.cli.run", "run the pipeline as a DVC experiment with a profile's overrides"),
    "smoke": ("gptlab.cli.smoke", "run all stages on a small profile, then check its metrics"),
    "compare": (
        "gptlab.cli.compare",
        "the experiments of `dvc exp show`: params that differ and headline metrics",
    ),
    "sweep": (
        "gptlab.cli.sweep",
        "run a sweep file's variants as queued DVC experiments and write their table",
    ),
    "metrics": ("gptlab.cli.metrics", "compare reports/ with the metrics baseline, or update it"),
    "mirror": (
        "gptlab.cli.mirror",
        "write every pinned input into a folder for GPTLAB_MIRROR (offline use)",
    ),
    "report": ("gptlab.cli.report", "the book's figures beside a run's, in .gptlab/REPRODUCTION.md"),
    "promote": ("gptlab.cli.promote", "set the champion alias of a registered model's version"),
    "ui": ("gptlab.cli.ui", "start the MLflow UI on the project's store, at the experiment's runs"),
}


DESCRIPTION = """\
GPT-2 from the book as a DVC pipeline tracked in MLflow. Which command runs it:
  gptlab smoke   first: all eight stages on a small profile (minutes on 2 cores), in .gptlab/smoke
                 (your params.yaml, outputs and dvc.lock stay untouched); CI runs it
  dvc repro      the full pipeline with params.yaml, here: the book's run (hours on a CPU)
  gptlab run     the pipeline with a profile's overrides, as a DVC experiment beside yours
  gptlab sweep   many variants of one stage (chapter 6's experiments), queued as DVC experiments
Then: gptlab compare (the experiments side by side), gptlab ui (the MLflow runs),
gptlab metrics check (against a baseline), gptlab classify / chat (the trained models)."""


def installed_version() -> str:
    """The installed package's version; a source tree run through PYTHONPATH has none, and still runs."""
    try:
        return importlib.metadata.version("gptlab")
    except importlib.metadata.PackageNotFoundError:
        return "(not installed: running from a source tree)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gptlab",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gptlab {installed_version()}")
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="keep the libraries' INFO lines (MLflow's), here and in the stages it runs, and print every "
        f"line the stages of `gptlab smoke` and `gptlab run` print ({VERBOSE_ENV}=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module, help_text) in COMMANDS.items():
        command = importlib.import_module(module)
        command_parser = sub.add_parser(name, help=help_text, description=help_text)
        command.add_arguments(command_parser)
        command_parser.set_defaults(command_parser=command_parser)
    return parser


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments; one a sub-command does not know is refused with that sub-command's own usage."""
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.verbose:  # before any module that imports mlflow, and inherited by `dvc exp run`'s stages
        os.environ[VERBOSE_ENV] = "1"
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        return int(module.run(args) or 0)
    except (GptlabError, OSError, yaml.YAMLError) as exc:  # expected: one line; anything else is a bug
        print(f"gptlab {args.command}: {describe_failure(exc)}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
