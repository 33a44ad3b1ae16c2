"""benchmarks/bench_pipeline.py: each DVC stage's wall time and peak memory, read off a real process tree."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import psutil
import pytest
import yaml

from helpers import PROJECT_ROOT

# A stage that holds `mb` MB resident for `seconds` s, as a DVC stage's script would run.
SCRIPT = """
import sys, time
held = bytearray(int(sys.argv[1]) * 1_000_000)
held[::4096] = b"x" * len(held[::4096])  # touch every page, so that it is resident
time.sleep(float(sys.argv[2]))
"""


@pytest.fixture
def bench_pipeline(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.syspath_prepend(PROJECT_ROOT / "benchmarks")  # as the script itself runs: its siblings
    import bench_pipeline

    return bench_pipeline


def test_the_watcher_times_each_stage_of_a_process_tree_and_its_peak_memory(
    bench_pipeline, tmp_path: Path
) -> None:
    (tmp_path / "stages").mkdir()
    for script in ("tokenize_data.py", "pretrain.py"):
        (tmp_path / "stages" / script).write_text(SCRIPT)
    stages = {
        "tokenize": {"cmd": "python stages/tokenize_data.py"},
        "pretrain": {"cmd": "python stages/pretrain.py"},
    }
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}))
    names = bench_pipeline.stage_names(tmp_path)
    assert names == {"stages/tokenize_data.py": "tokenize", "stages/pretrain.py": "pretrain"}

    # A shell runs the two stages one after the other, as `dvc repro` does under `gptlab run`.
    python = sys.executable
    run = psutil.Popen(
        ["sh", "-c", f"{python} stages/tokenize_data.py 50 1.5 && {python} stages/pretrain.py 250 2.5"],
        cwd=tmp_path,
    )
    seen: dict[str, dict[str, float]] = {}
    done = threading.Event()
    watcher = threading.Thread(target=bench_pipeline.watch, args=(run, names, seen, done))
    watcher.start()
    assert run.wait(timeout=60) == 0
    done.set()
    watcher.join(timeout=10)

    assert list(seen) == ["tokenize", "pretrain"]  # in the order they ran
    tokenize, pretrain = seen["tokenize"], seen["pretrain"]
    assert tokenize["last"] <= pretrain["first"]
    # Seen every half second: a stage's span is its run time within a sample either side.
    assert 1.5 - 1.0 <= tokenize["last"] - tokenize["first"] <= 1.5 + 5.0
    assert 2.5 - 1.0 <= pretrain["last"] - pretrain["first"] <= 2.5 + 5.0
    assert tokenize["peak_rss_bytes"] >= 50e6 and pretrain["peak_rss_bytes"] >= 250e6
    assert tokenize["peak_rss_bytes"] < pretrain["peak_rss_bytes"]


def test_the_table_gives_every_stage_and_the_whole_run(bench_pipeline) -> None:
    result = {
        "seconds": 3725.4,
        "stages": [
            {"stage": "download", "seconds": 2.2, "peak_rss_gb": 0.31},
            {"stage": "pretrain", "seconds": 605.0, "peak_rss_gb": 3.456},
        ],
    }
    assert bench_pipeline.table(result).splitlines() == [
        "| stage | wall | peak RSS |",
        "|---|---|---|",
        "| download | 0 min 2 s | 0.31 GB |",
        "| pretrain | 10 min 5 s | 3.46 GB |",
        "| all of `gptlab run` | **62 min 5 s** | 3.46 GB |",
    ]


def test_the_benchmark_names_its_options() -> None:
    shown = subprocess.run(
        [sys.executable, "benchmarks/bench_pipeline.py", "--help"],
        cwd=PROJECT_ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert all(option in shown for option in ("--profile", "--name", "--log", "--json"))
