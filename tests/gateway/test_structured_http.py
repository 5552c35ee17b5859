"""Structured outputs over HTTP (gateway/structured.py): OpenAI's ``response_format`` through the
``openai`` SDK, vLLM's ``structured_outputs`` and ``guided_*``, llama.cpp's ``json_schema`` and
``grammar``, streamed and not; a spec that does not compile is a 400 naming the field, streams
too, and the requests beside it are served. The tiny text model's output is gibberish, so what
holds is the constraint's doing."""

from __future__ import annotations

import json
import re

import httpx
import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from tests.support.gateway import error_of  # noqa: E402

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["ok", "colour"],
          "properties": {"ok": {"type": "boolean"}, "colour": {"enum": ["red", "green", "blue"]}}}
MESSAGES = [{"role": "user", "content": "hello world"}]


def test_the_sdks_response_format_json_schema_gives_valid_json(oai, text_model):
    r = oai.chat.completions.create(
        model=text_model, messages=MESSAGES, max_tokens=40, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}})
    choice = r.choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_sampled_choices_hold_too(oai, text_model):
    r = oai.chat.completions.create(
        model=text_model, messages=MESSAGES, max_tokens=40, temperature=1.0, seed=3, n=3,
        response_format={"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}})
    for choice in r.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), SCHEMA)


def test_json_object_on_completions_streamed(oai, text_model):
    chunks = list(oai.completions.create(model=text_model, prompt="hello", max_tokens=30, temperature=0,
                                         stream=True, extra_body={"response_format": {"type": "json_object"}}))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    reason = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason][-1]
    assert text.startswith("{")
    if reason == "stop":
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("extra, holds", [
    ({"structured_outputs": {"choice": ["alpha", "beta"]}}, lambda t: t in ("alpha", "beta")),
    ({"structured_outputs": {"regex": "[0-9]{3}-[a-c]"}}, lambda t: re.fullmatch(r"[0-9]{3}-[a-c]", t)),
    ({"structured_outputs": {"json": SCHEMA}}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),
    ({"structured_outputs": {"grammar": 'start: "x=" /[a-z]{2}/'}}, lambda t: re.fullmatch("x=[a-z]{2}", t)),
    ({"guided_choice": ["one", "two"]}, lambda t: t in ("one", "two")),
    ({"grammar": 'root ::= "yes" | "no"'}, lambda t: t in ("yes", "no")),  # llama.cpp's GBNF
    ({"json_schema": SCHEMA}, lambda t: jsonschema.validate(json.loads(t), SCHEMA) is None),  # llama.cpp's
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllm_and_llamacpp_fields(cluster, text_model, extra, holds, path):
    body = {"model": text_model, "max_tokens": 40, "temperature": 0, **extra}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "hello"})
    r = httpx.post(cluster.http_url + path, json=body, timeout=60)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    text = choice["message"]["content"] if "chat" in path else choice["text"]
    assert choice["finish_reason"] == "stop" and holds(text), text


@pytest.mark.parametrize("extra, param", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs"),  # the worker's compile error
    ({"grammar": "root ::= ("}, "grammar"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format"),  # compiles, but no output can start it (was a 500 at its first token)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": [1]}}},
     "response_format.json_schema.schema"),  # the edge's checks
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "xml"}}, "response_format.type"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ({"structured_outputs": {"pattern": "a"}}, "structured_outputs.pattern"),
    ({"guided_regex": "a", "json_schema": SCHEMA}, "json_schema"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_specs_are_400_naming_the_field_and_the_neighbours_are_served(cluster, text_model, extra, param,
                                                                           stream):
    url = cluster.http_url + "/v1/chat/completions"
    good = {"model": text_model, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
    with httpx.Client(timeout=60) as http:
        r = http.post(url, json={**good, **extra, "stream": stream})
        err = error_of(r, 400)
        assert err["param"] == param, err
        ok = http.post(url, json={**good, "structured_outputs": {"choice": ["fine"]}})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"


@pytest.mark.parametrize("extra, words", [
    ({"structured_outputs": {"regex": "a(b"}}, "structured_outputs does not compile: "),
    ({"grammar": "root ::= ("}, "grammar does not compile: "),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format does not compile: "),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "response_format admits no output"),
    ({"guided_choice": []}, "guided_choice must be a non-empty list of strings"),  # (the edge's: was
])                                                                                  # "guided_choice choice must")
def test_a_refused_spec_is_named_by_the_body_field_in_the_message_too(cluster, text_model, extra, words):
    """The worker's words name the request's field ("structured regex does not compile: ..."),
    which no HTTP body has: the message names the body's."""
    r = httpx.post(cluster.http_url + "/v1/chat/completions", timeout=60,
                   json={"model": text_model, "messages": MESSAGES, "max_tokens": 4, **extra})
    assert error_of(r, 400)["message"].startswith(words), r.text


def test_text_response_format_is_no_constraint(oai, text_model):
    free = oai.chat.completions.create(model=text_model, messages=MESSAGES, max_tokens=6, temperature=0)
    text = oai.chat.completions.create(model=text_model, messages=MESSAGES, max_tokens=6, temperature=0,
                                       response_format={"type": "text"})
    assert free.choices[0].message.content == text.choices[0].message.content
