"""Helpers shared by the tests: the project's root and committed params, the test inputs, git/dvc runs, HF caches."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import errno
import functools
import hashlib
import http.server
import json
import os
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping
from contextlib import closing, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import platformdirs
import pytest
import yaml

from gptlab.cli.ui_server import NO_JOB_RUNNER
from gptlab.data.config import Sources
from gptlab.data.fetch import MIRROR_ENV, FetchError, fetch, mirror_dir
from gptlab.data.gutenberg import Book
from gptlab.data.inputs import data_inputs, fetch_input
from gptlab.experiments.dvc_commands import ask_dvc
from gptlab.experiments.profiles import dvc_executable
from gptlab.model.config import ModelConfig
from gptlab.pipeline.params import Params, load_params
from gptlab.training.config import CheckpointConfig, TrainConfig

PROJECT_ROOT = Path(__file__).resolve().parents[1]
# Where the tests keep the pipeline's inputs between runs (default: the platform's per-user cache).
CACHE_ENV = "GPTLAB_CACHE_DIR"
# The user's mirror, read before any fixture points GPTLAB_MIRROR at the cache.
USER_MIRROR = mirror_dir()
# A GPT built in milliseconds: the `checkpoint` fixture's model, for tests of what reads checkpoints.
TINY_GPT = ModelConfig(vocab_size=300, context_length=32, emb_dim=32, n_heads=2, n_layers=2, qkv_bias=True)
# The generation and KV-cache tests' language model (tests/model/conftest.py builds it under both attentions).
TINY_LM = dict(
    vocab_size=97, context_length=32, emb_dim=32, n_heads=2, n_layers=2, drop_rate=0.1, qkv_bias=True
)


# dvc.yaml's stages, in the order `dvc repro` runs them.
PIPELINE_STAGES = (
    "download",
    "tokenize",
    "pretrain",
    "eval",
    "load-gpt2",
    "spam-finetune",
    "instruct-finetune",
    "preference-finetune",
)


@functools.cache
def committed_params_text() -> str:
    """params.yaml as committed (HEAD) when the project is a git checkout, else the file itself.

    Tests read the defaults from here, so a user who edits params.yaml can still run them.
    """
    try:
        shown = subprocess.run(
            ["git", "show", "HEAD:./params.yaml"], cwd=PROJECT_ROOT, capture_output=True, text=True
        )
    except OSError:  # no git at all
        shown = None
    if shown is not None and shown.returncode == 0:
        return shown.stdout
    return (PROJECT_ROOT / "params.yaml").read_text(encoding="utf-8")


def committed_params_raw() -> dict[str, Any]:
    """The committed params.yaml as plain data (a fresh copy: callers may edit it)."""
    return copy.deepcopy(_committed_raw())


@functools.cache
def _committed_raw() -> dict[str, Any]:
    return yaml.safe_load(committed_params_text())


@functools.cache
def committed_params() -> Params:
    """The committed params.yaml, validated into its typed config (frozen, so shared)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "params.yaml"
        path.write_text(committed_params_text(), encoding="utf-8")
        return load_params(path)


def train_config(**changes: Any) -> TrainConfig:
    """The committed pretrain.train (the book's loop settings) on the CPU, with `changes`."""
    return dataclasses.replace(committed_params().pretrain.train, device="cpu", **changes)


def checkpoint_config(**changes: Any) -> CheckpointConfig:
    """The committed checkpoints section (when to save, how many to keep), with `changes`."""
    return dataclasses.replace(committed_params().checkpoints, **changes)


def write_committed_params(project: Path) -> Path:
    """The committed params.yaml written into `project` (byte for byte); returns its path."""
    path = project / "params.yaml"
    path.write_text(committed_params_text(), encoding="utf-8")
    return path


def cache_dir() -> Path:
    """$GPTLAB_CACHE_DIR, else the platform's per-user cache folder for gptlab."""
    if value := os.environ.get(CACHE_ENV):
        return Path(value).expanduser()
    return Path(platformdirs.user_cache_dir("gptlab"))


def isolated_environment(tmp_path_factory: pytest.TempPathFactory, empty_store: Path) -> dict[str, str]:
    """The variables that give a test (or a fixture's commands) its own real MLflow store, no analytics,
    no network for the Hub, and the tests' cache of the inputs as the pipeline's mirror."""
    store = tmp_path_factory.mktemp("mlflow")
    copy_empty_store(empty_store, store / "mlflow.db")
    return {
        "MLFLOW_TRACKING_URI": f"sqlite:///{store}/mlflow.db",
        "MLFLOW_DISABLE_TELEMETRY": "true",
        "DVC_NO_ANALYTICS": "1",
        "DVC_SITE_CACHE_DIR": str(tmp_path_factory.mktemp("dvc-site")),
        "HF_HUB_OFFLINE": "1",
        # The stages a test runs find their inputs in the tests' cache (filled by `shared_data`).
        "GPTLAB_MIRROR": str(cache_dir()),
    }


def copy_empty_store(empty_store: Path, db: Path) -> None:
    """A new MLflow store at `db`, as if MLflow had created it there: a copy of the migrated empty one
    (seconds to create, milliseconds to copy), its default experiment's artifacts beside it."""
    shutil.copyfile(empty_store, db)
    with closing(sqlite3.connect(db)) as store, store:
        store.execute("UPDATE experiments SET artifact_location = ?", (str(db.parent / "mlruns" / "0"),))


def fetch_test_inputs(sources: Sources, cache: Path, mirror: Path | None) -> Path:
    """Every file of `sources` verified in `cache` (laid out like a mirror); returns `cache`.

    The pipeline's own fetch: kept when already there with the right sha256, else
    copied from `mirror`, else downloaded from its URL. When a file cannot be had,
    the calling test fails with one line naming the file, its URL and GPTLAB_MIRROR.
    """
    for pin in data_inputs(sources):
        try:
            fetch_input(pin, cache, mirror)
        except (FetchError, OSError) as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
        else:
            continue
        if mirror is None:
            reason += f"; {MIRROR_ENV} is not set"
        elif not (mirror / pin.path).is_file():
            reason += f"; {MIRROR_ENV}={mirror} has no {pin.path}"
        # Outside the except clause: the report is this one line, with no chained traceback.
        pytest.fail(
            f"test input {pin.path} ({pin.key}, {pin.url}) is missing: {reason}. "
            f"Without internet, set {MIRROR_ENV} to a folder holding each pinned file at its path "
            f"(here {pin.path}), e.g. one written by `gptlab mirror DIR` on a machine with internet.",
            pytrace=False,
        )
    return cache


_failure: list[str] = []


def inputs_dir() -> Path:
    """The pipeline's inputs for the tests, fetched once into the per-user cache (see fetch_test_inputs).

    Call it (or request the `shared_data` fixture) only where a test needs inputs: tests that need
    none must run without network or mirror. A failure is remembered, so each later test that needs
    inputs fails at once with the same line instead of trying again.
    """
    if _failure:
        pytest.fail(_failure[0], pytrace=False)
    try:
        return _fetch_once()
    except pytest.fail.Exception as exc:
        _failure.append(exc.msg)
        raise


@functools.cache
def _fetch_once() -> Path:
    return fetch_test_inputs(committed_params().data.sources, cache_dir(), USER_MIRROR)


def gutenberg_inputs(books: list[Book]) -> Path:
    """These Gutenberg books in the tests' cache at corpus.gutenberg.path, laid out like a mirror.

    The pipeline's own fetch, as for the other inputs: kept when already there, else copied
    from GPTLAB_MIRROR, else downloaded; a book that cannot be had fails the test in one line.
    Returns the cache (a mirror folder for the download stage).
    """
    folder = cache_dir() / committed_params().corpus.gutenberg.path
    for book in books:
        mirror_file = (
            USER_MIRROR / committed_params().corpus.gutenberg.path / book.file if USER_MIRROR else None
        )
        try:
            fetch(
                folder / book.file,
                url=book.url,
                sha256=book.sha256,
                mirror_file=mirror_file,
                size=book.bytes,
                progress=False,
            )
        except (FetchError, OSError) as exc:
            reason = (str(exc).splitlines() or [type(exc).__name__])[0]
            pytest.fail(
                f"test input {book.file} ({book.url}) is missing: {reason}. Without internet, set "
                f"{MIRROR_ENV} to a folder holding it at {folder.relative_to(cache_dir()) / book.file}.",
                pytrace=False,
            )
    return cache_dir()


@dataclass
class Disk:
    """A folder on a disk that runs out: `reason` is what the system says when it does."""

    folder: Path
    reason: str

    def fill(self) -> None:
        """Take the last free byte (of a full disk; on the others nothing can be written anyway)."""
        if self.reason != os.strerror(errno.ENOSPC):
            return
        fd = os.open(self.folder / "filler", os.O_WRONLY | os.O_CREAT, 0o644)
        try:
            while True:
                os.write(fd, b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC, exc
        finally:
            os.close(fd)

    def leftovers(self) -> list[str]:
        """Everything in the folder but the filler: what a failed write left behind."""
        return sorted(str(p.relative_to(self.folder)) for p in self.folder.rglob("*") if p.name != "filler")


@contextmanager
def small_disk(folder: Path, size: str, *, read_only: bool = False) -> Iterator[Disk]:
    """`folder` (made here) on a real disk that runs out, for the block.

    As root (CI): a tmpfs of `size` (mount's syntax: 1m) mounted there, ENOSPC once written full, or
    mounted read-only (EROFS). Without root (mount needs it): the folder made unwritable (EACCES),
    which root would ignore.
    """
    folder.mkdir(parents=True)
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield Disk(folder, os.strerror(errno.EACCES))
        finally:
            folder.chmod(0o755)
        return
    options = f"size={size},ro" if read_only else f"size={size}"
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(folder)], check=True)
    try:
        yield Disk(folder, os.strerror(errno.EROFS if read_only else errno.ENOSPC))
    finally:
        # lazy: a test that failed may still hold a file open on it
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def flip_tensor_bits(weights: Path, name: str) -> None:
    """Flip a bit of every value of float32 tensor `name` in a safetensors file, in place, as a bad disk would.

    The bit is the mantissa's highest (bit 22): each value moves by up to half itself and stays finite,
    so only the file's digest tells it apart. Nothing else of the file changes.
    """
    data = bytearray(weights.read_bytes())
    header_size = int.from_bytes(
        data[:8], "little"
    )  # safetensors: u64 header size, JSON header, tensor bytes
    entry = json.loads(data[8 : 8 + header_size])[name]
    assert entry["dtype"] == "F32", f"{name} is {entry['dtype']}, not float32"
    begin, end = (8 + header_size + offset for offset in entry["data_offsets"])
    for i in range(begin + 2, end, 4):  # little-endian: bits 16-23 are the value's third byte
        data[i] ^= 0x40
    weights.write_bytes(data)


def sigint_as_in_a_terminal() -> None:
    """A child's SIGINT back to the default (Python's KeyboardInterrupt), as in a terminal, for
    Popen's `preexec_fn`: a shell's background job, this test run maybe, starts with it ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def copy_code(dest: Path) -> None:
    """The pipeline's definition and code (dvc.yaml, .gitignore, src/, stages/, corpora/) copied into `dest`.

    examples/ too: tokenize depends on corpus.files.path, the example texts by default.
    """
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("dvc.yaml", ".gitignore"):
        shutil.copy2(PROJECT_ROOT / name, dest / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in ("src", "stages", "corpora", "examples"):
        shutil.copytree(PROJECT_ROOT / name, dest / name, ignore=ignore)


def project_env(project: Path, **extra: str) -> dict[str, str]:
    """The environment for a copied project's commands: conftest's (a temp MLflow store, GPTLAB_MIRROR,
    no analytics), the copy's own code on PYTHONPATH (not the editable install's), this interpreter's
    tools on PATH, and `extra`."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(project / "src"), os.environ.get("PYTHONPATH")])),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ["PATH"]]),
        **extra,
    }


def git(project: Path, *args: str) -> None:
    """`git ARGS` in `project` with a throwaway identity (commits need one); fails the test on an error."""
    identity = ("-c", "user.name=gptlab tests", "-c", "user.email=tests@gptlab.invalid")
    subprocess.run(["git", *identity, *args], cwd=project, check=True, capture_output=True)


def commit_as_fresh_clone(project: Path) -> None:
    """`project` made a git repository with everything in it committed, as a fresh clone is
    (`dvc exp run` and `gptlab run` start from the commit)."""
    git(project, "init", "-q")
    git(project, "add", "-A")
    git(project, "commit", "-q", "-m", "fresh clone")


def dvc(
    project: Path, *args: str, env: Mapping[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """`dvc ARGS` in `project` (this interpreter's dvc); fails the test, with dvc's output, unless it succeeds."""
    proc = subprocess.run(
        [dvc_executable(), *args],
        cwd=project,
        env=dict(os.environ if env is None else env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, f"dvc {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
    return proc


def dvc_exp_show(project: Path, *flags: str, env: Mapping[str, str] | None = None) -> str:
    """`dvc exp show FLAGS`'s output, asked again if it stalls as gptlab asks it (pygit2's blob reader
    can wait for good: gptlab/experiments/dvc_commands.py); fails the test unless it succeeds."""
    environment = dict(os.environ if env is None else env)
    done = ask_dvc(dvc_executable(), ["exp", "show", *flags], cwd=project, env=environment)
    assert done.code == 0, f"dvc exp show failed:\n{done.stdout}\n{done.stderr[-4000:]}"
    return done.stdout


# Pipeline outputs: a fresh clone has none of these.
OUTPUT_DIRS = ("data/", "models/", "reports/")


def copy_project(dest: Path) -> None:
    """What a fresh clone would hold: tracked files plus new, not ignored ones; no pipeline outputs.

    params.yaml is the committed one, so the checks below hold whatever the working tree's says.
    """
    listing = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listing.split("\0")):
        src = PROJECT_ROOT / rel
        if rel.startswith(OUTPUT_DIRS) or not src.is_file():
            continue
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(src, dest / rel)
    write_committed_params(dest)


# Variables that would point a child process's huggingface_hub elsewhere than the HF_HOME a test sets.
_HF_ENV_OVERRIDES = ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_ENDPOINT", "TRANSFORMERS_OFFLINE")


def hf_hub_cache(hf_home: Path, repo_id: str, revision: str, filename: str, data: bytes) -> Path:
    """`data` cached as `filename` of model `repo_id` at `revision`, laid out as the hub client lays it out.

    HF_HOME/hub/models--<org>--<name>/ holds the bytes once as blobs/<sha256> (an LFS file's etag),
    snapshots/<revision>/<filename> as a relative symlink to that blob, and refs/main naming the
    revision. Returns the snapshot path, the one hf_hub_download returns.
    """
    repo = hf_home / "hub" / ("models--" + repo_id.replace("/", "--"))
    blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
    blob.parent.mkdir(parents=True, exist_ok=True)
    blob.write_bytes(data)
    snapshot = repo / "snapshots" / revision / filename
    snapshot.parent.mkdir(parents=True, exist_ok=True)
    snapshot.symlink_to(os.path.relpath(blob, snapshot.parent))
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(revision, encoding="utf-8")
    return snapshot


def hf_env(hf_home: Path, **changes: str) -> dict[str, str]:
    """This process's environment for a child whose huggingface_hub uses `hf_home`, offline unless changed.

    huggingface_hub reads these variables once, when it is imported, so a test that sets them runs
    the code under test in a fresh interpreter.
    """
    env = {key: value for key, value in os.environ.items() if key not in _HF_ENV_OVERRIDES}
    return {**env, "HF_HOME": str(hf_home), "HF_HUB_OFFLINE": "1", **changes}


def closed_url() -> str:
    """A local URL where nothing listens: every request to it is refused, as with no network."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}"


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (hidden ones too) with its bytes: equal snapshots, nothing changed."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line_error(capsys: pytest.CaptureFixture[str], command: str) -> str:
    """The CLI's stderr, checked to be one `gptlab COMMAND: ...` line and no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"gptlab {command}: "), err
    return lines[0]


@contextlib.contextmanager
def served_model(uri: str, cwd: Path, env: Mapping[str, str]) -> Iterator[str]:
    """`mlflow models serve` on `uri` (this environment, one worker) until /ping answers: its base URL.

    Stopped after the block with SIGTERM to its process group, SIGKILL if it lingers; every wait bounded.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    mlflow_cli = Path(sys.executable).parent / "mlflow"
    command = [str(mlflow_cli), "models", "serve", "-m", uri, "--env-manager", "local"]
    log_path = cwd / "serve.log"
    with log_path.open("wb") as log:
        server = subprocess.Popen(
            [*command, "-h", "127.0.0.1", "-p", str(port), "-w", "1"],
            cwd=cwd,
            env=dict(env),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group, led by its PID: stopped with its workers
        )
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                assert server.poll() is None, log_path.read_text()[-3000:]
                with contextlib.suppress(OSError), urllib.request.urlopen(f"{url}/ping", timeout=5) as reply:
                    if reply.status == 200:
                        break
                assert time.monotonic() < deadline, "the server did not answer /ping within 120 s"
                time.sleep(1)
            yield url
        finally:
            for sig in (signal.SIGTERM, signal.SIGKILL):
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(server.pid, sig)
                try:
                    server.wait(timeout=30)
                    break
                except subprocess.TimeoutExpired:
                    continue
            with contextlib.suppress(ProcessLookupError):  # a worker that outlived the leader
                os.killpg(server.pid, signal.SIGKILL)


def invoke(url: str, body: Mapping[str, Any]) -> tuple[int, Any]:
    """POST `body` as JSON to the served model's /invocations: the HTTP status and the reply's JSON."""
    request = urllib.request.Request(
        f"{url}/invocations", data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as reply:
            return reply.status, json.loads(reply.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def free_port() -> int:
    """A local TCP port free now, for a server a test starts."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServedUrls:
    """What `serve_urls` gives a test: the GPTLAB_URL_REWRITE value and the paths the server was asked for."""

    rewrite: str
    requested: list[str]


@contextmanager
def serve_urls(files: Mapping[str, bytes], root: Path) -> Iterator[ServedUrls]:
    """A local HTTP server answering for these https URLs, and the GPTLAB_URL_REWRITE rule sending them to it.

    Each URL's bytes lie under `root` at host/path (its path decoded), so the pipeline's own fetch
    downloads them over real HTTP from their pinned URLs: any input's test can use it.
    """
    for url, data in files.items():
        parts = urllib.parse.urlsplit(url)
        path = root / parts.netloc / urllib.parse.unquote(parts.path).lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    requested: list[str] = []

    class Handler(http.server.SimpleHTTPRequestHandler):
        def do_GET(self) -> None:
            requested.append(self.path)
            super().do_GET()

        def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=root))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield ServedUrls(f"https://=http://127.0.0.1:{httpd.server_address[1]}/", requested)
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def wait_for(
    url: str, process: subprocess.Popen[bytes], seconds: float = 180, log: Path | None = None
) -> None:
    """Until `url` answers HTTP (any status); fails the test if `process` exits or `seconds` pass."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        assert process.poll() is None, f"the server for {url} exited with {process.returncode}"
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.2)
    pytest.fail(f"{url} did not answer within {seconds} s" + (f": {log.read_text()[-3000:]}" if log else ""))


class MlflowServer:
    """A real `mlflow server` on a SQLite store, started and killed (SIGKILL, all its processes)."""

    def __init__(self, store: Path) -> None:
        self.store, self.port = store, free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.store.mkdir(parents=True, exist_ok=True)
        command = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port)]
        command += ["--backend-store-uri", f"sqlite:///{self.store}/mlflow.db", "--workers", "1"]
        command += ["--artifacts-destination", str(self.store / "artifacts")]
        env = {**os.environ, **NO_JOB_RUNNER}  # as `gptlab ui` starts its server: no tracking call uses one
        with (self.store / "server.log").open("ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log, env=env, start_new_session=True)
        wait_for(f"{self.uri}/health", self.process, log=self.store / "server.log")
        # /health answers before the store is opened: the first API call opens it, which can take
        # longer than a test's tracking timeout on a loaded machine. Hand the test a warm server.
        search = f"{self.uri}/api/2.0/mlflow/experiments/search?max_results=1"
        with urllib.request.urlopen(search, timeout=120) as reply:
            assert reply.status == 200, f"{search} answered HTTP {reply.status}"

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def kill(self) -> None:
        if self.running:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
