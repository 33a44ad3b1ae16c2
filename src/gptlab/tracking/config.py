"""The `tracking` params: where MLflow logs and what it registers."""

from __future__ import annotations

from dataclasses import dataclass

from gptlab.schema import MAX_NAME_LENGTH, require


@dataclass(frozen=True)
class TrackingConfig:
    experiment: str
    # CPU, memory (and GPU where MLflow can read it) as system/... metrics of every run.
    system_metrics: bool = True
    # Log each trained model as an MLflow model (registered; weights stored once, in it).
    log_models: bool = True
    # Set by `gptlab sweep` on each variant it queues: the fine-tune runs are tagged gptlab.sweep and
    # gptlab.sweep_variant (and named `<stage> · <variant>`), so the MLflow UI groups a sweep's runs.
    sweep: str | None = None
    sweep_variant: str | None = None

    def __post_init__(self) -> None:
        for name in ("experiment", "sweep", "sweep_variant"):
            value = getattr(self, name)
            if value is not None:  # experiment is always set; the sweep's two only by `gptlab sweep`
                require(
                    value.strip() != "" and len(value) <= MAX_NAME_LENGTH,
                    name,
                    f"expected a name of 1 to {MAX_NAME_LENGTH} characters, got "
                    + (repr(value) if len(value) <= MAX_NAME_LENGTH else f"{len(value):,} characters"),
                )
