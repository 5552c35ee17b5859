"""A value of the wrong type is a 400 naming the field on every route, boolean fields first: chat's
``parallel_tool_calls: "yes"`` and ``store: 1`` (completions too) were a 501 "not supported by
slotserve" (the fields were declared ``Any`` and refused unless neutral), as were the other OpenAI
fields slotserve declares to refuse by name (``best_of: "2"``, ``modalities: "text"``, ...): a client
that sends a wrong type is told so, not that a feature is missing. Every boolean field of every route
(top-level and nested) is checked here with a string, a number and an object. Over the gateway's
handlers and a scripted broker client: no sockets, no processes."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")

from tests.gateway.test_error_field_names import BODIES, routes_app  # noqa: E402
from tests.support.gateway import error_of, served  # noqa: E402
from tests.support.scripted import ScriptedClient  # noqa: E402

C, P, R, M, I = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages", "/infill"
TOOL_M = {"name": "f", "input_schema": {"type": "object"}}

BOOLEANS = [  # (route, field as the error names it, the body's fields with the value v)
    (C, "parallel_tool_calls", lambda v: {"parallel_tool_calls": v}),  # (was 501)
    (C, "store", lambda v: {"store": v}),                              # (was 501)
    (P, "store", lambda v: {"store": v}),                              # (was 501)
    (C, "logprobs", lambda v: {"logprobs": v}),
    (P, "echo", lambda v: {"echo": v}),
    (C, "stream", lambda v: {"stream": v}),
    (P, "stream", lambda v: {"stream": v}),
    (P, "include_stop_str_in_output", lambda v: {"include_stop_str_in_output": v}),
    (C, "ignore_eos", lambda v: {"ignore_eos": v}),
    (C, "stream_options.include_usage", lambda v: {"stream": True, "stream_options": {"include_usage": v}}),
    (C, "stream_options.continuous_usage_stats",
     lambda v: {"stream": True, "stream_options": {"include_usage": True, "continuous_usage_stats": v}}),
    (C, "tools.0.function.strict", lambda v: {"tools": [{"type": "function", "function": {"name": "f", "strict": v}}]}),
    (C, "response_format.json_schema.strict",
     lambda v: {"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": v}}}),
    (R, "parallel_tool_calls", lambda v: {"parallel_tool_calls": v}),
    (R, "store", lambda v: {"store": v}),
    (R, "background", lambda v: {"background": v}),
    (R, "stream", lambda v: {"stream": v}),
    (R, "stream_options.include_obfuscation", lambda v: {"stream": True, "stream_options": {"include_obfuscation": v}}),
    (R, "tools.0.strict", lambda v: {"tools": [{"type": "function", "name": "f", "strict": v}]}),
    (R, "text.format.strict", lambda v: {"text": {"format": {"type": "json_schema", "name": "a", "schema": {}, "strict": v}}}),
    (M, "stream", lambda v: {"stream": v}),
    (M, "tool_choice.disable_parallel_tool_use",
     lambda v: {"tools": [TOOL_M], "tool_choice": {"type": "auto", "disable_parallel_tool_use": v}}),
    (M, "tools.0.strict", lambda v: {"tools": [{**TOOL_M, "strict": v}]}),
    (I, "stream", lambda v: {"stream": v}),
    (I, "ignore_eos", lambda v: {"ignore_eos": v}),
    (I, "cache_prompt", lambda v: {"cache_prompt": v}),
    (I, "return_tokens", lambda v: {"return_tokens": v}),
    (I, "timings_per_token", lambda v: {"timings_per_token": v}),
]


@pytest.fixture(scope="module")
def http():
    client = ScriptedClient()
    with served(routes_app(client), client) as h:
        yield h


def post(http, path: str, fields: dict):
    return http.post(path, json={**BODIES[path], **fields})


@pytest.mark.parametrize("value", ["yes", 1, {}])
@pytest.mark.parametrize("path, field, body", BOOLEANS, ids=[f"{p}:{f}" for p, f, _ in BOOLEANS])
def test_a_boolean_field_of_another_type_is_a_400_naming_it(http, path, field, body, value):
    r = post(http, path, body(value))
    if path == M:  # (Anthropic's shape: the message starts with the field)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert r.json()["error"]["message"].startswith(field), r.text
    else:
        e = error_of(r, 400)
        assert e["param"] == field, e


@pytest.mark.parametrize("path, field, wrong, unsupported", [
    (C, "parallel_tool_calls", "yes", None),
    (C, "store", 1, True),
    (P, "store", "no", True),
    (C, "service_tier", 5, "flex"),
    (P, "best_of", "2", 3),
    (C, "modalities", "text", ["audio"]),
    (C, "functions", {}, [{"name": "f"}]),
    (C, "function_call", 5, {"name": "f"}),
    (C, "audio", "x", {"voice": "alloy"}),
    (C, "prediction", "x", {"type": "content", "content": "x"}),
    (C, "web_search_options", "x", {}),
])
def test_an_unimplemented_openai_field_of_another_type_is_a_400_and_its_value_a_501(http, path, field, wrong,
                                                                                   unsupported):
    e = error_of(post(http, path, {field: wrong}), 400)
    assert (e["param"], e["code"]) == (field, "invalid_type"), e
    if unsupported is not None:  # (a value of its type that slotserve cannot honour: 501, as before)
        e = error_of(post(http, path, {field: unsupported}), 501)
        assert (e["param"], e["code"]) == (field, "unsupported"), e


@pytest.mark.parametrize("field, wrong", [("audio", "x"), ("function_call", "x")])
def test_a_messages_unimplemented_field_of_another_type_is_a_400(http, field, wrong):
    messages = [{"role": "assistant", "content": "a", field: wrong}, {"role": "user", "content": "b"}]
    e = error_of(post(http, C, {"messages": messages}), 400)
    assert (e["param"], e["code"]) == (f"messages.0.{field}", "invalid_type"), e


@pytest.mark.parametrize("value", [True, False])
def test_parallel_tool_calls_true_or_false_is_served(http, value):
    assert post(http, C, {"parallel_tool_calls": value}).status_code == 200


@pytest.mark.parametrize("field, body", [
    ("temperature", {"temperature": "0.5"}), ("temperature", {"temperature": True}), ("top_p", {"top_p": "1"}),
    ("top_k", {"top_k": 1.5}), ("max_tokens", {"max_tokens": "5"}), ("stream", {"stream": "yes"}),
    ("metadata.user_id", {"metadata": {"user_id": 5}}),
])
def test_a_messages_field_of_another_type_names_it_once_in_anthropic_s_words(http, field, body):
    # it was 'temperature: Invalid value for 'temperature': Input should be a valid number (got "0.5")': the field
    # twice, the second time in OpenAI's words; Anthropic says 'temperature: Input should be a valid number'
    r = post(http, M, body)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    message = r.json()["error"]["message"]
    assert message.startswith(f"{field}: Input should be ") and "Invalid value" not in message, message


@pytest.mark.parametrize("path, body, kind", [
    (P, {"stop": {"a": 1}}, "an object"),
    (C, {"temperature": [1]}, "an array"),
    (C, {"seed": {"n": 1}}, "an object"),
    (R, {"temperature": {}}, "an object"),
    (R, {"input": [{"role": "user", "content": [["x"]]}]}, "an array"),
])
def test_a_value_of_another_type_is_named_in_json_s_words_never_python_s(http, path, body, kind):
    # an array or object a client sent was shown by its Python type ('got dict', '(got list)'); it is a JSON value
    message = error_of(post(http, path, body), 400)["message"]
    assert f"got {kind}" in message and not any(f"got {t}" in message for t in ("dict", "list")), message
