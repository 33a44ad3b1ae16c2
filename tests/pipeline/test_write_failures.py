"""Writes that fail (issue 23, cases 3 and 11): one line naming the file, no temporary file left, and
the temporaries of a killed run (kill -9) removed by the next run of the same command.

The disks are real: as root (CI), a 1 MiB tmpfs the test mounts, written full (ENOSPC) or mounted
read-only (EROFS). Without root (mount needs it) the same tests run on a folder the user may not
write (EACCES), which root would ignore.
"""

from __future__ import annotations

import http.server
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from gptlab.cli.main import main
from gptlab.data.fetch import fetch, sha256_file
from gptlab.errors import GptlabError
from gptlab.model.build import build_gpt
from gptlab.model.checkpoint import cpu_weights, save_model, save_training_checkpoint
from gptlab.model.config import ModelConfig
from gptlab.pipeline.stage import stage_main

from helpers import PROJECT_ROOT, Disk, committed_params, small_disk

# ~8 MB of weights: more than the disk holds.
WIDE = ModelConfig(vocab_size=1000, context_length=32, emb_dim=256, n_heads=2, n_layers=2, drop_rate=0.0)
TINY = ModelConfig(vocab_size=300, context_length=32, emb_dim=32, n_heads=2, n_layers=1, drop_rate=0.0)


@pytest.fixture(params=["full", "read-only"])
def disk(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Disk]:
    """As root: a 1 MiB tmpfs (ENOSPC once written full), or one mounted read-only (EROFS)."""
    with small_disk(tmp_path / "disk", "1m", read_only=request.param == "read-only") as found:
        yield found


def one_line_error(capsys: pytest.CaptureFixture[str], prefix: str) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(prefix), err
    return lines[0]


def test_export_onto_a_full_disk_is_one_line_naming_the_file(
    tmp_path: Path, disk: Disk, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpoint = save_model(build_gpt(WIDE), tmp_path / "models" / "pretrain")
    out = disk.folder / "hf"
    assert main(["export", str(checkpoint), str(out)]) == 2
    line = one_line_error(capsys, "gptlab export: ")
    assert str(out) in line and disk.reason in line
    assert disk.leftovers() == []


def test_a_model_save_onto_a_full_disk_fails_the_stage_in_one_line(
    disk: Disk, capsys: pytest.CaptureFixture[str]
) -> None:
    """What the spam stage (training_stage) does last: save_model into models/spam."""
    target = disk.folder / "models" / "spam"
    model = build_gpt(WIDE)
    with pytest.raises(SystemExit) as stopped:
        stage_main(lambda _: save_model(model, target), None, ["--params", str(PROJECT_ROOT / "params.yaml")])
    assert stopped.value.code == 2
    line = one_line_error(capsys, "error: cannot write ")
    assert str(target) in line and disk.reason in line
    assert [p for p in disk.leftovers() if p.endswith(".tmp")] == []


def test_a_training_checkpoint_onto_a_full_disk_names_the_file(disk: Disk) -> None:
    """The weights fit, the training state (~4 MB of optimizer moments) does not: torch.save fails."""
    model = build_gpt(TINY)
    state = {"optimizer": {"exp_avg": torch.zeros(1 << 20)}, "steps": 3}
    with pytest.raises(GptlabError) as failed:
        save_training_checkpoint(disk.folder / "resume", 3, TINY, cpu_weights(model), state)
    message = str(failed.value)
    assert str(disk.folder / "resume" / "step-0000003") in message and disk.reason in message
    assert ".tmp" not in message  # named where it would have been, not by its temporary folder
    assert [p for p in disk.leftovers() if p != "resume"] == []


def test_mirror_onto_a_full_disk_names_the_file(
    shared_data: Path, disk: Disk, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GPTLAB_MIRROR", str(shared_data))
    params = PROJECT_ROOT / "params.yaml"
    assert main(["mirror", str(disk.folder / "m"), "--no-weights", "--params", str(params)]) == 2
    line = one_line_error(capsys, "gptlab mirror: cannot write ")
    assert str(disk.folder / "m") in line and disk.reason in line
    assert [p for p in disk.leftovers() if p.endswith(".part")] == []


@pytest.mark.slow
def test_report_onto_a_full_disk_names_the_file_and_leaves_no_temp(
    tmp_path: Path, disk: Disk, capsys: pytest.CaptureFixture[str]
) -> None:
    disk.fill()
    out = disk.folder / "REPRODUCTION.md"
    reports = tmp_path / "reports"
    reports.mkdir()
    assert main(["report", "--reports", str(reports), "--out", str(out)]) == 2
    line = one_line_error(capsys, "gptlab report: ")
    assert line == f"gptlab report: cannot write {out}: {disk.reason}"
    assert disk.leftovers() == []


# --------------------------------------------------------------------------- #
# 11. What a kill -9 left is removed by the next run of the same command
# --------------------------------------------------------------------------- #


def _run_killed(code: str) -> None:
    """Run `code` in a Python process of its own that ends by SIGKILL, as `kill -9` would end it."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr


def test_the_temporary_folder_of_a_killed_export_goes_on_the_next_export(tmp_path: Path) -> None:
    checkpoint = save_model(build_gpt(TINY), tmp_path / "models" / "pretrain")
    out = tmp_path / "out"
    _run_killed(
        "import os; from pathlib import Path; from gptlab.model.hf_gpt2 import write_folder_atomically\n"
        f"def half(tmp): (tmp / 'model.safetensors').write_bytes(b'x' * 4096); os.kill(os.getpid(), 9)\n"
        f"write_folder_atomically(Path({str(out)!r}), half)\n"
    )
    (orphan,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.")]
    assert orphan.name.endswith(".tmp") and (orphan / "model.safetensors").is_file()
    assert main(["export", str(checkpoint), str(out)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["models", "out"]


def test_a_temporary_file_of_a_live_writer_is_kept(tmp_path: Path) -> None:
    """Another process writing the same target at the same time keeps its temporary file."""
    from gptlab.files import write_json

    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        theirs = tmp_path / f".metrics.json.{live.pid}-abcdefgh.tmp"
        theirs.write_text("{")
        write_json(tmp_path / "metrics.json", {"a": 1})
        assert theirs.exists()
    finally:
        live.kill()
        live.wait()
    write_json(tmp_path / "metrics.json", {"a": 2})
    assert not theirs.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


class _Stalling(http.server.BaseHTTPRequestHandler):
    """Announces 100,000 bytes, sends 1,000 and then nothing until `done`: a download that will be killed."""

    done = threading.Event()

    def do_GET(self) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        self.wfile.write(b"x" * 1000)
        self.wfile.flush()
        self.done.wait(60)

    def log_message(self, *args: object) -> None:
        pass


def test_the_part_file_of_a_killed_download_goes_on_the_next_fetch(shared_data: Path, tmp_path: Path) -> None:
    pinned = committed_params().data.sources.gpt2_encoder_json
    dest = tmp_path / "raw" / pinned.path
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Stalling)
    threading.Thread(target=httpd.serve_forever, args=(0.05,), daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/encoder.json"
    code = f"from gptlab.data.fetch import fetch; fetch({str(dest)!r}, url={url!r}, sha256={pinned.sha256!r})"
    downloading = subprocess.Popen([sys.executable, "-c", code], stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not list(dest.parent.glob(f".{dest.name}.*.part")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
    finally:
        downloading.send_signal(signal.SIGKILL)
        downloading.wait()
        _Stalling.done.set()
        httpd.shutdown()
        httpd.server_close()
    (orphan,) = list(dest.parent.glob(f".{dest.name}.*.part"))
    got = fetch(dest, url=url, sha256=pinned.sha256, mirror_file=shared_data / pinned.path)
    assert got.origin == "mirror" and sha256_file(dest) == pinned.sha256
    assert not orphan.exists() and [p.name for p in dest.parent.iterdir()] == [dest.name]
    # Also when the file is there by then (put there by hand): the rerun tidies and fetches nothing.
    orphan.write_bytes(b"x" * 1000)
    assert fetch(dest, url=url, sha256=pinned.sha256).origin == "present"
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]
