"""The `gptlab` command: one module per subcommand."""
