"""The fields of a Messages block that the chat path takes without looking at them, or needs present, are
checked as Anthropic types them, whole and in ``count_tokens``: a ``tool_result``'s ``is_error`` (a
boolean), an assistant's ``thinking`` block's ``thinking`` and ``signature`` and a ``redacted_thinking``
block's ``data`` (strings, required: they are replayed, not shown to the model), a ``tool_use`` block's
``input`` (required). Anthropic refuses each ("Input should be a valid boolean", "Field required");
null is no value of any of them (``is_error: null`` is refused, and leaving it out is served).

Before, each was taken silently: ``"is_error": "yes"`` answered 200, a thinking block of ``"thinking":
5`` or without a signature too, and a ``tool_use`` block without ``input`` became a call with ``{}``
for arguments. Over the gateway's handlers and a scripted broker client: no sockets, no processes."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from tests.gateway.test_json_in_strings import handlers  # noqa: E402
from tests.gateway.test_tools_stream import OutputClient  # noqa: E402
from tests.support.gateway import served  # noqa: E402

M, K = "/v1/messages", "/v1/messages/count_tokens"
USE = {"type": "tool_use", "id": "a", "name": "f", "input": {}}


def result(**fields) -> list[dict]:
    """A call and its result, the result's block with ``fields``."""
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [USE]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "a", "content": "plain", **fields}]}]


def thought(block: dict) -> list[dict]:
    """A conversation whose assistant turn holds ``block`` before its text."""
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "content": [block, {"type": "text", "text": "ok"}]},
            {"role": "user", "content": "plain"}]


THINKING = {"type": "thinking", "thinking": "hmm", "signature": "s"}
REDACTED = {"type": "redacted_thinking", "data": "opaque"}
NO_INPUT = {k: v for k, v in USE.items() if k != "input"}

REFUSED = [  # (messages, the field named, the words after it)
    (result(is_error="yes"), "messages.2.content.0.is_error", 'Input should be true or false; got "yes"'),
    (result(is_error=1), "messages.2.content.0.is_error", "Input should be true or false; got 1"),
    # null was taken as absent; Anthropic's type (the SDK's ToolResultBlockParam.is_error: bool) has no null
    (result(is_error=None), "messages.2.content.0.is_error", "Input should be true or false; got null"),
    (thought({**THINKING, "thinking": 5}), "messages.1.content.0.thinking", "Input should be a string; got 5"),
    (thought({k: v for k, v in THINKING.items() if k != "signature"}), "messages.1.content.0.signature",
     "Field required"),
    (thought({**THINKING, "signature": None}), "messages.1.content.0.signature", "Input should be a string; got null"),
    (thought({"type": "redacted_thinking"}), "messages.1.content.0.data", "Field required"),
    (thought({**REDACTED, "data": []}), "messages.1.content.0.data", "Input should be a string; got"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": [NO_INPUT]}],
     "messages.1.content.0.input", "Field required"),
]


@pytest.fixture(scope="module")
def http():
    client = OutputClient()
    with served(handlers(client), client) as h:
        yield h


def post(http, path: str, messages: list[dict]):
    return http.post(path, json={"model": "m", "messages": messages, **({"max_tokens": 2} if path == M else {})})


@pytest.mark.parametrize("path", [M, K])
@pytest.mark.parametrize("messages, field, says", REFUSED, ids=[f"{f}:{i}" for i, (_, f, _) in enumerate(REFUSED)])
def test_a_block_field_anthropic_refuses_is_a_400_naming_it(http, path, messages, field, says):
    r = post(http, path, messages)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert r.json()["error"]["message"].startswith(f"{field}: {says}"), r.text


@pytest.mark.parametrize("messages", [result(is_error=True), result(is_error=False), result(),
                                      thought(THINKING), thought({**THINKING, "signature": ""}), thought(REDACTED)])
def test_well_typed_block_fields_are_served(http, messages):
    r = post(http, M, messages)
    assert r.status_code == 200, r.text
