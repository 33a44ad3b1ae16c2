"""Where inputs come from: the tests' per-user cache (fetched like the pipeline does) and `gptlab mirror DIR`."""

from __future__ import annotations

import dataclasses
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

import platformdirs
import pytest
import yaml

from gptlab.cli.main import main as gptlab_main
from gptlab.data.config import Sources
from gptlab.data.fetch import sha256_file
from gptlab.data.inputs import data_inputs

from helpers import (
    CACHE_ENV,
    PROJECT_ROOT,
    cache_dir,
    closed_url,
    committed_params,
    committed_params_raw,
    fetch_test_inputs,
    hf_env,
    hf_hub_cache,
)

TESTS_DIR = Path(__file__).resolve().parents[1]  # tests/, where conftest.py lies


def pointed_at(base: str) -> Sources:
    """The committed pins (real paths, real sha256) with every URL moved to `base`/<source name>."""
    pinned = committed_params().data.sources
    moved = {
        field.name: dataclasses.replace(getattr(pinned, field.name), url=f"{base}/{field.name}")
        for field in dataclasses.fields(pinned)
    }
    return dataclasses.replace(pinned, **moved)


def files_under(folder: Path) -> list[str]:
    """Every file under `folder`, hidden temporary files included."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


class _CountingHandler(http.server.SimpleHTTPRequestHandler):
    def do_GET(self) -> None:
        self.server.requests.append(self.path)  # type: ignore[attr-defined]
        super().do_GET()

    def log_message(self, format: str, *args: object) -> None:  # keep test output quiet
        pass


@pytest.fixture
def server(tmp_path: Path, shared_data: Path) -> Iterator[tuple[Sources, list[str]]]:
    """The pinned inputs served on 127.0.0.1 as their URLs serve them (the spam data as a zip).

    Yields the pins pointed at this server and the list of paths it was asked for.
    """
    root = tmp_path / "served"
    root.mkdir()
    sources = pointed_at("http://127.0.0.1:0")  # only to list the files; URLs are set below
    for field in dataclasses.fields(sources):
        src = getattr(sources, field.name)
        if src.member is None:
            shutil.copyfile(shared_data / src.path, root / field.name)
        else:
            with zipfile.ZipFile(root / field.name, "w") as zf:
                zf.write(shared_data / src.path, src.member)
    httpd = http.server.ThreadingHTTPServer(
        ("127.0.0.1", 0), functools.partial(_CountingHandler, directory=root)
    )
    httpd.requests = []  # type: ignore[attr-defined]
    thread = threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield pointed_at(f"http://127.0.0.1:{httpd.server_address[1]}"), httpd.requests  # type: ignore[attr-defined]
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join()


def test_inputs_are_downloaded_once_verified_and_cached(
    server: tuple[Sources, list[str]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sources, requests = server
    monkeypatch.delenv("GPTLAB_MIRROR", raising=False)
    cache = tmp_path / "cache"

    assert fetch_test_inputs(sources, cache, mirror=None) == cache
    pins = data_inputs(sources)
    assert sorted(requests) == sorted(f"/{field.name}" for field in dataclasses.fields(sources))
    assert files_under(cache) == sorted(pin.path.as_posix() for pin in pins)  # nothing partial left
    for pin in pins:
        assert sha256_file(cache / pin.path) == pin.sha256, pin.path

    asked = len(requests)
    assert fetch_test_inputs(sources, cache, mirror=None) == cache  # a later run: all from the cache
    assert len(requests) == asked


def test_a_damaged_cached_file_is_fetched_again(server: tuple[Sources, list[str]], tmp_path: Path) -> None:
    sources, requests = server
    cache = tmp_path / "cache"
    fetch_test_inputs(sources, cache, mirror=None)
    verdict = cache / sources.the_verdict.path
    verdict.write_text("not The Verdict")
    requests.clear()
    fetch_test_inputs(sources, cache, mirror=None)
    assert requests == ["/the_verdict"]
    assert sha256_file(verdict) == sources.the_verdict.sha256


def test_with_neither_network_nor_mirror_the_failure_is_one_line(tmp_path: Path) -> None:
    base = closed_url()
    sources = pointed_at(base)
    with pytest.raises(pytest.fail.Exception) as info:
        fetch_test_inputs(sources, tmp_path / "cache", mirror=None)
    message = info.value.msg
    assert "\n" not in message
    assert "test input the-verdict.txt" in message and f"{base}/the_verdict" in message
    assert "GPTLAB_MIRROR is not set" in message and "set GPTLAB_MIRROR to a folder" in message
    assert "gptlab mirror DIR" in message
    assert files_under(tmp_path / "cache") == []

    empty = tmp_path / "empty-mirror"
    empty.mkdir()
    with pytest.raises(pytest.fail.Exception) as info:
        fetch_test_inputs(sources, tmp_path / "cache", mirror=empty)
    assert "\n" not in info.value.msg
    assert f"GPTLAB_MIRROR={empty} has no the-verdict.txt" in info.value.msg


@pytest.mark.slow
def test_pytest_run_offline_fails_the_tests_that_need_inputs_and_runs_the_others(tmp_path: Path) -> None:
    """The real fixture in a pytest run of its own: empty cache, no mirror, every URL refused."""
    (tmp_path / "test_tiny.py").write_text(
        "def test_needs_inputs(shared_data):\n"
        "    raise AssertionError('never reached')\n"
        "\n"
        "def test_needs_the_tokenizer(tokenizer):\n"
        "    raise AssertionError('never reached')\n"
        "\n"
        "def test_needs_nothing():\n"
        "    assert 1 + 1 == 2\n"
    )
    proxy = closed_url()  # urllib sends every request through it: a machine with no network
    env = {k: v for k, v in os.environ.items() if k.lower() not in ("gptlab_mirror", "no_proxy")}
    env.update(
        {
            CACHE_ENV: str(tmp_path / "cache"),
            "http_proxy": proxy,
            "https_proxy": proxy,
            "HTTP_PROXY": proxy,
            "HTTPS_PROXY": proxy,
            # The project's tests/ on the path, so `-p conftest` loads the fixtures under test.
            "PYTHONPATH": os.pathsep.join(filter(None, [str(TESTS_DIR), env.get("PYTHONPATH")])),
        }
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "test_tiny.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    out = proc.stdout
    assert proc.returncode == 1, out + proc.stderr
    assert "1 passed, 2 errors" in out, out
    # Each test that needs inputs reports exactly one line: no traceback, no chained exceptions.
    url = committed_params().data.sources.the_verdict.url
    report = out[out.index("= ERRORS =") : out.index("short test summary info")].splitlines()[1:-1]
    assert len(report) == 4, out
    for header, line in zip(report[::2], report[1::2], strict=True):
        assert "ERROR at setup of test_needs_" in header, out
        assert line.startswith("test input the-verdict.txt (data.sources.the_verdict, "), out
        assert url in line and "GPTLAB_MIRROR is not set" in line and "set GPTLAB_MIRROR to a folder" in line
    assert not (tmp_path / "cache").exists() or files_under(tmp_path / "cache") == []


def test_cache_dir_is_per_user_and_overridable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(CACHE_ENV)
    assert cache_dir() == Path(platformdirs.user_cache_dir("gptlab"))


def _committed_params_file(folder: Path, **weights: dict[str, object]) -> Path:
    raw = committed_params_raw()
    if weights:
        raw["gpt2"]["weights"] = weights
    path = folder / "params.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False), encoding="utf-8")
    return path


def test_mirror_command_writes_a_folder_that_serves_as_gptlab_mirror(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("GPTLAB_MIRROR", str(shared_data))  # the source here; on a user's machine, the URLs
    params = _committed_params_file(tmp_path)
    out = tmp_path / "offline"

    assert gptlab_main(["mirror", str(out), "--no-weights", "--params", str(params)]) == 0
    pins = data_inputs(committed_params().data.sources)
    assert files_under(out) == sorted(pin.path.as_posix() for pin in pins)
    for pin in pins:
        assert sha256_file(out / pin.path) == pin.sha256, pin.path
    printed = capsys.readouterr().out
    assert f"export GPTLAB_MIRROR={out.resolve()}" in printed

    assert gptlab_main(["mirror", str(out), "--no-weights", "--params", str(params)]) == 0
    assert printed.count("mirror)") == len(pins) and capsys.readouterr().out.count("present)") == len(pins)

    # On the offline machine: with every URL refused, the folder supplies every input.
    cache = fetch_test_inputs(pointed_at(closed_url()), tmp_path / "cache", mirror=out)
    assert files_under(cache) == files_under(out)


def test_mirror_command_with_a_gutenberg_profile_writes_its_books_too(
    shared_data: Path, gutenberg_books: list, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPTLAB_MIRROR", str(shared_data))
    books = str(PROJECT_ROOT / committed_params().corpus.gutenberg.books)
    corpus = {"name": "gutenberg", "gutenberg": {"books": books, "books_per_author": 2, "max_books": 3}}
    profile = tmp_path / "three-books.yaml"
    profile.write_text(yaml.safe_dump({"corpus": corpus}), encoding="utf-8")
    out = tmp_path / "offline"

    params = _committed_params_file(tmp_path)
    assert (
        gptlab_main(["mirror", str(out), "--no-weights", "--params", str(params), "--profile", str(profile)])
        == 0
    )
    folder = out / committed_params().corpus.gutenberg.path
    assert sorted(p.name for p in folder.iterdir()) == sorted(b.file for b in gutenberg_books[:3])
    for book in gutenberg_books[:3]:
        assert sha256_file(folder / book.file) == book.sha256


def test_mirror_command_writes_weights_at_gpt2_weights_name_filename(
    shared_data: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    blob = os.urandom(4096)
    pin = {
        "repo_id": "example/tiny-gpt2",
        "revision": "0" * 40,
        "filename": "model.safetensors",
        "sha256": hashlib.sha256(blob).hexdigest(),
        "size": len(blob),
    }
    params = _committed_params_file(tmp_path, tiny=pin)
    source = tmp_path / "source-mirror"
    shutil.copytree(shared_data, source)
    (source / "gpt2-weights" / "tiny").mkdir(parents=True)
    (source / "gpt2-weights" / "tiny" / "model.safetensors").write_bytes(blob)
    monkeypatch.setenv("GPTLAB_MIRROR", str(source))

    out = tmp_path / "offline"
    assert gptlab_main(["mirror", str(out), "--params", str(params)]) == 0
    assert (out / "gpt2-weights" / "tiny" / "model.safetensors").read_bytes() == blob
    assert "gpt2.weights.tiny:" in capsys.readouterr().out

    # Weights neither in the mirror nor in the Hugging Face cache, offline: exit 2, the file named,
    # and how to skip weights.
    (source / "gpt2-weights" / "tiny" / "model.safetensors").unlink()
    hf_home = tmp_path / "hf-home"
    again = tmp_path / "offline-2"
    proc = mirror_command(again, params, hf_env(hf_home))
    assert proc.returncode == 2
    assert "gpt2.weights.tiny: model.safetensors of example/tiny-gpt2 at revision " in proc.stderr
    assert "is not in the Hugging Face cache" in proc.stderr and "--no-weights" in proc.stderr
    assert str(again / "gpt2-weights" / "tiny" / "model.safetensors") in proc.stderr
    assert not (again / "gpt2-weights").exists() or files_under(again / "gpt2-weights") == []

    # In the Hugging Face cache: the hub client's file is verified and copied out (a mirror holds files).
    hf_hub_cache(hf_home, "example/tiny-gpt2", "0" * 40, "model.safetensors", blob)
    proc = mirror_command(again, params, hf_env(hf_home))
    assert proc.returncode == 0, proc.stderr
    assert (again / "gpt2-weights" / "tiny" / "model.safetensors").read_bytes() == blob
    assert not (again / "gpt2-weights" / "tiny" / "model.safetensors").is_symlink()
    assert (
        f"gpt2.weights.tiny: {again / 'gpt2-weights/tiny/model.safetensors'} (4,096 bytes, huggingface)"
        in proc.stdout
    )


def mirror_command(out: Path, params: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """`gptlab mirror OUT` in a fresh interpreter, whose huggingface_hub reads `env` when imported."""
    return subprocess.run(
        [sys.executable, "-m", "gptlab.cli.main", "mirror", str(out), "--params", str(params)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_mirror_command_imports_no_torch(shared_data: Path, tmp_path: Path) -> None:
    params = _committed_params_file(tmp_path)
    code = (
        "import argparse, sys\n"
        "from gptlab.cli import mirror\n"
        "parser = argparse.ArgumentParser()\n"
        "mirror.add_arguments(parser)\n"
        f"code = mirror.run(parser.parse_args([{str(tmp_path / 'out')!r}, '--no-weights', '--params', "
        f"{str(params)!r}]))\n"
        "heavy = [m for m in ('torch', 'mlflow', 'pandas') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "sys.exit(code)\n"
    )
    env = {**os.environ, "GPTLAB_MIRROR": str(shared_data)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert len(files_under(tmp_path / "out")) == len(data_inputs(committed_params().data.sources))
