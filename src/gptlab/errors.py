"""The one exception family for expected failures, so callers can tell them from bugs.

A `GptlabError` is something the user can fix (a bad param, a missing or
damaged input, a model that does not fit): the CLI and the stage scripts print
it as one line and exit with code 2. Any other exception is a bug and keeps
its traceback.
"""

from __future__ import annotations

# Exit code of the CLI and the stage scripts for an expected failure (1 stays "a check failed").
EXIT_USAGE = 2


class GptlabError(Exception):
    """An expected failure; the message says what is wrong and how to fix it."""
