"""A tracking store that cannot be used (issue 43, items 6 to 8): one line naming it and the fix, exit code 2.

The stores are real SQLite files: on a read-only disk (as root, a tmpfs the test mounts and then remounts
read-only; without root, a folder and file the user may not write, which root would ignore), damaged
(random bytes), or locked by another process holding an exclusive transaction. Each is tried by
`gptlab ui --print-url`, `gptlab report` and a stage.
"""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path

import pytest

from gptlab.cli.main import main
from gptlab.pipeline.stage import stage_main
from gptlab.tracking.runs import stage_run

from helpers import PROJECT_ROOT, copy_empty_store, one_line_error, write_committed_params


@pytest.fixture
def disk(tmp_path: Path) -> Iterator[Path]:
    """A folder on its own disk (a tmpfs, as root), made read-only by `read_only`."""
    folder = tmp_path / "disk"
    folder.mkdir()
    if os.geteuid() != 0:
        yield folder
        for path in [folder, *folder.rglob("*")]:
            path.chmod(0o755 if path.is_dir() else 0o644)
        return
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(folder)], check=True)
    try:
        yield folder
    finally:
        subprocess.run(["umount", "--lazy", str(folder)], check=True)


def read_only(folder: Path) -> None:
    """Nothing in `folder` can be written any more: the disk remounted read-only (as root), else modes."""
    if os.geteuid() == 0:
        subprocess.run(["mount", "-o", "remount,ro", str(folder)], check=True)
        return
    for path in [*folder.rglob("*"), folder]:
        path.chmod(0o555 if path.is_dir() else 0o444)


@pytest.fixture
def db(tmp_path: Path, empty_store: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A new SQLite store that MLFLOW_TRACKING_URI names, none of its files open; the working folder `tmp_path`."""
    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    copy_empty_store(empty_store, db)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.chdir(tmp_path)
    return db


def report(tmp_path: Path) -> list[str]:
    reports = tmp_path / "reports"
    reports.mkdir(exist_ok=True)
    book = PROJECT_ROOT / "reproduction" / "book.yaml"
    return [
        "report",
        "--reports",
        str(reports),
        "--out",
        str(tmp_path / "R.md"),
        "--book",
        str(book),
        "--log",
    ]


def stage(params: Path) -> int:
    """A stage as the scripts in stages/ run one: its exit code."""
    with pytest.raises(SystemExit) as stopped:
        stage_main(lambda _: stage_run("eval", "exp", {}).__enter__(), None, ["--params", str(params)])
    return int(stopped.value.code)


def fails_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], store: str, said: str, *, ui: bool = True
) -> None:
    """`gptlab ui --print-url` (when `ui`), `gptlab report` and a stage each exit 2 with one line naming
    `store` and saying `said`."""
    params = write_committed_params(tmp_path)
    lines = []
    for command, argv in (("ui", ["ui", "--print-url"]), ("report", report(tmp_path)))[0 if ui else 1 :]:
        assert main(argv) == 2
        lines.append(one_line_error(capsys, command))
    assert stage(params) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    lines.append(err.strip().removeprefix("error: "))
    for line in lines:
        assert f"MLflow tracking store {store} {said}" in line and "MLFLOW_TRACKING_URI" in line, line


def test_a_read_only_project_with_the_default_store(
    tmp_path: Path, disk: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    write_committed_params(disk)
    read_only(disk)
    monkeypatch.chdir(disk)
    fails_in_one_line(tmp_path, capsys, f"sqlite:///{disk}/mlflow.db", "cannot be opened or created")
    assert sorted(p.name for p in disk.iterdir()) == ["params.yaml"]


def test_a_read_only_store_is_read_but_not_written(
    tmp_path: Path,
    disk: Path,
    empty_store: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    uri = f"sqlite:///{disk}/mlflow.db"
    copy_empty_store(empty_store, disk / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.chdir(tmp_path)
    read_only(disk)
    write_committed_params(tmp_path)
    assert main(["ui", "--print-url"]) == 0  # reading is all it does
    capsys.readouterr()
    fails_in_one_line(tmp_path, capsys, uri, "cannot be written", ui=False)


def test_a_damaged_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    db.write_bytes(os.urandom(20_000))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    monkeypatch.chdir(tmp_path)
    fails_in_one_line(tmp_path, capsys, f"sqlite:///{db}", "is damaged (file is not a database)")


@pytest.mark.slow  # SQLite waits 5 s for a lock before it gives up, for each of the three
def test_a_store_locked_by_another_process(
    tmp_path: Path, db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    hold = "import sqlite3, sys, time\n"
    hold += f"sqlite3.connect({str(db)!r}, isolation_level=None).execute('BEGIN EXCLUSIVE')\n"
    hold += "print('locked', flush=True)\ntime.sleep(600)\n"
    holder = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        fails_in_one_line(
            tmp_path, capsys, f"sqlite:///{db}", "is locked by another process (database is locked)"
        )
    finally:
        holder.kill()
        holder.wait()


def test_a_store_left_mid_transaction_by_a_killed_process_is_rolled_back_and_used(
    tmp_path: Path, db: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A stage killed with SIGKILL while it writes leaves a hot journal beside the store: the next
    command rolls it back, as SQLite does for any writer, rather than calling the store read-only."""
    write = "import sqlite3, sys, time\n"
    write += f"db = sqlite3.connect({str(db)!r}, isolation_level=None)\n"
    write += "db.execute('PRAGMA cache_size=1')\ndb.execute('BEGIN')\n"  # a tiny cache: pages reach the file
    write += 'db.execute("CREATE TABLE unfinished AS SELECT zeroblob(2000) AS b FROM experiments, (SELECT 1 '
    write += 'UNION SELECT 2 UNION SELECT 3 UNION SELECT 4 UNION SELECT 5 UNION SELECT 6 UNION SELECT 7 UNION SELECT 8)")\n'
    write += "db.execute('UPDATE experiments SET name = name || \\'-half\\'')\n"
    write += "print('writing', flush=True)\ntime.sleep(600)\n"
    writer = subprocess.Popen([sys.executable, "-c", write], stdout=subprocess.PIPE, text=True)
    assert writer.stdout.readline().strip() == "writing"
    writer.kill()
    writer.wait()
    assert (db.parent / "mlflow.db-journal").stat().st_size > 0  # what the killed writer left

    write_committed_params(tmp_path)
    assert main(report(tmp_path)) == 0  # a stage's run: the store checked, then logged to
    assert main(["ui", "--print-url"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert not (db.parent / "mlflow.db-journal").exists()
    with closing(sqlite3.connect(db)) as store:
        tables = {name for (name,) in store.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        names = [name for (name,) in store.execute("SELECT name FROM experiments")]
    assert "unfinished" not in tables and not any(name.endswith("-half") for name in names)


# A stage's MLflow run, started once the file named by argv[1] exists: so two start together.
STAGE_AT_ONCE = """\
import sys, time
from pathlib import Path
import mlflow  # before the start: what each process loads first takes it a second or more
from gptlab.tracking.runs import stage_run
print("ready", flush=True)
while not Path(sys.argv[1]).exists():
    time.sleep(0.005)
with stage_run(sys.argv[2], "gptlab", {"toy": 1}, system_metrics=False) as run:
    run.log_metrics({"toy/x": 1.0})
"""


@pytest.mark.slow
def test_two_pipelines_starting_at_once_on_a_new_store_both_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Row 80: both created the store's tables and ran its migrations, and one failed ("duplicate column
    name: step", or alembic's "expected to match one row")."""
    db = tmp_path / "store" / "mlflow.db"
    db.parent.mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{db}")
    go = tmp_path / "go"
    stages = [
        subprocess.Popen(
            [sys.executable, "-c", STAGE_AT_ONCE, str(go), name],
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for name in ("first", "second")
    ]
    assert [stage.stdout.readline().strip() for stage in stages] == ["ready", "ready"]
    go.touch()
    for stage in stages:
        out, err = stage.communicate(timeout=300)
        assert stage.returncode == 0, err[-2000:]
    with closing(sqlite3.connect(db)) as store:
        finished = store.execute("SELECT name, status FROM runs ORDER BY name").fetchall()
    assert finished == [("first", "FINISHED"), ("second", "FINISHED")]
