"""A chat message's content is taken by one rule at every entry point, OpenAI's
(:func:`protocol.chat.content_text`): the HTTP chat route and ``/tokenize``, the Python SDK
(:class:`~protocol.request.RequestParams`, what ``Client.submit_request`` builds), ``slotserve run``'s
JSONL rows (:meth:`RequestParams.from_mapping`) and the wire. Was: the SDK and rows refused an
assistant's ``content: null`` beside its ``tool_calls`` and a list of text parts ("chat message 1 must
have string 'role' and 'content'"), and a call's blank or null ``arguments``, which the gateway takes;
now each takes them, and refuses what the gateway refuses in the same words. Over the handlers app
with a scripted broker client (tests/support/scripted.py), no sockets."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("starlette")

from protocol.errors import UnsupportedError  # noqa: E402
from protocol.request import RequestParams, from_wire, to_wire  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402


def _call(arguments=..., cid: str = "c1") -> dict:
    fn = {"name": "get_time"} if arguments is ... else {"name": "get_time", "arguments": arguments}
    return {"id": cid, "type": "function", "function": fn}


TAKEN = {
    "null beside calls": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                             "tool_calls": [_call("{}")]},
                          {"role": "tool", "tool_call_id": "c1", "content": "noon"}],
    "null alone": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                   {"role": "user", "content": "and?"}],
    "text parts": [{"role": "system", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief."}]},
                   {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    "blank arguments": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None,
                                                           "tool_calls": [_call(""), _call(None, "c2"), _call(cid="c3")]},
                        {"role": "tool", "tool_call_id": "c1", "content": "noon"},
                        {"role": "tool", "tool_call_id": "c2", "content": "noon"},
                        {"role": "tool", "tool_call_id": "c3", "content": "noon"}],  # (each call answered)
}


@pytest.mark.parametrize("case", sorted(TAKEN))
def test_every_entry_point_takes_what_openai_takes_as_the_same_prompt(chat_http, case):
    messages = TAKEN[case]
    r = chat_http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": messages})
    assert r.status_code == 200, r.text
    over_http = chat_http.scripted.submitted[-1].prompt
    sdk = RequestParams(messages, 2).prompt  # (Client.submit_request builds this; refused before)
    row = RequestParams.from_mapping(json.loads(json.dumps({"messages": messages, "max_tokens": 2}))).prompt
    wire = from_wire(to_wire(RequestParams(messages, 2))).prompt
    assert sdk == row == wire == over_http, (sdk, over_http)
    assert all(type(m.content) is str for m in sdk)
    if case == "text parts":
        assert [m.content for m in sdk] == ["be brief.", "hi"]
    if case == "blank arguments":
        assert [c.arguments for c in sdk[1].tool_calls] == ["{}"] * 3


REFUSED = [  # (content of the user's message, the field at fault below it)
    ([], ""), (None, ""), ([{"type": "image_url", "image_url": {"url": "x"}}], ".0.type"),
    ([{"type": "mystery"}], ".0.type"), ([{"text": "hi"}], ".0.type"), ([{"type": "text"}], ".0.text"),
    ([{"type": "text", "text": 5}], ".0.text"), ([{"type": 5}], ".0.type"),
]


@pytest.mark.parametrize("content, below", REFUSED)
def test_every_entry_point_refuses_what_the_gateway_refuses_in_its_words(chat_http, content, below):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": content}]
    r = chat_http.post("/v1/chat/completions", json={"model": "m", "max_tokens": 2, "messages": messages})
    unsupported = below == ".0.type" and content[0].get("type") == "image_url"
    e = error_of(r, 501 if unsupported else 400)
    assert e["param"] == "messages.1.content" + below, e
    with pytest.raises(ValueError) as sdk:
        RequestParams(messages, 2)
    with pytest.raises(ValueError) as row:
        RequestParams.from_mapping({"messages": messages, "max_tokens": 2})
    assert str(sdk.value) == str(row.value) and isinstance(sdk.value, UnsupportedError) is unsupported
    words = e["message"].removeprefix(e["param"] + " ")  # (an empty array's message starts with its field)
    field = "chat message 1 content" + "".join(f"[{k}]" if k.isdigit() else f".{k}" for k in below.split(".")[1:])
    assert str(sdk.value) in (f"{field} {words}", f"{field}: {words}"), (str(sdk.value), e)
    assert not chat_http.scripted.submitted
