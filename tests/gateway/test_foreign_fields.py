"""A llama.cpp or Ollama field sent to a generation route is the 400 of any unknown field
(``unknown_parameter``, its ``param`` the field), whose message also says what to send instead (found
by a newcomer pass with llama-server habits: ``n_predict`` was a bare "Unrecognized request argument
supplied: n_predict"); any other unknown field keeps today's words exactly. The app runs in this
process, its broker link never started (the body is refused before any worker is asked)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.foreign_fields import Route, hint

MESSAGES = [{"role": "user", "content": "hi"}]
BODIES = {Route.COMPLETIONS: {"model": "m", "prompt": "hi"}, Route.CHAT: {"model": "m", "messages": MESSAGES},
          Route.RESPONSES: {"model": "m", "input": "hi"},
          Route.MESSAGES: {"model": "m", "max_tokens": 5, "messages": MESSAGES},
          Route.TOKENIZE: {"model": "m", "prompt": "hi"}}
OPENAI = (Route.COMPLETIONS, Route.CHAT)
GENERATION = (Route.COMPLETIONS, Route.CHAT, Route.RESPONSES, Route.MESSAGES)

# (field, value as its client sends it, the routes, what the 400's message must name)
HINTED = [
    ("n_predict", 32, OPENAI + (Route.MESSAGES,), "llama.cpp's n_predict is max_tokens here"),
    ("n_predict", 32, (Route.RESPONSES,), "llama.cpp's n_predict is max_output_tokens here"),
    ("repeat_penalty", 1.1, OPENAI, "llama.cpp's repeat_penalty is repetition_penalty here"),
    ("repeat_penalty", 1.1, (Route.RESPONSES, Route.MESSAGES), "is repetition_penalty, which is taken by "
                                                               "/v1/chat/completions and /v1/completions"),
    ("n_probs", 3, (Route.COMPLETIONS,), "llama.cpp's n_probs is logprobs here"),
    ("n_probs", 3, (Route.CHAT,), "llama.cpp's n_probs is top_logprobs here, with logprobs: true"),
    ("n_probs", 3, (Route.RESPONSES,), "llama.cpp's n_probs is top_logprobs here, with include"),
    ("cache_prompt", True, GENERATION, "the prefix cache is always on; leave it out"),
    ("id_slot", 0, GENERATION, "slots are assigned by the broker; leave it out"),
    ("n_keep", 4, GENERATION, "llama.cpp's n_keep is not supported"),
    ("samplers", ["top_k", "temperature"], OPENAI, "llama.cpp's samplers is not supported"),
    ("typical_p", 0.9, GENERATION, "llama.cpp's typical_p sampler is not supported; leave it out"),
    ("tfs_z", 1.0, OPENAI, "llama.cpp's tfs_z sampler is not supported"),
    ("mirostat", 2, GENERATION, "llama.cpp's mirostat sampler is not supported"),
    ("mirostat_tau", 5.0, OPENAI, "llama.cpp's mirostat_tau sampler is not supported"),
    ("mirostat_eta", 0.1, OPENAI, "llama.cpp's mirostat_eta sampler is not supported"),
    ("dry_multiplier", 0.8, OPENAI, "llama.cpp's dry_multiplier sampler is not supported"),
    ("dry_sequence_breakers", ["\n"], OPENAI, "llama.cpp's dry_sequence_breakers sampler is not supported"),
    ("xtc_probability", 0.5, OPENAI, "llama.cpp's xtc_probability sampler is not supported"),
    ("repeat_last_n", 64, OPENAI, "llama.cpp's repeat_last_n is not supported"),
    ("ignore_eos", True, (Route.RESPONSES, Route.MESSAGES), "llama.cpp's ignore_eos is taken by /v1/chat/completions"),
    ("grammar", "root ::= \"a\"", (Route.RESPONSES,), "llama.cpp's grammar is taken by /v1/chat/completions"),
    ("json_schema", {"type": "object"}, (Route.RESPONSES,), "llama.cpp's json_schema is text.format here"),
    ("stop", ["\n"], (Route.MESSAGES,), "llama.cpp's stop is stop_sequences here"),
    ("options", {"num_predict": 8}, OPENAI, "Ollama's options are not read here: send each as a top-level field, "
                                            "max_tokens for num_predict"),
    ("options", {"num_predict": 8}, (Route.RESPONSES,), "max_output_tokens for num_predict"),
    ("num_predict", 8, OPENAI, "Ollama's num_predict is max_tokens here"),
    ("num_ctx", 4096, GENERATION, "Ollama's num_ctx is the server's, not a request's: slotserve up --max-model-len"),
    ("keep_alive", "5m", GENERATION, "Ollama's keep_alive is not needed"),
    ("format", "json", OPENAI, "Ollama's format is response_format here"),
    # /tokenize: llama.cpp's body there (found by a newcomer pass: {"content": ...} was a bare 400)
    ("content", "hi", (Route.TOKENIZE,), "llama.cpp's content is prompt here"),
    ("add_special", True, (Route.TOKENIZE,), "llama.cpp's add_special is add_special_tokens here"),
    ("with_pieces", True, (Route.TOKENIZE,), "llama.cpp's with_pieces is return_token_strs here"),
]
CASES = [(field, value, route, words) for field, value, routes, words in HINTED for route in routes]


@pytest.fixture(scope="module")
def http():
    return TestClient(create_app(GatewayConfig(broker="tcp://127.0.0.1:1")))  # (no lifespan: no link)


def post(http, route: Route, field: str, value) -> dict:
    r = http.post(route.value, json={**BODIES[route], field: value})
    assert r.status_code == 400, r.text
    return r.json()


@pytest.mark.parametrize("field, value, route, words", CASES,
                         ids=[f"{route.name.lower()}-{field}" for field, _, route, _ in CASES])
def test_a_llama_cpp_or_ollama_field_is_told_what_to_send_instead(http, field, value, route, words):
    body = post(http, route, field, value)
    if route is Route.MESSAGES:  # (Anthropic's shape: no param; the field starts the message)
        message = body["error"]["message"]
        assert body["error"]["type"] == "invalid_request_error", body
        assert message.startswith(f"{field}: Extra inputs are not permitted ({hint(field, route)})"), body
    else:
        e = body["error"]
        assert (e["type"], e["param"], e["code"]) == ("invalid_request_error", field, "unknown_parameter"), e
        assert e["message"] == f"Unrecognized request argument supplied: {field} ({hint(field, route)})", e
        message = e["message"]
    assert words in message and message.endswith(")"), message


@pytest.mark.parametrize("route", list(Route), ids=[r.name.lower() for r in Route])
@pytest.mark.parametrize("field", ["foo", "nonsense_p", "max_new_tokens"])
def test_any_other_unknown_field_keeps_its_words_exactly(http, route, field):
    body = post(http, route, field, 1)
    if route is Route.MESSAGES:
        assert body == {"type": "error", "error": {"type": "invalid_request_error",
                                                   "message": f"{field}: Extra inputs are not permitted"}}
    else:
        assert body == {"error": {"message": f"Unrecognized request argument supplied: {field}",
                                  "type": "invalid_request_error", "param": field, "code": "unknown_parameter"}}


@pytest.mark.parametrize("route", OPENAI, ids=[r.name.lower() for r in OPENAI])
def test_a_field_served_under_its_llama_cpp_name_is_taken_not_hinted(route):
    """ignore_eos, grammar, json_schema, top_k, min_p and stop are served by the OpenAI routes: no hint there."""
    for field in ("ignore_eos", "grammar", "json_schema", "top_k", "min_p", "stop"):
        assert hint(field, route) is None, field


def test_a_nested_field_or_a_route_without_hints_keeps_its_words(http):
    """Only a top-level field of a generation route is hinted: a message's ``n_predict`` is no request
    field, ``/tokenize`` (no sampling) hints only llama.cpp's own tokenize fields, and ``/infill``
    (llama.cpp's own fields) gets none."""
    assert hint("messages.0.n_predict", Route.CHAT) is None and hint("n_predict", None) is None
    r = http.post(Route.CHAT.value, json={"model": "m", "messages": [{"role": "user", "content": "hi",
                                                                       "n_predict": 1}]})
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "Unrecognized request argument supplied: messages.0.n_predict", r.text
    r = http.post("/tokenize", json={"model": "m", "prompt": "hi", "n_predict": 1})
    assert r.status_code == 400 and r.json()["error"]["message"] == \
        "Unrecognized request argument supplied: n_predict", r.text
