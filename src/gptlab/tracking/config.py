"""The `tracking` params: where MLflow logs and what it registers."""

from __future__ import annotations

from dataclasses import dataclass

from gptlab.schema import name_problem, require


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
            # experiment is always set; the sweep's two only by `gptlab sweep`
            problem = None if value is None else name_problem(value)
            require(problem is None, name, problem or "")
