"""`gptlab ui`: the MLflow UI on the project's store, opened at the experiment's runs.

MLflow 3's UI keeps its *GenAI / Model training* switch per browser and starts a new
browser on GenAI, whose experiment page is an empty traces overview. The URL printed
here carries `workflowType=machine_learning`, so it opens on the experiment's training
runs whatever the browser used before, and gptlab's view of the runs table (its key
params and headline metrics as columns: gptlab.tracking.ui). The URL is printed once the server
answers (gptlab.cli.ui_server). With MLFLOW_TRACKING_URI naming a server, that server's URL is
printed and nothing is started.
"""

from __future__ import annotations

import argparse

from gptlab.cli.ui_server import START_TIMEOUT_S, Readiness, check_port_free, local_url, serve, ui_command
from gptlab.errors import InputError
from gptlab.pipeline.params import load_params
from gptlab.tracking.ui import runs_link, ui_link

# mlflow is imported in run(), so `gptlab --help` stays fast.


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--experiment", help="the experiment to open (default: tracking.experiment of params.yaml)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="(default: %(default)s)")
    parser.add_argument("--port", type=int, default=5000, help="(default: %(default)s)")
    parser.add_argument("--print-url", action="store_true", help="print the URL only; start no server")
    parser.add_argument(
        "--timeout",
        type=_seconds,
        default=START_TIMEOUT_S,
        metavar="SECONDS",
        help="how long the server may take to answer before it is given up (default: %(default)g)",
    )


def _seconds(text: str) -> float:
    """--timeout's value: seconds, more than 0."""
    try:
        seconds = float(text)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"expected seconds more than 0, got {text!r}")
    return seconds


def experiment_url(base: str, experiment_id: str | None) -> str:
    """Where the experiment's training runs are, with gptlab's columns (the experiments list if it does not exist yet)."""
    page = runs_link(experiment_id) if experiment_id else ui_link("experiments")
    return base.rstrip("/") + "/" + page


def run(args: argparse.Namespace) -> int:
    # the MLflow side on first use: keeps `gptlab --help` fast
    from gptlab.tracking.store import check_reachable, imported_mlflow, masked_uri, store_errors, tracking_uri

    if not 0 < args.port < 65536:
        raise InputError(f"--port: expected 1 to 65535, got {args.port}")
    name = args.experiment or load_params().tracking.experiment
    store = tracking_uri()
    remote = store.startswith(("http://", "https://"))
    if not (remote or args.print_url):  # before MLflow loads (seconds): a busy port prints only why
        check_port_free(args.host, args.port)
    check_reachable(store)
    with store_errors(store):
        found = imported_mlflow().MlflowClient(tracking_uri=store).get_experiment_by_name(name)
    base = store if remote else f"http://{args.host}:{args.port}"
    url = experiment_url(base, found.experiment_id if found else None)
    missing = "" if found else f" (no experiment {name!r} yet: run a stage first)"
    line = f"MLflow UI, experiment {name!r}{missing}: {masked_uri(url)}"
    if remote or args.print_url:
        print(line, flush=True)
        return 0
    # The URL once the server answers, on the line that says so: a click before that would find nothing
    # there, so the starting line holds no address a terminal would make clickable.
    starting = f"starting the MLflow UI on port {args.port} (up to {args.timeout:g} s) ..."
    ready = line.replace("MLflow UI,", "MLflow UI ready,", 1)
    readiness = Readiness(f"{local_url(args.host, args.port)}/health", starting, ready, args.timeout)
    return serve(ui_command(store, args.host, args.port), readiness=readiness)
