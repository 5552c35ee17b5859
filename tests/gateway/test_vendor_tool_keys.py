"""A function tool of the Responses or Messages API takes its vendor's keys: those the chat path has no
use for (Anthropic's ``eager_input_streaming``, ``defer_loading``, ``input_examples``,
``allowed_callers``; OpenAI's ``defer_loading``, ``allowed_callers``, ``output_schema``, ``async``) are
checked as the vendor types them and change nothing, and null where the vendor's type allows it
(Anthropic's ``type``, OpenAI's ``description`` and ``parameters``) is the default. A key neither vendor
defines is an unknown field, in the route's words; Anthropic's required ``input_schema`` is required.

Before, each translation handed the tool's other keys to the chat path, whose check knows chat's function
keys only: every one of those vendor keys was a 400 "tools.0 does not take ['defer_loading']" (so a
client that sends them, the SDKs' own types, could not call a tool at all), ``"type": null`` on a
Messages tool "server tools such as None run on Anthropic's servers", ``"description": null`` on a
Responses tool "tools.0.description must be a string", ``"parameters": null`` "must be the JSON schema
of an object", an unknown key "tools.0 does not take ['foo']" (code invalid_value), and a Messages tool
without ``input_schema`` was served as a function of no parameters. Over the gateway's handlers and a
scripted broker client: no sockets, no processes."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
from starlette.testclient import TestClient  # noqa: E402

from tests.gateway.test_json_in_strings import handlers  # noqa: E402
from tests.gateway.test_tools_stream import OutputClient  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402

R, M, K = "/v1/responses", "/v1/messages", "/v1/messages/count_tokens"
SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}
ANTHROPIC_TOOL = {"name": "get_weather", "description": "the weather", "input_schema": SCHEMA}
OPENAI_TOOL = {"type": "function", "name": "get_weather", "description": "the weather", "parameters": SCHEMA}
USER = [{"role": "user", "content": "plain"}]


@pytest.fixture(scope="module")
def scripted():
    client = OutputClient()
    with TestClient(handlers(client)) as http:
        yield http, client
    for t in client.threads:
        t.join(10)


def messages(http, path, tool):
    return http.post(path, json={"model": "m", "messages": USER, "tools": [tool],
                                 **({"max_tokens": 2} if path == M else {})})


def responses(http, tool):
    return http.post(R, json={"model": "m", "input": "plain", "max_output_tokens": 2, "tools": [tool]})


def submitted_prompt(scripted, r):
    """What the request submitted asks the worker to render: its chat and its tools."""
    http, client = scripted
    assert r.status_code == 200, r.text
    return client.submitted[-1].prompt, client.submitted[-1].tools


@pytest.mark.parametrize("extra", [{"eager_input_streaming": True}, {"eager_input_streaming": None},
                                   {"defer_loading": True}, {"input_examples": [{"city": "Oslo"}]},
                                   {"allowed_callers": ["direct"]}, {"type": None}, {"type": "custom"}])
def test_a_messages_tool_takes_anthropics_keys_and_they_change_nothing(scripted, extra):
    http, _ = scripted
    tool = {**ANTHROPIC_TOOL, **extra}
    assert submitted_prompt(scripted, messages(http, M, tool)) == submitted_prompt(
        scripted, messages(http, M, ANTHROPIC_TOOL))


@pytest.mark.parametrize("extra", [{"defer_loading": False}, {"allowed_callers": ["direct"]},
                                   {"allowed_callers": None}, {"output_schema": {"type": "object"}},
                                   {"output_schema": None}, {"async": True}, {"strict": None}])
def test_a_responses_tool_takes_openais_keys_and_they_change_nothing(scripted, extra):
    http, _ = scripted
    assert submitted_prompt(scripted, responses(http, {**OPENAI_TOOL, **extra})) == submitted_prompt(
        scripted, responses(http, OPENAI_TOOL))


@pytest.mark.parametrize("key, without", [("description", {"name": "get_weather", "parameters": SCHEMA}),
                                          ("parameters", {"name": "get_weather", "description": "the weather"})])
def test_a_null_responses_tool_key_is_the_default(scripted, key, without):
    http, _ = scripted
    assert submitted_prompt(scripted, responses(http, {**OPENAI_TOOL, key: None})) == submitted_prompt(
        scripted, responses(http, {"type": "function", **without}))


@pytest.mark.parametrize("path", [M, K])
@pytest.mark.parametrize("extra, field", [
    ({"eager_input_streaming": "yes"}, "tools.0.eager_input_streaming"),
    ({"defer_loading": None}, "tools.0.defer_loading"),
    ({"input_examples": ["Oslo"]}, "tools.0.input_examples"),
    ({"allowed_callers": "direct"}, "tools.0.allowed_callers"),
])
def test_a_messages_tool_key_of_the_wrong_type_is_a_400_naming_it(scripted, path, extra, field):
    r = messages(scripted[0], path, {**ANTHROPIC_TOOL, **extra})
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(f"{field} must be "), r.text


@pytest.mark.parametrize("extra, field", [
    ({"defer_loading": "no"}, "tools.0.defer_loading"),
    ({"allowed_callers": "direct"}, "tools.0.allowed_callers"),
    ({"output_schema": "object"}, "tools.0.output_schema"),
    ({"async": 1}, "tools.0.async"),
])
def test_a_responses_tool_key_of_the_wrong_type_is_a_400_naming_it(scripted, extra, field):
    e = error_of(responses(scripted[0], {**OPENAI_TOOL, **extra}), 400)
    assert (e["param"], e["code"]) == (field, "invalid_type") and e["message"].startswith(f"{field} must be "), e


@pytest.mark.parametrize("path", [M, K])
def test_an_unknown_messages_tool_key_is_refused_in_anthropics_words(scripted, path):
    r = messages(scripted[0], path, {**ANTHROPIC_TOOL, "foo": 1})
    assert r.status_code == 400 and r.json()["error"]["message"] == "tools.0.foo: Extra inputs are not permitted", \
        r.text


def test_an_unknown_responses_tool_key_is_an_unknown_field(scripted):
    e = error_of(responses(scripted[0], {**OPENAI_TOOL, "foo": 1}), 400)
    assert (e["param"], e["code"]) == ("tools.0.foo", "unknown_parameter"), e


@pytest.mark.parametrize("path", [M, K])
def test_a_messages_tool_without_input_schema_is_refused(scripted, path):
    r = messages(scripted[0], path, {"name": "get_weather"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith("tools.0.input_schema: Field required"), r.text
