"""The pretrain stage end to end against the book's own chapter 5 loop, on the same data and settings.

Four variants, each a fresh process, rounds interleaved:

- book: chapter 5's `train_model_simple` written here from the book's text
  (seed 123, GPTModel with the masked-softmax attention, AdamW(lr,
  weight_decay=0.1), an evaluation of eval_iter batches every eval_freq steps,
  a greedy sample with the uncached `generate_text_simple` after each epoch);
  its loop's wall time is the yardstick;
- book-kept: the same loop in a process that keeps freed memory as the stages
  do (gptlab.pipeline.memory), to show how much of a stage's lead that setting is;
- default: `python stages/pretrain.py` at params.yaml's (book-exact) settings;
- fast: the same stage with profiles/fast.yaml's overrides.

The stage runs in a temporary copy of the project (its tracked files, then the
download and tokenize stages, offline through GPTLAB_MIRROR), so it pays what a
real run pays: start-up, MLflow, full-split losses, checkpoints, outputs. The
stage's own breakdown (seconds by phase) is printed beside its wall time.
Targets: default <= 1.0x the book loop; fast <= 0.40x where bf16 is fast
(AMX or AVX-512 BF16 CPUs), <= 0.6x elsewhere.

    python benchmarks/bench_stage.py --smoke           # the smoke model: about a minute
    python benchmarks/bench_stage.py --epochs 1        # GPT-2 small dims, one epoch: a few minutes
    python benchmarks/bench_stage.py                   # the real thing (10 epochs): ~10 min per variant
    python benchmarks/bench_stage.py --variants fast   # the fast stage and the yardstick only
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml

from gptlab.experiments.smoke import prepare_workspace, source_commit_env
from gptlab.pipeline.memory import keep_freed_memory

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("book", "book-kept", "default", "fast")
PHASES_PREFIX = "seconds by phase: "


def prepared_project(workdir: Path, params: Callable[[Path], Path] | None = None) -> Path:
    """A copy of the project (as `gptlab smoke` makes one) with the download and tokenize stages run.

    `params(project)`, if given, writes the params file those stages read (params.yaml otherwise),
    so that data sliced by a profile is tokenized once, already sliced.
    """
    project = workdir / "project"
    prepare_workspace(ROOT, project, source_commit_env(ROOT))
    chosen = ["--params", str(params(project))] if params else []
    for stage in ("download", "tokenize_data"):
        subprocess.run(
            [sys.executable, f"stages/{stage}.py", *chosen],
            cwd=project,
            env=child_env(project),
            check=True,
            capture_output=True,
        )
    return project


def child_env(project: Path) -> dict[str, str]:
    """The copy's own code first on the path (the venv's editable install may point elsewhere)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(project / "src"), str(project)])}


def merged(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        out[key] = (
            merged(base[key], value) if isinstance(value, dict) and isinstance(base.get(key), dict) else value
        )
    return out


def variant_params(project: Path, smoke: bool, epochs: int | None) -> dict[str, Path]:
    """A params file per stage variant: book-exact (params.yaml) and fast, at the chosen size."""
    base = yaml.safe_load((project / "params.yaml").read_text())
    if smoke:
        base = merged(
            base, {"pretrain": yaml.safe_load((project / "profiles/smoke.yaml").read_text())["pretrain"]}
        )
    if epochs is not None:
        base = merged(base, {"pretrain": {"train": {"epochs": epochs}}})
    fast = merged(base, yaml.safe_load((project / "profiles/fast.yaml").read_text()))
    files = {}
    for name, params in (("default", base), ("fast", fast)):
        files[name] = project / f"params-{name}.yaml"
        files[name].write_text(yaml.safe_dump(params, sort_keys=False))
    return files


def run_variant(project: Path, variant: str, params_files: dict[str, Path]) -> dict[str, Any]:
    """Wall seconds of one fresh process running `variant`, and what it reported."""
    book = variant.startswith("book")
    params = params_files["default" if book else variant]
    if book:
        command = [sys.executable, str(Path(__file__).resolve()), "--book-loop", str(params)]
        command += ["--keep-freed-memory"] if variant == "book-kept" else []
    else:
        command = [sys.executable, "stages/pretrain.py", "--params", str(params)]
    started = time.perf_counter()
    done = subprocess.run(command, cwd=project, env=child_env(project), capture_output=True, text=True)
    wall = time.perf_counter() - started
    if done.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{done.stderr[-3000:]}")
    row: dict[str, Any] = {"variant": variant, "process_seconds": wall}
    if book:
        row.update(json.loads(done.stdout.strip().splitlines()[-1]))
        row["seconds"] = row["loop_seconds"]  # the yardstick: the book's training loop
    else:
        phases = next(line for line in done.stderr.splitlines() if line.startswith(PHASES_PREFIX))
        row["phases"] = json.loads(phases.removeprefix(PHASES_PREFIX))
        row["seconds"] = wall  # the whole stage, start-up included
    return row


# ---------------------------------------------------------------------- #
# The book's chapter 5 loop, written from its text (run in its own process)
# ---------------------------------------------------------------------- #


def book_loop(params_file: Path) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from torch.utils.data import DataLoader

    from gptlab.data.verdict import GPTDatasetV1
    from gptlab.model.build import build_gpt
    from gptlab.model.tokenizer import load_tokenizer
    from gptlab.pipeline.params import load_params

    params = load_params(params_file)
    cfg = params.pretrain
    raw_dir = Path(params.data.raw_dir)
    tokenizer = load_tokenizer(raw_dir)
    text = (raw_dir / params.data.sources.the_verdict.path).read_text(encoding="utf-8")
    split_idx = int(params.tokenize.verdict.train_ratio * len(text))

    def loader(part: str, shuffle: bool) -> DataLoader:
        dataset = GPTDatasetV1(tokenizer.encode(part), cfg.data.max_length, cfg.data.stride)
        return DataLoader(dataset, batch_size=cfg.train.batch_size, shuffle=shuffle, drop_last=shuffle)

    torch.manual_seed(cfg.train.seed)
    train_loader, val_loader = loader(text[:split_idx], True), loader(text[split_idx:], False)
    model_cfg = cfg.model.resolve()
    assert model_cfg.attention == "masked_softmax", (
        "the book's model computes attention with a masked softmax"
    )
    torch.manual_seed(cfg.train.seed)
    model = build_gpt(model_cfg)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.train.lr, weight_decay=cfg.train.weight_decay)

    def calc_loss_batch(input_batch, target_batch):
        logits = model(input_batch)
        return F.cross_entropy(logits.flatten(0, 1), target_batch.flatten())

    def calc_loss_loader(data_loader, num_batches):
        num_batches = min(num_batches, len(data_loader))
        total = 0.0
        for i, (input_batch, target_batch) in enumerate(data_loader):
            if i >= num_batches:
                break
            total += calc_loss_batch(input_batch, target_batch).item()
        return total / num_batches

    def generate_text_simple(idx, max_new_tokens, context_size):
        for _ in range(max_new_tokens):
            with torch.no_grad():
                logits = model(idx[:, -context_size:])[:, -1, :]
            idx = torch.cat((idx, torch.argmax(logits, dim=-1, keepdim=True)), dim=1)
        return idx

    started = time.perf_counter()
    train_losses, tokens_seen, global_step = [], 0, -1
    for _epoch in range(cfg.train.epochs):
        model.train()
        for input_batch, target_batch in train_loader:
            optimizer.zero_grad()
            loss = calc_loss_batch(input_batch, target_batch)
            loss.backward()
            optimizer.step()
            tokens_seen += input_batch.numel()
            global_step += 1
            if global_step % cfg.train.eval_freq == 0:
                model.eval()
                with torch.no_grad():
                    train_losses.append(calc_loss_loader(train_loader, cfg.train.eval_iter))
                    calc_loss_loader(val_loader, cfg.train.eval_iter)
                model.train()
        model.eval()  # generate_and_print_sample
        encoded = torch.tensor(tokenizer.encode(cfg.sample.prompt)).unsqueeze(0)
        ids = generate_text_simple(encoded, cfg.sample.max_new_tokens, model.pos_emb.weight.shape[0])
        print(tokenizer.decode(ids.squeeze(0).tolist()).replace("\n", " "), file=sys.stderr)
        model.train()
    loop = time.perf_counter() - started
    return {"loop_seconds": loop, "steps": global_step + 1, "last_eval_train_loss": train_losses[-1]}


# ---------------------------------------------------------------------- #


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def measure(
    smoke: bool, epochs: int | None, rounds: int, variants: tuple[str, ...] = VARIANTS
) -> list[dict[str, Any]]:
    """Rows of (variant, median seconds, ratio to the book loop, ...), rounds interleaved."""
    with tempfile.TemporaryDirectory(prefix="gptlab-bench-stage-") as tmp:
        project = prepared_project(Path(tmp))
        params_files = variant_params(project, smoke, epochs)
        runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in variants}
        for _ in range(rounds):
            for variant in variants:
                runs[variant].append(run_variant(project, variant, params_files))
                print(f"  {variant}: {runs[variant][-1]['seconds']:.1f} s", file=sys.stderr)
    book = statistics.median(r["seconds"] for r in runs["book"])
    rows = []
    for variant in variants:
        seconds = statistics.median(r["seconds"] for r in runs[variant])
        row = {"variant": variant, "seconds": seconds, "ratio_to_book": seconds / book}
        last = runs[variant][-1]
        if "phases" in last:
            row["phases"] = last["phases"]
            row["startup_and_exit_seconds"] = last["process_seconds"] - sum(
                v for k, v in last["phases"].items() if not k.startswith("seconds_training_")
            )
        rows.append(row)
    return rows


def chosen(variants: list[str]) -> tuple[str, ...]:
    """The variants to run, in the table's order; the book's loop, the yardstick, always."""
    return tuple(v for v in VARIANTS if v == "book" or v in variants)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--smoke", action="store_true", help="the smoke profile's tiny model")
    parser.add_argument("--epochs", type=int, default=None, help="override pretrain.train.epochs")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; medians are printed")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    parser.add_argument(
        "--variants",
        nargs="+",
        choices=VARIANTS,
        default=list(VARIANTS),
        help="which to run (book, the yardstick, always runs)",
    )
    parser.add_argument("--book-loop", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--keep-freed-memory", action="store_true", help=argparse.SUPPRESS)
    return parser


def main() -> None:
    args = build_parser().parse_args()
    if args.book_loop is not None:  # the book variant's own process
        if args.keep_freed_memory:
            keep_freed_memory()
        print(json.dumps(book_loop(args.book_loop)))
        return

    before = load_average()
    variants = chosen(args.variants)
    rows = measure(args.smoke, args.epochs, args.rounds, variants)
    after = load_average()
    size = "smoke model" if args.smoke else "GPT-2 small dims"
    print(f"pretrain stage vs the book's chapter 5 loop ({size}, epochs {args.epochs or 'as params'})")
    print(f"load average before: {before}; after: {after}")
    print(f"{'variant':<10} {'seconds':>9} {'vs book loop':>13}")
    for row in rows:
        print(f"{row['variant']:<10} {row['seconds']:>9.1f} {row['ratio_to_book']:>12.2f}x")
    if "book-kept" in variants:
        print("book-kept: the book's loop with freed memory kept, as the stages run (gptlab.pipeline.memory)")
    for row in rows:
        if "phases" in row:
            phases = ", ".join(f"{k.removeprefix('seconds_')} {v:.1f}" for k, v in row["phases"].items())
            print(f"{row['variant']}: start-up and exit {row['startup_and_exit_seconds']:.1f} s; {phases}")
    print("targets: default <= 1.0x; fast <= 0.40x where bf16 is fast, <= 0.6x elsewhere")
    if args.json is not None:
        args.json.write_text(json.dumps({"load_before": before, "load_after": after, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
