"""spam-finetune with its frozen trunk computed once, against the whole model on every pass, side by side.

Both paths read one project copy (bench_stage.py's: download and tokenize run
offline through GPTLAB_MIRROR) and one base model built the offline profile's
way (bench_finetune.py's: pretrain cut to one step, converted by load-gpt2, so
gpt2-small's dimensions with context 256). The stage runs at params.yaml's
chapter 6 settings with `spam.cache_frozen_trunk` true ("cached") and false
("whole"), each in a fresh process, rounds interleaved. Printed per path: the
stage's wall time, the training loop's seconds per step and per evaluation, the
trunk's one-off computation, the rest of the stage (start-up, initial and final
scores, outputs), peak RSS, and whether both paths wrote the same bytes
(metrics, reports, the checkpoint).

    python benchmarks/bench_frozen_trunk.py --smoke                # the smoke profile's model and data: ~1 min
    python benchmarks/bench_frozen_trunk.py --max-rows 96 --max-steps 12   # gpt2-small dims, a slice of the data
    python benchmarks/bench_frozen_trunk.py --max-steps 20         # full data, 20 steps: ~15 min on 2 quiet cores
    python benchmarks/bench_frozen_trunk.py                        # the whole stage, 650 steps: about an hour
    python benchmarks/bench_frozen_trunk.py --against 94f0011      # and the stage as that commit wrote it
    python benchmarks/bench_frozen_trunk.py --paths cached --against 94f0011   # the default stage vs that commit's

`--against REV` adds a third run: REV's own code (`git archive`) on the same
inputs and base model, at REV's params.yaml with the same profile and caps,
timed from outside (wall, peak RSS); its metrics and reports must equal the
cached path's byte for byte.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from bench_finetune import Sizes, run_script
from bench_finetune import variant_params as base_params
from bench_stage import ROOT, child_env, load_average, merged, prepared_project

PATHS = {"cached": True, "whole": False}
STAGE = "spam_finetune"
OUTPUTS = (
    "reports/spam/metrics.json",
    "reports/spam/counts.json",
    "reports/spam/losses.csv",
    "reports/spam/accuracy.csv",
    "reports/spam/predictions.csv",
    "models/spam/model.safetensors",
    "models/spam/config.json",
)
REPORTS_COMPARED = OUTPUTS[:5]  # another commit's checkpoint may carry other metadata: its numbers only
FIGURES = {
    "wall_seconds": "wall",
    "trunk_seconds": "trunk",
    "seconds_per_step": "s/step",
    "seconds_per_evaluation": "s/eval",
    "rest_seconds": "rest",
    "peak_rss_gb": "peak RSS",
}


@dataclass(frozen=True)
class Size:
    """What the runs are cut to: the smoke profile's model and data, the spam rows per split, the steps."""

    smoke: bool
    max_rows: int | None
    max_steps: int | None

    def describe(self) -> str:
        model = "the smoke profile's model" if self.smoke else "gpt2-small dims, context 256"
        rows = f"at most {self.max_rows} messages per split" if self.max_rows else "full data"
        if self.smoke and not self.max_rows:
            rows = "the smoke profile's data"
        steps = f"training capped at {self.max_steps} steps" if self.max_steps else "the whole training"
        return f"{model}, {rows}, {steps}"


def prepared(workdir: Path, size: Size) -> tuple[Path, dict[str, Path]]:
    """The project copy with its base model, and a params file per path."""

    def sliced_base(project: Path) -> Path:  # the base models' params, the spam rows cut to --max-rows
        base = base_params(project, "default", Sizes(size.smoke, 1, 32))["base"]
        if size.max_rows:
            values = yaml.safe_load(base.read_text())
            values["tokenize"]["spam"]["max_rows"] = size.max_rows
            base.write_text(yaml.safe_dump(values, sort_keys=False))
        return base

    project = prepared_project(workdir, sliced_base)
    base = project / "params-base.yaml"
    run_script(project, "pretrain", base)
    run_script(project, "load_gpt2", base)
    params = profile_params(project, size)
    files = {}
    for path, cache in PATHS.items():
        files[path] = project / f"params-{path}.yaml"
        files[path].write_text(
            yaml.safe_dump(merged(params, {"spam": {"cache_frozen_trunk": cache}}), sort_keys=False)
        )
    return project, files


def profile_params(project: Path, size: Size) -> dict[str, Any]:
    """`project`'s params.yaml with its offline profile, at `size` (chapter 6's trainable kept for smoke)."""
    params = merged(
        yaml.safe_load((project / "params.yaml").read_text()),
        yaml.safe_load((project / "profiles/offline.yaml").read_text()),
    )
    if size.smoke:  # its data and model; chapter 6's trainable (the profile trains all, with no frozen trunk)
        trainable = params["spam"]["trainable"]
        params = merged(params, yaml.safe_load((project / "profiles/smoke.yaml").read_text()))
        params["spam"]["trainable"] = trainable
    tracking = {"experiment": "bench-frozen-trunk", "log_models": False}
    return merged(params, {"spam": {"train": {"max_steps": size.max_steps}}, "tracking": tracking})


def commit_copy(project: Path, rev: str, size: Size) -> tuple[Path, Path]:
    """REV's own code (`git archive`) holding `project`'s inputs and base model; its params file."""
    copy = project.parent / "against"
    copy.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(copy)], input=archive.stdout, check=True)
    shutil.copytree(project / "data", copy / "data", dirs_exist_ok=True)  # the archive holds data/.gitignore
    shutil.copytree(project / "models" / "gpt2", copy / "models" / "gpt2", dirs_exist_ok=True)
    params = copy / "params-against.yaml"
    params.write_text(yaml.safe_dump(profile_params(copy, size), sort_keys=False))
    return copy, params


def run_commit(copy: Path, params: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """REV's stage script in a fresh process, timed from outside: wall and peak RSS; its reports."""
    # Its output to a file, not a pipe: nothing reads a pipe during wait4, and a full one stops the stage.
    with tempfile.TemporaryFile() as output:
        started = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, f"stages/{STAGE}.py", "--params", str(params)],
            cwd=copy,
            env=child_env(copy),
            stdout=output,
            stderr=subprocess.STDOUT,
        )
        _, status, usage = os.wait4(proc.pid, 0)
        wall = time.perf_counter() - started
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here, not by Popen
        if proc.returncode != 0:
            output.seek(0)
            failed = output.read().decode(errors="replace")[-3000:]
            raise RuntimeError(f"spam-finetune at the other commit failed:\n{failed}")
    figures = {key: None for key in FIGURES} | {
        "wall_seconds": wall,
        "peak_rss_gb": usage.ru_maxrss / 1024**2,
    }
    return figures, {name: (copy / name).read_bytes() for name in REPORTS_COMPARED}


def run_path(project: Path, params: Path) -> tuple[dict[str, Any], dict[str, bytes]]:
    """One fresh process running the stage: its figures, and the bytes of what it wrote."""
    report = project / "bench-frozen-trunk.json"
    command = [sys.executable, str(Path(__file__).resolve()), "--stage-process", str(params), str(report)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=project, env=child_env(project), capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"spam-finetune failed:\n{done.stderr[-3000:]}")
    recorded = json.loads(report.read_text())
    phases = recorded["phase_seconds"]
    figures = {
        "wall_seconds": wall,
        "trunk_seconds": recorded["trunk_seconds"],
        "seconds_per_step": phases["step"] / recorded["steps"],
        "seconds_per_evaluation": phases["evaluation"] / recorded["evaluations"],
        "rest_seconds": wall - recorded["trunk_seconds"] - recorded["training_seconds"],
        "peak_rss_gb": recorded["peak_rss_kb"] / 1024**2,
        "steps": recorded["steps"],
        "evaluations": recorded["evaluations"],
        "training_seconds": recorded["training_seconds"],
        "summary": recorded["summary"],
    }
    return figures, {name: (project / name).read_bytes() for name in OUTPUTS}


def stage_process(params: Path, report: Path) -> None:
    """Run the stage in this process as its script does, recording its loop's figures and its trunk's."""
    from gptlab.pipeline import training_stage
    from gptlab.pipeline.stage import stage_main

    module = importlib.import_module(f"stages.{STAGE}")
    recorded: dict[str, Any] = {}
    fit, spam_trunk = training_stage.fit, module.spam_trunk

    def recorded_fit(*args: Any, **kwargs: Any) -> Any:
        result = fit(*args, **kwargs)
        recorded.update(
            steps=result.steps - result.resumed_steps,
            evaluations=len(result.history),
            training_seconds=result.wall_seconds,
            phase_seconds=result.phase_seconds,
        )
        return result

    @contextmanager
    def recorded_trunk(*args: Any, **kwargs: Any) -> Iterator[Any]:
        with spam_trunk(*args, **kwargs) as trunk:
            recorded.update(trunk_seconds=trunk.seconds, summary=trunk.summary)
            yield trunk

    training_stage.fit, module.spam_trunk = recorded_fit, recorded_trunk
    stage_main(module.run, module.__doc__, ["--params", str(params)])
    peaks = (resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    report.write_text(json.dumps({**recorded, "peak_rss_kb": max(peaks)}))  # Linux: kilobytes


def measure(
    size: Size, rounds: int, against: str | None = None, paths: tuple[str, ...] = tuple(PATHS)
) -> tuple[list[dict[str, Any]], bool, bool | None]:
    """One row per path (medians over the rounds) and the ratios to the cached path; whether every run
    of both paths wrote the same bytes; whether `against` wrote the same metrics and reports (None: no run)."""
    with tempfile.TemporaryDirectory(prefix="gptlab-bench-frozen-trunk-") as tmp:
        project, files = prepared(Path(tmp), size)
        runs: dict[str, list[dict[str, Any]]] = {path: [] for path in paths}
        written: dict[str, list[dict[str, bytes]]] = {path: [] for path in paths}
        if against is not None:
            copy, against_params = commit_copy(project, against, size)
            runs[against], written[against] = [], []
        for _ in range(rounds):
            for path in runs:
                if path == against:
                    figures, outputs = run_commit(copy, against_params)
                else:
                    figures, outputs = run_path(project, files[path])
                runs[path].append(figures)
                written[path].append(outputs)
                print(f"  {path}: {figures['wall_seconds']:.1f} s", file=sys.stderr)
    rows = []
    for path, measured in runs.items():
        medians = {key: _median([r[key] for r in measured]) for key in FIGURES}
        rows.append({"path": path, **measured[-1], **medians})
    cached, *others = rows
    for other in others:
        ratio = {key: _ratio(cached[key], other[key]) for key in FIGURES}
        rows.append({"path": f"cached/{other['path']}", **ratio})
    reference = written["cached"][0]
    same = all(_same(outputs, reference) for path in paths for outputs in written[path])
    same_against = None if against is None else all(_same(o, reference) for o in written[against])
    return rows, same, same_against


def _same(outputs: dict[str, bytes], reference: dict[str, bytes]) -> bool:
    """Every file of `outputs` (an `against` run: REPORTS_COMPARED) is the same in `reference`."""
    return all(reference[name] == data for name, data in outputs.items())


def _median(values: list[float | None]) -> float | None:
    return None if None in values else statistics.median(values)


def _ratio(value: float | None, baseline: float | None) -> float | None:
    return value / baseline if value is not None and baseline else None


def print_table(
    rows: list[dict[str, Any]], size: Size, same: bool, against: str | None, same_against: bool | None
) -> None:
    print(f"spam-finetune, frozen trunk cached vs the whole model ({size.describe()})")
    print(f"{'path':<13}" + "".join(f" {heading:>9}" for heading in FIGURES.values()))
    for row in rows:
        ratio = row["path"].startswith("cached/")
        print(f"{row['path']:<13}" + "".join(f" {_cell(row[key], key, ratio):>9}" for key in FIGURES))
    ours = [row for row in rows if row["path"] in PATHS]
    for row in ours:
        print(
            f"{row['path']}: {row['steps']} steps, {row['evaluations']} evaluations, training loop "
            f"{row['training_seconds']:.1f} s; frozen trunk cache {row['summary']}"
        )
    if len(ours) > 1:
        print(f"same outputs (metrics, reports, checkpoint) on both paths: {'yes' if same else 'NO'}")
    if against is not None:
        print(f"same metrics and reports at {against} as cached: {'yes' if same_against else 'NO'}")


def _cell(value: float | None, key: str, ratio: bool) -> str:
    """One table cell, never blank: "-" where the figure does not apply (the whole model computes no trunk)."""
    if value is None or (key == "trunk_seconds" and value == 0 and not ratio):
        return "-"
    if ratio:
        return f"{value:.2f}x"
    if key == "peak_rss_gb":
        return f"{value:.2f}GB"
    return f"{value:.3f}" if value < 10 else f"{value:.1f}"


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="the smoke profile's tiny model and data")
    parser.add_argument("--max-rows", type=int, default=None, help="spam messages per split (default: all)")
    parser.add_argument("--max-steps", type=int, default=None, help="training steps per run (default: all)")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians are printed")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--paths",
        nargs="+",
        choices=list(PATHS),
        default=list(PATHS),
        help="which of our paths to run (cached, the yardstick, always runs)",
    )
    parser.add_argument(
        "--against", metavar="REV", default=None, help="also run the stage as this git commit wrote it"
    )
    parser.add_argument("--stage-process", nargs=2, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage_process is not None:  # the stage's own process
        stage_process(*(Path(arg) for arg in args.stage_process))
        return
    for name, value in (("--max-rows", args.max_rows), ("--max-steps", args.max_steps)):
        if value is not None and value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    size = Size(args.smoke, args.max_rows, args.max_steps)
    before = load_average()
    paths = tuple(path for path in PATHS if path == "cached" or path in args.paths)
    rows, same, same_against = measure(size, args.rounds, args.against, paths)
    after = load_average()
    print_table(rows, size, same, args.against, same_against)
    print(f"load average before: {before}; after: {after}")
    if args.json is not None:
        payload = {"load_before": before, "load_after": after, "same_outputs": same, "rows": rows}
        payload |= {"against": args.against, "same_as_against": same_against}
        args.json.write_text(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
