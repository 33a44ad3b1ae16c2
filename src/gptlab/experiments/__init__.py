"""The experiments layer: profiles, smoke runs, sweeps, comparing experiments and checking metrics."""
