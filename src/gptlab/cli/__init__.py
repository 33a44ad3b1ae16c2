"""The `gptlab` command: one module per subcommand, each parsing its arguments and calling the layer that does the work (experiments/ for smoke, run, sweep, compare, metrics)."""
