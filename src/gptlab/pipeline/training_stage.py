"""What the training stages (pretrain, spam-finetune, instruct-finetune, preference-finetune) do alike.

Each opens its MLflow run and its resume folder, records what it read, trains
with the shared loop, and on rank 0 publishes the same way: the checkpoint
(named by its run), the reports folder DVC tracks, the same files and figures
in MLflow, the loop's time, and the checkpoint as a registered MLflow model.
The stage scripts keep only what is their chapter's own.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from torch.utils.data import Dataset

from gptlab.files import write_csv, write_figure, write_json
from gptlab.model.checkpoint import save_model
from gptlab.model.config import ModelConfig
from gptlab.model.gpt import GPTModel
from gptlab.pipeline.params import Params
from gptlab.pipeline.plots import plot_losses
from gptlab.schema import flatten
from gptlab.tasks.config import LoraConfig, Trainable
from gptlab.tasks.fine_tune import adds_lora
from gptlab.tracking.buffered_run import StageRun, stage_metrics
from gptlab.tracking.registry import log_model
from gptlab.tracking.runs import rerun_command, stage_run
from gptlab.training.config import TrainConfig
from gptlab.training.distributed import is_main
from gptlab.training.loop import TrainResult, fit
from gptlab.training.losses import LossFn
from gptlab.training.resume import resume_folder
from gptlab.training.timing import LapClock

if TYPE_CHECKING:
    import pandas as pd
    from matplotlib.figure import Figure


@dataclass(frozen=True)
class DatasetRead:
    """A dataset a stage trains on, as its MLflow run records it: name, folder, split sizes (a corpus:
    also its book count and list digest)."""

    name: str
    path: Path
    profile: Mapping[str, int | str]


@dataclass(frozen=True)
class Reports:
    """A training stage's DVC outputs under reports/<name>/: metrics, counts and the loss curve."""

    folder: Path
    metrics: Mapping[str, Any]  # DVC metrics; logged to MLflow at the last step (initial_* were at step 0)
    counts: Mapping[str, Any]  # counts.json; their scalars also as gptlab.<name> tags
    losses: pd.DataFrame  # losses.csv, a DVC plot (`loss_table`)
    # The loss figure also written here under this name (pretrain's DVC output loss.png); None: MLflow only.
    figure_file: str | None = None


def loss_table(history: list[dict[str, float]], columns: list[str]) -> pd.DataFrame:
    """losses.csv: the loop's evaluation rows in `columns`' order."""
    import pandas as pd  # at the end of a run, not with the stage: a few tenths of a second

    return pd.DataFrame(history, columns=columns)


@dataclass
class TrainingRun:
    """One execution of a training stage: its MLflow run and its resume folder."""

    params: Params
    tracker: StageRun
    run_dir: Path
    finish_saving: ExitStack  # waits, as the run ends, for the checkpoint `fit` saved last

    @property
    def main(self) -> bool:
        """False on torchrun's other processes: they train, rank 0 alone publishes."""
        return is_main()

    def fit(
        self, model: GPTModel, train: Dataset, val: Dataset, cfg: TrainConfig, loss_fn: LossFn, **kw: Any
    ) -> TrainResult:
        """The shared loop, resuming from this run's folder on the params' checkpoint cadence."""
        return fit(
            model,
            train,
            val,
            cfg=cfg,
            checkpoints=self.params.checkpoints,
            loss_fn=loss_fn,
            run_dir=self.run_dir,
            tracker=self.tracker,
            finish_saving=self.finish_saving,
            **kw,
        )

    def report_trainable(
        self,
        model: GPTModel,
        base_model: str,
        trainable: Trainable,
        lora: LoraConfig,
        base_metadata: Mapping[str, Any] | None = None,
    ) -> int:
        """Print and tag what trains of the fine-tuned model (with LoRA: the adapters alone).

        The base model is printed and tagged as what it is (`describe_base`), not by its folder's
        name alone: with `gpt2.source: pretrain`, models/gpt2/gpt2-medium holds our own model.
        """
        count = sum(p.numel() for p in model.parameters() if p.requires_grad)
        base = describe_base(base_model, model.cfg, base_metadata or {})
        self.tracker.set_tags({"gptlab.base_model": base, "gptlab.trainable_params": count})
        adapters = f" (LoRA rank {lora.rank}, alpha {lora.alpha:g})" if adds_lora(trainable) else ""
        print(f"{base}: {count:,} of {sum(p.numel() for p in model.parameters()):,} params train{adapters}")
        return count

    def publish(
        self,
        model: GPTModel,
        model_dir: Path,
        metadata: Mapping[str, Any],
        reports: Reports,
        result: TrainResult,
        *,
        kind: str,
        model_defaults: Mapping[str, Any],
        skip: tuple[str, ...] = (),
    ) -> None:
        """Write the checkpoint and the reports, and log both (and the loop's time) to MLflow.

        The book's loss figure is logged as `<kind>/loss.png`, on the pipeline run's MLflow run
        too, and the metrics as `<stage prefix>/<metrics.json name>` on both. `skip` names report files the
        stage logged itself (figures); `kind` and `model_defaults` are those of the registered
        model (gptlab.tracking.registry) and its params' defaults (gptlab.serving.specs).
        """
        save_model(model, model_dir, dict(metadata))
        self.tracker.record_checkpoint(model_dir)
        write_json(reports.folder / "metrics.json", reports.metrics)
        write_json(reports.folder / "counts.json", reports.counts)
        write_csv(reports.folder / "losses.csv", reports.losses)
        if result.history:
            figure = loss_figure(result)
            if reports.figure_file is not None:
                write_figure(reports.folder / reports.figure_file, figure)
                skip = (*skip, reports.figure_file)
            self.tracker.log_figure(figure, f"{kind}/loss.png", pipeline=True)
        # The figures after training (those before it were logged at step 0), named as metrics.json names them.
        final = {k: v for k, v in flatten(dict(reports.metrics)).items() if not k.startswith("initial")}
        self.tracker.log_headline(final, step=result.global_step)
        self.tracker.set_tags({f"gptlab.{k}": v for k, v in reports.counts.items() if isinstance(v, int)})
        self.tracker.log_reports(reports.folder, f"{kind}/reports", skip=skip)
        # Time is no metric (it differs run to run, and is no curve): tags the sweep table reads, and a file.
        seen_per_second = f"{result.seen_name.removesuffix('_seen')}_per_second"
        self.tracker.set_tags(
            {
                "gptlab.wall_seconds": f"{result.wall_seconds:.3f}",
                f"gptlab.{seen_per_second}": f"{result.seen_per_second:.1f}",
            }
        )
        self.tracker.log_dict(
            {"wall_seconds": result.wall_seconds, seen_per_second: result.seen_per_second}
            | LapClock.as_metrics(result.phase_seconds),
            f"{kind}/training_seconds.json",
        )
        if self.params.tracking.log_models:  # as the other logging: sent later while the server is lost
            headline = stage_metrics(self.tracker.prefix, final)
            self.tracker.send(lambda: self.register_model(kind, model_dir, model_defaults, headline))

    def register_model(
        self, kind: str, model_dir: Path, defaults: Mapping[str, Any], headline: Mapping[str, float]
    ) -> None:
        """Log and register the checkpoint as the MLflow model of its kind (gptlab.serving.specs)."""
        # mlflow.models and pandas with it: as a run publishes its model, never as a stage starts
        from gptlab.serving.specs import model_spec

        spec = model_spec(kind, model_dir, self.params.data.bpe_files(), defaults)
        log_model(self.tracker, kind, spec, experiment=self.params.tracking.experiment, headline=headline)


def describe_base(name: str, cfg: ModelConfig, metadata: Mapping[str, Any]) -> str:
    """What a fine-tune starts from, in words: OpenAI's GPT-2 or this pipeline's pretrain checkpoint, its size.

    `gpt2-small (this pipeline's pretrain checkpoint models/pretrain: 2 layers, 64-dim embeddings, ...)`:
    with `gpt2.source: pretrain` the folder models/gpt2/gpt2-small holds our own model, whatever its name says.
    """
    size = (
        f"{cfg.n_layers} layers, {cfg.emb_dim}-dim embeddings, {cfg.n_heads} heads, "
        f"context {cfg.context_length}"
    )
    if metadata.get("source") == "pretrain":
        origin = f"this pipeline's pretrain checkpoint {metadata.get('checkpoint', 'models/pretrain')}"
    elif metadata.get("source") == "random":
        origin = "its architecture with freshly drawn weights"
    elif metadata.get("source") == "huggingface":
        origin = f"OpenAI's GPT-2 weights ({metadata.get('repo_id', name)})"
    else:
        origin = "a checkpoint"
    return f"{name} ({origin}: {size})"


def loss_figure(result: TrainResult) -> Figure:
    """The book's loss figure of a run: train and validation loss against epochs, what was seen on top."""
    # An epoch's steps: the first epoch's last step + 1 (every epoch has as many; a run cut short by
    # max_steps ends its only epoch early, and its figure spans that one epoch).
    steps_per_epoch = result.epochs[0]["step"] + 1 if result.epochs else max(result.steps, 1)
    label = result.seen_name.replace("_", " ").capitalize()  # "Tokens seen", "Examples seen"
    return plot_losses(result.history, steps_per_epoch, seen_key=result.seen_name, seen_label=label)


def trainable_metadata(trainable: Trainable, count: int, lora: LoraConfig) -> dict[str, Any]:
    """What a fine-tuned checkpoint records of its training: LoRA's adapters are merged into it."""
    merged = (
        {"lora": {"rank": lora.rank, "alpha": lora.alpha, "merged": True}} if adds_lora(trainable) else {}
    )
    return {"trainable": trainable, "trainable_params": count, **merged}


@contextmanager
def training_run(
    stage: str,
    params: Params,
    *,
    logged: Mapping[str, Any],
    fingerprint: Mapping[str, Any],
    inputs: list[Path],
    dataset: DatasetRead,
    upstream: tuple[Path, Mapping[str, Any]] | None = None,
    swept: bool = True,
) -> Iterator[TrainingRun]:
    """The stage's MLflow run (params `logged`) and its resume folder, for the block.

    `fingerprint` and `inputs` key the resume folder: what determines the numbers.
    `upstream` is the checkpoint the stage starts from and its metadata (linked to
    the run that wrote it); `swept` stages are tagged with the `gptlab sweep` they
    run in. The folder is removed once the block has published and its logging is
    sent; after an error, or a tracking server lost for good (TrackingLost), it
    stays, so a rerun resumes (after a complete training, with nothing to train).
    """
    tracking = params.tracking
    sweep = {"sweep": tracking.sweep, "sweep_variant": tracking.sweep_variant} if swept else {}
    run_params = {**logged, **flatten(params.checkpoints, "checkpoints")}
    with (
        stage_run(
            stage, tracking.experiment, run_params, system_metrics=tracking.system_metrics, **sweep
        ) as tracker,
        resume_folder(stage, fingerprint, inputs) as run_dir,
        ExitStack() as finish_saving,  # the last checkpoint is written while the stage publishes
    ):
        if upstream is not None:
            tracker.link_upstream(*upstream)
        tracker.log_input(dataset.name, dataset.path, context="training", profile=dataset.profile)
        yield TrainingRun(params, tracker, run_dir, finish_saving)
        tracker.ensure_sent(
            f"the outputs are written and the trained state is kept in {run_dir}; once the server answers, "
            f"run {rerun_command(stage)}: it resumes there, trains nothing again and logs a complete run"
        )
