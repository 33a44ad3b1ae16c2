"""Figures the reproduction report computes live from our code, one module per chapter.

Each function takes the run's inputs (`FigureInputs`, or None: the project's
data/raw) and the figure's `args` from reproduction/book.yaml, and returns a
number, a string or a (nested) list: what the book prints, computed here. The
chapter modules import torch only when a figure is computed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gptlab.book.figures import appendix_e, ch2, ch3, ch4, ch5

LIVE: dict[str, Callable[..., Any]] = {
    name: function
    for module in (ch2, ch3, ch4, ch5, appendix_e)
    for name, function in vars(module).items()
    if name in module.__all__
}
