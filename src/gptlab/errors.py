"""The one exception family for expected failures, so callers can tell them from bugs.

A `GptlabError` is something the user can fix (a bad param, a missing or
damaged input, a model that does not fit): the CLI and the stage scripts print
it as one line and exit with code 2. File-system and YAML errors are printed
the same way, naming the file. Any other exception is a bug and keeps its
traceback.
"""

from __future__ import annotations

import yaml

# Exit code of the CLI and the stage scripts for an expected failure (1 stays "a check failed").
EXIT_USAGE = 2


class GptlabError(Exception):
    """An expected failure; the message says what is wrong and how to fix it."""


class InputError(GptlabError, ValueError):
    """A value or file the user supplied that cannot be used (also a ValueError, as it is one)."""


def describe_failure(exc: BaseException) -> str | None:
    """One line for an expected failure (ours, a file-system or a YAML error); None for a bug."""
    if isinstance(exc, GptlabError):
        return str(exc)
    if isinstance(exc, OSError):
        where = f"{exc.filename}: " if exc.filename else ""
        return f"{where}{exc.strerror or exc}"
    if isinstance(exc, yaml.YAMLError):
        mark = getattr(exc, "problem_mark", None)
        where = f"{mark.name}, line {mark.line + 1}: " if mark is not None else ""
        return f"{where}not valid YAML ({getattr(exc, 'problem', None) or exc})"
    return None
