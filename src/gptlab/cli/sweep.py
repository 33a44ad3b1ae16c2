"""`gptlab sweep NAME`: a sweep file's variants as queued DVC experiments, then their table.

Each variant of sweeps/NAME.yaml (or a path) is queued with `dvc exp run --queue`, `dvc queue start
--jobs N` runs them, and once each has succeeded or failed their table is written to
reports/sweeps/<sweep>.md and .csv. --profile lays a profile's overrides under every variant; the
sweep is then named <file>-<profile>. One sweep runs at a time in a project (they share DVC's
queue); every wait is bounded (--timeout, a day by default, and each dvc command). Stopped
(Ctrl-C, SIGTERM) while queuing, it removes the variants it queued, or says the command that
does; stopped while waiting, it leaves them running.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
from pathlib import Path

from gptlab.errors import GptlabError, InputError, describe_failure
from gptlab.experiments import sweep as sweeps
from gptlab.experiments.profiles import dvc_executable, experiment_env, profile_path
from gptlab.experiments.smoke import source_commit_env
from gptlab.pipeline.stage import Terminated, sigterm_stops
from gptlab.tracking.store import masked_uri, prepare_store
from gptlab.tracking.sweep_runs import sweep_runs


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add(
        "sweep",
        metavar="NAME",
        help="sweeps/NAME.yaml, or a path to a sweep file (a pipe too, with --name; '-' for stdin)",
    )
    add(
        "--profile",
        help="profiles/PROFILE.yaml (or a path, a pipe too): overrides under every variant, e.g. smoke",
    )
    add("--jobs", "-j", type=int, default=1, help="experiments run at a time (dvc queue start --jobs)")
    add(
        "--name",
        help="the sweep's name: prefix of its experiments, its MLflow tag and table file (default: the file's name, plus -PROFILE with --profile)",
    )
    add(
        "--replace",
        action="store_true",
        help="remove earlier experiments of the same names first (default: refuse to run over them)",
    )
    add(
        "--collect",
        action="store_true",
        help="queue and run nothing: write the table from the sweep's experiments as they are",
    )
    add(
        "--timeout",
        type=float,
        default=sweeps.QUEUE_TIMEOUT_S,
        help="stop waiting for the queue after this many seconds (default: %(default)g, a day); the experiments go on, --collect writes the table later",
    )
    add("--out", type=Path, help="folder for <sweep>.md and .csv (default: reports/sweeps)")


def run(args: argparse.Namespace) -> int:
    project = Path.cwd()
    if not (project / "dvc.yaml").is_file():
        raise GptlabError("dvc.yaml not found: run `gptlab sweep` from the project root")
    if args.jobs < 1:
        raise InputError(f"--jobs: expected 1 or more, got {args.jobs}")
    if not args.timeout > 0:
        raise InputError(f"--timeout: expected a positive number of seconds, got {args.timeout:g}")
    head = ["git", "rev-parse", "--short", "HEAD"]
    if not (commit := subprocess.run(head, cwd=project, capture_output=True, text=True).stdout.strip()):
        raise GptlabError(
            "gptlab sweep runs DVC experiments, which start from a git commit: run it in a git repository with at least one commit"
        )
    path, profile = sweeps.sweep_path(args.sweep), profile_path(args.profile) if args.profile else None
    sweep = sweeps.load_sweep(path, project / "params.yaml", profile, args.name)
    dvc = sweeps.Dvc(project, {**experiment_env(project), **source_commit_env(project)}, dvc_executable())
    print(f"sweep {sweep.name}: {len(sweep.variants)} variants of {sweep.file.stage} from {path}", flush=True)
    for note in sweeps.coincidences(sweep, sweep.effective):
        print(f"note: {note}", file=sys.stderr, flush=True)
    if args.collect:
        found = dvc.experiments()
    else:
        waiting = False
        try:
            # SIGTERM stops it as Ctrl-C does; the first lock: a second sweep is refused at once.
            with sigterm_stops(), sweeps.sweep_lock(project, sweep.name):
                # The MLflow store and experiments exist before stages log to them in parallel (the
                # experiments' store is this process's: MLFLOW_TRACKING_URI, else the project's).
                prepare_store(sorted({str(p["tracking.experiment"]) for p in sweep.effective.values()}))
                sweeps.queue(sweep, dvc, replace=args.replace)
                waiting = True
                found = sweeps.run_queue(sweep, dvc, jobs=args.jobs, timeout=args.timeout)
        except sweeps.Stopped as stop:
            print(f"\nstopped by {stop} while queuing the variants: {stop.note}", file=sys.stderr)
            return 128 + stop.signum
        except KeyboardInterrupt as stop:
            signum = signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT
            said = (
                f"stopped waiting; the variants go on in DVC's queue (`dvc queue status`, stop them with `dvc queue kill NAME`); `gptlab sweep {args.sweep} --name {sweep.name} --collect` writes the table once they are done"
                if waiting
                else "stopped before any variant was queued"
            )
            print(f"\n{said}", file=sys.stderr)
            return 128 + signum
    ran = sorted({str(e.params.get("tracking.experiment")) for e in found.values() if e.params})
    try:
        runs = sweep_runs(ran, sweep.name, sweep.file.stage) if ran else {}
    except Exception as exc:  # noqa: BLE001 - the table is written without the times rather than lost
        reason = describe_failure(exc) or f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        print(f"warning: no training times from MLflow ({masked_uri(reason)})", file=sys.stderr)
        runs = {}
    rows = sweeps.collect(sweep, found, project, runs)
    csv_path, md_path = sweeps.write_table(sweep, rows, args.out or sweeps.SWEEP_REPORTS, commit=commit)
    print(f"\nwrote {md_path} and {csv_path}")
    print(
        f"compare them with `dvc exp show` (experiments {sweep.name}-*) or in the MLflow UI: filter `tags.gptlab.sweep = '{sweep.name}'`"
    )
    for row in (failed := [row for row in rows if row["status"] != "success"]):
        hint = f"`dvc queue logs {row['experiment']}`" if row["status"] == "failed" else "not run"
        print(f"variant {row['variant']}: {row['status']} ({hint})", file=sys.stderr)
    return 1 if failed else 0
