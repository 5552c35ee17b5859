"""A body that is not valid JSON, on every route that reads one (the gateway's whole app, no broker:
every body is read before the broker is asked anything). A string escape of half a UTF-16 surrogate
pair (``"\\ud800"`` alone) was answered in the parser's words, "unexpected end of hex escape" (or
"lone leading surrogate" for a trailing half), and ``/models/load`` took it and failed to answer
(its 404 could not be written as UTF-8): each route now says what and where it is, in its own
error shape."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from starlette.testclient import TestClient  # noqa: E402

from gateway.app import create_app  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.errors import invalid_json  # noqa: E402
from tests.support.cluster import free_port  # noqa: E402

ANTHROPIC = ("/v1/messages", "/v1/messages/count_tokens")


@pytest.fixture(scope="module")
def app():
    config = GatewayConfig(broker=f"tcp://127.0.0.1:{free_port()}", connect_timeout_s=0.5,
                           on_demand_models=("lazy",))
    return create_app(config, model_orders=lambda op, model: None)


@pytest.fixture(scope="module")
def http(app):
    with TestClient(app) as c:
        yield c


def post_routes(app) -> list[str]:
    """Every path of the app that takes a POST: each reads a JSON body."""
    return sorted({r.path for r in app.routes if "POST" in (r.methods or ())})


def test_every_post_route_is_covered(app):
    assert set(ANTHROPIC) <= set(post_routes(app)) and {"/v1/completions", "/models/load", "/infill"} <= \
        set(post_routes(app))


def error_message(r, path: str) -> str:
    """The message of a 400 in the route's error shape: Anthropic's on the Messages API, else OpenAI's
    with the code ``invalid_json`` and no ``param``."""
    assert r.status_code == 400, (path, r.text)
    body = r.json()
    if path in ANTHROPIC:
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}, body
        assert body["error"]["type"] == "invalid_request_error"
        return body["error"]["message"]
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    assert (body["error"]["type"], body["error"]["param"], body["error"]["code"]) == \
        ("invalid_request_error", None, "invalid_json"), body
    return body["error"]["message"]


@pytest.mark.parametrize("raw, escape", [
    (b'{"model": "lazy", "prompt": "\\ud800", "x": 1}', "\\ud800"),                # a high half at the end
    (b'{"model": "lazy", "prompt": "ab\\udc00"}', "\\udc00"),                      # a low half alone
    (b'{"model": "lazy", "prompt": "\\uD83D\\u0041"}', "\\uD83D"),                 # a high half, no low one next
    (b'{"model": "lazy", "prompt": "\\ud83d\\ude00 \\\\ud800 \\udbff"}', "\\udbff"),  # a pair, an escaped
])                                                                                # backslash, then a lone half
def test_a_lone_surrogate_escape_is_named_with_its_place_on_every_route(app, http, raw, escape):
    column = raw.decode().index(escape) + 1  # (each escape is once in its body, on line 1)
    for path in post_routes(app):
        message = error_message(http.post(path, content=raw, headers={"content-type": "application/json"}), path)
        assert message == (f"the body is not valid JSON: it contains an unpaired surrogate escape '{escape}' at "
                           f"line 1 column {column} (half of a UTF-16 surrogate pair, which is no character); send "
                           "the character itself as UTF-8, or both halves of its pair"), (path, message)


def test_the_line_and_column_are_counted_in_characters_on_later_lines():
    raw = '{\n  "model": "é",\n  "input": ["ok", "é\\ud800"]\n}'.encode()
    assert "at line 3 column 21 " in invalid_json(raw, "").message
    assert raw.decode().splitlines()[2][20:26] == "\\ud800"


def test_a_syntax_error_before_a_lone_surrogate_is_the_one_named_and_a_pair_is_no_error(app, http):
    for path in post_routes(app):
        r = http.post(path, content=b'{"model": "lazy" "prompt": "\\ud800"}', headers={"content-type": "application/json"})
        message = error_message(r, path)
        assert "surrogate" not in message and message.startswith("the body is not valid JSON: ") and \
            "Invalid JSON" not in message, (path, message)  # (pydantic's prefix, said twice before)
        paired = http.post(path, content=b'{"model": "lazy", "prompt": "\\ud83d\\ude00"}',
                           headers={"content-type": "application/json"})
        assert "not valid JSON" not in paired.text, (path, paired.text)
