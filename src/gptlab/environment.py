"""Environment variables that one gptlab process sets for another to read.

A light module (no torch, no mlflow), so the CLI and `gptlab smoke` can name what the
stages they start will read, without importing the modules that read it.
"""

from __future__ import annotations

# Set (by `gptlab -v`) to keep the libraries' INFO lines, which gptlab.tracking.store otherwise quiets.
VERBOSE_ENV = "GPTLAB_VERBOSE"
# The project's commit, when a stage runs in a copy of it (a `gptlab smoke` workspace): gptlab.tracking.lineage.
SOURCE_COMMIT_ENV = "GPTLAB_SOURCE_COMMIT"
SOURCE_DIRTY_ENV = "GPTLAB_SOURCE_DIRTY"
# The id every stage run of one pipeline run is tagged with (gptlab.pipeline_run): set by `gptlab smoke`
# and `gptlab run` for the `dvc exp run` they start; without it, gptlab.tracking.lineage derives one.
PIPELINE_RUN_ENV = "GPTLAB_PIPELINE_RUN"
