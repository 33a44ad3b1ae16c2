"""gptlab's checkpoints as MLflow pyfunc models: what `mlflow.pyfunc.load_model` and `mlflow models serve` run.

It imports mlflow at its top (`mlflow.pyfunc`): a pyfunc model is a subclass of
`mlflow.pyfunc.PythonModel`. MLflow loads it through the models-from-code file
pyfunc_model_code.py (the kind in `model_config`), so nothing is pickled; what a
model is logged as (its signature, example and artifacts) is specs.py's, which
the training stages import instead, so this module is part of no stage's code.

A logged model holds, as artifacts, the checkpoint folder (`model.safetensors` +
`config.json` + `manifest.json`, the weights' only copy in MLflow, checked against the
manifest as it loads) and GPT-2's BPE files
(`vocab.bpe`, `encoder.json`), and the gptlab package itself as code
(`code_paths`): it loads in any Python that has torch, tiktoken and safetensors,
without the project on `sys.path`. Three kinds, each with a signature and an
input example:

- `spam`: a DataFrame column `text` -> `label` (ham / spam) and `spam_probability`
  (a classifier of your own classes: `label`, one of them, and its `probability`),
  each message encoded, truncated and padded as in training (`gptlab classify`);
- `instruct`: `instruction` and optional `input` -> `response`, the greedy answer
  to the Alpaca prompt, fitted to the context as `gptlab chat` does (params
  `max_new_tokens`, and `temperature`, `top_k`, `seed` to sample instead);
- `lm`: `prompt` -> `text` (the prompt and its continuation), for the pretrained
  and converted language models (params `max_new_tokens`, `temperature`,
  `top_k` with 0 for none, `seed`).

The model runs on `$GPTLAB_DEVICE` (default `auto`: cuda, then mps, then cpu), with
fp32 weights, or bf16 ones with `$GPTLAB_PRECISION` bf16 (or auto: bf16 where bf16 is fast).
Each request is checked as `gptlab classify` and `gptlab chat` check theirs
(gptlab.tasks.request): texts must be strings (the signature's type; a number
or a mapping is refused, not turned into text), the required ones non-empty, and
the params in range. An input it cannot answer is a `BadModelInput`: one line
naming the field, which `mlflow models serve` sends as a 400 reply without a
stack trace. So is a generation still running when most of the scoring server's
timeout has passed (`_within_timeout`): it stops there, rather than on after a 504.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, get_args

import mlflow.pyfunc
import pandas as pd
import torch
from mlflow.exceptions import MlflowException
from mlflow.protos.databricks_pb2 import INVALID_PARAMETER_VALUE

from gptlab.model.checkpoint import load_model
from gptlab.model.config import SampleConfig
from gptlab.model.generate import generate_text
from gptlab.model.gpt import GPTModel
from gptlab.model.tokenizer import gpt2_tokenizer
from gptlab.serving.specs import KIND_KEY, KINDS, probability_column
from gptlab.tasks import request
from gptlab.tasks.classifier import classify_texts
from gptlab.tasks.responses import fit_to_context, generate_response
from gptlab.tracking.registry import CHECKPOINT, ENCODER_JSON, VOCAB_BPE
from gptlab.training.runtime import Precision, inference_dtype, resolve_device

DEVICE_ENV = "GPTLAB_DEVICE"
PRECISION_ENV = "GPTLAB_PRECISION"
# MLflow's scoring server answers 504 after this many seconds (default 60), and lets the request's work go on.
TIMEOUT_ENV = "MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT"
# The share of that timeout a generating request may work: its refusal reaches the caller before the 504.
WORK_SHARE = 0.9


class _Checkpoint(mlflow.pyfunc.PythonModel):
    """Loads the checkpoint and the tokenizer from the model's artifacts."""

    def load_context(self, context: Any) -> None:
        device = resolve_device(os.environ.get(DEVICE_ENV, "auto"))
        precision = os.environ.get(PRECISION_ENV, "fp32")
        if precision not in get_args(Precision):
            expected = ", ".join(get_args(Precision))
            raise ValueError(f"${PRECISION_ENV}: expected one of {expected}, got {precision!r}")
        # Building the model draws its initial weights: leave the caller's random state as it was.
        with torch.random.fork_rng(devices=[]):
            self.model, self.metadata = load_model(context.artifacts[CHECKPOINT], device)
        self.model.to(inference_dtype(device, precision))
        self.tokenizer = gpt2_tokenizer(context.artifacts[VOCAB_BPE], context.artifacts[ENCODER_JSON])


class SpamClassifier(_Checkpoint):
    """`text` -> `label` and `spam_probability` (or `probability`), exactly as `gptlab classify` computes them."""

    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        texts = request.texts(
            _column(model_input, "text"), "text (row {n})", hint="give some text to classify"
        )
        batch_size = request.batch_size((params or {}).get("batch_size", 8))
        probs = classify_texts(
            self.model,
            self.tokenizer,
            texts,
            max_length=int(self.metadata["max_length"]),
            pooling=self.metadata["pooling"],
            batch_size=batch_size,
        )
        labels = {int(index): name for index, name in self.metadata["labels"].items()}
        names = [labels[i] for i in sorted(labels)]
        column = probability_column(names)
        shown = probs[:, names.index("spam")] if column == "spam_probability" else probs.max(axis=1)
        return pd.DataFrame({"label": [names[int(i)] for i in probs.argmax(axis=1)], column: shown})


class InstructionModel(_Checkpoint):
    """`instruction` (+ optional `input`) -> `response`, the answer `gptlab chat` prints (greedy unless sampled)."""

    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        instructions = request.texts(
            _column(model_input, "instruction"), "instruction (row {n})", hint="say what the model should do"
        )
        given = _column(model_input, "input") if "input" in model_input else [""] * len(instructions)
        inputs = [
            request.text(v, f"input (row {n})", hint="", required=False) for n, v in enumerate(given, 1)
        ]
        params = params or {}
        default = self.metadata.get("max_new_tokens", 256)
        max_new_tokens = request.max_new_tokens(params.get("max_new_tokens", default))
        sampling = _sampling(params)
        responses = []
        with _within_timeout(self.model):
            for instruction, text in zip(instructions, inputs, strict=True):
                fitted = fit_to_context(
                    self.tokenizer,
                    {"instruction": instruction, "input": text, "output": ""},
                    context_length=self.model.cfg.context_length,
                    max_new_tokens=max_new_tokens,
                )
                responses.append(
                    generate_response(
                        self.model,
                        self.tokenizer,
                        fitted.entry,
                        max_new_tokens=fitted.max_new_tokens,
                        **sampling,
                    )
                )
        return pd.DataFrame({"response": responses})


class TextGenerator(_Checkpoint):
    """`prompt` -> `text`: the prompt and its continuation, seeded like the stages' samples."""

    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        params = params or {}
        prompts = request.texts(
            _column(model_input, "prompt"), "prompt (row {n})", hint="give a text to continue"
        )
        max_new_tokens = request.max_new_tokens(params.get("max_new_tokens", 50))
        sampling = _sampling(params)
        texts = []
        with _within_timeout(self.model):
            for prompt in prompts:
                sample = SampleConfig(prompt, max_new_tokens, **sampling)
                texts.append(generate_text(self.model, self.tokenizer, sample))
        return pd.DataFrame({"text": texts})


_CLASSES: dict[str, type[_Checkpoint]] = {
    "spam": SpamClassifier,
    "instruct": InstructionModel,
    "lm": TextGenerator,
}


class GptlabModel(mlflow.pyfunc.PythonModel):
    """The model that pyfunc_model_code.py sets: the class of `model_config[KIND_KEY]`, loaded and asked."""

    def load_context(self, context: Any) -> None:
        kind = (context.model_config or {}).get(KIND_KEY)
        if kind not in _CLASSES:
            raise ValueError(f"model_config {KIND_KEY}: expected one of {KINDS}, got {kind!r}")
        self.model = _CLASSES[kind]()
        self.model.load_context(context)

    def predict(
        self, context: Any, model_input: pd.DataFrame, params: dict[str, Any] | None = None
    ) -> pd.DataFrame:
        try:
            return self.model.predict(context, model_input, params)
        except ValueError as exc:  # the input: the caller's to fix, said in one line
            raise BadModelInput(" ".join(str(exc).split())) from exc


class BadModelInput(MlflowException, ValueError):
    """An input the model cannot answer, in one line.

    As an MlflowException (INVALID_PARAMETER_VALUE), `mlflow models serve` replies 400 with
    this message and without the stack trace it attaches to any other error; as a ValueError,
    `mlflow.pyfunc` callers catch it as before. The scoring server rewrites the message of an
    MlflowException to "Failed to predict data '<the whole input>'. Error: <message>" (on two
    lines, the input printed as a table): the caller's own data before what is wrong. The
    message is set once here, so the reply holds that one line.
    """

    def __init__(self, message: str) -> None:
        super().__init__(message, error_code=INVALID_PARAMETER_VALUE)

    @property
    def message(self) -> str:
        return self._line

    @message.setter
    def message(self, value: str) -> None:
        if not hasattr(self, "_line"):  # MlflowException.__init__'s; the server's rewrite is ignored
            self._line = value


@contextmanager
def _within_timeout(model: GPTModel) -> Iterator[None]:
    """The block generates until WORK_SHARE of the scoring server's timeout has passed, then stops: a ValueError.

    MLflow's server gives a request up after MLFLOW_SCORING_SERVER_REQUEST_TIMEOUT s (a 504) but
    not its work: 10,000 new tokens kept a core busy a minute after. Every new token passes the
    output head, which checks the time: a request answers in time, or is refused in one line
    (a 400) while its caller still waits, and its work ends there.
    """
    timeout = float(os.environ.get(TIMEOUT_ENV) or 60)
    deadline = time.monotonic() + WORK_SHARE * timeout

    def check(module: torch.nn.Module, args: object) -> None:
        if time.monotonic() > deadline:
            raise ValueError(
                f"the request takes longer than the scoring server allows ({TIMEOUT_ENV}: {timeout:g} s), "
                f"so it was stopped after {WORK_SHARE * timeout:g} s: ask for fewer max_new_tokens or rows, "
                f"or serve with a longer {TIMEOUT_ENV}"
            )

    handle = model.out_head.register_forward_pre_hook(check)
    try:
        yield
    finally:
        handle.remove()


def _sampling(params: dict[str, Any]) -> dict[str, Any]:
    """temperature (0: greedy), top_k (0: none) and seed of a request, checked as `gptlab chat` checks them."""
    return {
        "temperature": request.temperature(params.get("temperature", 0.0)),
        "top_k": request.top_k(params.get("top_k", 0)),
        "seed": request.seed(params.get("seed", 123)),
    }


def _column(frame: pd.DataFrame, column: str) -> list[Any]:
    """The column's values as the request gave them (checked by gptlab.tasks.request)."""
    if column not in frame:
        raise ValueError(f"the input has no column {column!r} (columns: {list(frame.columns)})")
    return frame[column].tolist()
