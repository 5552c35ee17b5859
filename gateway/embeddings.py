"""``POST /v1/embeddings`` (OpenAI's shape) and ``POST /v1/rerank`` (Cohere's and Jina's shape, as vLLM and
llama.cpp serve it).

**/v1/embeddings**: ``{"model", "input", "encoding_format"?, "dimensions"?, "user"?}`` ->
``{"object": "list", "data": [{"object": "embedding", "index", "embedding"}], "model", "usage":
{"prompt_tokens", "total_tokens"}}`` (OpenAI's API reference, "Create embeddings").

- ``input``: a string, a list of strings, a list of token ids, or a list of token-id lists (at
  most :data:`MAX_INPUTS`); none may be empty. Token ids are embedded as given (no special token
  added); text is tokenised by the worker with the model's special tokens (as sentence-transformers
  does). One slotserve request per input, all submitted at once: the broker batches them with
  everyone else's.
- ``encoding_format``: ``"float"`` (default; JSON numbers) or ``"base64"``: the little-endian
  float32 bytes, base64 (what OpenAI sends, and what its SDK decodes).
- ``dimensions``: the embedding's length. The model's own length always; a shorter one only for a
  Matryoshka model (:attr:`protocol.messages.ModelInfo.matryoshka_dims`: the first values,
  renormalised to unit length, :func:`protocol.embedding.truncate`); 400 ``invalid_value`` for
  any other model (a truncated embedding of a model not trained for it is a worse embedding, so
  it is refused rather than silently made).
- Too long an input (over the served context: the model's ``max_seq_len`` tokens, 256 for
  all-MiniLM-L6-v2, or ``--max-model-len`` when lower): 400 ``context_length_exceeded``, as OpenAI
  answers, naming what the client can change ("input (300 tokens) exceeds the 256 tokens this
  model embeds at most (the model's own limit, or a lower --max-model-len); shorten it or split
  it": ``--max-model-len`` only ever lowers it); never silently truncated. An error about one
  entry of a list names it as the body does (``input[3] (70 tokens) exceeds ...``, ``documents[2]
  contains token id ...``),
  whichever side found it, with the same code (:func:`_about`): ``context_length_exceeded``, or
  ``invalid_value`` for another bad value (a token id outside the vocabulary, an input that
  tokenises to nothing), as the gateway's own checks code a bad value.
- A model that generates (no embeddings): 400 ``unsupported``; an unknown one: 404
  ``model_not_found``; empty input: 400 ``invalid_value``.

**/v1/rerank** (also ``/rerank`` and ``/v2/rerank``): ``{"model", "query", "documents": [str or
{"text": str}], "top_n"?, "return_documents"?}`` (a document as Jina's and Cohere's objects too)
-> ``{"id", "model", "usage": {"total_tokens"}, "results":
[{"index", "relevance_score", "document": {"text"}?}]}``, the results sorted by score, highest
first (ties by index), the ``top_n`` first (default all). With an embedding model (a bi-encoder)
a document's ``relevance_score`` is the **cosine similarity** of its embedding and the query's
(:func:`protocol.embedding.cosine`), in [-1, 1]; cross-encoders, which score each (query,
document) pair in one forward, are not served. ``return_documents`` (default true, as vLLM)
adds each document's text. An optional field given null (``top_n``, ``return_documents``,
``encoding_format``) is its default, as left out.

Errors are OpenAI-shaped (:mod:`gateway.errors`). While the gateway drains, both answer 503; one in
flight is in the drain's registry from its start to its end, as a generation request is: the drain
waits for it, and when the drain ends it (:meth:`_Call.end`) it answers 503 and its requests are
cancelled. A client that disconnects cancels the requests of its inputs (499 in the metrics), as for
generation.
"""

from __future__ import annotations

import asyncio
import base64
import re
import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from client import Client
from client.errors import RemoteError
from gateway.drain import REFUSED, Drain, unless_ended
from gateway.errors import APIError, bad_request, from_remote, from_value_error, shutting_down
from gateway.generate import ClientGone, _Watch, parse_body
from gateway.generation import Signal
from gateway.link import BrokerConnections, resolve_model
from gateway.metrics import GatewayMetrics
from gateway.responses import error_response, json_response, new_id
from gateway.schemas import NULL_IS_DEFAULT, _bad_type, _check_ids, _shown
from protocol.embedding import cosine, pack, truncate, unpack
from protocol.enums import ErrorCode, FinishReason
from protocol.messages import ModelInfo
from protocol.validation import echo

MAX_INPUTS = 2048
"""Most inputs per ``/v1/embeddings`` request, and documents per rerank (OpenAI's bound for ``input``)."""

_INPUT_SHAPES = "input must be a string, a list of strings, a list of token ids or a list of token-id lists"


def _bad_value(message: str) -> PydanticCustomError:
    """A body error about a value (empty, too many), shown as is with the code ``invalid_value``."""
    return PydanticCustomError("invalid_value", message)


def _input(value: Any) -> Any:
    """``input``'s shape checked before its type (as :func:`gateway.schemas._prompt` checks ``prompt``):
    a message about the entry at fault, and empty inputs refused (OpenAI's 400)."""
    if type(value) is str:
        if not value:
            raise _bad_value("input must not be empty")
        return value
    if type(value) is not list:
        raise _bad_type(f"{_INPUT_SHAPES}, got {_shown(value)}")
    if not value:
        raise _bad_value("input must not be an empty list")
    if len(value) > MAX_INPUTS:
        raise _bad_value(f"input holds {len(value)} entries; at most {MAX_INPUTS} are allowed per request")
    kinds = set(map(type, value))
    if kinds == {str}:
        empty = next((i for i, s in enumerate(value) if not s), None)
        if empty is not None:
            raise _bad_value(f"input[{empty}] must not be empty")
    elif kinds == {list}:
        for i, ids in enumerate(value):
            if not ids:
                raise _bad_value(f"input[{i}] must not be an empty list of token ids")
            _check_ids(ids, f"input[{i}]")
    elif str in kinds or list in kinds:
        raise _bad_type(f"{_INPUT_SHAPES}, not a mix")
    else:
        _check_ids(value, "input")
    return value


_DOCUMENTS = "documents must be a non-empty list of documents, each a non-empty string or {\"text\": string}"


def _documents(value: Any) -> Any:
    """``documents`` as the texts to rank: each a non-empty string, or an object ``{"text": string}`` (Jina's
    and Cohere's document objects), its text taken; the first entry of another shape is named."""
    if type(value) is not list or not value:
        raise _bad_type(_DOCUMENTS)
    if len(value) > MAX_INPUTS:
        raise _bad_value(f"documents holds {len(value)} entries; at most {MAX_INPUTS} are allowed per request")
    if all(type(d) is str and d for d in value):
        return value
    texts = []
    for i, d in enumerate(value):
        if isinstance(d, dict):
            extra = sorted(set(d) - {"text"})
            if extra:  # (an image's, or a Cohere field for rank_fields: text is what is ranked here)
                raise _bad_value(f"documents[{i}] takes text alone (a document object is {{\"text\": string}}), "
                                 f"not {echo(extra[0])}")
            d = d.get("text")
            if type(d) is not str:
                raise _bad_type(f"documents[{i}].text must be a string, got {_shown(d)}")
        elif type(d) is not str:
            raise _bad_type(f"{_DOCUMENTS}; documents[{i}] is {_shown(d)}")
        if not d:
            raise _bad_value(f"documents[{i}] must not be empty")
        texts.append(d)
    return texts


class EmbeddingsRequest(BaseModel):
    """``/v1/embeddings``' body (OpenAI's fields; ``user`` accepted and unused). Strict, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None  # None: the one model served
    input: Annotated[str | list[str] | list[int] | list[list[int]], BeforeValidator(_input)]
    encoding_format: Annotated[Literal["float", "base64"], NULL_IS_DEFAULT] = "float"
    dimensions: int | None = None
    user: str | None = None


class RerankRequest(BaseModel):
    """``/v1/rerank``'s body (Cohere's and Jina's fields, as vLLM takes them). Strict, unknown fields refused."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None  # None: the one model served
    query: str
    documents: Annotated[list[str], BeforeValidator(_documents)]
    top_n: int | None = None
    return_documents: Annotated[bool, NULL_IS_DEFAULT] = True


class _Call:
    """An embeddings or rerank request being served, in the drain's registry
    (:class:`gateway.drain.AbortableCall`): :meth:`end` (the gateway stopping) ends its work
    (:meth:`guard`: its body's read, the broker link, its wait on ``signal``), which then answers 503
    with the message."""

    __slots__ = ("signal", "ended", "_ended")

    def __init__(self, signal: Signal) -> None:
        self.signal = signal
        self.ended: str | None = None
        self._ended = asyncio.Event()

    def end(self, message: str) -> None:
        if self.ended is None:
            self.ended = message
            self._ended.set()
            self.signal.set()

    async def guard(self, aw):
        """``aw``'s result, unless the gateway ends this request first: then ``aw`` is cancelled (its
        requests with it) and the 503 raised; its body's read and the broker link look at no signal."""
        done, result = await unless_ended(aw, self._ended)
        if not done:
            raise shutting_down(self.ended)
        return result


class EmbeddingEndpoints:
    """The handlers, over the gateway's broker link (one shared client per model), its drain and its
    metrics (``slotserve_http_requests_total`` and the latency by path, prompt tokens by model)."""

    def __init__(self, link: BrokerConnections, drain: Drain, max_body_bytes: int, metrics: GatewayMetrics) -> None:
        self.link = link
        self.drain = drain
        self.max_body_bytes = max_body_bytes
        self.metrics = metrics

    async def embeddings(self, request: Request) -> Response:
        return await self._answer(request, self._embeddings)

    async def rerank(self, request: Request) -> Response:
        return await self._answer(request, self._rerank)

    async def _answer(self, request: Request, handler) -> Response:
        """``handler(request, call) -> (body, model, prompt tokens)`` answered as JSON, or its APIError;
        observed; ``call`` in the drain's registry meanwhile (a draining gateway refuses it first)."""
        t0, path = time.monotonic(), request.scope["path"]
        call = _Call(Signal(asyncio.get_running_loop()))
        self.metrics.in_flight.inc()
        try:
            if self.drain.draining:
                raise shutting_down(REFUSED)
            self.drain.add(call)
            out, model, tokens = await call.guard(handler(request, call))
        except APIError as e:
            self.metrics.observe(path, e.status)
            return error_response(e)
        except (ClientGone, ClientDisconnect):  # (its requests were cancelled)
            self.metrics.observe(path, 499)
            return Response(status_code=499)
        finally:
            self.drain.discard(call)
            self.metrics.in_flight.dec()
        self.metrics.observe(path, 200, latency_s=time.monotonic() - t0, model=model, prompt_tokens=tokens)
        return json_response(out)

    async def _embeddings(self, request: Request, call: _Call) -> tuple[dict, str, int]:
        body = await self._parse(request, EmbeddingsRequest)
        client = await self.link.client_for(body.model)
        size = _dimensions(body.dimensions, self.link.model_info(body.model), body.model)
        vectors, tokens = await _embed(client, *_inputs(body.input), request, call)
        data = []
        for i, raw in enumerate(vectors):
            if size is not None:
                raw = pack(truncate(unpack(raw), size))
            data.append({"object": "embedding", "index": i,
                         "embedding": base64.b64encode(raw).decode() if body.encoding_format == "base64"
                         else unpack(raw)})
        usage = {"prompt_tokens": sum(tokens), "total_tokens": sum(tokens)}
        return {"object": "list", "data": data, "model": body.model, "usage": usage}, body.model, sum(tokens)

    async def _rerank(self, request: Request, call: _Call) -> tuple[dict, str, int]:
        body = await self._parse(request, RerankRequest)
        if not body.query:
            raise bad_request("query must not be empty", "query")
        if body.top_n is not None and body.top_n < 1:
            raise bad_request(f"top_n must be >= 1 (or left out: every document), got {echo(body.top_n)}", "top_n")
        client = await self.link.client_for(body.model)
        vectors, tokens = await _embed(client, [body.query, *body.documents],
                                       ["query"] + [f"documents[{i}]" for i in range(len(body.documents))], request,
                                       call)
        query = unpack(vectors[0])
        scores = [cosine(query, unpack(v)) for v in vectors[1:]]
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))[:body.top_n]
        results = [{"index": i, "relevance_score": scores[i],
                    **({"document": {"text": body.documents[i]}} if body.return_documents else {})}
                   for i in order]
        return ({"id": new_id("rerank"), "model": body.model, "usage": {"total_tokens": sum(tokens)},
                 "results": results}, body.model, sum(tokens))

    async def _parse(self, request: Request, schema: type[BaseModel]) -> Any:
        body = await parse_body(request, schema, self.max_body_bytes)
        if body.model is None:  # the one model served (400 naming them when several are)
            body.model = await resolve_model(self.link, None)
        return body


async def _embed(client: Client, prompts: list, names: list[str], request: Request,
                 call: _Call) -> tuple[list[bytes], list[int]]:
    """Each prompt's embedding (float32 bytes) and length in tokens, in order, through ``client``
    (the model's shared one), every request submitted at once. ``names``: each prompt's place in the
    body (``input``, ``input[3]``, ``query``, ``documents[2]``). Raises :class:`APIError`: the
    client's refusal (400), or the first failed request's code (:func:`gateway.errors.from_remote`),
    naming that prompt (:func:`_about`), or the 503 of ``call`` ended by the gateway's stop;
    ClientGone when the HTTP client disconnects first. The requests not ended are cancelled whatever
    happens."""
    signal = call.signal
    handles: list = []
    watch = None
    try:
        try:
            for prompt in prompts:
                handles.append(client.embed(prompt, signal.poke))  # (the completion callback wakes the loop)
        except ValueError as e:  # refused at submission (the model is known: e.g. it generates)
            raise _about(from_value_error(e), names[len(handles)]) from None
        watch = _Watch(request, signal)
        # Until every request ended, or one failed (the answer is its error: the rest are cancelled).
        # (finish_reason is set before the completion callback runs: no poke is missed.)
        while True:
            failed = next(((h, n) for h, n in zip(handles, names) if h.finish_reason not in _RUNNING_OR_STOP), None)
            if failed is not None or all(h.finish_reason is not None for h in handles):
                break
            if call.ended is not None:  # the gateway stops: the drain ended this request
                raise shutting_down(call.ended)
            await signal.wait()
            if watch.gone:
                raise ClientGone
    finally:
        if watch is not None:
            watch.stop()
        for h in handles:
            if h.finish_reason is None:
                client.cancel(h.request_id)
    if failed is not None:
        h, name = failed
        err = h.error
        if isinstance(err, RemoteError):
            raise _about(from_remote(err.code, err.message), name)
        raise APIError(500, f"an embedding request ended {h.finish_reason}: {err}", code="internal")
    if any(h.embedding_bytes is None for h in handles):  # (a worker that broke the protocol)
        raise APIError(500, "a worker ended an embedding request without its vector", code="model_error")
    return [h.embedding_bytes for h in handles], [h.prompt_tokens or 0 for h in handles]


_RUNNING_OR_STOP = (None, FinishReason.STOP)

_SUBJECT = re.compile(r"(input|prompt)\b")
"""How the client's and the worker's checks name the one prompt they check (its first word)."""


def _about(error: APIError, name: str) -> APIError:
    """``error``, a refusal of the prompt at ``name`` (``input``, ``input[3]``, ``query``,
    ``documents[2]``), naming it: a 400's ``param`` is its body field, and its message says which
    entry -- the checks' own subject (``input``, ``prompt``) becomes ``name`` (``input[3] (70 tokens)
    exceeds the 64 tokens this model embeds at most ...``), or ``name`` leads. Its code is the same whichever side found
    it: a worker's ``bad_request`` (its wire code for a check without a code of its own) is the
    client's ``invalid_value`` (:func:`~gateway.errors.from_value_error`'s for the same checks, and the
    code of the gateway's own checks of a value, as on the chat and completions routes). Not an
    ``unsupported`` 400 (the model's kind, the same for every entry) nor another status: they are
    about no one entry."""
    if error.status != 400 or error.param == "model":  # (the model's kind: no entry's fault)
        return error
    error.param = name.split("[", 1)[0]
    if error.code == ErrorCode.BAD_REQUEST.value:
        error.code = "invalid_value"
    if error.code != "unsupported":
        subject = _SUBJECT.match(error.message)
        error.message = (name + error.message[subject.end():]) if subject else f"{name}: {error.message}"
    return error


def _inputs(value: str | list) -> tuple[list, list[str]]:
    """``input`` as a list of prompts -- one string or token-id list, or each entry of a list of
    them -- and each one's name in the body (``input``; ``input[0]``, ``input[1]``, ... for a list)."""
    if type(value) is str or (value and type(value[0]) is int):
        return [value], ["input"]
    return list(value), [f"input[{i}]" for i in range(len(value))]


def _dimensions(dimensions: int | None, info: ModelInfo | None, model: str) -> int | None:
    """The length to cut the embeddings to (None: as they are), or 400 for a ``dimensions`` the model does
    not allow. None too for a model known to generate (no embedding size): the request's own refusal
    (:func:`_embed`: "this model generates text and gives no embeddings ...") says what is wrong."""
    if dimensions is None or (info is not None and info.embedding_size is None):
        return None
    if info is None:
        raise bad_request(f"dimensions {dimensions}: the size of model `{model}`'s embeddings is not known yet (no "
                          "worker has registered it); leave dimensions out, or retry once it is loaded", "dimensions")
    size = info.embedding_size
    if dimensions == size:
        return None
    if dimensions in info.matryoshka_dims:
        return dimensions
    if not info.matryoshka_dims:
        raise bad_request(f"dimensions {dimensions}: model `{model}` gives embeddings of {size} values and is no "
                          "Matryoshka model, whose embeddings may be cut shorter; leave dimensions out", "dimensions")
    raise bad_request(f"dimensions {dimensions}: model `{model}` gives embeddings of {size} values, and may cut them "
                      f"to {_ranges(info.matryoshka_dims)}", "dimensions")


def _ranges(dims: tuple[int, ...]) -> str:
    """``(1, 2, ..., 768)`` as ``1..768``; a short list as it is."""
    if len(dims) > 8 and list(dims) == list(range(dims[0], dims[-1] + 1)):
        return f"{dims[0]}..{dims[-1]}"
    return ", ".join(map(str, dims))
