"""An error's message names each field as the client sent it on its route, not as the request names it
inside slotserve (``protocol.request.RequestParams``, whose names the client SDK's and the worker's
checks write): ``stop_token_ids`` was "stop_token contains token id ...", a token-id list of ``stop``
"stop_sequences[0] ..." at its index among the lists alone, a text entry of ``stop`` its index among the
strings alone; the Messages API's ``stop_sequences`` was "stop_sequences: stop[0] has 5000 characters";
the Responses API's ``max_output_tokens`` and chat's ``max_completion_tokens`` "max_tokens (8)"; a
Responses or Messages tool's key "tools.0.function ..."; ``/infill``'s ``repeat_penalty`` and
``n_predict`` "repetition_penalty ..." and "max_tokens ...". (The ``param`` was right already.) Over the
gateway's handlers and scripted broker clients: no sockets, no processes."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("starlette")
from starlette.applications import Starlette  # noqa: E402
from starlette.routing import Route  # noqa: E402
from starlette.testclient import TestClient  # noqa: E402

from client import RemoteError  # noqa: E402
from client.handle import ClientHandle  # noqa: E402
from gateway.config import GatewayConfig  # noqa: E402
from gateway.errors import APIError, reworded  # noqa: E402
from gateway.generate import Generate  # noqa: E402
from gateway.infill import InfillEndpoint  # noqa: E402
from gateway.messages_api import MessagesEndpoints  # noqa: E402
from gateway.metrics import GatewayMetrics  # noqa: E402
from gateway.response_store import ResponseStore  # noqa: E402
from gateway.responses_api import ResponsesEndpoints  # noqa: E402
from gateway.tokenize import TokenizeEndpoints  # noqa: E402
from gateway.tokenizer import Tokenizers  # noqa: E402
from protocol.enums import ErrorCode, FinishReason  # noqa: E402
from protocol.request import ModelLimits  # noqa: E402
from tests.support.gateway import error_of  # noqa: E402
from tests.support.scripted import VOCAB, ScriptedClient, ScriptedLink, letters  # noqa: E402

MESSAGES = [{"role": "user", "content": "hi"}]
BODIES = {"/v1/completions": {"model": "m", "prompt": "hi", "max_tokens": 2},
          "/v1/chat/completions": {"model": "m", "messages": MESSAGES, "max_tokens": 2},
          "/v1/responses": {"model": "m", "input": "hi", "max_output_tokens": 2},
          "/v1/messages": {"model": "m", "messages": MESSAGES, "max_tokens": 2},
          "/infill": {"model": "m", "input_prefix": "ab", "input_suffix": "cd", "n_predict": 2}}
INTERNAL = ("stop_token ", "stop_sequences", "repetition_penalty", "response_format", ".function")
"""Names of the request's (or the chat path's) that no body of these routes holds as written."""


class WorkerRefuses(ScriptedClient):
    """A client whose requests the worker ends with ``code`` and ``message`` (a refusal only the worker
    can make: it tokenised the text prompt); ``tokenizer``: whether the model has one (the client's checks)."""

    def __init__(self, code: ErrorCode | None = None, message: str = "", tokenizer: bool = True) -> None:
        super().__init__()
        self.code, self.message, self.tokenizer = code, message, tokenizer

    def submit_request(self, prompt, max_tokens, callback=None, *, on_token=None, **options):
        if self.code is not None or not self.tokenizer:
            ModelLimits(VOCAB, 64, self.tokenizer).build(prompt, max_tokens, **options)  # (the client's checks)
        return super().submit_request(prompt, max_tokens, callback, on_token=on_token, **options)

    def _script(self, h: ClientHandle) -> None:
        if self.code is None:
            return super()._script(h)
        h._end(FinishReason.ERROR, None, RemoteError(self.code, self.message), time.monotonic())
        h.callback([])
        h._done = True


def routes_app(client: ScriptedClient) -> Starlette:
    link = ScriptedLink(client)
    tokenizers = Tokenizers(letters)
    gen = Generate(GatewayConfig(), link, GatewayMetrics(), tokenizers=tokenizers)
    responses = ResponsesEndpoints(gen, ResponseStore(8, 60.0))
    messages = MessagesEndpoints(gen, TokenizeEndpoints(link, tokenizers))
    return Starlette(routes=[Route("/v1/completions", gen.completions, methods=["POST"]),
                             Route("/v1/chat/completions", gen.chat_completions, methods=["POST"]),
                             Route("/v1/responses", responses.create, methods=["POST"]),
                             Route("/v1/messages", messages.create, methods=["POST"]),
                             Route("/infill", InfillEndpoint(gen).infill, methods=["POST"])])


def refusal(path: str, extra: dict, client: ScriptedClient | None = None, stream: bool = False) -> tuple[str, str]:
    """``(message, param)`` of the 400 that ``path`` answers a body with ``extra``; the message names
    none of :data:`INTERNAL`."""
    client = client or ScriptedClient()
    with TestClient(routes_app(client)) as http:
        r = http.post(path, json={**BODIES[path], **extra, **({"stream": True} if stream else {})})
    for t in client.threads:
        t.join(10)
    if path == "/v1/messages":  # (Anthropic's shape: no param, the message starts with the field)
        assert r.status_code == 400, r.text
        message, param = r.json()["error"]["message"], None
    else:
        e = error_of(r, 400)
        message, param = e["message"], e["param"]
    internal = [name for name in INTERNAL if not (path == "/v1/messages" and name == "stop_sequences")]
    assert not any(name in message for name in internal), message
    return message, param


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("ids, words", [([99999], "stop_token_ids contains token id 99999, outside the model's vocabulary"),
                                        ([-1], "stop_token_ids contains negative token id -1")])
def test_stop_token_ids_is_named_stop_token_ids(path, ids, words):
    message, param = refusal(path, {"stop_token_ids": ids})
    assert message.startswith(words) and param == "stop_token_ids", message


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stop, words", [
    (["a", [1, 99999]], "stop[1] contains token id 99999"),      # (was stop_sequences[0])
    ([[1], "b", [-1]], "stop[2] contains negative token id -1"),  # (was stop_sequences[1])
    ([[1], "b" * 5000], "stop[1] has 5000 characters"),         # (was stop[0]: its index among the strings)
    ("b" * 5000, "stop has 5000 characters"),                  # (one string: was stop[0])
])
def test_a_stop_entry_is_named_at_its_place_in_stop(path, stop, words):
    message, param = refusal(path, {"stop": stop})
    assert message.startswith(words) and param == "stop", message


def test_a_text_stop_without_a_tokenizer_points_to_stops_token_id_lists():
    message, param = refusal("/v1/completions", {"prompt": [1, 2], "stop": ["x"]}, WorkerRefuses(tokenizer=False))
    assert "(stop)" in message and param == "stop", message


@pytest.mark.parametrize("stream", [False, True])
def test_chat_names_max_completion_tokens_where_it_was_given(stream):
    body = {"max_tokens": None, "max_completion_tokens": 3, "min_tokens": 5}
    message, _ = refusal("/v1/chat/completions", body, stream=stream)
    assert message == "min_tokens (5) must be <= max_completion_tokens (3)", message
    message, _ = refusal("/v1/chat/completions", {"max_tokens": 3, "min_tokens": 5})
    assert message == "min_tokens (5) must be <= max_tokens (3)", message  # (the field it was given as)


CONTEXT = "prompt (60 tokens) + max_tokens (8) = 68 exceeds the served context of 64 tokens (--max-model-len); " \
          "shorten the prompt or lower max_tokens"


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, extra, field", [
    ("/v1/chat/completions", {"max_tokens": None, "max_completion_tokens": 8}, "max_completion_tokens"),
    ("/v1/chat/completions", {"max_tokens": 8}, "max_tokens"),
    ("/v1/responses", {"max_output_tokens": 8}, "max_output_tokens"),
    ("/v1/messages", {"max_tokens": 8}, "max_tokens"),
    ("/infill", {"n_predict": 8}, "n_predict"),
])
def test_the_workers_context_refusal_names_the_budget_as_given(path, extra, field, stream):
    client = WorkerRefuses(ErrorCode.CONTEXT_LENGTH_EXCEEDED, CONTEXT)
    message, _ = refusal(path, extra, client, stream=stream)
    said = CONTEXT.replace("max_tokens", field)
    assert message == (f"messages: {said}" if path == "/v1/messages" else said), message  # (Anthropic's: field first)


def test_the_messages_apis_stop_sequences_by_its_own_name():
    message, _ = refusal("/v1/messages", {"stop_sequences": ["a", "b" * 5000]})
    assert message == "stop_sequences[1] has 5000 characters; at most 1024 are allowed", message  # (was
    # "stop_sequences: stop[0] has ...")
    message, _ = refusal("/v1/messages", {"stop_sequences": list("abcde")})
    assert message == "stop_sequences holds 5 entries; at most 4 are allowed", message


TOOLS_R = [{"type": "function", "name": "f", "parameters": {"type": "object"}}]
TOOLS_M = [{"name": "f", "input_schema": {"type": "object"}}]


@pytest.mark.parametrize("path, extra, words", [
    ("/v1/responses", {"tools": [{"type": "function", "name": "f", "foo": 1}]},
     "Unrecognized request argument supplied: tools.0.foo"),
    ("/v1/responses", {"tools": TOOLS_R, "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
     "give no text.format with it"),
    ("/v1/responses", {"text": {"format": {"type": "json_schema", "name": "a", "schema": {}, "foo": 1}}},
     "Unknown parameter: 'text.format.foo' (text.format takes type, name, schema, strict and description)"),
    ("/v1/messages", {"tools": [{"name": "f", "foo": 1, "input_schema": {"type": "object"}}]},
     "tools.0.foo: Extra inputs are not permitted"),
    ("/v1/messages", {"tools": TOOLS_M, "tool_choice": {"type": "any"},
                      "output_config": {"format": {"type": "json_schema", "schema": {"type": "object"}}}},
     "give no output_config.format with it"),
])
def test_a_translations_chat_fields_are_the_vendors(path, extra, words):
    message, _ = refusal(path, extra)
    assert words in message, message


@pytest.mark.parametrize("extra, words, param", [
    ({"repeat_penalty": 0}, "repeat_penalty must be > 0", "repeat_penalty"),
    ({"n_predict": 10**22}, "n_predict must be < 2**64", "n_predict"),
])
def test_infill_names_its_own_fields(extra, words, param):
    message, got = refusal("/infill", extra)
    assert message.startswith(words) and got == param, message


def test_infill_names_input_suffix_in_the_workers_refusal():
    client = WorkerRefuses(ErrorCode.UNSUPPORTED, "suffix: this model's tokenizer cannot render fill in the middle; "
                                                  "leave suffix out")
    message, param = refusal("/infill", {}, client)
    assert message == ("input_suffix: this model's tokenizer cannot render fill in the middle; leave input_suffix "
                       "out") and param == "input_suffix", message


def test_reworded_renames_whole_names_only():
    table = (("stop", "stop_sequences"), (r"tools\.(\d+)\.function", r"tools.\1"))
    e = reworded(APIError(400, "stop_token and stop: tools.1.function.name, xstop, a.stop, tools.1.functions"), table)
    assert e.message == "stop_token and stop_sequences: tools.1.name, xstop, a.stop, tools.1.functions"


def test_reworded_keeps_what_the_message_quotes_as_sent():
    """A name inside what a message quotes (the client's value as ``echo`` or JSON writes it, a special
    token) is no field of the request's: it was rewritten too ('max_tokens' -> 'max_output_tokens',
    <fim-suffix> -> <fim-input_suffix>)."""
    table = (("max_tokens", "max_output_tokens"), ("suffix", "input_suffix"))
    e = reworded(APIError(400, "tools.1.function.name 'max_tokens' is given twice; got \"max_tokens\" and "
                               "'a max_tokens' in the model's max_tokens; none of <fim-suffix>, fim-suffix; suffix"), table)
    assert e.message == ("tools.1.function.name 'max_tokens' is given twice; got \"max_tokens\" and 'a max_tokens' "
                         "in the model's max_output_tokens; none of <fim-suffix>, fim-suffix; input_suffix")


TWICE = [{"type": "function", "name": "max_tokens", "parameters": {"type": "object"}}] * 2


@pytest.mark.parametrize("path, extra, words", [
    ("/v1/responses", {"tools": TWICE}, "tools.1.name 'max_tokens' is given twice"),  # (was 'max_output_tokens')
    ("/v1/responses", {"tools": TWICE[:1], "tool_choice": {"type": "function", "name": "reasoning_effort"}},
     "tool_choice names function 'reasoning_effort', which is not in tools"),  # (was 'reasoning.effort')
    ("/v1/messages", {"tools": [{"name": "parallel_tool_calls", "input_schema": {"type": "object"}}] * 2},
     "tools.1.name 'parallel_tool_calls' is given twice"),  # (was 'tool_choice.disable_parallel_tool_use')
])
def test_a_tool_named_as_a_chat_field_is_quoted_as_sent(path, extra, words):
    message, _ = refusal(path, extra)
    assert words in message, message


def test_infill_keeps_the_fim_tokens_the_worker_looked_for():
    from worker.models.fim import missing_message

    said = missing_message({})
    assert "<fim-suffix>" in said and said.startswith("suffix: ")
    message, param = refusal("/infill", {}, WorkerRefuses(ErrorCode.UNSUPPORTED, said))
    assert message == "input_suffix" + said.removeprefix("suffix").replace("leave suffix out", "leave input_suffix out") \
        and param == "input_suffix", message  # (was '<fim-input_suffix>' for SantaCoder's token)
