"""Response bodies and stream chunks in OpenAI's shapes, and the finish_reason mapping.

Shapes follow OpenAI's API reference ("The completion object", "The chat
completion object", "The chat completion chunk object"): ``id``,
``object``, ``created`` (Unix seconds), ``model``, ``choices``, ``usage``.
Each choice also carries ``token_ids`` (vLLM's name): the generated token
ids of that choice (of the delta, in a stream chunk) -- the only output of a
model without a tokenizer -- and, as vLLM, ``stop_reason``: the stop string
(str) or stop token (int) that ended it, else null (a token-id stop sequence
appears as its list of ids).

``usage`` (:func:`usage`) counts each prompt once whatever ``n``; it is null
when a text or chat prompt's length is unknown because no request with that
prompt reached a worker (the gateway has no tokenizer; the worker reports
the count with the request's end) -- with ``continuous_usage_stats``, also
on a text stream's chunks until the count arrives.

finish_reason: slotserve ends a request in five ways; OpenAI has two that apply.

==============  ====================================================================
slotserve       HTTP
==============  ====================================================================
``stop``        ``"stop"``: a stop string (the text ends before it, unless
                ``include_stop_str_in_output``), a stop token or a stop sequence (in
                ``token_ids``; special tokens such as EOS are left out of the text, as vLLM does)
``length``      ``"length"`` (``max_tokens`` reached)
``deadline``    ``"length"``: ``timeout_s`` passed; like ``max_tokens``, a limit the
                caller set cut the output short (the tokens so far are returned)
``cancelled``   never seen by its caller: the HTTP client disconnected (that is what
                cancels it). When the gateway itself is stopping: 503
``error``       an HTTP error status (:mod:`gateway.errors`); in a stream already
                under way, a final ``{"error": {...}}`` event
==============  ====================================================================
"""

from __future__ import annotations

import itertools
import os
import time

from pydantic_core import to_json
from starlette.responses import Response

from gateway.errors import APIError
from gateway.generation import Delta, Generation
from gateway.logprobs import TokenStr, chat_content, completion_logprobs, merge_completion_logprobs, \
    vllm_prompt_logprobs
from gateway.tokenizer import token_id_string
from protocol.enums import FinishReason

_FINISH = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.DEADLINE: "length"}


def finish_reason(reason: FinishReason | None) -> str | None:
    """slotserve's finish reason -> OpenAI's (None while running; only for stop/length/deadline)."""
    return None if reason is None else _FINISH[reason]


_ID_PREFIX = os.urandom(6).hex()  # per process: ids from two gateways never collide
_ID_COUNTER = itertools.count()


def new_id(prefix: str, sep: str = "-") -> str:
    """``cmpl-...`` / ``chatcmpl-...`` (``resp_...`` with ``sep="_"``): a fresh id (a per-process
    random part and a counter: unique, and cheaper than a uuid4 per request)."""
    return f"{prefix}{sep}{_ID_PREFIX}{next(_ID_COUNTER):010x}"


def prompt_tokens(gens: list[Generation], prompts: int) -> int | None:
    """The prompt tokens of ``gens``, each prompt counted once (``prompts``
    distinct prompts, each shared by ``len(gens) // prompts`` choices), or None
    when one prompt's length is unknown.

    A token-id prompt's length is known at submission; a text or chat prompt's
    only once a worker has tokenised it (it comes with the request's first
    tokens, or with its end when it ends before any). A
    prompt's length is taken from whichever request with the same prompt knows
    it -- another choice of it, or the same text given twice -- so it is
    unknown only when none of them reached a worker (e.g. each one's
    ``timeout_s`` passed in the broker's queue).
    """
    per = max(1, len(gens) // max(1, prompts))
    firsts = gens[::per]
    counts = [g.prompt_tokens for g in firsts]
    if None not in counts:  # the common case: token ids, or every prompt ran
        return sum(counts)
    known: dict = {}
    for g in gens:
        n = g.prompt_tokens
        if n is not None:
            known.setdefault(g.prompt_key, n)
    total = 0
    for g in firsts:
        n = known.get(g.prompt_key)
        if n is None:
            return None
        total += n
    return total


def cached_tokens(gens: list[Generation], prompts: int) -> int:
    """The prompt tokens of ``gens`` that the workers' prefix caches gave, each prompt counted
    once as in :func:`prompt_tokens`, by its first choice (later choices of the same prompt hit
    the blocks the first one stored); a prompt not prefilled yet counts 0."""
    return sum(g.cached_tokens or 0 for g in gens[::max(1, len(gens) // max(1, prompts))])


def usage(gens: list[Generation], prompts: int, streamed: bool = False) -> dict | None:
    """``usage`` for ``gens`` (see :func:`prompt_tokens`). ``streamed``: count the
    completion tokens already sent in stream chunks, not all generated.

    None (``"usage": null``) while a prompt's length is unknown: OpenAI's
    ``usage`` is optional, and a ``prompt_tokens`` of 0 for a prompt that has
    tokens would be a wrong count, not a missing one.

    ``prompt_tokens_details.cached_tokens`` (OpenAI's field, always an int, as
    OpenAI sends it): :func:`cached_tokens` (0 on a miss).
    """
    prompt = prompt_tokens(gens, prompts)
    if prompt is None:
        return None
    completion = sum(g.streamed_tokens if streamed else g.completion_tokens for g in gens)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached_tokens(gens, prompts)}}


class ResponseBuilder:
    """The fields every body or chunk of one HTTP response shares, and how its choices are shown:
    ``token_str`` renders a token id (:mod:`gateway.logprobs`); ``echo``: a completion shows its
    prompt first (``Generation.echo_text``, and with logprobs its tokens' entries);
    ``prompt_logprobs``: each choice carries vLLM's ``prompt_logprobs`` (non-streamed answers)."""

    __slots__ = ("id", "created", "model", "chat", "token_str", "token_bytes", "echo", "prompt_logprobs")

    def __init__(self, model: str, chat: bool, token_str: TokenStr = token_id_string, echo: bool = False,
                 prompt_logprobs: bool = False, token_bytes=None) -> None:
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.model = model
        self.chat = chat
        self.token_str = token_str
        self.token_bytes = token_bytes  # chat's bytes of a token (None: its string's UTF-8)
        self.echo = echo
        self.prompt_logprobs = prompt_logprobs

    def completion(self, gens: list[Generation], prompts: int) -> dict:
        """The whole non-streamed response."""
        choices = []
        for g in gens:
            lp = g.logprobs
            if self.chat:
                choice = {"index": g.index, "message": {"role": "assistant", "content": g.text, "refusal": None},
                          "logprobs": None if lp is None else {"content": chat_content(g.tokens, lp, self.token_str,
                                                                                  self.token_bytes)}}
            else:
                text = g.text
                logprobs = None
                if lp is not None:
                    logprobs, offset = self._echoed(g)
                    out, _ = completion_logprobs(g.tokens, lp, self.token_str, offset)
                    logprobs = out if logprobs is None else merge_completion_logprobs(logprobs, out)
                if self.echo:
                    text = (g.echo_text or "") + text
                choice = {"index": g.index, "text": text, "logprobs": logprobs}
            choice.update({"finish_reason": finish_reason(g.finish_reason), "stop_reason": g.stop_reason,
                           "token_ids": g.tokens})
            if self.prompt_logprobs:
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(g)
            choices.append(choice)
        return {"id": self.id, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices, "usage": usage(gens, prompts)}

    def _echoed(self, g: Generation) -> tuple[dict | None, int]:
        """The echoed prompt's logprobs object (None without echo) and the text offset after it."""
        if not self.echo:
            return None, 0
        ids = g.prompt_ids or []
        entries = g.handle.prompt_logprobs or [None] * len(ids)
        return completion_logprobs(ids, entries, self.token_str, 0)

    def _vllm_prompt_logprobs(self, g: Generation) -> list | None:
        entries, ids = g.handle.prompt_logprobs, g.prompt_ids
        if entries is None or ids is None:
            return None
        return vllm_prompt_logprobs(ids, entries, self.token_str)

    def chunk(self, choices: list[dict], usage_: dict | None = None, with_usage: bool = False) -> bytes:
        """One SSE event: ``data: {chunk}`` (:meth:`chunk_body`)."""
        return sse(self.chunk_body(choices, usage_, with_usage))

    def chunk_body(self, choices: list[dict], usage_: dict | None = None, with_usage: bool = False) -> dict:
        """One stream chunk. ``with_usage``: include ``"usage"`` (null unless given), as OpenAI does
        when ``include_usage`` is set."""
        body = {"id": self.id, "object": "chat.completion.chunk" if self.chat else "text_completion",
                "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            body["usage"] = usage_
        return body

    @staticmethod
    def error_event(e: APIError) -> bytes:
        """A stream's last event but ``[DONE]`` when it fails: ``data: {"error": {...}}``."""
        return sse(e.body())

    done: object = b"data: [DONE]\n\n"
    """A stream's end (:data:`DONE`)."""

    def delta_choice(self, g: Generation, d: Delta, reason: str | None,
                     stop_reason: int | tuple[int, ...] | str | None = None) -> dict:
        """One choice of a stream chunk (``stop_reason``: what stopped it, on its last chunk).
        A chat choice's role came in its :meth:`role_choice` chunk, so its deltas carry content only;
        ``logprobs`` covers the delta's tokens (null unless asked)."""
        if not self.chat:
            logprobs = None
            if d.logprobs is not None:
                logprobs, g.text_offset = completion_logprobs(d.tokens, d.logprobs, self.token_str, g.text_offset)
            return {"index": g.index, "text": d.text, "logprobs": logprobs, "finish_reason": reason,
                    "stop_reason": stop_reason, "token_ids": d.tokens}
        logprobs = None if d.logprobs is None else {"content": chat_content(d.tokens, d.logprobs, self.token_str,
                                                                                    self.token_bytes)}
        return {"index": g.index, "delta": {"content": d.text} if d.text else {}, "logprobs": logprobs,
                "finish_reason": reason, "stop_reason": stop_reason, "token_ids": d.tokens}

    def echo_choice(self, g: Generation) -> dict:
        """A streamed completion's first chunk with ``echo``: the prompt's text (and with logprobs its
        tokens' entries), before anything generated."""
        logprobs = None
        if g.handle.logprobs is not None:
            logprobs, g.text_offset = self._echoed(g)
        return {"index": g.index, "text": g.echo_text or "", "logprobs": logprobs, "finish_reason": None,
                "stop_reason": None, "token_ids": []}

    @staticmethod
    def role_choice(index: int) -> dict:
        """A chat choice's first stream chunk: the role and empty content, nothing generated
        yet (``{"role": "assistant", "content": ""}``, as OpenAI and vLLM send first)."""
        return {"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                "finish_reason": None, "stop_reason": None, "token_ids": []}


STREAM_END = object()
"""The end of a :class:`ChunkBodies` stream (no failure)."""


class ChunkBodies(ResponseBuilder):
    """A chat stream as objects for an API translated onto the chat path (:mod:`gateway.translation`):
    chunk bodies (dicts, :meth:`ResponseBuilder.chunk_body`), an :class:`APIError` when it fails,
    :data:`STREAM_END` when it ends well; the translation writes the events."""

    __slots__ = ()

    def chunk(self, choices: list[dict], usage_: dict | None = None, with_usage: bool = False) -> dict:
        return self.chunk_body(choices, usage_, with_usage)

    @staticmethod
    def error_event(e: APIError) -> APIError:
        return e

    done = STREAM_END


def sse(body: dict) -> bytes:
    """A server-sent event carrying ``body`` as JSON."""
    return b"data: " + to_json(body) + b"\n\n"


DONE = ResponseBuilder.done


def json_response(body: dict | bytes, status: int = 200, headers: dict | None = None) -> Response:
    """A JSON response (``body`` a dict, or bytes already encoded)."""
    return Response(body if isinstance(body, bytes) else to_json(body), status, headers,
                    media_type="application/json")


def error_response(e: APIError) -> Response:
    """``e`` in OpenAI's error shape, with its status and headers."""
    return json_response(e.to_json(), e.status, e.headers)
