"""The entry point every script in the project's stages/ folder shares.

It parses `--params`, loads and checks params.yaml before any work, runs the
stage, and turns an expected failure into one line on stderr and exit code 2,
so DVC never caches a broken output. Under torchrun only rank 0 prints.

A training stage (`stage_main(..., trains=True)`) whose params ask for several
processes (`distributed`) starts itself on them through torch.distributed.run
(gptlab.training.distributed.launch), so `dvc repro` and `dvc exp run` train on
them all and the stage's process is the one DVC waits for. Each process joins
the group with `distributed.timeout_minutes`; one whose collective fails because
a peer is gone exits quietly (EXIT_PEER_LOST) and the launcher names the peer.

Ctrl-C (SIGINT) stops a stage in one line with exit code 130: its MLflow run
ends KILLED and its resumable state stays for the rerun (a save in flight is
finished first). SIGTERM (what `dvc queue kill`, `timeout` and schedulers send)
does the same with 143: it raises `Terminated`, a KeyboardInterrupt, in the main thread. Under torchrun
the agent passes the signal on to every rank, and each stops the same way (one
waiting in a collective stops once its peers have gone); rank 0 alone says so. A second SIGTERM acts
as it did before: the process ends at once. A process already failing because a
peer is gone finishes its cleanup when the agent's SIGTERM comes.

Every stage process keeps the large blocks torch frees (gptlab.pipeline.memory): the
same numbers, a faster CPU step.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import yaml

from gptlab.errors import EXIT_USAGE, GptlabError, describe_failure
from gptlab.pipeline.memory import keep_freed_memory
from gptlab.pipeline.params import PARAMS_FILE, Params, load_params
from gptlab.training import distributed
from gptlab.training.distributed import is_main


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
    module), it does nothing. Run as a script, it also keeps freed memory (gptlab.pipeline.memory)
    for the life of the process, before torch allocates anything.
    """
    if module == "__main__":
        stage_parser(description).parse_args()
        keep_freed_memory()


class Terminated(KeyboardInterrupt):
    """SIGTERM arrived: the stage stops as on Ctrl-C (its MLflow run ends KILLED, its state is kept)."""


@contextmanager
def sigterm_stops() -> Iterator[None]:
    """Within the block, SIGTERM raises Terminated in the main thread; the previous handler comes back after."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread takes signals
        yield
        return
    previous = signal.getsignal(signal.SIGTERM)
    previous = signal.SIG_DFL if previous is None else previous  # None: installed outside Python

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, previous)  # a second SIGTERM acts as before, during the cleanup too
        if distributed.peer_lost(sys.exc_info()[1]):  # already failing, as torchrun's agent stops the rest:
            return  # its cleanup (the MLflow run's end) goes on, in silence
        raise Terminated(f"stopped by {signal.Signals(signum).name}")

    signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def stage_main(
    run: Callable[[Params], object],
    description: str | None,
    argv: list[str] | None = None,
    *,
    trains: bool = False,
) -> None:
    """Run the stage: `trains` (pretrain and the fine-tunes) starts it on `distributed`'s processes."""
    args = stage_parser(description).parse_args(argv)
    if not is_main():  # another torchrun process: rank 0 speaks for all of them
        sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - for the life of the process
    try:
        params = load_params(args.params)
        if trains and distributed.launches(params.distributed):
            sys.exit(
                distributed.launch(params.distributed, sys.argv[0], sys.argv[1:] if argv is None else argv)
            )
        if trains:
            distributed.setup(params.distributed.timeout_minutes)  # no-op for one process
        with sigterm_stops():
            run(params)
    except Terminated as exc:
        # On a line of its own: a progress bar may hold the line, without its newline yet.
        if is_main():
            print(
                f"\n{exc}: rerun the stage (one that trains resumes from its last checkpoint)",
                file=sys.stderr,
            )
        sys.exit(128 + signal.SIGTERM)  # the shell's code for a process ended by SIGTERM
    except KeyboardInterrupt:
        if is_main():
            print(
                "\nstopped by SIGINT (Ctrl-C): rerun the stage (one that trains resumes from its last checkpoint)",
                file=sys.stderr,
            )
        sys.exit(128 + signal.SIGINT)  # the shell's code for a process ended by SIGINT
    except (GptlabError, OSError, yaml.YAMLError) as exc:  # expected: one line; anything else is a bug
        print(f"error: {describe_failure(exc)}", file=sys.stderr)
        sys.exit(EXIT_USAGE)
    except Exception as exc:
        if not distributed.peer_lost(exc):  # a bug: its traceback
            raise
        sys.exit(distributed.EXIT_PEER_LOST)  # the launcher names the process that is gone
