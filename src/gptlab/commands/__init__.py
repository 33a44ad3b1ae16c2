"""Subcommands of the `gptlab` CLI, one module each: add_arguments(parser) and run(args)."""
