"""The local `mlflow ui` server behind `gptlab ui`, run as a server should be.

A busy port is one line naming `--port` (exit 2), found before anything starts: mlflow's
own server prints the URL and a traceback, then exits 0. The server runs in its own
process group (mlflow starts uvicorn and job runners under it); SIGTERM, SIGHUP and Ctrl-C
stop that whole group, so no worker outlives `gptlab ui`. Its start-up INFO lines and the
libraries' deprecation warnings are left out unless `gptlab -v`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import subprocess
import sys
import types
from collections.abc import Mapping
from pathlib import Path

from gptlab.environment import VERBOSE_ENV
from gptlab.errors import InputError

# Seconds the server's group has to exit after SIGTERM before it is killed.
STOP_TIMEOUT_S = 10
# What the child reads (mlflow's and Python's own variables): deprecation warnings (starlette's
# are UserWarnings whose message starts with its module) and INFO lines off.
QUIET_ENV = {
    "PYTHONWARNINGS": "ignore::DeprecationWarning,ignore:starlette.",
    "MLFLOW_LOGGING_LEVEL": "WARNING",
}
# Unless the user sets it: no job runner (MLflow's GenAI jobs, which the training runs' UI does not
# use) beside the web server, verbose or not: ~8 Huey consumers, ~15 s of CPU at each start.
NO_JOB_RUNNER = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


class _Stop(Exception):
    """SIGTERM or SIGHUP arrived: stop the server like Ctrl-C does."""


def check_port_free(host: str, port: int) -> None:
    """An InputError naming --port when `host:port` is taken (or cannot be bound)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        # As uvicorn binds: a port left in TIME_WAIT by a stopped server counts as free.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise InputError(
                    f"port {port} on {host} is already in use (another `gptlab ui`?): "
                    "pick another with --port, or stop what is there"
                ) from None
            raise InputError(
                f"cannot listen on {host}:{port} ({exc.strerror}): check --host and --port"
            ) from None


def ui_command(store: str, host: str, port: int) -> list[str]:
    """`mlflow ui` on `store` with one worker (a local UI needs no more; four cost ~3 GiB)."""
    mlflow = Path(sys.executable).with_name("mlflow")
    command = [str(mlflow), "ui", "--backend-store-uri", store, "--registry-store-uri", store]
    command += ["--host", host, "--port", str(port), "--workers", "1"]
    if not os.environ.get(VERBOSE_ENV):
        command += ["--uvicorn-opts", "--log-level warning --no-access-log"]
    return command


def serve(command: list[str], env: Mapping[str, str] | None = None) -> int:
    """Run the server in its own process group until it exits or we are told to stop; its exit code.

    Ctrl-C, SIGTERM and SIGHUP stop the whole group (then 0: the usual way to leave a server).
    """
    child_env = {**NO_JOB_RUNNER, **(os.environ if env is None else env)}
    if not child_env.get(VERBOSE_ENV):
        child_env.update(QUIET_ENV)
    handled = (signal.SIGTERM, signal.SIGHUP)
    previous = {signum: signal.signal(signum, _raise_stop) for signum in handled}
    server = subprocess.Popen(command, env=child_env, start_new_session=True)
    try:
        return server.wait()
    except (KeyboardInterrupt, _Stop):
        return 0
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        stop_group(server)


def stop_group(server: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, then SIGKILL what is left after STOP_TIMEOUT_S."""
    try:
        os.killpg(server.pid, signal.SIGTERM)
    except ProcessLookupError:
        return  # the group is gone already
    with contextlib.suppress(subprocess.TimeoutExpired):
        server.wait(timeout=STOP_TIMEOUT_S)
    # The leader may be gone while its workers linger: the group, not just the leader.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(server.pid, signal.SIGKILL)
    server.wait()


def _raise_stop(signum: int, frame: types.FrameType | None) -> None:
    raise _Stop(signal.Signals(signum).name)
