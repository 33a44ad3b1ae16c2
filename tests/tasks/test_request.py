"""One check of a request's texts and params for the CLI and the served models, each refusal one line naming the field."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from gptlab.cli.main import main
from gptlab.errors import InputError
from gptlab.tasks import request
from gptlab.tasks.request import RequestError

from helpers import one_line_error


def refusal(call, *args, **kwargs) -> str:
    with pytest.raises(RequestError) as raised:
        call(*args, **kwargs)
    message = str(raised.value)
    assert "\n" not in message
    return message


def test_texts_must_be_strings_and_required_ones_non_empty() -> None:
    assert request.texts(["hi", np.str_("there")], "text (row {n})", hint="h") == ["hi", "there"]
    assert request.text(None, "input", hint="", required=False) == ""
    assert request.text(math.nan, "input", hint="", required=False) == ""
    assert request.text("  ", "input", hint="", required=False) == "  "
    # What a JSON request can hold in a string column, none of it text.
    for value, shown in [
        (123, "int 123"),
        ({"a": 1}, "dict {'a': 1}"),
        (1.5, "float 1.5"),
        (True, "bool True"),
        (["x"], "list ['x']"),
    ]:
        assert (
            refusal(request.texts, ["ok", value], "text (row {n})", hint="h")
            == f"text (row 2): expected a string, got {shown}"
        )
    for empty in ("", "  \n", None, math.nan):
        assert (
            refusal(request.texts, ["ok", empty], "message {n}", hint="give some text to classify")
            == "message 2 is empty: give some text to classify"
        )
    assert (
        refusal(request.text, 10**50, "text", hint="h")
        == f"text: expected a string, got int {str(10**50)[:37]}..."
    )


def test_counts_are_integers_from_one_to_their_cap() -> None:
    assert request.batch_size(8) == 8 and request.batch_size(np.int64(3)) == 3
    assert request.max_new_tokens(10_000) == 10_000
    for bad in (0, -5):
        assert refusal(request.batch_size, bad) == f"batch_size: expected 1 to 65536, got {bad}"
    assert refusal(request.batch_size, 0, "--batch-size") == "--batch-size: expected 1 to 65536, got 0"
    assert refusal(request.max_new_tokens, 10_001) == "max_new_tokens: expected 1 to 10000, got 10001"
    for bad, shown in [(2.0, "float 2.0"), ("8", "str '8'"), (True, "bool True"), (None, "NoneType None")]:
        assert refusal(request.batch_size, bad) == f"batch_size: expected an integer, got {shown}"


def test_sampling_params_temperature_top_k_and_seed() -> None:
    assert request.temperature(0) == 0.0 and request.temperature(0.7) == 0.7
    assert request.top_k(0) is None and request.top_k(None) is None and request.top_k(5) == 5
    assert request.seed(0) == 0 and request.seed(2**63 - 1) == 2**63 - 1
    assert (
        refusal(request.temperature, 0.001)
        == "temperature: expected 0 (greedy) or a number from 0.01 to 100, got 0.001"
    )
    assert refusal(request.temperature, -1).startswith("temperature: expected 0 (greedy)")
    for bad in (math.inf, math.nan, "hot", None):
        assert refusal(request.temperature, bad).startswith("temperature: expected a number, got ")
    assert refusal(request.top_k, -1) == "top_k: expected 0 (no limit) to 50257, got -1"
    assert refusal(request.top_k, 50258) == "top_k: expected 0 (no limit) to 50257, got 50258"
    assert refusal(request.seed, -1) == f"seed: expected 0 to {2**63 - 1}, got -1"
    assert refusal(request.seed, 1.5) == "seed: expected an integer, got float 1.5"


def test_a_request_error_is_an_input_error_and_a_value_error() -> None:
    """The CLI prints an InputError as one line; the served models answer a ValueError with a 400."""
    assert issubclass(RequestError, InputError) and issubclass(RequestError, ValueError)


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["classify", "--batch-size", "0", "hi"],
            "gptlab classify: --batch-size: expected 1 to 65536, got 0",
        ),
        (
            ["classify", "--batch-size", "-5", "hi"],
            "gptlab classify: --batch-size: expected 1 to 65536, got -5",
        ),
        (["classify", "hi", " "], "gptlab classify: message 2 is empty: give some text to classify"),
        (["chat", ""], "gptlab chat: the instruction is empty: say what the model should do"),
        (
            ["chat", "Hi.", "--max-new-tokens", "0"],
            "gptlab chat: --max-new-tokens: expected 1 to 10000, got 0",
        ),
        (
            ["chat", "Hi.", "--max-new-tokens", "100000"],
            "gptlab chat: --max-new-tokens: expected 1 to 10000, got 100000",
        ),
    ],
)
def test_the_cli_refuses_as_the_served_models_do_before_loading_a_model(
    args: list[str], line: str, checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*args, "--model", str(checkpoint)]) == 2
    assert one_line_error(capsys, args[0]) == line
