"""The two fine-tuning stages at full data, default params against profiles/fast.yaml, in figures per unit.

spam-finetune and instruct-finetune each run in a fresh process, rounds
interleaved, in a temporary copy of the project per variant (bench_stage.py's:
its tracked files, download and tokenize run offline through GPTLAB_MIRROR).
The base models are built as the offline profile builds them
(`gpt2.source: pretrain`: load-gpt2 converts this pipeline's own pretrained
model, gpt2-small's dimensions with context 256, into both fine-tunes' base
models) from one pretrain cut to one step, since weights do not change speed;
load-gpt2 runs in each copy, so the base models compute with the variant's
kernels (pretrain.model.attention and .kernels).

Every training record is read, but training stops after `--max-steps` steps
(a full spam run is 20 min or more a variant on 2 CPU cores), so the figures
that count are per unit and do not depend on the cap: seconds per training
step and per evaluation (the loop's own breakdown, what the stage logs as
`<kind>/training_seconds.json`), and seconds per answer (instruct's greedy
answers to every test record, timed around the stage's call of
`generate_responses`). Weights do change one thing: where an answer ends at
end-of-text. A model this barely trained may run every answer to
instruct.max_new_tokens, which `--answer-tokens` sets (32 by default; the
book's 256 would take over 20 min of answers at batch 1), and the breakdown
prints the answers' mean length (roughly: their text encoded again). Beside
them, the stage's wall time (start-up, the final full-split scores and MLflow logging included,
so it grows with the data, not the cap) and the peak RSS of the stage process.

    python benchmarks/bench_finetune.py --smoke     # the smoke profile's tiny model and data: a few minutes
    python benchmarks/bench_finetune.py             # full data, 20 steps, 32-token answers: 24 min on 2 quiet CPU cores (Zen 4)
    python benchmarks/bench_finetune.py --stages instruct-finetune --max-steps 10 --rounds 3
"""

from __future__ import annotations

import argparse
import importlib
import json
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from bench_stage import child_env, load_average, merged, prepared_project

STAGES = {"spam-finetune": "spam_finetune", "instruct-finetune": "instruct_finetune"}
VARIANTS = ("default", "fast")
# The per-unit figures, then the stage's totals, in the table's order: key and heading.
FIGURES = {
    "seconds_per_step": "s/step",
    "seconds_per_evaluation": "s/eval",
    "seconds_per_answer": "s/answer",
    "wall_seconds": "wall",
    "peak_rss_gb": "peak RSS",
}


@dataclass(frozen=True)
class Sizes:
    """What the runs are cut to: the smoke profile's model and data or the full ones, steps, answer length."""

    smoke: bool
    max_steps: int
    answer_tokens: int


def variant_params(project: Path, variant: str, sizes: Sizes) -> dict[str, Path]:
    """The variant's params file for the fine-tunes, and the one that builds their base models.

    Both read params.yaml with the offline profile's `gpt2.source: pretrain` (and the smoke
    profile with --smoke), then fast.yaml for the fast variant. The base models' file also cuts
    pretrain to one step and logs no MLflow models: what it builds is not timed.
    """
    params = merged(
        yaml.safe_load((project / "params.yaml").read_text()),
        yaml.safe_load((project / "profiles/offline.yaml").read_text()),
    )
    if sizes.smoke:
        params = merged(params, yaml.safe_load((project / "profiles/smoke.yaml").read_text()))
    if variant == "fast":
        params = merged(params, yaml.safe_load((project / "profiles/fast.yaml").read_text()))
    capped = {
        "spam": {"train": {"max_steps": sizes.max_steps}},
        "instruct": {"train": {"max_steps": sizes.max_steps}, "max_new_tokens": sizes.answer_tokens},
        "tracking": {"experiment": f"bench-finetune-{variant}"},
    }
    params = merged(params, capped)
    base = merged(params, {"pretrain": {"train": {"max_steps": 1}}, "tracking": {"log_models": False}})
    files = {"finetune": project / "params-finetune.yaml", "base": project / "params-base.yaml"}
    for name, values in (("finetune", params), ("base", base)):
        files[name].write_text(yaml.safe_dump(values, sort_keys=False))
    return files


def prepared_copies(workdir: Path, sizes: Sizes) -> dict[str, tuple[Path, Path]]:
    """A project copy per variant holding its data and base models, and its fine-tunes' params file.

    The pretrained model is built once, in the first copy (its weights are no variant's);
    load-gpt2 runs in each, so each variant's base models compute with its own kernels.
    """
    first = prepared_project(
        workdir / VARIANTS[0], lambda project: variant_params(project, VARIANTS[0], sizes)["base"]
    )
    run_script(first, "pretrain", first / "params-base.yaml")
    copies = {}
    for variant in VARIANTS:
        project = workdir / variant / "project"
        if not project.exists():  # a fresh MLflow store: each copy's runs are its own
            shutil.copytree(first, project, ignore=shutil.ignore_patterns("mlflow.db", "mlruns"))
        files = variant_params(project, variant, sizes)
        run_script(project, "load_gpt2", files["base"])
        copies[variant] = (project, files["finetune"])
    return copies


def run_script(project: Path, stage: str, params: Path) -> None:
    """Run stages/<stage>.py in `project` with `params`, untimed: what the fine-tunes start from."""
    done = subprocess.run(
        [sys.executable, f"stages/{stage}.py", "--params", str(params)],
        cwd=project,
        env=child_env(project),
        capture_output=True,
        text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"{project.parent.name}: {stage} failed:\n{done.stderr[-3000:]}")


def run_stage(project: Path, stage: str, params: Path) -> dict[str, Any]:
    """One fresh process running `stage`: its wall seconds and what `stage_process` recorded in it."""
    report = project / f"bench-{stage}.json"
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--stage-process",
        stage,
        str(params),
        str(report),
    ]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=project, env=child_env(project), capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{stage} failed:\n{done.stderr[-3000:]}")
    recorded = json.loads(report.read_text())
    training = recorded["training"]
    phases = training["phase_seconds"]
    answers = recorded.get("answers")
    return {
        "wall_seconds": wall,
        "peak_rss_gb": recorded["peak_rss_kb"] / 1024**2,
        "seconds_per_step": phases["step"] / training["steps"],
        "seconds_per_evaluation": phases["evaluation"] / training["evaluations"],
        "seconds_per_answer": answers["seconds"] / answers["count"] if answers else None,
        "steps": training["steps"],
        "evaluations": training["evaluations"],
        "answers": answers["count"] if answers else None,
        "answer_tokens": answers["tokens"] if answers else None,
        "training_seconds": training["wall_seconds"],
        "phases": phases,
    }


def stage_process(stage: str, params: Path, report: Path) -> None:
    """Run `stage` in this process as its script does, and record what its loop and its answering took.

    The stage runs unchanged: the shared loop's result (steps, evaluations, seconds by phase)
    and the answers are recorded on their way back to it.
    """
    from gptlab.pipeline import training_stage
    from gptlab.pipeline.stage import stage_main
    from gptlab.tasks import instruction_scores

    module = importlib.import_module(f"stages.{STAGES[stage]}")
    recorded: dict[str, Any] = {}
    fit = training_stage.fit

    def recorded_fit(*args: Any, **kwargs: Any) -> Any:
        result = fit(*args, **kwargs)
        recorded["training"] = {
            "steps": result.steps - result.resumed_steps,
            "evaluations": len(result.history),
            "wall_seconds": result.wall_seconds,
            "phase_seconds": result.phase_seconds,
        }
        return result

    training_stage.fit = recorded_fit
    generate_responses = instruction_scores.generate_responses  # instruct's answers; spam gives none

    def timed_answers(model: Any, tokenizer: Any, *args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        answers = generate_responses(model, tokenizer, *args, **kwargs)
        seconds = time.perf_counter() - started
        tokens = sum(len(tokenizer.encode(a["model_response"])) for a in answers)  # about: re-encoded
        recorded["answers"] = {"count": len(answers), "seconds": seconds, "tokens": tokens}
        return answers

    instruction_scores.generate_responses = timed_answers
    stage_main(module.run, module.__doc__, ["--params", str(params)])
    peaks = (resource.getrusage(who).ru_maxrss for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    report.write_text(json.dumps({**recorded, "peak_rss_kb": max(peaks)}))  # Linux: kilobytes


def measure(stages: list[str], sizes: Sizes, rounds: int) -> list[dict[str, Any]]:
    """One row per stage and variant (medians over the rounds), then each stage's fast/default ratios."""
    with tempfile.TemporaryDirectory(prefix="gptlab-bench-finetune-") as tmp:
        projects = prepared_copies(Path(tmp), sizes)
        runs: dict[tuple[str, str], list[dict[str, Any]]] = {}
        for _ in range(rounds):
            for stage in stages:
                for variant in VARIANTS:
                    project, params = projects[variant]
                    row = run_stage(project, stage, params)
                    runs.setdefault((stage, variant), []).append(row)
                    print(f"  {stage} {variant}: {row['wall_seconds']:.1f} s", file=sys.stderr)
    rows = []
    for stage in stages:
        medians = {variant: _medians(runs[stage, variant]) for variant in VARIANTS}
        rows += [{"stage": stage, "variant": variant, **medians[variant]} for variant in VARIANTS]
        ratios = {
            key: medians["fast"][key] / medians["default"][key] if medians["default"][key] else None
            for key in FIGURES
        }
        rows.append({"stage": stage, "variant": "fast/default", **ratios})
    return rows


def _medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure's median over the rounds; counts and the phase breakdown of the last round."""
    figures = {
        key: statistics.median(r[key] for r in runs) if runs[0][key] is not None else None for key in FIGURES
    }
    return {**runs[-1], **figures}


def print_table(rows: list[dict[str, Any]], sizes: Sizes) -> None:
    data = "the smoke profile's model and data" if sizes.smoke else "full data, gpt2-small dims, context 256"
    print(
        f"fine-tuning stages, default params vs profiles/fast.yaml ({data}; training capped at "
        f"{sizes.max_steps} steps, answers at {sizes.answer_tokens} new tokens at most)"
    )
    print(f"{'stage':<18} {'variant':<13}" + "".join(f" {heading:>9}" for heading in FIGURES.values()))
    for row in rows:
        ratio = row["variant"] == "fast/default"
        cells = [_cell(row[key], key, ratio) for key in FIGURES]
        print(f"{row['stage']:<18} {row['variant']:<13}" + "".join(f" {cell:>9}" for cell in cells))
    for row in rows:
        if "phases" in row:
            phases = ", ".join(f"{k} {v:.1f}" for k, v in row["phases"].items())
            answers = (
                f", {row['answers']} answers of ~{row['answer_tokens'] / row['answers']:.0f} tokens"
                if row["answers"]
                else ""
            )
            print(
                f"{row['stage']} {row['variant']}: {row['steps']} steps, {row['evaluations']} evaluations"
                f"{answers}; training loop {row['training_seconds']:.1f} s ({phases}), the rest of the "
                f"stage {row['wall_seconds'] - row['training_seconds']:.1f} s"
            )


def _cell(value: float | None, key: str, ratio: bool) -> str:
    """One table cell, never blank nor holding a space: "-" where the figure does not apply."""
    if value is None:
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
    parser.add_argument(
        "--max-steps", type=int, default=20, help="training steps per run (the data stays full)"
    )
    parser.add_argument(
        "--answer-tokens", type=int, default=32, help="instruct.max_new_tokens: the length of each answer"
    )
    parser.add_argument(
        "--stages", nargs="+", choices=STAGES, default=list(STAGES), help="the stages to time"
    )
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians are printed")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument("--stage-process", nargs=3, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage_process is not None:  # one stage's own process
        stage, params, report = args.stage_process
        stage_process(stage, Path(params), Path(report))
        return
    for name, value in (("--max-steps", args.max_steps), ("--answer-tokens", args.answer_tokens)):
        if value < 1:
            parser.error(f"{name} must be at least 1, got {value}")
    sizes = Sizes(args.smoke, args.max_steps, args.answer_tokens)

    before = load_average()
    rows = measure(args.stages, sizes, args.rounds)
    after = load_average()
    print_table(rows, sizes)
    print(f"load average before: {before}; after: {after}")
    if args.json is not None:
        args.json.write_text(json.dumps({"load_before": before, "load_after": after, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
