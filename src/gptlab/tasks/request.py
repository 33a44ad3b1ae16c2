"""What a request to a trained model may ask, checked the same way wherever it comes from.

`gptlab classify` and `gptlab chat` check their arguments here, and the served models
(gptlab.serving.pyfunc_models) their rows and params: a bad value is one `RequestError`
line that starts with the field (an option, a column and row, a param), before any work,
never an error deep in torch. Each caller names its fields in its own terms (`--batch-size`
on the command line, `batch_size` in a served request).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

from gptlab.errors import InputError
from gptlab.model.config import GPT2_VOCAB_SIZE
from gptlab.schema import MAX_BATCH_SIZE, MAX_NEW_TOKENS, TEMPERATURE_RANGE, is_control

MAX_SEED = 2**63 - 1  # torch.manual_seed's range, and an MLflow `long` param's


class RequestError(InputError):
    """A value of a request that cannot be answered; the message names the field first."""


def text(value: Any, field: str, *, hint: str, required: bool = True) -> str:
    """`value` as the text it must be; a missing one (None, NaN) counts as empty.

    A required text must hold more than whitespace and control characters (a line of NULs reads
    as nothing); `hint` says what to give instead.
    """
    if value is None or (isinstance(value, float) and math.isnan(value)):
        value = ""
    if not isinstance(value, str):  # a number or a mapping is not a message, whatever str() makes of it
        raise RequestError(f"{field}: expected a string, got {type(value).__name__} {_short(value)}")
    if required and all(char.isspace() or is_control(char) for char in value):
        shown = "" if not value.strip() else f" (only control characters: {_short(value)})"
        raise RequestError(f"{field} is empty{shown}: {hint}")
    return value


def texts(values: Sequence[Any], field: str, *, hint: str) -> list[str]:
    """Every value a non-empty string; `field` holds `{n}`, each value's number from 1 (`message {n}`)."""
    return [text(value, field.format(n=n), hint=hint) for n, value in enumerate(values, 1)]


def batch_size(value: Any, field: str = "batch_size") -> int:
    """How many texts one forward pass takes."""
    return _count(value, field, MAX_BATCH_SIZE)


def max_new_tokens(value: Any, field: str = "max_new_tokens") -> int:
    """The longest answer in tokens (the model's context may cap it further)."""
    return _count(value, field, MAX_NEW_TOKENS)


def temperature(value: Any, field: str = "temperature") -> float:
    """0 for greedy decoding, else a temperature the logits can be divided by without overflow."""
    low, high = TEMPERATURE_RANGE
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise RequestError(f"{field}: expected a number, got {type(value).__name__} {_short(value)}")
    if value != 0 and not low <= value <= high:
        raise RequestError(
            f"{field}: expected 0 (greedy) or a number from {low:g} to {high:g}, got {value:g}"
        )
    return float(value)


def top_k(value: Any, field: str = "top_k") -> int | None:
    """Sample among the k likeliest tokens; 0 (or None) for all of them."""
    if value is None:
        return None
    k = _integer(value, field)
    if not 0 <= k <= GPT2_VOCAB_SIZE:
        raise RequestError(f"{field}: expected 0 (no limit) to {GPT2_VOCAB_SIZE}, got {k}")
    return k or None


def seed(value: Any, field: str = "seed") -> int:
    """The sampling seed: a non-negative integer torch can seed with."""
    number = _integer(value, field)
    if not 0 <= number <= MAX_SEED:
        raise RequestError(f"{field}: expected 0 to {MAX_SEED}, got {number}")
    return number


def _count(value: Any, field: str, cap: int) -> int:
    number = _integer(value, field)
    if not 1 <= number <= cap:
        raise RequestError(f"{field}: expected 1 to {cap}, got {number}")
    return number


def _integer(value: Any, field: str) -> int:
    """An int, or anything that is one exactly (a numpy integer); never a bool, a float or a string."""
    try:
        if isinstance(value, bool):
            raise TypeError
        return operator.index(value)
    except TypeError:
        raise RequestError(
            f"{field}: expected an integer, got {type(value).__name__} {_short(value)}"
        ) from None


def _short(value: Any) -> str:
    """The value as the request gave it, cut to keep the line short."""
    shown = repr(value)
    return shown if len(shown) <= 40 else shown[:37] + "..."
