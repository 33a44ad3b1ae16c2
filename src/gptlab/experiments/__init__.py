"""The experiments layer: the pipeline run as a whole (profiles, smoke runs, sweeps) and its results compared and checked; cli/ only parses their arguments."""
