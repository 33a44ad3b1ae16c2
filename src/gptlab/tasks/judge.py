"""A larger model scores the fine-tuned model's answers, as chapter 7 does with Llama 3.

The judge is any chat model behind an Ollama `/api/chat` endpoint or an
OpenAI-compatible `/v1/chat/completions` endpoint (llama.cpp, vLLM, LM Studio,
OpenAI itself). It is asked the book's question and its reply is parsed for an
integer from 0 to 100. A reply without a usable score, or a request that fails
mid-way, is counted and reported, never fatal: training has already finished by
then. A judge that cannot be reached at all is a configuration error, found
before training starts by `check_judge`.

Only the standard library is used (urllib, json), as in the book.

The optional API key (GPTLAB_JUDGE_API_KEY, never in params.yaml, never logged)
is guarded: redirects are refused, so neither the key nor the prompt is resent
to another address, and the key is not sent over plain http:// to a host other
than this machine unless `instruct.judge.allow_insecure_http` is true.
"""

from __future__ import annotations

import http.client
import ipaddress
import json
import math
import os
import re
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tqdm import tqdm

from gptlab.data.instruct import format_input
from gptlab.errors import InputError
from gptlab.tasks.config import JudgeConfig

# The book's options, for reproducible judging: fixed seed, greedy, 2048-token context.
SEED = 123
NUM_CTX = 2048
# An optional bearer token for hosted OpenAI-compatible endpoints; secrets stay out of params.yaml.
API_KEY_ENV = "GPTLAB_JUDGE_API_KEY"
# Histogram bins of 10 points; the last one also holds 100.
BINS = [(lo, lo + 9) for lo in range(0, 90, 10)] + [(90, 100)]

_DISABLE_HINT = "set instruct.judge.enabled: false in params.yaml to run without the judge"
# The first number in a reply, with sign and decimals so that "-5" or "85.5" are seen as such.
_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:\.\d+)?")


class JudgeError(InputError):
    """The judge endpoint cannot be used as configured; the message names the URL and the fix."""


class _RefuseRedirects(urllib.request.HTTPRedirectHandler):
    """urllib follows a 302 to a POST by resending its headers, the API key included: refuse instead."""

    def redirect_request(self, req, fp, code, msg, headers, newurl):  # type: ignore[no-untyped-def]
        fp.close()
        raise JudgeError(
            f"judge at {req.full_url} answered HTTP {code}, a redirect to {newurl}; redirects are refused "
            "so that the request and its API key go nowhere else: set instruct.judge.url to the final address"
        )


# Every judge request goes through this opener: urllib's defaults, minus following redirects.
_OPENER = urllib.request.build_opener(_RefuseRedirects)


@dataclass(frozen=True)
class Verdict:
    """One judged answer: the score (None when unusable) and the judge's raw reply or the failure."""

    score: int | None
    reply: str


def judge_prompt(entry: Mapping[str, str], model_response: str) -> str:
    """The book's scoring prompt for one test record and the fine-tuned model's answer."""
    return (
        f"Given the input `{format_input(entry)}` "
        f"and correct output `{entry['output']}`, "
        f"score the model response `{model_response}`"
        f" on a scale from 0 to 100, where 100 is the best score. "
        f"Respond with the integer number only."
    )


def parse_score(reply: str) -> int | None:
    """The first number in `reply` if it is a whole number from 0 to 100, else None."""
    match = _NUMBER.search(reply)
    if match is None:
        return None
    value = float(match.group())
    if not value.is_integer() or not 0 <= value <= 100:
        return None
    return int(value)


def query(cfg: JudgeConfig, prompt: str) -> str:
    """Send one user message to the judge and return its reply text.

    Raises OSError (urllib's URLError, timeouts) or http.client.HTTPException when
    the request fails, ValueError when the answer is not the chat response the API
    promises, and JudgeError (a ValueError) for a redirect or an API key that would
    go over plain HTTP to another host (nothing is sent then).
    """
    messages = [{"role": "user", "content": prompt}]
    if cfg.api == "ollama":
        payload: dict[str, Any] = {
            "model": cfg.model,
            "messages": messages,
            "stream": False,
            "options": {"seed": SEED, "temperature": 0, "num_ctx": NUM_CTX},
        }
    else:
        payload = {"model": cfg.model, "messages": messages, "temperature": 0, "seed": SEED}
    headers = _headers()
    _check_transport(cfg, headers)
    request = urllib.request.Request(
        cfg.url, data=json.dumps(payload).encode("utf-8"), headers=headers, method="POST"
    )
    with _OPENER.open(request, timeout=cfg.timeout_s) as response:
        body = response.read().decode("utf-8", errors="replace")
    try:
        data = json.loads(body)
        content = (
            data["message"]["content"] if cfg.api == "ollama" else data["choices"][0]["message"]["content"]
        )
    except (json.JSONDecodeError, KeyError, IndexError, TypeError) as exc:
        raise InputError(f"not an {cfg.api!r} chat response: {body[:200]!r}") from exc
    if not isinstance(content, str):
        raise InputError(f"not an {cfg.api!r} chat response: message content is {content!r}")
    return content


def check_judge(cfg: JudgeConfig) -> None:
    """Fail fast, before any training, when the judge cannot answer as configured."""
    try:
        query(cfg, "Respond with the integer number 100 only.")
    except JudgeError:
        raise
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", errors="replace")[:200]
        raise JudgeError(
            f"judge at {cfg.url} answered HTTP {exc.code} ({detail or exc.reason}); check instruct.judge.url "
            f"and that model {cfg.model!r} is available there (e.g. `ollama pull {cfg.model}`), or {_DISABLE_HINT}"
        ) from exc
    except (OSError, http.client.HTTPException) as exc:  # refused, timed out, not HTTP at all
        reason = getattr(exc, "reason", exc)
        raise JudgeError(
            f"judge at {cfg.url} is unreachable ({reason}); start it (e.g. `ollama serve`) "
            f"or fix instruct.judge.url, or {_DISABLE_HINT}"
        ) from exc
    except ValueError as exc:
        raise JudgeError(
            f"judge at {cfg.url} did not answer as a {cfg.api!r} chat endpoint ({exc}); check "
            f"instruct.judge.api and instruct.judge.url, or {_DISABLE_HINT}"
        ) from exc


def judge_one(cfg: JudgeConfig, entry: Mapping[str, str], model_response: str) -> Verdict:
    """Score one answer; a failed request or a reply without a score gives score None."""
    try:
        reply = query(cfg, judge_prompt(entry, model_response))
    except (OSError, http.client.HTTPException) as exc:  # URLError and timeouts are OSErrors
        return Verdict(None, f"request failed: {exc}")
    except ValueError as exc:
        return Verdict(None, str(exc))
    return Verdict(parse_score(reply), reply)


def judge_all(cfg: JudgeConfig, records: Iterable[Mapping[str, str]]) -> list[Verdict]:
    """Score every record's `model_response` against its reference `output`."""
    records = list(records)
    return [
        judge_one(cfg, record, record["model_response"])
        for record in tqdm(records, desc="judging", unit="answer")
    ]


def summarize(scores: Sequence[int | None]) -> dict[str, Any]:
    """Mean, counts and a 10-point histogram of the usable scores (mean None when there are none)."""
    usable = [s for s in scores if s is not None]
    histogram = {f"{lo}-{hi}": sum(lo <= s <= hi for s in usable) for lo, hi in BINS}
    mean = math.fsum(usable) / len(usable) if usable else None
    return {
        "mean": mean,
        "scored": len(usable),
        "unusable": len(scores) - len(usable),
        "histogram": histogram,
    }


def _check_transport(cfg: JudgeConfig, headers: Mapping[str, str]) -> None:
    """Refuse to send the API key in clear text to another machine, unless explicitly allowed."""
    if "Authorization" not in headers or cfg.allow_insecure_http:
        return
    parts = urllib.parse.urlsplit(cfg.url)
    if parts.scheme == "https" or _is_loopback(parts.hostname):
        return
    raise JudgeError(
        f"refusing to send the API key ({API_KEY_ENV}) over plain http:// to {parts.hostname} ({cfg.url}), "
        "where anyone on the way can read it: use an https:// URL, or set "
        "instruct.judge.allow_insecure_http: true if that network is trusted"
    )


def _is_loopback(host: str | None) -> bool:
    """Whether `host` names this machine (localhost, 127.0.0.0/8, ::1); no DNS lookup."""
    if not host:
        return False
    host = host.lower().rstrip(".")
    if host == "localhost" or host.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _headers() -> dict[str, str]:
    headers = {"Content-Type": "application/json"}
    if os.environ.get(API_KEY_ENV):
        headers["Authorization"] = f"Bearer {os.environ[API_KEY_ENV]}"
    return headers
