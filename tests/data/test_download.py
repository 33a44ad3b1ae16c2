"""The download stage: pinned files from a present copy, the mirror or a URL, verified and atomic."""

from __future__ import annotations

import functools
import hashlib
import http.server
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from gptlab.data.config import SourceFile
from gptlab.data.fetch import FetchError, fetch, sha256_file
from gptlab.pipeline.params import load_params
from stages.download import run

from helpers import PROJECT_ROOT, committed_params, committed_params_raw

# Nothing listens here: a test that reaches this URL fails, proving no download happened.
UNREACHABLE = "http://127.0.0.1:9/never-fetched"


@pytest.fixture(scope="module")
def sources() -> dict[str, SourceFile]:
    """The pins of the committed params.yaml."""
    pinned = committed_params().data.sources
    return {name: getattr(pinned, name) for name in vars(pinned)}


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves a folder; /truncated promises 1,000 bytes and sends 10."""

    def do_GET(self) -> None:
        if self.path != "/truncated":
            super().do_GET()
            return
        self.send_response(200)
        self.send_header("Content-Length", "1000")
        self.end_headers()
        self.wfile.write(b"0123456789")
        self.close_connection = True

    def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
        pass


@pytest.fixture
def server(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """A local HTTP server on an ephemeral port; yields (base URL, the folder it serves)."""
    root = tmp_path / "served"
    root.mkdir()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Handler, directory=root))
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}", root
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def _files(folder: Path) -> list[str]:
    """Every file under `folder`, hidden temporary files included."""
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file())


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_from_mirror_gives_the_pinned_bytes(shared_data: Path, sources, tmp_path: Path) -> None:
    verdict = sources["the_verdict"]
    dest = tmp_path / "raw" / verdict.path
    got = fetch(dest, url=UNREACHABLE, sha256=verdict.sha256, mirror_file=shared_data / verdict.path)
    assert (got.origin, got.path) == ("mirror", dest)
    assert dest.read_bytes() == (shared_data / verdict.path).read_bytes()
    assert got.size == dest.stat().st_size
    assert _files(tmp_path / "raw") == [verdict.path]
    # Published with the umask's mode, not a temporary file's private 0600.
    umask = os.umask(0)
    os.umask(umask)
    assert dest.stat().st_mode & 0o777 == 0o666 & ~umask


def test_present_file_with_right_hash_is_kept(shared_data: Path, sources, tmp_path: Path) -> None:
    verdict = sources["the_verdict"]
    dest = tmp_path / verdict.path
    shutil.copyfile(shared_data / verdict.path, dest)
    os.utime(dest, ns=(1_000_000_000, 1_000_000_000))
    before = dest.stat()
    got = fetch(dest, url=UNREACHABLE, sha256=verdict.sha256, mirror_file=None)
    after = dest.stat()
    assert got.origin == "present"
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_stale_present_file_is_replaced_from_mirror(shared_data: Path, sources, tmp_path: Path) -> None:
    verdict = sources["the_verdict"]
    dest = tmp_path / verdict.path
    dest.write_text("an older edition\n")
    got = fetch(dest, url=UNREACHABLE, sha256=verdict.sha256, mirror_file=shared_data / verdict.path)
    assert got.origin == "mirror"
    assert sha256_file(dest) == verdict.sha256


def test_tampered_mirror_file_is_refused(shared_data: Path, sources, tmp_path: Path) -> None:
    verdict = sources["the_verdict"]
    mirror_file = tmp_path / "mirror" / verdict.path
    mirror_file.parent.mkdir()
    tampered = (shared_data / verdict.path).read_bytes().replace(b"Gisburn", b"Gisborn", 1)
    mirror_file.write_bytes(tampered)
    raw = tmp_path / "raw"
    with pytest.raises(FetchError) as info:
        fetch(raw / verdict.path, url=UNREACHABLE, sha256=verdict.sha256, mirror_file=mirror_file)
    message = str(info.value)
    assert verdict.sha256 in message and _sha256(tampered) in message
    assert str(mirror_file) in message and UNREACHABLE in message and "GPTLAB_MIRROR" in message
    assert _files(raw) == []


def test_url_download_of_a_plain_file(server, shared_data: Path, sources, tmp_path: Path) -> None:
    base, served = server
    verdict = sources["the_verdict"]
    shutil.copyfile(shared_data / verdict.path, served / "verdict.txt")
    raw = tmp_path / "raw"
    # A mirror without the file falls through to the URL.
    got = fetch(
        raw / verdict.path,
        url=f"{base}/verdict.txt",
        sha256=verdict.sha256,
        mirror_file=tmp_path / "empty-mirror" / verdict.path,
        size=(shared_data / verdict.path).stat().st_size,
    )
    assert got.origin == "url"
    assert sha256_file(got.path) == verdict.sha256
    assert _files(raw) == [verdict.path]


@pytest.mark.parametrize("member", ["SMSSpamCollection", "nested/SMSSpamCollection"])
def test_url_zip_extracts_only_the_member(
    server, shared_data: Path, sources, tmp_path: Path, member: str
) -> None:
    base, served = server
    spam = sources["sms_spam"]
    with zipfile.ZipFile(served / "sms spam.zip", "w", zipfile.ZIP_DEFLATED) as zf:
        zf.write(shared_data / spam.path, member)
        zf.writestr("readme", "not wanted")
    raw = tmp_path / "raw"
    got = fetch(raw / "spam" / "SMS", url=f"{base}/sms%20spam.zip", sha256=spam.sha256, member=member)
    assert got.origin == "url"
    assert got.path.read_bytes() == (shared_data / spam.path).read_bytes()
    # Written to dest, never to the zip's own path; the downloaded archive is gone.
    assert _files(raw) == ["spam/SMS"]


@pytest.mark.parametrize("member", ["../evil.txt", "a/../../evil.txt", "/tmp/evil.txt", "C:\\evil.txt", ""])
def test_zip_member_escaping_the_folder_is_refused(server, tmp_path: Path, member: str) -> None:
    base, served = server
    evil = b"overwrite something\n"
    with zipfile.ZipFile(served / "evil.zip", "w") as zf:
        zf.writestr(zipfile.ZipInfo(member or "x"), evil)
    raw = tmp_path / "raw"
    with pytest.raises(FetchError, match="zip member") as info:
        fetch(raw / "file.txt", url=f"{base}/evil.zip", sha256=_sha256(evil), member=member)
    assert repr(member) in str(info.value)
    assert not raw.exists()
    assert [p for p in tmp_path.rglob("*evil.txt")] == []
    assert not (tmp_path.parent / "evil.txt").exists()


def test_zip_without_the_member_is_refused(server, tmp_path: Path) -> None:
    base, served = server
    with zipfile.ZipFile(served / "other.zip", "w") as zf:
        zf.writestr("something-else", "x")
    raw = tmp_path / "raw"
    with pytest.raises(FetchError, match="no member 'SMSSpamCollection'.*something-else"):
        fetch(raw / "SMS", url=f"{base}/other.zip", sha256="0" * 64, member="SMSSpamCollection")
    assert _files(raw) == []


def test_truncated_download_is_refused(server, tmp_path: Path) -> None:
    base, _ = server
    raw = tmp_path / "raw"
    with pytest.raises(FetchError, match="IncompleteRead.*990 more expected") as info:
        fetch(raw / "file.bin", url=f"{base}/truncated", sha256=_sha256(b"0123456789" * 100))
    assert f"{base}/truncated" in str(info.value)
    assert _files(raw) == []


def test_incorrect_download_is_refused_with_both_hashes(server, tmp_path: Path) -> None:
    base, served = server
    (served / "file.txt").write_bytes(b"what the server has\n")
    expected = _sha256(b"what the pin says\n")
    raw = tmp_path / "raw"
    with pytest.raises(FetchError) as info:
        fetch(raw / "file.txt", url=f"{base}/file.txt", sha256=expected)
    assert expected in str(info.value) and _sha256(b"what the server has\n") in str(info.value)
    assert _files(raw) == []


def test_wrong_size_is_refused_even_with_the_right_hash(server, tmp_path: Path) -> None:
    base, served = server
    data = b"twenty bytes of data"
    (served / "file.txt").write_bytes(data)
    raw = tmp_path / "raw"
    with pytest.raises(FetchError, match="20 bytes read"):
        fetch(raw / "file.txt", url=f"{base}/file.txt", sha256=_sha256(data), size=19)
    assert _files(raw) == []


def test_http_error_names_the_url(server, tmp_path: Path) -> None:
    base, _ = server
    with pytest.raises(FetchError, match="HTTP Error 404") as info:
        fetch(tmp_path / "missing.txt", url=f"{base}/missing.txt", sha256="0" * 64)
    assert f"{base}/missing.txt" in str(info.value)
    assert _files(tmp_path) == []


def _project(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A temp project dir holding the committed params.yaml with raw_dir moved; cwd is set to it."""
    params = committed_params_raw()
    params["data"]["raw_dir"] = "inputs/raw"
    project = tmp_path / "project"
    project.mkdir()
    (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    monkeypatch.chdir(project)
    return project


def _runs(experiment: str) -> list:
    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r}"
    return client.search_runs([found.experiment_id], order_by=["attributes.start_time ASC"])


@pytest.mark.slow
def test_stage_fetches_every_source_and_logs_a_run(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = _project(tmp_path, monkeypatch)
    params = load_params("params.yaml")
    run(params)
    sources = {name: getattr(params.data.sources, name) for name in vars(params.data.sources)}
    raw = project / "inputs" / "raw"
    assert _files(raw) == sorted(src.path for src in sources.values())
    for src in sources.values():
        assert sha256_file(raw / src.path) == src.sha256

    run(params)  # a second run keeps every file
    first, second = _runs(params.tracking.experiment)
    for mlflow_run, origin in ((first, "mirror"), (second, "present")):
        assert mlflow_run.info.run_name == "download"
        assert mlflow_run.info.status == "FINISHED"
        assert mlflow_run.data.params["data.raw_dir"] == "inputs/raw"
        for name, src in sources.items():
            assert mlflow_run.data.tags[f"origin.{name}"] == origin
            assert mlflow_run.data.params[f"bytes.{name}"] == str((raw / src.path).stat().st_size)


@pytest.mark.slow
def test_stage_script_exits_nonzero_on_a_tampered_mirror(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    project = _project(tmp_path, monkeypatch)
    mirror = tmp_path / "mirror"
    shutil.copytree(shared_data, mirror)
    tampered = mirror / "instruction-data.json"
    tampered.write_bytes(tampered.read_bytes()[:-1])
    # The script as dvc.yaml runs it (-P: the stages/ folder must not shadow stdlib modules).
    result = subprocess.run(
        [sys.executable, "-P", str(PROJECT_ROOT / "stages" / "download.py"), "--params", "params.yaml"],
        cwd=project,
        env={**os.environ, "GPTLAB_MIRROR": str(mirror)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "error: could not fetch" in result.stderr and sha256_file(tampered) in result.stderr
    fetched = _files(project / "inputs" / "raw")
    assert "instruction-data.json" not in fetched
    assert not [f for f in fetched if f.endswith(".part")]
    (failed,) = _runs(load_params("params.yaml").tracking.experiment)
    assert failed.info.status == "FAILED"
