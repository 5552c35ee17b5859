"""``/v1/responses`` logprobs, as OpenAI's Responses API gives them (the ``openai`` SDK's types:
``ResponseOutputText.logprobs``, ``ResponseTextDeltaEvent.logprobs``): ``include:
["message.output_text.logprobs"]`` fills the ``output_text`` part with one ``{"token", "bytes",
"logprob", "top_logprobs"}`` per token, ``top_logprobs`` (0..20) alternatives each, and each text
delta and ``.done`` event with its tokens' (no ``bytes``); ``top_logprobs`` alone is echoed and asks
nothing (``logprobs: []``). Was: ``top_logprobs`` above 0 a 400 "not supported", and
``logprobs: []`` whatever ``include`` said. Refused, naming ``include.N``, where which tokens wrote the
message would be a guess: beside tools, or for a model whose thinking is split off. Over the gateway's
handlers and the scripted client of tests/support/scripted.py (each token's entry known): no sockets."""

from __future__ import annotations

import pytest

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
from openai.types.responses import Response, ResponseStreamEvent  # noqa: E402
from pydantic import TypeAdapter  # noqa: E402
from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from gateway.config import GatewayConfig  # noqa: E402
from gateway.generate import Generate  # noqa: E402
from gateway.metrics import GatewayMetrics  # noqa: E402
from gateway.response_store import ResponseStore  # noqa: E402
from gateway.responses_api import ResponsesEndpoints  # noqa: E402
from gateway.responses_output import OutputItems  # noqa: E402
from gateway.tokenizer import Tokenizers  # noqa: E402
from gateway.translation import Piece, chunk_pieces, completion_pieces  # noqa: E402
from tests.support.gateway import error_of, sse  # noqa: E402
from tests.support.scripted import ScriptedClient, ScriptedLink, letters  # noqa: E402

EVENTS = TypeAdapter(ResponseStreamEvent)
INCLUDE = ["message.output_text.logprobs"]
TOOLS = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]


def app(config: GatewayConfig, client: ScriptedClient) -> Starlette:
    link = ScriptedLink(client)
    gen = Generate(config, link, GatewayMetrics(), tokenizers=Tokenizers(letters))
    responses = ResponsesEndpoints(gen, ResponseStore(8, 60.0))
    return Starlette(routes=[Route("/v1/responses", responses.create, methods=["POST"]),
                             Route("/v1/chat/completions", gen.chat_completions, methods=["POST"])])


@pytest.fixture(params=[GatewayConfig(), GatewayConfig(reasoning_parser="qwen3")], ids=["plain", "thinks"])
def served(request):
    """``(http, client, thinks)``: the Responses and chat handlers, with a reasoning parser or none."""
    client = ScriptedClient()
    with TestClient(app(request.param, client)) as http:
        yield http, client, request.param.reasoning_parser is not None
    for t in client.threads:
        t.join(10)


@pytest.fixture
def http():
    client = ScriptedClient()
    with TestClient(app(GatewayConfig(), client)) as h:
        h.scripted = client
        yield h
    for t in client.threads:
        t.join(10)


def chat_entries(http, top: int) -> list[dict]:
    """The chat path's logprobs entries for the same prompt and budget: what the message must carry."""
    r = http.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                "max_tokens": 4, "logprobs": True, "top_logprobs": top})
    return r.json()["choices"][0]["logprobs"]["content"]


def without_bytes(entries: list[dict]) -> list[dict]:
    return [{"token": e["token"], "logprob": e["logprob"],
             "top_logprobs": [{"token": t["token"], "logprob": t["logprob"]} for t in e["top_logprobs"]]}
            for e in entries]


@pytest.mark.parametrize("top", [None, 0, 3, 20])
def test_include_gives_the_output_texts_logprobs(http, top):
    body = {"model": "m", "input": "hi", "max_output_tokens": 4, "include": INCLUDE,
            **({} if top is None else {"top_logprobs": top})}
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    response = Response.model_validate(r.json())  # (the SDK's type, strictly its fields)
    part = r.json()["output"][0]["content"][0]
    assert part["logprobs"] == chat_entries(http, top or 0) and len(part["logprobs"]) == 4, part
    assert all(len(e["top_logprobs"]) == (top or 0) for e in part["logprobs"])
    assert "".join(e["token"] for e in part["logprobs"]) == part["text"]
    assert response.top_logprobs == top and http.scripted.submitted[0].logprobs == (top or 0)


def test_top_logprobs_alone_is_echoed_and_asks_nothing(http):
    r = http.post("/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 4, "top_logprobs": 5})
    assert r.status_code == 200, r.text
    assert r.json()["output"][0]["content"][0]["logprobs"] == [] and r.json()["top_logprobs"] == 5
    assert http.scripted.submitted[0].logprobs is None


def test_a_streams_deltas_add_up_to_the_answers_logprobs(http):
    body = {"model": "m", "input": "hi", "max_output_tokens": 4, "include": INCLUDE, "top_logprobs": 2}
    events = sse(http, "/v1/responses", body)
    for e in events:
        EVENTS.validate_python(e)  # (every event the SDK's type)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    done = next(e for e in events if e["type"] == "response.output_text.done")
    final = events[-1]["response"]["output"][0]["content"][0]
    whole = chat_entries(http, 2)
    assert [lp for d in deltas for lp in d["logprobs"]] == done["logprobs"] == without_bytes(whole)
    assert final["logprobs"] == whole


@pytest.mark.parametrize("top, code", [(-1, "invalid_value"), (21, "invalid_value"), ("5", "invalid_type"),
                                       (True, "invalid_type")])
def test_top_logprobs_outside_0_to_20_is_a_400_naming_it(http, top, code):
    e = error_of(http.post("/v1/responses", json={"model": "m", "input": "hi", "top_logprobs": top}), 400)
    assert (e["param"], e["code"]) == ("top_logprobs", code), e
    assert not http.scripted.submitted


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_beside_tools_are_refused_naming_include(http, stream):
    body = {"model": "m", "input": "hi", "include": ["reasoning.encrypted_content", *INCLUDE], "tools": TOOLS,
            "stream": stream}
    e = error_of(http.post("/v1/responses", json=body), 400)
    assert (e["param"], e["code"]) == ("include.1", "unsupported_parameter") and "tools" in e["message"], e
    r = http.post("/v1/responses", json={**body, "tool_choice": "none", "stream": False})  # (no call can come)
    assert r.status_code == 200 and len(r.json()["output"][0]["content"][0]["logprobs"]) > 0, r.text


@pytest.mark.parametrize("stream", [False, True])
def test_logprobs_where_the_thinking_is_split_off_are_refused_naming_include(served, stream):
    http, client, thinks = served
    body = {"model": "m", "input": "hi", "max_output_tokens": 4, "include": INCLUDE, "stream": stream}
    r = http.post("/v1/responses", json=body)
    if thinks:
        e = error_of(r, 400)
        assert (e["param"], e["code"]) == ("include.0", "unsupported_parameter") and "qwen3" in e["message"], e
        assert not client.submitted
    else:
        assert r.status_code == 200, r.text
    r = http.post("/v1/responses", json={**body, "include": [], "stream": False})
    assert r.status_code == 200, r.text  # (without the include, a model that thinks is served as before)


ENTRY = {"token": "a", "logprob": -0.5, "bytes": [97], "top_logprobs": [{"token": "b", "logprob": -1.0, "bytes": [98]}]}
LAST = {**ENTRY, "token": "", "bytes": []}


def test_a_chunks_logprobs_ride_its_first_piece_or_a_piece_of_no_text():
    text = {"choices": [{"delta": {"content": "a"}, "logprobs": {"content": [ENTRY]}}]}
    last = {"choices": [{"delta": {}, "logprobs": {"content": [LAST]}}]}
    assert chunk_pieces(text) == [Piece("text", "a", logprobs=(ENTRY,))]
    assert chunk_pieces(last) == [Piece("text", "", logprobs=(LAST,))]
    assert chunk_pieces({"choices": [{"delta": {}, "logprobs": None}]}) == []
    whole = {"choices": [{"message": {"content": "a"}, "logprobs": {"content": [ENTRY, LAST]}}]}
    assert completion_pieces(whole) == [Piece("text", "a", logprobs=(ENTRY, LAST))]


def test_a_token_that_writes_nothing_joins_the_message_or_is_dropped_without_one():
    items = OutputItems()
    items.feed(Piece("text", "", logprobs=(LAST,)))  # (before any text: the answer has none, as the whole answer's)
    assert items.items == [] and items.take() == []
    items.feed(Piece("text", "a", logprobs=(ENTRY,)))
    items.feed(Piece("text", "", logprobs=(LAST,)))
    items.close()
    part = items.items[0]["content"][0]
    assert part["text"] == "a" and part["logprobs"] == [ENTRY, LAST]
    events = items.take()
    added = next(e for e in events if e["type"] == "response.content_part.added")
    assert added["part"]["logprobs"] == []  # (a snapshot: the part grew after it)
    deltas = [e for e in events if e["type"] == "response.output_text.delta"]
    assert [lp["token"] for d in deltas for lp in d["logprobs"]] == ["a", ""]
