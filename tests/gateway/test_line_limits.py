"""llama.cpp's ``n_indent`` and ``t_max_predict_ms`` on ``/completion`` and ``/infill`` (llama.vscode
sends both with every ``/infill``; they were accepted and not applied, so an editor's completion ran
on past where llama.cpp stops): a line indented less than ``n_indent`` ends the generation, the text
cut before its first character past the indentation; the first newline once ``t_max_predict_ms``
have passed since the first token ends it, kept whole. Either answers ``stop: true``, ``stop_type``
``limit``, whole and streamed alike, and cancels the rest upstream at once. Over the gateway's
handlers and a scripted client whose text comes in the pieces a worker releases and whose time is a
fake clock (no sleeps); each prompt of a body is judged on its own."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("starlette")
from starlette.applications import Starlette  # noqa: E402
from starlette.middleware import Middleware  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from client.handle import ClientHandle  # noqa: E402
from gateway.auth import APIKeys  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.generate import Generate  # noqa: E402
from gateway.infill import InfillEndpoint  # noqa: E402
from gateway.line_limits import LineLimits  # noqa: E402
from gateway.llama_completion import LlamaCompletionEndpoint  # noqa: E402
from gateway.metrics import GatewayMetrics  # noqa: E402
from gateway.tokenizer import Tokenizers  # noqa: E402
from protocol.enums import FinishReason  # noqa: E402
from tests.gateway.test_llama_completion import FINAL_KEYS, KEY, Link, events, tokenizer  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import ScriptedClient  # noqa: E402

GIVE_UP_S = 10.0
"""How long a script that runs on waits for the gateway's cancel before it ends ``length`` (a test
that sees that fails: the gateway did not cancel)."""

SCRIPTS = {
    # (piece, the fake clock's seconds when it comes), one token each
    "code": [("x = 1", 0.0), ("\n", 0.0), ("    ", 0.0), ("y = 2", 0.0), ("\n", 0.0), ("  ", 0.0), ("z", 0.0),
             (" = 3", 0.0), ("\n", 0.0)],
    "flat": [("a", 0.0), ("\n", 0.0), ("b", 0.0), ("\n", 0.0)],
    "blank": [("a", 0.0), ("\n", 0.0), ("\n", 0.0), ("    b", 0.0)],
    "slow": [("one", 0.0), (" two", 0.5), (" three", 2.0), ("\n", 2.5), ("four", 2.6), ("\n", 2.7)],
    "quick": [("one", 0.0), ("\n", 0.1), ("two", 0.2), ("\n", 0.3), ("three", 2.0), ("\nfour", 2.1), ("\n", 2.2)],
}
"""The scripted output of each prompt (its text); a prompt ending ``+`` runs on after its script
(as a model would) until it is cancelled."""

NOW = threading.local()


def fake_clock() -> float:
    """The script's time on the thread that delivers its tokens (each request's own)."""
    return NOW.s


class Lines(ScriptedClient):
    """Delivers each prompt's script (:data:`SCRIPTS`) as the client does: per piece its token
    (``on_token``), then the text (``on_text``); a cancel ends the request ``cancelled`` before its
    next token. ``cancelled``: the ids the gateway cancelled."""

    def __init__(self) -> None:
        super().__init__()
        self.cancelled: list[int] = []
        self.ended: dict[int, FinishReason] = {}
        self._cancels: dict[int, threading.Event] = {}

    def cancel(self, request_id) -> bool:
        self.cancelled.append(request_id)
        self._cancels.setdefault(request_id, threading.Event()).set()
        return True

    def _script(self, h: ClientHandle) -> None:
        name = h.params.prompt
        runs_on = name.endswith("+")
        gone = self._cancels.setdefault(h.request_id, threading.Event())
        h._prompt_tokens = 2
        reason = FinishReason.LENGTH
        for i, (piece, at) in enumerate(SCRIPTS[name.rstrip("+")]):
            if gone.is_set():
                reason = FinishReason.CANCELLED
                break
            NOW.s = at
            if h.first_token_s is None:
                h.first_token_s = time.monotonic()
            h._tokens.append(i)
            if h.on_token is not None:
                h.on_token(i)
            h._text.append(piece)
            if h.on_text is not None:
                h.on_text(piece)
        else:
            if runs_on and gone.wait(GIVE_UP_S):
                reason = FinishReason.CANCELLED
        self.ended[h.request_id] = reason
        h._end(reason, None, None, time.monotonic())
        h.callback(h.tokens)
        h._done = True

    def ended_as(self) -> dict[int, FinishReason]:
        """How each request ended, once every script has (a cancelled one ends at once)."""
        for t in self.threads:
            t.join(GIVE_UP_S + 5)
        return self.ended


def app(client: Lines) -> Starlette:
    gen = Generate(GatewayConfig(), Link(client), GatewayMetrics(), tokenizers=Tokenizers(tokenizer))
    completion = LlamaCompletionEndpoint(gen, clock=fake_clock)
    return Starlette(routes=[Route("/completion", completion.handle, methods=["POST"]),
                             Route("/infill", InfillEndpoint(gen, clock=fake_clock).infill, methods=["POST"])],
                     middleware=[Middleware(APIKeys, api_keys=(KEY,))])


@pytest.fixture
def served():
    client = Lines()
    with TestClient(app(client), headers={"Authorization": f"Bearer {KEY}"}) as http:
        yield http, client
    for t in client.threads:
        t.join(GIVE_UP_S + 5)


def complete(http, **body):
    r = http.post("/completion", json={"n_predict": 60, **body})
    assert r.status_code == 200, r.text
    return r.json()


def streamed(http, path: str = "/completion", **body) -> list[dict]:
    """The finals of a stream, by index, each with ``content`` and ``tokens`` the events carried."""
    out = {}
    for e in events(http.post(path, json={"n_predict": 60, "stream": True, **body})):
        got = out.setdefault(e["index"], {"content": "", "tokens": []})
        got["content"] += e["content"]
        got["tokens"] += e["tokens"]
        if e["stop"]:
            got.update({k: v for k, v in e.items() if k not in ("content", "tokens")})
    return [out[i] for i in sorted(out)]


def check_limit(out: dict, content: str, tokens: int) -> None:
    """``out`` ended by a limit: llama.cpp's final fields, ``content`` kept, ``tokens`` counted."""
    assert (out["content"], out["stop"], out["stop_type"], out["stopping_word"], out["truncated"]) == \
        (content, True, "limit", "", False), out
    assert out["tokens_predicted"] == out["timings"]["predicted_n"] == len(out["tokens"]) == tokens, out
    assert out["tokens"] == list(range(tokens)) and out["has_new_line"] is ("\n" in content)


@pytest.mark.parametrize("stream", [False, True])
def test_a_line_indented_less_ends_it_cut_before_its_text(served, stream):
    """n_indent 4: ``    y = 2`` passes (exactly 4), ``  z`` (2) ends it: kept up to the ``z``, its
    indentation included, as llama.cpp cuts it; the rest is cancelled upstream."""
    http, client = served
    body = {"prompt": "code+", "n_indent": 4, "return_tokens": True}
    out = streamed(http, **body)[0] if stream else complete(http, **body)
    check_limit(out, "x = 1\n    y = 2\n  ", 7)
    if not stream:
        assert set(out) == FINAL_KEYS
    assert client.cancelled == [0] and client.ended_as() == {0: FinishReason.CANCELLED}


@pytest.mark.parametrize("stream", [False, True])
def test_n_indent_0_or_absent_is_off_and_a_line_at_the_limit_passes(served, stream):
    http, client = served
    for i, extra in enumerate(({"n_indent": 0}, {}, {"n_indent": 2, "t_max_predict_ms": 0},
                               {"n_indent": 0, "t_max_predict_ms": -1})):
        body = {"prompt": "code", "return_tokens": True, **extra}
        out = streamed(http, **body)[0] if stream else complete(http, **body)
        assert (out["content"], out["stop_type"], out["tokens_predicted"]) == \
            ("x = 1\n    y = 2\n  z = 3\n", "limit", 9), (extra, out)
    assert client.cancelled == [] and set(client.ended_as().values()) == {FinishReason.LENGTH}


def test_an_empty_line_is_indented_less(served):
    """llama.cpp's check: an empty line's newline is its first character, so n_indent > 0 ends at it."""
    http, client = served
    check_limit(complete(http, prompt="blank+", n_indent=1, return_tokens=True), "a\n", 3)
    assert complete(http, prompt="blank", n_indent=0)["content"] == "a\n\n    b"


@pytest.mark.parametrize("stream", [False, True])
def test_the_time_limit_ends_it_at_the_first_newline_after_it(served, stream):
    """t_max_predict_ms 1000: past it at " three" (2 s) but mid-line, so it runs on to the newline
    and ends there, the newline kept."""
    http, client = served
    body = {"prompt": "slow+", "t_max_predict_ms": 1000, "return_tokens": True}
    out = streamed(http, **body)[0] if stream else complete(http, **body)
    check_limit(out, "one two three\n", 4)
    assert client.cancelled == [0]


@pytest.mark.parametrize("stream", [False, True])
def test_a_newline_before_the_time_limit_goes_on(served, stream):
    """Newlines at 0.1 s and 0.3 s are within 1000 ms: it goes on; the piece "\\nfour" at 2.1 s ends
    it, kept whole (llama.cpp's check is on the piece that holds a newline)."""
    http, client = served
    body = {"prompt": "quick+", "t_max_predict_ms": 1000, "return_tokens": True}
    out = streamed(http, **body)[0] if stream else complete(http, **body)
    check_limit(out, "one\ntwo\nthree\nfour", 6)
    out = complete(http, prompt="quick", t_max_predict_ms=5000)  # (never past it: to the end)
    assert (out["content"], out["tokens_predicted"]) == ("one\ntwo\nthree\nfour\n", 7)
    assert client.cancelled == [0]


@pytest.mark.parametrize("stream", [False, True])
def test_each_prompt_of_a_body_is_judged_on_its_own(served, stream):
    """Several prompts: one cut by its indentation, one by the time limit, one that never meets
    either; only the two are cancelled, each answer its own."""
    http, client = served
    body = {"prompt": ["code", "flat", "slow+"], "n_indent": 0, "t_max_predict_ms": 1000, "return_tokens": True}
    got = streamed(http, **body) if stream else complete(http, **body)
    assert [o["content"] for o in got] == ["x = 1\n    y = 2\n  z = 3\n", "a\nb\n", "one two three\n"]
    assert [o["stop_type"] for o in got] == ["limit"] * 3
    check_limit(got[2], "one two three\n", 4)
    got = streamed(http, **{**body, "n_indent": 4}) if stream else complete(http, **{**body, "n_indent": 4})
    check_limit(got[0], "x = 1\n    y = 2\n  ", 7)
    check_limit(got[1], "a\n", 3)
    check_limit(got[2], "one two three\n", 4)
    assert sorted(client.cancelled) == [2, 3, 4, 5]


def test_infill_applies_them_as_llama_vscode_sends_them(served):
    http, client = served
    body = {"input_prefix": "code+", "input_suffix": "", "n_indent": 4, "t_max_predict_ms": 250,
            "t_max_prompt_ms": 500, "stream": False, "n_predict": 60}
    r = http.post("/infill", json=body)
    assert r.status_code == 200, r.text
    check_limit(r.json(), "x = 1\n    y = 2\n  ", 7)
    assert client.cancelled == [0]


@pytest.mark.parametrize("path", ["/completion", "/infill"])
@pytest.mark.parametrize("field, value, words", [
    ("n_indent", -1, "n_indent -1: n_indent must be >= 0"), ("n_indent", 1.5, "n_indent"),
    ("n_indent", "4", "n_indent"), ("t_max_predict_ms", -2, "t_max_predict_ms -2: t_max_predict_ms must be >= 0"),
    ("t_max_predict_ms", 0.5, "t_max_predict_ms"), ("t_max_predict_ms", True, "t_max_predict_ms"),
])
def test_a_bad_value_is_the_routes_400_naming_it(served, path, field, value, words):
    http, client = served
    body = {"prompt": "code", "n_predict": 2, field: value} if path == "/completion" else \
        {"input_prefix": "code", "n_predict": 2, field: value}
    for stream in (False, True):
        err = error_of(http.post(path, json={**body, "stream": stream}), 400)
        assert err["param"] == field and words in err["message"], err
    assert not client.submitted


@pytest.mark.parametrize("pieces, n_indent, kept", [
    (["a", "\n", "  ", "  ", "b"], 4, None),                   # indentation in pieces, exactly 4: passes
    (["a\n", "\t\t", "b"], 3, "a\n\t\t"),                     # a tab counts one
    (["a\n  b\n    c\n", "d"], 2, "a\n  b\n    c\n"),          # several lines in one piece
    (["a\n  b\n c"], 2, "a\n  b\n "),
    (["a", "\n", "   ", "\n"], 4, "a\n   "),                   # a line of spaces alone is short too
    (["first line", " goes on"], 8, None),                      # the first line is never judged
])
def test_lines_are_judged_as_llama_cpp_judges_them(pieces, n_indent, kept):
    limits = LineLimits(n_indent, 0, lambda: 0.0)
    stopped = False
    for p in pieces:
        limits.token()
        stopped = limits.feed(p)
        if stopped:
            break
    assert stopped is (kept is not None) and limits.text == ("".join(pieces) if kept is None else kept)
