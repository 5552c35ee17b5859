"""The fields the translated routes take and do not use are checked as their vendor checks them (an
adversarial pass found them taken unchecked: ``thinking: {"type": "bogus"}``, ``service_tier: "gold"``,
``include: ["bogus"]`` all answered 200). ``/v1/messages`` (and ``count_tokens`` where Anthropic's
takes the field): ``thinking`` (Anthropic's ``ThinkingConfigParam``: ``enabled`` with an int
``budget_tokens`` >= 1024 and below ``max_tokens``, ``disabled``, ``adaptive``, ``between_tools``),
``service_tier``, ``speed``, ``cache_control`` (top-level, a block's, a tool's); ``/v1/responses``:
``include``, ``text.verbosity``, ``prompt_cache_retention``, ``reasoning``, ``stream_options``;
``/v1/chat/completions``: ``safety_identifier``, ``prompt_cache_key``, ``prompt_cache_retention``,
``verbosity`` (the chat route answered them 'Unrecognized request argument supplied', which the
openai SDK's chat.completions.create sends, while /v1/responses took the first two). A wrong type or value is a 400
naming the field, in the vendor's shape and words, whole and streamed, before anything is submitted;
every value the vendor takes stays taken. Over the handlers apps with scripted broker clients
(tests/gateway/conftest.py's fixtures), no sockets."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
pytest.importorskip("openai")
pytest.importorskip("anthropic")
pytest.importorskip("transformers")

from gateway.messages_body import MIN_THINKING_BUDGET  # noqa: E402
from gateway.responses_api import INCLUDABLES  # noqa: E402
from tests.gateway.test_empty_content import MESSAGES_PATHS  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import KEY  # noqa: E402

USER = [{"role": "user", "content": "plain"}]
ENABLED = {"type": "enabled", "budget_tokens": MIN_THINKING_BUDGET}
MESSAGES_FIELDS = [  # (field, value, what the message starts with, whether count_tokens takes the field)
    ("thinking", "on", 'thinking: Input should be an object whose type is', True),
    ("thinking", {"type": "bogus"}, "thinking.type: Input should be 'enabled', 'disabled', 'adaptive' or "
                                    "'between_tools'; got \"bogus\"", True),
    ("thinking", {"budget_tokens": 2048}, "thinking.type: Input should be", True),
    ("thinking", {"type": "enabled"}, "thinking.budget_tokens: Field required", True),
    ("thinking", {**ENABLED, "budget_tokens": 1023}, "thinking.budget_tokens: Input should be greater than or equal "
                                                     "to 1024; got 1023", True),
    ("thinking", {**ENABLED, "budget_tokens": 2048.0}, "thinking.budget_tokens: Input should be a valid integer; "
                                                       "got 2048.0", True),
    ("thinking", {**ENABLED, "budget_tokens": "2048"}, "thinking.budget_tokens: Input should be a valid integer", True),
    ("thinking", {**ENABLED, "budget_tokens": True}, "thinking.budget_tokens: Input should be a valid integer", True),
    ("thinking", {**ENABLED, "display": "full"}, "thinking.display: Input should be 'summarized' or 'omitted' or "
                                                 "null; got \"full\"", True),
    ("thinking", {"type": "disabled", "budget_tokens": 2048}, "thinking.budget_tokens: Extra inputs are not "
                                                              "permitted (thinking of type disabled takes type)", True),
    ("thinking", {**ENABLED, "effort": "high"}, "thinking.effort: Extra inputs are not permitted", True),
    ("service_tier", "gold", "service_tier: Input should be 'auto' or 'standard_only'; got \"gold\"", False),
    ("service_tier", 1, "service_tier: Input should be 'auto' or 'standard_only'; got 1", False),
    ("speed", "warp", "speed: Input should be 'standard' or 'fast'; got \"warp\"", True),
    ("cache_control", "ephemeral", 'cache_control: Input should be an object {"type": "ephemeral"}', True),
    ("cache_control", {"type": "persistent"}, "cache_control.type: Input should be 'ephemeral'", True),
    ("cache_control", {"type": "ephemeral", "ttl": "1d"}, "cache_control.ttl: Input should be '5m' or '1h'; got "
                                                          "\"1d\"", True),
    ("cache_control", {"type": "ephemeral", "scope": "org"}, "cache_control.scope: Extra inputs are not permitted",
     True),
]


@pytest.mark.parametrize("path, stream", MESSAGES_PATHS)
@pytest.mark.parametrize("field, value, message, counted", MESSAGES_FIELDS,
                         ids=[f"{f}-{i}" for i, (f, *_) in enumerate(MESSAGES_FIELDS)])
def test_messages_a_field_taken_unused_is_checked_as_anthropic_checks_it(messages_http, path, stream, field, value,
                                                                         message, counted):
    body = {"model": "m", "messages": USER, field: value,
            **({} if stream is None else {"max_tokens": 4096, "stream": stream})}
    r = messages_http.post(path, json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["type"] == "error", r.text
    assert r.json()["error"]["type"] == "invalid_request_error", r.text
    want = message if counted or stream is not None else f"{field}: Extra inputs are not permitted"
    assert r.json()["error"]["message"].startswith(want), r.text
    assert not messages_http.scripted.submitted


@pytest.mark.parametrize("stream", [False, True])
def test_messages_a_thinking_budget_must_be_below_max_tokens(messages_http, stream):
    """Anthropic's rule (the thinking counts in ``max_tokens``); ``count_tokens`` has no ``max_tokens``
    and takes any budget of at least 1024."""
    for budget in (4096, 5000):
        body = {"model": "m", "messages": USER, "max_tokens": 4096, "stream": stream,
                "thinking": {**ENABLED, "budget_tokens": budget}}
        r = messages_http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
        assert r.status_code == 400 and r.json()["error"]["message"] == (
            f"thinking.budget_tokens: max_tokens must be greater than thinking.budget_tokens (4096 <= {budget}): the "
            "thinking counts in max_tokens; raise max_tokens or lower the budget"), r.text
    assert not messages_http.scripted.submitted
    r = messages_http.post("/v1/messages/count_tokens", json={"model": "m", "messages": USER, "thinking": {
        **ENABLED, "budget_tokens": 5000}}, headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.json()["input_tokens"] > 0, r.text


@pytest.mark.parametrize("path, stream", MESSAGES_PATHS)
@pytest.mark.parametrize("block, field", [
    ({"type": "text", "text": "plain", "cache_control": {"type": "ephemeral", "ttl": "2h"}},
     "messages.0.content.0.cache_control.ttl"),
    ({"type": "text", "text": "plain", "cache_control": "ephemeral"}, "messages.0.content.0.cache_control"),
    (None, "tools.0.cache_control.type"),
    ("system", "system.0.cache_control.type"),
])
def test_messages_a_blocks_or_tools_cache_control_is_checked_too(messages_http, path, stream, block, field):
    body = {"model": "m", "messages": USER, **({} if stream is None else {"max_tokens": 5, "stream": stream})}
    bad = {"type": "persistent"}
    if block is None:
        body["tools"] = [{"name": "get_time", "input_schema": {"type": "object"}, "cache_control": bad}]
    elif block == "system":
        body["system"] = [{"type": "text", "text": "Be brief.", "cache_control": bad}]
    else:
        body["messages"] = [{"role": "user", "content": [block]}]
    r = messages_http.post(path, json=body, headers={"x-api-key": KEY})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{field}: "), r.text
    assert not messages_http.scripted.submitted


@pytest.mark.parametrize("path, stream", MESSAGES_PATHS)
def test_messages_every_value_anthropic_takes_is_taken(messages_http, path, stream):
    cached = {"type": "ephemeral", "ttl": "1h"}
    fields = [("thinking", ENABLED), ("thinking", {**ENABLED, "display": "omitted"}),
              ("thinking", {"type": "disabled"}), ("thinking", {"type": "adaptive"}), ("thinking", {"type": "adaptive", "display": "summarized"}),
              ("thinking", {"type": "between_tools"}), ("thinking", None), ("speed", "fast"), ("speed", "standard"),
              ("speed", None), ("cache_control", {"type": "ephemeral"}), ("cache_control", cached),
              ("cache_control", None)]
    if stream is not None:
        fields += [("service_tier", "auto"), ("service_tier", "standard_only"), ("inference_geo", "us")]
    for field, value in fields:
        body = {"model": "m", field: value, "system": [{"type": "text", "text": "be brief", "cache_control": cached}],
                "messages": [{"role": "user", "content": [{"type": "text", "text": "plain", "cache_control": cached}]}],
                **({} if stream is None else {"max_tokens": 2048, "stream": stream, "tools": [  # (the letters
                    # tokenizer renders no tools: a count's tools are test_messages_api's cluster's)
                    {"name": "get_time", "input_schema": {"type": "object"}, "cache_control": cached}]})}
        r = messages_http.post(path, json=body, headers={"x-api-key": KEY})
        assert r.status_code == 200, (field, value, r.text)


RESPONSES_FIELDS = [  # (field, value, param, message)
    ("include", ["bogus"], "include.0", "Invalid value: 'bogus'. Supported values are: 'file_search_call.results', "),
    ("include", [INCLUDABLES[0], 5], "include.1", "Invalid value for 'include.1': Input should be a valid string"),
    ("text", {"verbosity": "loud"}, "text.verbosity",
     "Invalid value: 'loud'. Supported values are: 'low', 'medium', and 'high'."),
    ("reasoning", {"summary": "long"}, "reasoning.summary", "Invalid value: 'long'. Supported values are: 'auto', "),
    ("reasoning", {"generate_summary": 1}, "reasoning.generate_summary", "Invalid value: 1."),
    ("reasoning", {"context": "none"}, "reasoning.context", "Invalid value: 'none'."),
    ("reasoning", {"mode": 2}, "reasoning.mode",
     "Invalid type for 'reasoning.mode': expected a string, but got a number instead."),  # (was 'got int')
    ("reasoning", {"mode": ["a"]}, "reasoning.mode",
     "Invalid type for 'reasoning.mode': expected a string, but got an array instead."),  # (was 'got list')
    ("reasoning", {"budget": 1}, "reasoning.budget", "Unknown parameter: 'reasoning.budget'"),
    ("stream_options", {"include_obfuscation": "yes"}, "stream_options.include_obfuscation",
     "Invalid type for 'stream_options.include_obfuscation': expected a boolean, but got a string instead."),
    ("stream_options", {"include_obfuscation": 0}, "stream_options.include_obfuscation",
     "Invalid type for 'stream_options.include_obfuscation': expected a boolean, but got a number instead."),
    ("stream_options", {"include_obfuscation": {}}, "stream_options.include_obfuscation",
     "Invalid type for 'stream_options.include_obfuscation': expected a boolean, but got an object instead."),
    ("stream_options", {"include_usage": True}, "stream_options.include_usage",
     "Unknown parameter: 'stream_options.include_usage'"),
    ("prompt_cache_retention", "1h", "prompt_cache_retention",
     "Invalid value: '1h'. Supported values are: 'in_memory' and '24h'."),
    ("prompt_cache_retention", 24, "prompt_cache_retention", "Invalid value: 24."),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, value, param, message", RESPONSES_FIELDS,
                         ids=[f"{f}-{i}" for i, (f, *_) in enumerate(RESPONSES_FIELDS)])
def test_responses_a_field_taken_unused_is_checked_as_openai_checks_it(responses_http, stream, field, value, param,
                                                                       message):
    r = responses_http.post("/v1/responses", json={"model": "m", "input": "plain", "stream": stream, field: value})
    e = error_of(r, 400)
    assert e["param"] == param and e["message"].startswith(message), e
    assert e["type"] == "invalid_request_error", e
    assert not responses_http.scripted.submitted


@pytest.mark.parametrize("stream", [False, True])
def test_responses_every_value_openai_takes_is_taken(responses_http, stream):
    for field, value in [("include", list(INCLUDABLES)), ("include", []), ("text", {"verbosity": "low"}),
                         ("text", {"verbosity": None}), ("reasoning", {"effort": "low", "summary": "auto",
                                                                       "generate_summary": None, "context": "auto",
                                                                       "mode": "standard"}),
                         ("stream_options", {"include_obfuscation": False}), ("stream_options", {}),
                         ("prompt_cache_retention", "in_memory"), ("prompt_cache_retention", "24h"),
                         ("prompt_cache_retention", None), ("prompt_cache_key", "k"), ("safety_identifier", "u")]:
        r = responses_http.post("/v1/responses", json={"model": "m", "input": "plain", "stream": stream, field: value})
        assert r.status_code == 200, (field, value, r.text)


CHAT_FIELDS = [  # (field, value, code, message)
    ("verbosity", "loud", "invalid_value", "Invalid value: 'loud'. Supported values are: 'low', 'medium', and 'high'."),
    ("verbosity", 1, "invalid_type", "Invalid value for 'verbosity': Input should be a valid string"),
    ("prompt_cache_retention", "1h", "invalid_value", "Invalid value: '1h'. Supported values are: 'in_memory' and "
                                                      "'24h'."),
    ("prompt_cache_retention", True, "invalid_type",
     "Invalid value for 'prompt_cache_retention': Input should be a valid string"),
    ("prompt_cache_key", 5, "invalid_type", "Invalid value for 'prompt_cache_key': Input should be a valid string"),
    ("safety_identifier", ["u"], "invalid_type",
     "Invalid value for 'safety_identifier': Input should be a valid string"),
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("field, value, code, message", CHAT_FIELDS,
                         ids=[f"{f}-{i}" for i, (f, *_) in enumerate(CHAT_FIELDS)])
def test_chat_a_field_taken_unused_is_checked_as_openai_checks_it(chat_http, stream, field, value, code, message):
    r = chat_http.post("/v1/chat/completions", json={"model": "m", "messages": USER, "max_tokens": 2,
                                                      "stream": stream, field: value})
    e = error_of(r, 400)
    assert (e["param"], e["code"], e["type"]) == (field, code, "invalid_request_error"), e
    assert e["message"].startswith(message), e
    assert not chat_http.scripted.submitted


@pytest.mark.parametrize("stream", [False, True])
def test_chat_every_value_openai_takes_is_taken(chat_http, stream):
    """Each field the openai SDK's ``chat.completions.create`` sends that the chat path does not use:
    the SDK's own call, each value its types allow."""
    openai = pytest.importorskip("openai")
    with openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=chat_http,
                       max_retries=0) as sdk:
        for field, value in [("verbosity", "low"), ("verbosity", "medium"), ("verbosity", "high"), ("verbosity", None),
                             ("prompt_cache_retention", "in_memory"), ("prompt_cache_retention", "24h"),
                             ("prompt_cache_retention", None), ("prompt_cache_key", "k"), ("prompt_cache_key", ""),
                             ("safety_identifier", "u-1"), ("safety_identifier", None)]:
            r = sdk.chat.completions.create(model="m", messages=USER, max_tokens=2, stream=stream, **{field: value})
            if stream:
                r = list(r)
                assert r[-1].choices[0].finish_reason is not None, (field, value)
            else:
                assert r.choices[0].finish_reason is not None, (field, value)
