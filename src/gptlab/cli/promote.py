"""`gptlab promote NAME VERSION`: point the registered model's `champion` alias at one version.

Each successful training stage registers its model as a new version of
`gptlab-pretrain`, `gptlab-spam` or `gptlab-instruct` (`<tracking.experiment>-<stage>`).
After promoting, `gptlab classify --model models:/gptlab-spam@champion` (or
`gptlab chat --model models:/gptlab-instruct@champion`, or
`mlflow models serve -m models:/gptlab-spam@champion`) uses that version. The
registry is the tracking store's: MLFLOW_TRACKING_URI, else the project's mlflow.db.
"""

from __future__ import annotations

import argparse

from gptlab.errors import InputError

# mlflow is imported in run(), so `gptlab --help` stays fast.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("name", metavar="NAME", help="registered model, e.g. gptlab-spam")
    parser.add_argument("version", metavar="VERSION", help="its version number, e.g. 3")
    parser.add_argument("--alias", default="champion", help="the alias to set (default: %(default)s)")


def run(args: argparse.Namespace) -> int:
    if not args.version.isdigit() or int(args.version) < 1:
        raise InputError(f"VERSION: expected a version number (1, 2, ...), got {args.version!r}")
    # the MLflow side on first use: keeps `gptlab --help` fast
    from gptlab.tracking.registry import promote

    uri = promote(args.name, str(int(args.version)), args.alias)
    print(f"{args.name} version {int(args.version)} is now @{args.alias}: {uri}")
    return 0
