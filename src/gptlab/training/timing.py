"""Where a stage's wall time goes: a lap clock that adds each lap's seconds to a named phase.

Marking the end of each phase (`lap("step")`, `lap("evaluation")`, ...) needs no
indented blocks around the code it times; the totals go to MLflow beside the
run's other metrics, never into DVC's outputs (they differ every run).
"""

from __future__ import annotations

import time
from collections import defaultdict


class LapClock:
    """Seconds per phase: each `lap(name)` charges the time since the previous lap to `name`."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self._last = time.perf_counter()

    def lap(self, phase: str) -> None:
        now = time.perf_counter()
        self.seconds[phase] += now - self._last
        self._last = now

    def metrics(self, prefix: str = "seconds_") -> dict[str, float]:
        """The totals as metrics, e.g. {"seconds_step": 12.3}."""
        return self.as_metrics(self.seconds, prefix)

    @staticmethod
    def as_metrics(seconds: dict[str, float], prefix: str = "seconds_") -> dict[str, float]:
        return {f"{prefix}{phase}": value for phase, value in seconds.items()}
