"""The judge client against a real HTTP server on 127.0.0.1, speaking Ollama's and OpenAI's shapes;
its API key never follows a redirect nor goes over plain HTTP to another host.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from gptlab.data.instruct import format_input
from gptlab.schema import ConfigError, build
from gptlab.tasks.config import JudgeConfig
from gptlab.tasks.judge import (
    API_KEY_ENV,
    JudgeError,
    check_judge,
    judge_all,
    judge_one,
    judge_prompt,
    parse_score,
    summarize,
)

from helpers import committed_params_raw

ENTRY = {
    "instruction": "Convert 45 kilometers to meters.",
    "input": "",
    "output": "45 kilometers is 45000 meters.",
}
ENTRY_WITH_INPUT = {
    "instruction": "Rewrite the sentence using a simile.",
    "input": "The car is very fast.",
    "output": "The car is as fast as lightning.",
}


class FakeJudge:
    """A scripted chat endpoint: answers the queued (status, body, delay) replies in order, records requests."""

    def __init__(self) -> None:
        self.replies: list[tuple[int, str, float]] = []
        self.requests: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                owner.requests.append(
                    {"path": self.path, "json": json.loads(body), "auth": self.headers.get("Authorization")}
                )
                status, text, delay = owner.replies.pop(0)
                time.sleep(delay)
                payload = text.encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                except (BrokenPipeError, ConnectionResetError):  # a client that timed out has gone
                    pass

            def log_message(self, *args: Any) -> None:  # keep pytest output clean
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"

    def reply(self, body: str | dict[str, Any], status: int = 200, delay: float = 0.0) -> None:
        self.replies.append((status, body if isinstance(body, str) else json.dumps(body), delay))


@pytest.fixture
def fake_judge() -> Iterator[FakeJudge]:
    judge = FakeJudge()
    thread = threading.Thread(target=judge.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
    thread.start()
    yield judge
    judge.server.shutdown()
    judge.server.server_close()


def ollama(content: str) -> dict[str, Any]:
    return {"model": "llama3", "message": {"role": "assistant", "content": content}, "done": True}


def openai(content: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}


def config(url: str, api: str = "ollama", timeout_s: float = 5.0) -> JudgeConfig:
    return JudgeConfig(enabled=True, api=api, url=url, model="llama3", timeout_s=timeout_s)  # type: ignore[arg-type]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_prompt_is_the_books() -> None:
    prompt = judge_prompt(ENTRY_WITH_INPUT, "The car is as quick as a cheetah.")
    assert prompt == (
        f"Given the input `{format_input(ENTRY_WITH_INPUT)}` and correct output "
        "`The car is as fast as lightning.`, score the model response `The car is as quick as a cheetah.` "
        "on a scale from 0 to 100, where 100 is the best score. Respond with the integer number only."
    )
    assert "### Input:\nThe car is very fast." in prompt
    assert "### Input" not in judge_prompt(ENTRY, "45000 meters")


@pytest.mark.parametrize(
    ("reply", "score"),
    [
        ("85", 85),
        ("  92\n", 92),
        ("Score: 73/100", 73),
        ("0", 0),
        ("100", 100),
        ("100.0", 100),
        ("150", None),
        ("-5", None),
        ("85.5", None),
        ("I cannot score this.", None),
        ("", None),
    ],
)
def test_parse_score(reply: str, score: int | None) -> None:
    assert parse_score(reply) == score


def test_ollama_request_and_scores(fake_judge: FakeJudge) -> None:
    fake_judge.reply(ollama("87"))
    fake_judge.reply(ollama("Score: 40"))
    cfg = config(f"{fake_judge.base}/api/chat")
    records = [
        {**ENTRY, "model_response": "45000 meters"},
        {**ENTRY_WITH_INPUT, "model_response": "Fast car."},
    ]

    verdicts = judge_all(cfg, records)

    assert [v.score for v in verdicts] == [87, 40]
    assert verdicts[1].reply == "Score: 40"
    first = fake_judge.requests[0]
    assert first["path"] == "/api/chat"
    assert first["json"]["model"] == "llama3"
    assert first["json"]["stream"] is False
    assert first["json"]["options"] == {"seed": 123, "temperature": 0, "num_ctx": 2048}
    assert first["json"]["messages"] == [{"role": "user", "content": judge_prompt(ENTRY, "45000 meters")}]
    assert first["auth"] is None


def test_openai_request_and_scores(fake_judge: FakeJudge, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "sk-test")
    fake_judge.reply(openai("64"))
    cfg = config(f"{fake_judge.base}/v1/chat/completions", api="openai")

    verdict = judge_one(cfg, ENTRY, "45000 meters")

    assert verdict.score == 64
    request = fake_judge.requests[0]
    assert request["path"] == "/v1/chat/completions"
    assert request["json"]["temperature"] == 0
    assert request["json"]["seed"] == 123
    assert "options" not in request["json"]
    assert request["json"]["messages"][0]["content"] == judge_prompt(ENTRY, "45000 meters")
    assert request["auth"] == "Bearer sk-test"


def test_unusable_replies_are_counted_not_fatal(fake_judge: FakeJudge) -> None:
    fake_judge.reply("<html>not json</html>")
    fake_judge.reply({"unexpected": "shape"})
    fake_judge.reply(ollama("A fine answer, I would say."))
    fake_judge.reply(ollama("150"))
    fake_judge.reply("internal error", status=500)
    fake_judge.reply(openai("90"))  # the wrong shape for an ollama judge
    fake_judge.reply(ollama("90"))
    cfg = config(f"{fake_judge.base}/api/chat")
    records = [{**ENTRY, "model_response": f"answer {i}"} for i in range(7)]

    verdicts = judge_all(cfg, records)

    assert [v.score for v in verdicts] == [None, None, None, None, None, None, 90]
    assert verdicts[0].reply.startswith("not an 'ollama' chat response")
    assert verdicts[2].reply == "A fine answer, I would say."
    assert verdicts[4].reply.startswith("request failed: HTTP Error 500")
    summary = summarize([v.score for v in verdicts])
    assert summary["scored"] == 1
    assert summary["unusable"] == 6
    assert summary["mean"] == 90
    assert summary["histogram"]["90-100"] == 1
    assert sum(summary["histogram"].values()) == 1


def test_timeout_is_an_unusable_reply(fake_judge: FakeJudge) -> None:
    fake_judge.reply(ollama("80"), delay=1.0)
    verdict = judge_one(config(f"{fake_judge.base}/api/chat", timeout_s=0.2), ENTRY, "45000 meters")
    assert verdict.score is None
    assert verdict.reply.startswith("request failed")


def test_summary_bins_and_mean() -> None:
    scores = [0, 9, 10, 55, 59, 89, 90, 100, None]
    summary = summarize(scores)
    usable = [s for s in scores if s is not None]
    assert summary["mean"] == pytest.approx(sum(usable) / len(usable))
    assert (summary["scored"], summary["unusable"]) == (8, 1)
    hist = summary["histogram"]
    assert list(hist) == [f"{lo}-{lo + 9}" for lo in range(0, 90, 10)] + ["90-100"]
    assert (hist["0-9"], hist["10-19"], hist["50-59"], hist["80-89"], hist["90-100"]) == (2, 1, 2, 1, 2)
    assert summarize([None, None]) == {
        "mean": None,
        "scored": 0,
        "unusable": 2,
        "histogram": {k: 0 for k in hist},
    }


def test_check_unreachable_names_url_and_fix() -> None:
    url = f"http://127.0.0.1:{free_port()}/api/chat"
    with pytest.raises(JudgeError, match="unreachable") as info:
        check_judge(config(url))
    assert url in str(info.value)
    assert "instruct.judge.enabled: false" in str(info.value)


def test_check_http_error_names_model(fake_judge: FakeJudge) -> None:
    fake_judge.reply({"error": "model 'llama3' not found"}, status=404)
    url = f"{fake_judge.base}/api/chat"
    with pytest.raises(JudgeError, match="HTTP 404") as info:
        check_judge(config(url))
    assert url in str(info.value)
    assert "not found" in str(info.value)
    assert "ollama pull llama3" in str(info.value)


def test_check_wrong_api_shape(fake_judge: FakeJudge) -> None:
    fake_judge.reply(ollama("100"))  # an Ollama server, configured as openai
    with pytest.raises(JudgeError, match="instruct.judge.api"):
        check_judge(config(f"{fake_judge.base}/api/chat", api="openai"))


def test_check_accepts_a_working_judge(fake_judge: FakeJudge) -> None:
    fake_judge.reply(ollama("100"))
    check_judge(config(f"{fake_judge.base}/api/chat"))
    assert len(fake_judge.requests) == 1


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("url", "localhost:11434/api/chat", "instruct.judge.url: expected an http:// or https:// URL"),
        ("timeout_s", 0, "instruct.judge.timeout_s: expected a positive number of seconds"),
        ("api", "anthropic", "instruct.judge.api: expected one of ['ollama', 'openai']"),
    ],
)
def test_bad_judge_params_name_the_key(key: str, value: Any, message: str) -> None:
    section = {"enabled": True, "api": "ollama", "url": "http://localhost:11434/api/chat", "model": "llama3"}
    with pytest.raises(ConfigError, match=re.escape(message)):
        build(JudgeConfig, {**section, "timeout_s": 120, key: value}, "instruct.judge")


class Recorder:
    """A local HTTP server that records each request's method, path and headers, and answers `reply`."""

    def __init__(self, reply: Callable[[BaseHTTPRequestHandler], None]) -> None:
        self.requests: list[dict[str, Any]] = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def handle_any(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                owner.requests.append(
                    {"method": self.command, "path": self.path, "headers": dict(self.headers)}
                )
                reply(self)

            do_GET = do_POST = handle_any

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(
            target=self.server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _chat_reply(handler: BaseHTTPRequestHandler) -> None:
    payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": "100"}}]}).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(payload)))
    handler.end_headers()
    handler.wfile.write(payload)


@pytest.fixture
def servers() -> Iterator[tuple[Recorder, Recorder]]:
    """(judge, elsewhere): the judge answers every request with a 302 to `elsewhere`."""
    elsewhere = Recorder(_chat_reply)

    def redirect(handler: BaseHTTPRequestHandler) -> None:
        handler.send_response(302)
        handler.send_header("Location", f"{elsewhere.base}/v1/chat/completions")
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    judge = Recorder(redirect)
    yield judge, elsewhere
    judge.close()
    elsewhere.close()


def judge_config(url: str, **extra: Any) -> JudgeConfig:
    section = {"enabled": True, "api": "openai", "url": url, "model": "llama3", "timeout_s": 5, **extra}
    return build(JudgeConfig, section, "instruct.judge")


@pytest.mark.parametrize("with_key", [True, False], ids=["key", "no-key"])
def test_judge_refuses_redirects(
    servers: tuple[Recorder, Recorder], monkeypatch: pytest.MonkeyPatch, with_key: bool
) -> None:
    judge, elsewhere = servers
    if with_key:
        monkeypatch.setenv(API_KEY_ENV, "sk-secret-123")
    else:
        monkeypatch.delenv(API_KEY_ENV, raising=False)
    cfg = judge_config(f"{judge.base}/v1/chat/completions")

    with pytest.raises(JudgeError, match="redirect") as info:
        check_judge(cfg)
    assert cfg.url in str(info.value) and elsewhere.base in str(info.value)
    assert "sk-secret-123" not in str(info.value)
    verdict = judge_one(cfg, {"instruction": "Say hi.", "input": "", "output": "hi"}, "hi")
    assert verdict.score is None and "redirect" in verdict.reply

    assert len(judge.requests) == 2
    assert judge.requests[0]["headers"].get("Authorization") == ("Bearer sk-secret-123" if with_key else None)
    assert elsewhere.requests == []  # the key (and the prompt) never reached the redirect target


@pytest.mark.parametrize(
    ("url", "allowed"),
    [
        ("http://judge.example.com/v1/chat/completions", False),
        ("http://10.1.2.3:8000/v1/chat/completions", False),
        ("http://127.0.0.2:8000/v1/chat/completions", True),  # loopback
        ("http://localhost:8000/v1/chat/completions", True),
        ("http://[::1]:8000/v1/chat/completions", True),
        ("https://judge.example.com/v1/chat/completions", True),
    ],
)
def test_judge_key_never_goes_over_plain_http_to_other_hosts(
    monkeypatch: pytest.MonkeyPatch, url: str, allowed: bool
) -> None:
    sent: list[str] = []

    def fake_open(request: Any, timeout: float) -> Any:  # nothing leaves the machine
        sent.append(request.full_url)
        raise OSError("not connecting in a test")

    monkeypatch.setattr("gptlab.tasks.judge._OPENER.open", fake_open)
    monkeypatch.setenv(API_KEY_ENV, "sk-secret-123")
    if allowed:
        with pytest.raises(JudgeError, match="unreachable"):
            check_judge(judge_config(url))
        assert sent == [url]
        return
    with pytest.raises(JudgeError, match="allow_insecure_http") as info:
        check_judge(judge_config(url))
    assert url in str(info.value) and "sk-secret-123" not in str(info.value)
    assert sent == []

    # Without a key there is nothing to leak; with the explicit opt-in the key is sent.
    monkeypatch.delenv(API_KEY_ENV)
    with pytest.raises(JudgeError, match="unreachable"):
        check_judge(judge_config(url))
    monkeypatch.setenv(API_KEY_ENV, "sk-secret-123")
    with pytest.raises(JudgeError, match="unreachable"):
        check_judge(judge_config(url, allow_insecure_http=True))
    assert sent == [url, url]


def test_judge_allow_insecure_http_is_a_checked_bool() -> None:
    assert judge_config("http://localhost:1/x").allow_insecure_http is False
    with pytest.raises(ConfigError, match=r"instruct\.judge\.allow_insecure_http"):
        judge_config("http://localhost:1/x", allow_insecure_http="yes")
    params = committed_params_raw()
    assert params["instruct"]["judge"]["allow_insecure_http"] is False
