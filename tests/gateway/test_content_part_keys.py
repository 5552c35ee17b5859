"""A chat message's text part takes the keys OpenAI's type has, as the message itself does: a chat
message's unknown key was a 400 (``Unrecognized request argument supplied: messages.0.foo``) while a key
of its content part was taken silently (``{"type": "text", "text": "hi", "foo": 1}`` served, on
``/v1/chat/completions`` and ``/tokenize``); the Responses API's parts and the Messages API's blocks
refused theirs already. Now a part's unknown key is the same 400, naming ``messages.0.content.1.foo``;
OpenAI's ``prompt_cache_breakpoint`` and the ``cache_control`` marker OpenRouter's and LiteLLM's clients
put on a part are taken (checked as objects, not used). Over the handlers app with a scripted broker
client, no sockets."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from tests.support.gateway import error_of  # noqa: E402

HI = {"type": "text", "text": "hi"}
LONG, CLIPPED = "k" * 5000, "k" * 100 + "… (5000 characters)"


def _body(path: str, content: list) -> dict:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": content}]
    return {"model": "m", "messages": messages, **({"max_tokens": 2} if "chat" in path else {})}


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("key, shown", [("foo", "foo"), ("texts", "texts"), (LONG, CLIPPED)],
                         ids=["foo", "texts", "long"])
def test_an_unknown_key_of_a_text_part_is_an_unknown_field(chat_http, path, key, shown):
    e = error_of(chat_http.post(path, json=_body(path, [HI, {**HI, key: 1}])), 400)
    field = f"messages.1.content.1.{shown}"
    assert (e["param"], e["code"]) == (field, "unknown_parameter"), e
    assert e["message"].startswith(f"Unrecognized request argument supplied: {field} (messages.1.content.1 takes "
                                   "type and text"), e
    assert not chat_http.scripted.submitted


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
@pytest.mark.parametrize("extra", [{"cache_control": {"type": "ephemeral"}},
                                   {"cache_control": {"type": "ephemeral", "ttl": "1h"}},
                                   {"prompt_cache_breakpoint": {"mode": "explicit", "ttl": "30m"}},
                                   {"cache_control": None, "prompt_cache_breakpoint": None}])
def test_the_cache_markers_clients_send_are_taken_and_change_nothing(chat_http, path, extra):
    r = chat_http.post(path, json=_body(path, [{**HI, **extra}]))
    assert r.status_code == 200, r.text
    plain = chat_http.post(path, json=_body(path, [HI]))
    if path == "/tokenize":
        assert r.json()["tokens"] == plain.json()["tokens"]
    else:
        first, second = chat_http.scripted.submitted
        assert first.prompt == second.prompt


@pytest.mark.parametrize("key", ["cache_control", "prompt_cache_breakpoint"])
def test_a_cache_marker_of_another_type_is_named(chat_http, key):
    e = error_of(chat_http.post("/v1/chat/completions", json=_body("/v1/chat/completions", [{**HI, key: "yes"}])),
                 400)
    assert (e["param"], e["code"]) == (f"messages.1.content.0.{key}", "invalid_type"), e
    assert e["message"] == f'messages.1.content.0.{key} must be an object or null; got "yes"', e
