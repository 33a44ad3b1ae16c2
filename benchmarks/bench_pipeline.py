"""The whole pipeline as a user runs it: `gptlab run --profile NAME`, each stage's wall time and peak memory.

The run happens in a fresh clone of this repository's HEAD (so its DVC cache is
empty and every stage runs, download included, offline through GPTLAB_MIRROR
or online), with the clone's own code first on the path. A watcher samples the
run's process tree every half second: a stage's wall time is from the first to
the last sample that saw its script (within a second), its peak memory the
largest resident set (VmHWM) the kernel reported for it.

    python benchmarks/bench_pipeline.py                      # the offline profile: about 80 min on 2 cores
    python benchmarks/bench_pipeline.py --profile smoke      # every stage on a tiny model: a few minutes
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
import yaml
from bench_stage import ROOT, load_average

SAMPLE_SECONDS = 0.5


def stage_names(project: Path) -> dict[str, str]:
    """dvc.yaml's stage name for each stage script (stages/tokenize_data.py -> tokenize)."""
    stages = yaml.safe_load((project / "dvc.yaml").read_text())["stages"]
    return {stage["cmd"].split()[1]: name for name, stage in stages.items()}


def stage_of(process: psutil.Process, names: dict[str, str]) -> str | None:
    """The DVC stage a process runs, if any."""
    try:
        script = next((arg for arg in process.cmdline() if arg.startswith("stages/")), None)
    except psutil.Error:
        return None
    return names.get(script, script) if script else None


def peak_rss_bytes(process: psutil.Process) -> int:
    """The kernel's high-water mark of the process's resident set (Linux), else its current one."""
    try:
        status = Path(f"/proc/{process.pid}/status").read_text()
        kib = next(line.split()[1] for line in status.splitlines() if line.startswith("VmHWM:"))
        return int(kib) * 1024
    except (OSError, StopIteration):
        return process.memory_info().rss


def watch(
    root: psutil.Process, names: dict[str, str], stages: dict[str, dict[str, float]], done: threading.Event
) -> None:
    """Record, per stage script, when it was first and last seen running and its peak RSS."""
    while not done.is_set():
        now = time.perf_counter()
        try:
            children = root.children(recursive=True)
        except psutil.Error:
            break
        for child in children:
            if (stage := stage_of(child, names)) is None:
                continue
            try:
                rss = peak_rss_bytes(child)
            except psutil.Error:
                continue
            row = stages.setdefault(stage, {"first": now, "last": now, "peak_rss_bytes": 0})
            row["last"] = now
            row["peak_rss_bytes"] = max(row["peak_rss_bytes"], rss)
        done.wait(SAMPLE_SECONDS)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines() if Path("/proc/cpuinfo").exists() else []:
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def measure(profile: str, name: str, log: Path) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="gptlab-bench-pipeline-") as tmp:
        project = Path(tmp) / "project"
        subprocess.run(["git", "clone", "-q", str(ROOT), str(project)], check=True)
        env = {**os.environ, "PYTHONPATH": str(project / "src")}
        gptlab = [sys.executable, "-c", "from gptlab.cli.main import main; raise SystemExit(main())"]
        stages: dict[str, dict[str, float]] = {}
        done = threading.Event()
        load_before = load_average()
        started = time.perf_counter()
        with log.open("w") as out:
            run = psutil.Popen(
                [*gptlab, "run", "--profile", profile, "--name", name],
                cwd=project,
                env=env,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
            watcher = threading.Thread(
                target=watch, args=(run, stage_names(project), stages, done), daemon=True
            )
            watcher.start()
            returncode = run.wait()
        wall = time.perf_counter() - started
        done.set()
        watcher.join()
    if returncode:
        raise SystemExit(f"gptlab run failed (exit {returncode}); its output: {log}")
    rows = [
        {
            "stage": stage,
            "seconds": row["last"] - row["first"],
            "peak_rss_gb": row["peak_rss_bytes"] / 1e9,
        }
        for stage, row in sorted(stages.items(), key=lambda item: item[1]["first"])
    ]
    return {
        "profile": profile,
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "load_before": load_before,
        "load_after": load_average(),
        "seconds": wall,
        "stages": rows,
    }


def table(result: dict[str, Any]) -> str:
    lines = ["| stage | wall | peak RSS |", "|---|---|---|"]
    for row in result["stages"]:
        minutes, seconds = divmod(round(row["seconds"]), 60)
        lines.append(f"| {row['stage']} | {minutes} min {seconds} s | {row['peak_rss_gb']:.2f} GB |")
    minutes, seconds = divmod(round(result["seconds"]), 60)
    peak = max((row["peak_rss_gb"] for row in result["stages"]), default=0.0)
    lines.append(f"| all of `gptlab run` | **{minutes} min {seconds} s** | {peak:.2f} GB |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--profile", default="offline", help="profiles/NAME.yaml (default: offline)")
    parser.add_argument("--name", default=None, help="the DVC experiment's name")
    parser.add_argument("--log", type=Path, default=Path("bench-pipeline.log"), help="gptlab run's output")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    name = args.name or f"bench-{args.profile}-{time.strftime('%Y%m%d-%H%M%S')}"
    result = measure(args.profile, name, args.log.resolve())
    print(
        f"{result['cpu']}, {result['cores']} cores; load {result['load_before']} before, "
        f"{result['load_after']} after"
    )
    print(table(result))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
