"""Refusals that named the wrong field, or not the entry at fault, and optional fields that refused
null where the others take it as absent:

- a budget that alone leaves no room for a prompt (``max_tokens`` 1,000,000 in a 64-token context)
  was the context refusal of the prompt: ``param`` ``messages`` (chat), ``input`` (/v1/responses),
  "messages: prompt (N tokens) + max_tokens ..." on /v1/messages; now it names the budget as the
  body gave it (``max_completion_tokens``, ``max_output_tokens``, ``n_predict``), refused before the
  prompt is tokenised (the Python SDK's check, :meth:`protocol.request.ModelLimits.check`);
- an empty stop entry was "stop entries must not be empty" (``stop_sequences entries`` on
  /v1/messages): now ``stop[1]`` (``stop_sequences[1]``), the entry;
- a named tool choice without its name was "'tool_choice' is not supported" on /v1/responses and
  "tool_choice must be ..." on the others: now OpenAI's "Missing required parameter:
  'tool_choice.name'" (chat's ``tool_choice.function``, ``.function.name``), Anthropic's
  "tool_choice.name: Field required" on /v1/messages; a name of another type is named too;
- ``return_documents: null`` on /v1/rerank, ``encoding_format: null`` on /v1/embeddings,
  ``stream: null`` on /completion and /infill, ``input_prefix``, ``input_suffix`` and ``prompt: null``
  on /infill were 400s (``Input should be a valid boolean``) where ``top_n: null`` and every
  optional OpenAI field take null as absent (and llama.cpp's ``json_value`` reads null as absent).

Over the gateway's handlers and scripted broker clients: no sockets, no processes."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("starlette")
from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from gateway.llama_completion import LlamaCompletionEndpoint  # noqa: E402
from protocol.enums import ErrorCode  # noqa: E402
from protocol.errors import ContextLengthError  # noqa: E402
from protocol.request import ModelLimits, RequestParams  # noqa: E402
from tests.gateway.test_embeddings_shapes import http as embeddings_http  # noqa: E402,F401
from tests.gateway.test_error_field_names import BODIES, WorkerRefuses, routes_app  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import VOCAB  # noqa: E402

C, P, R, M = "/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"
NATIVE = {"/completion": {"prompt": "hi", "n_predict": 2}}


def _served(client):
    app = routes_app(client)
    app.router.routes.append(_native_route(client))
    with TestClient(app) as http:
        yield http
    for t in client.threads:
        t.join(10)


@pytest.fixture
def limited():
    """The routes (and llama.cpp's ``/completion``) over a client that checks each request as the SDK
    does for a model with a 64-token context, and ends those it takes with an error (:class:`WorkerRefuses`)."""
    yield from _served(WorkerRefuses(ErrorCode.CONTEXT_LENGTH_EXCEEDED, "unused"))


@pytest.fixture
def served():
    """The same routes over a client that answers (the scripted letters)."""
    yield from _served(WorkerRefuses())


def _native_route(client) -> Route:
    from gateway.config import GatewayConfig
    from gateway.generate import Generate
    from gateway.metrics import GatewayMetrics
    from gateway.tokenizer import Tokenizers
    from tests.support.scripted import ScriptedLink, letters

    gen = Generate(GatewayConfig(), ScriptedLink(client), GatewayMetrics(), tokenizers=Tokenizers(letters))
    return Route("/completion", LlamaCompletionEndpoint(gen).handle, methods=["POST"])


def _refusal(http, path: str, body: dict) -> tuple[str, str | None]:
    r = http.post(path, json=body)
    if path in (M, "/v1/messages/count_tokens"):  # (Anthropic's shape: the message starts with the field)
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"], None
    e = error_of(r, 400)
    return e["message"], e["param"]


BIG = 10**6
BUDGETS = [(C, "max_tokens"), (C, "max_completion_tokens"), (P, "max_tokens"), (R, "max_output_tokens"),
           (M, "max_tokens"), ("/infill", "n_predict"), ("/completion", "n_predict")]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, field", BUDGETS, ids=[f"{p}:{f}" for p, f in BUDGETS])
def test_a_budget_no_prompt_fits_beside_names_the_budget(limited, path, field, stream):
    body = {**(BODIES.get(path) or NATIVE[path]), field: BIG, "stream": stream}
    if field == "max_completion_tokens":
        body.pop("max_tokens")
    message, param = _refusal(limited, path, body)
    assert message == (f"{field} ({BIG}) leaves no room for the prompt in the served context of 64 tokens "
                       f"(--max-model-len), which the prompt and the tokens generated share; lower {field} below 64"), \
        message  # (was "prompt (N tokens) + max_tokens (1000000) ...", param messages / input / prompt)
    assert param in (None, field), param


def test_the_sdk_names_the_budget_before_and_after_the_prompt_is_tokenised():
    limits = ModelLimits(VOCAB, 64, True)
    with pytest.raises(ContextLengthError, match=r"^max_tokens \(64\) leaves no room for the prompt .* below 64$"):
        limits.build("some text", 64)  # (a text prompt: before the worker tokenises it)
    with pytest.raises(ContextLengthError, match=re.escape("below 64 (at most 54 with this prompt of 10)")):
        limits.check(RequestParams("some text", 64), prompt_len=10)  # (the worker's check, the prompt counted)
    with pytest.raises(ContextLengthError, match=r"^prompt \(10 tokens\) \+ max_tokens \(60\) = 70 exceeds"):
        limits.check(RequestParams("some text", 60), prompt_len=10)  # (a budget that fits alone: the sum's words)
    with pytest.raises(ContextLengthError, match=r"^prompt \(64 tokens\) \+ max_tokens \(64\)"):
        limits.build([1] * 64, 64)  # (a prompt too long itself: both named, as before)


@pytest.mark.parametrize("path, stop, said", [
    (C, ["a", ""], "stop[1]"), (C, "", "stop"), (P, ["a", [1], ""], "stop[2]"), (P, [[1], []], "stop[1]"),
    (M, ["a", ""], "stop_sequences[1]"), ("/completion", ["a", ""], "stop[1]"), ("/infill", ["", "a"], "stop[0]"),
])
def test_an_empty_stop_entry_is_named(limited, path, stop, said):
    body = {**(BODIES.get(path) or NATIVE[path]), ("stop_sequences" if path == M else "stop"): stop}
    message, param = _refusal(limited, path, body)
    assert message.startswith(f"{said} must not be empty"), message  # (was "stop entries must not be empty")
    assert param in (None, "stop"), param


TOOLS = {C: [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
         R: [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
         M: [{"name": "f", "input_schema": {"type": "object"}}]}


@pytest.mark.parametrize("path, choice, said, param", [
    (R, {"type": "function"}, "Missing required parameter: 'tool_choice.name'", "tool_choice.name"),
    (R, {"type": "function", "name": None}, "Missing required parameter: 'tool_choice.name'", "tool_choice.name"),
    (R, {"type": "function", "name": 5}, "Invalid type for 'tool_choice.name': expected a string", "tool_choice.name"),
    (C, {"type": "function"}, "Missing required parameter: 'tool_choice.function'", "tool_choice.function"),
    (C, {"type": "function", "function": {}}, "Missing required parameter: 'tool_choice.function.name'",
     "tool_choice.function.name"),
    (C, {"type": "function", "function": {"name": 5}}, "tool_choice.function.name must be a string",
     "tool_choice.function.name"),
    (M, {"type": "tool"}, "tool_choice.name: Field required", None),
    (M, {"type": "tool", "name": 5}, "tool_choice.name: Input should be a valid string", None),
])
def test_a_named_tool_choice_without_its_name_says_the_name_is_missing(limited, path, choice, said, param):
    message, got = _refusal(limited, path, {**BODIES[path], "tools": TOOLS[path], "tool_choice": choice})
    assert message.startswith(said) and got == param, (message, got)  # (was "... is not supported", "must be")


def test_a_built_in_tool_choice_is_still_not_served(limited):
    message, param = _refusal(limited, R, {**BODIES[R], "tools": TOOLS[R], "tool_choice": {"type": "web_search"}})
    assert "is not supported" in message and param == "tool_choice", message


def test_rerank_and_embeddings_take_null_as_absent(embeddings_http):  # noqa: F811
    body = {"model": "m", "query": "north", "documents": ["east", "up", "down", "north"]}
    plain = embeddings_http.post("/v1/rerank", json=body)
    nulls = embeddings_http.post("/v1/rerank", json={**body, "top_n": None, "return_documents": None})
    assert nulls.status_code == 200, nulls.text  # (return_documents: null was "Input should be a valid boolean")
    assert [x["document"] for x in nulls.json()["results"]] == [x["document"] for x in plain.json()["results"]]
    r = embeddings_http.post("/v1/embeddings", json={"model": "m", "input": "north", "encoding_format": None})
    assert r.status_code == 200 and r.json()["data"][0]["embedding"] == [0.0, 1.0, 0.0, 0.0], r.text
    for bad, param in (({"return_documents": 1}, "return_documents"), ({"return_documents": "no"}, "return_documents")):
        assert error_of(embeddings_http.post("/v1/rerank", json={**body, **bad}), 400)["param"] == param


@pytest.mark.parametrize("path, nulls", [
    ("/completion", {"stream": None}),
    ("/infill", {"stream": None}),
    ("/infill", {"input_suffix": None, "prompt": None}),
])
def test_llama_cpp_bodies_take_null_as_absent(served, path, nulls):
    body = {**(BODIES.get(path) or NATIVE[path]), **nulls}
    r = served.post(path, json=body)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json"), r.text


def test_infill_takes_a_null_prefix_as_empty(served):
    from gateway.infill import InfillRequest

    assert InfillRequest.model_validate({**BODIES["/infill"], "input_prefix": None}).input_prefix == ""
    # (the scripted tokenizer refuses "" itself: the cursor at the top of a file is a real model's case)
    e = error_of(served.post("/infill", json={**BODIES["/infill"], "input_extra": None}), 400)
    assert e["param"] == "input_extra", e  # (llama.cpp's 400 too: it must be an array)
