"""A body that lacks its route's input field but carries another route's (chat given a completions
``prompt``, completions given chat's ``messages``, /v1/messages given ``prompt`` or ``input``,
/v1/responses given ``messages`` or ``prompt``) is still the 400 naming the route's own field, and its
message names the route that takes the field sent: chat's bare "Missing required parameter: 'messages'"
did not tell a client where a ``prompt`` belongs (:func:`gateway.errors.missing_parameter`). Over the
gateway's handlers and a scripted broker client: no sockets, no processes."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from tests.gateway.test_error_field_names import MESSAGES, routes_app  # noqa: E402
from tests.support.gateway import error_of, served  # noqa: E402
from tests.support.scripted import ScriptedClient  # noqa: E402

C, P, R, M = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"
ROUTE_OF = {"prompt": "/v1/completions'", "messages": "/v1/chat/completions' and /v1/messages'",
            "input": "/v1/responses'"}
SENT = {"prompt": "hi", "messages": MESSAGES, "input": "hi"}


@pytest.fixture(scope="module")
def http():
    client = ScriptedClient()
    with served(routes_app(client), client) as h:
        yield h


def refusal(http, path: str, fields: dict) -> tuple[str, str | None]:
    """``(message, param)`` of the 400 that ``path`` answers ``fields`` with (Anthropic's shape on
    /v1/messages: no param, the message starts with the field)."""
    r = http.post(path, json={"model": "m", "max_tokens": 2, **fields} if path != R else {"model": "m", **fields})
    if path == M:
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        return r.json()["error"]["message"], None
    e = error_of(r, 400)
    assert e["code"] == "missing_required_parameter", e
    return e["message"], e["param"]


@pytest.mark.parametrize("path, own, sent", [
    (C, "messages", "prompt"), (C, "messages", "input"),
    (P, "prompt", "messages"), (P, "prompt", "input"),
    (M, "messages", "prompt"), (M, "messages", "input"),
    (R, "input", "messages"), (R, "input", "prompt")])
def test_another_routes_input_is_named_with_its_route(http, path, own, sent):
    message, param = refusal(http, path, {sent: SENT[sent]})
    assert f"Missing required parameter: '{own}'" in message
    assert message.endswith(f"; '{sent}' is {ROUTE_OF[sent]} field; this route takes '{own}'"), message
    assert param == (None if path == M else own)
    if path == M:
        assert message.startswith(f"{own}: "), message


@pytest.mark.parametrize("path, own", [(C, "messages"), (P, "prompt"), (M, "messages"), (R, "input")])
def test_no_input_at_all_is_the_bare_missing_parameter(http, path, own):
    message, _ = refusal(http, path, {})
    assert message.endswith(f"Missing required parameter: '{own}'"), message


def test_a_responses_prompt_template_is_no_completions_prompt(http):
    r = http.post(R, json={"model": "m", "prompt": {"id": "pmpt_1"}})
    e = error_of(r, 400)
    assert (e["param"], e["code"]) == ("prompt", "unsupported_parameter"), e


def test_a_null_field_is_none_sent(http):
    message, param = refusal(http, C, {"prompt": None})
    assert (message, param) == ("Missing required parameter: 'messages'", "messages")
