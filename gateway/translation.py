"""Other vendors' APIs served as translations onto the one chat path (issue 34, item 3).

``/v1/responses`` (:mod:`gateway.responses_api`) and ``/v1/messages`` (:mod:`gateway.messages_api`)
have no pipeline of their own: a :class:`Translation` turns the body into a
:class:`~gateway.schemas.ChatCompletionRequest`, :meth:`gateway.generate.Generate.translated` serves
it exactly as ``/v1/chat/completions`` would (tools, structured outputs, reasoning split, usage,
drain, disconnects), and the translation writes the chat answer, stream or error in its vendor's
shapes.

Both the whole answer and the stream are read as the same :class:`Piece` sequence
(:func:`completion_pieces`, :func:`chunk_pieces`) and written by one builder per vendor, so a
stream's deltas add up to the answer.
"""

from __future__ import annotations

import codecs
import json
import re
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, replace
from typing import Any, Protocol

from pydantic import BaseModel, ValidationError
from starlette.responses import Response

from gateway.errors import APIError, bad_request, from_validation, nonfinite_number
from gateway.schemas import ChatCompletionRequest, _shown
from protocol.validation import LONE_SURROGATE, clip

__all__ = ["Piece", "Translation", "call_input", "chat_request", "check_keys", "chunk_pieces", "completion_pieces",
           "parse_body", "renamed", "renamed_error", "string_field", "unsupported_field", "vendor_tool"]


class Translation(Protocol):
    """One HTTP request of another vendor's API on the chat path (one object per request: it may keep
    what it needs between the body and the answer)."""

    def chat_body(self, raw: bytes) -> ChatCompletionRequest:
        """The chat request of the body ``raw`` (JSON bytes); :class:`APIError` (400) naming the
        vendor's field for a body it refuses."""

    def answer(self, completion: dict) -> Response:
        """The HTTP answer to the chat completion ``completion`` (reasoning split, tool calls parsed)."""

    def events(self, chunks: AsyncIterator) -> AsyncIterator[bytes]:
        """The vendor's event stream from the chat stream ``chunks``: chunk bodies (dicts), then
        :data:`gateway.responses.STREAM_END`, or an :class:`APIError` when the request failed."""

    def error(self, e: APIError) -> Response:
        """``e`` in the vendor's error shape, naming the vendor's field (``e.param`` is the vendor's
        when the body was refused before it became a chat request, else the chat path's)."""

    def resolved(self, model: str) -> None:
        """The body named no model: the chat path serves ``model`` (the one served), which the
        vendor's answer names."""

    def check_reasoning(self, parser: str | None) -> None:
        """Before the chat request is submitted: the chat path will split the answer's thinking off with
        ``parser`` (a :data:`gateway.reasoning.PARSERS` name; None: it will not). :class:`APIError`
        (400) when the vendor's request cannot be served so."""


@dataclass(frozen=True, slots=True)
class Piece:
    """One piece of a chat answer, in the order generated: ``kind`` is ``"reasoning"`` or
    ``"text"`` (``text`` the text), ``"call"`` (a tool call begins: ``call_id``, ``name``) or
    ``"arguments"`` (``text`` more of the current call's arguments, JSON text as the model wrote it).
    ``logprobs``: the chat logprobs entries (``{"token", "logprob", "bytes", "top_logprobs"}``) of
    the tokens that came with the piece, when the chat request asked for them (a stream's chunk gives
    its tokens' to its first piece, as the chat path does; a whole answer all of them to its text)."""

    kind: str
    text: str = ""
    call_id: str = ""
    name: str = ""
    logprobs: tuple[dict, ...] = ()


def completion_pieces(completion: dict) -> list[Piece]:
    """The pieces of a whole chat completion's first choice: its reasoning, its content (with the
    answer's logprobs entries, when asked), its calls."""
    choice = completion["choices"][0]
    message = choice["message"]
    pieces = []
    if message.get("reasoning_content"):
        pieces.append(Piece("reasoning", message["reasoning_content"]))
    if message.get("content"):
        pieces.append(Piece("text", message["content"], logprobs=_entries(choice)))
    for call in message.get("tool_calls") or ():
        pieces.append(Piece("call", call_id=call["id"], name=call["function"]["name"]))
        if call["function"]["arguments"]:
            pieces.append(Piece("arguments", call["function"]["arguments"]))
    return pieces


def chunk_pieces(chunk: dict) -> list[Piece]:
    """The pieces of one chat stream chunk (none for the role chunk and the usage chunk); the chunk's
    logprobs entries ride on its first piece, or on a text piece of no text when it has none (the
    answer's last token, which writes nothing)."""
    pieces = []
    for choice in chunk["choices"]:
        first = len(pieces)
        delta = choice["delta"]
        if delta.get("reasoning_content"):
            pieces.append(Piece("reasoning", delta["reasoning_content"]))
        if delta.get("content"):
            pieces.append(Piece("text", delta["content"]))
        for call in delta.get("tool_calls") or ():
            if "id" in call:
                pieces.append(Piece("call", call_id=call["id"], name=call["function"]["name"]))
            if call["function"].get("arguments"):
                pieces.append(Piece("arguments", call["function"]["arguments"]))
        entries = _entries(choice)
        if entries and len(pieces) == first:
            pieces.append(Piece("text", "", logprobs=entries))
        elif entries:
            pieces[first] = replace(pieces[first], logprobs=entries)
    return pieces


def _entries(choice: dict) -> tuple[dict, ...]:
    """A chat choice's logprobs entries (``logprobs.content``), ``()`` when none were asked."""
    logprobs = choice.get("logprobs")
    return tuple(logprobs.get("content") or ()) if isinstance(logprobs, dict) else ()


def call_input(arguments: str) -> dict:
    """A call's arguments (JSON text) as an object: ``{}`` when they are not one (cut by ``max_tokens``).
    A lone surrogate the model's text escapes (``"\\ud800"``: no character, and no UTF-8 answer
    can hold it) is U+FFFD, as the detokenizer writes bytes that are no character."""
    try:
        value = json.loads(arguments) if arguments else {}
    except (ValueError, RecursionError):  # (RecursionError: nested deeper than Python's limit)
        return {}
    if not isinstance(value, dict):
        return {}
    return value if "\\u" not in arguments else _replaced(value)  # (only an escape makes a surrogate)




def _replaced(value):
    """``value`` (parsed JSON) with every lone surrogate of its strings, keys included, as U+FFFD."""
    if isinstance(value, str):
        return value if value.isascii() else LONE_SURROGATE.sub("\ufffd", value)
    if isinstance(value, dict):
        return {_replaced(k): _replaced(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_replaced(v) for v in value]
    return value


def parse_body(schema: type[BaseModel], raw: bytes, owned: Callable[[Any, tuple], bool] | None = None) -> BaseModel:
    """``raw`` validated by ``schema`` (a route's body): 400 naming the first bad field (:func:`from_validation`),
    or the first number no double holds, anywhere in the body (NaN, Infinity, 1e400: :func:`nonfinite_number`;
    ``owned`` passes over those the route refuses in its own words); a llama.cpp or Ollama field unknown to
    ``schema`` is told what to send instead when the schema names its route (``hint_route``, a
    :class:`gateway.foreign_fields.Route`). Every route's body is read so.
    A UTF-8 byte order mark before the JSON is ignored, as RFC 8259 (section 8.1) lets a parser do,
    and as Python's :func:`json.loads` and ``slotserve run`` read one."""
    raw = raw.removeprefix(codecs.BOM_UTF8)
    error = nonfinite_number(raw, owned)
    if error is not None:
        raise error
    try:
        return schema.model_validate_json(raw)
    except ValidationError as e:
        raise from_validation(e.errors(include_url=False, include_context=False),
                              getattr(schema, "hint_route", None)) from None


def chat_request(fields: dict, params: tuple[tuple[str, str], ...]) -> ChatCompletionRequest:
    """The chat request of ``fields`` (the body's translation; ``None`` values left out); 400 for a
    value the chat request refuses, naming the vendor's field (``params``: :func:`renamed`'s table)."""
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise renamed_error(from_validation(e.errors(include_url=False, include_context=False)), params) from None


def unsupported_field(field: str, what: str) -> APIError:
    """400 for a field of the vendor's API that slotserve does not serve on its translation, naming it."""
    return bad_request(f"'{field}' is not supported by slotserve's {what}; leave it out", field,
                       "unsupported_parameter")


KeyCheck = tuple[Callable[[Any], bool], str]
"""A key's check: whether a value is of the key's type, and that type in words (``"true or false"``)."""


def vendor_tool(tool: dict, where: str, chat_keys: frozenset[str], unused: dict[str, KeyCheck]) -> dict:
    """``tool``, a function tool of the vendor's body at the field ``where`` (``tools.0``), with its keys
    that the chat path does not take left out: those in ``unused`` (the vendor's keys that change
    nothing here: a deferred tool is rendered as any other, a streaming or caller hint is moot) once
    checked as the vendor types them, else a 400 naming the key. Another key than ``chat_keys`` and
    ``unused`` is the 400 of an unknown field (``unknown_parameter``: on ``/v1/messages`` Anthropic's
    "tools.0.foo: Extra inputs are not permitted"), not the chat path's "tools.0 does not take"."""
    check_keys(tool, where, chat_keys, unused)
    return {k: v for k, v in tool.items() if k not in unused}


def check_keys(obj: dict, where: str, known: frozenset[str], unused: dict[str, KeyCheck],
               takes: str | None = None) -> None:
    """400 for a key of ``obj`` (the vendor's object at the field ``where``: a tool, a message, a content
    block) that the route would otherwise take silently, as the vendor refuses it: a key in ``unused``
    (the vendor's, which change nothing here) whose value is not of the vendor's type (``invalid_type``),
    or a key neither ``known`` nor in ``unused``: an unknown field (``unknown_parameter``, named
    ``where.key``, clipped; ``takes``: what the object takes, in words, said after it). On
    ``/v1/messages`` the latter reads as Anthropic's "messages.0.foo: Extra inputs are not permitted"."""
    for key, value in obj.items():
        if key in unused:
            check, words = unused[key]
            if not check(value):
                raise bad_request(f"{where}.{key} must be {words}; got {_shown(value)}", f"{where}.{key}",
                                  "invalid_type")
        elif key not in known:
            field = f"{where}.{clip(key)}"
            raise bad_request(f"Unrecognized request argument supplied: {field}" + (f" ({where} takes {takes})"
                              if takes else ""), field, "unknown_parameter")


def string_field(item: dict, key: str, where: str) -> str:
    """``item[key]``, which must be a string: 400 naming ``where.key`` else."""
    value = item.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key} must be a string", f"{where}.{key}")
    return value


def renamed_error(e: APIError, table: tuple[tuple[str, str], ...]) -> APIError:
    """``e``, an error of the chat path, naming the vendor's field alone (returned; changed in place):
    its ``param`` (:func:`renamed`), and its message where that starts with the chat field's name, as
    the chat path's checks write it ("response_format.json_schema.schema must be ...": a Messages
    client sent ``output_config.format.schema``, and was told both names)."""
    chat = e.param
    e.param = renamed(chat, table)
    if chat is not None and e.param != chat and re.match(re.escape(chat) + r"(?![\w.\[])", e.message):
        e.message = e.param + e.message[len(chat):]
    return e


def renamed(param: str | None, table: tuple[tuple[str, str], ...]) -> str | None:
    """A chat field's name as the vendor's body names it: the first ``(pattern, replacement)`` of
    ``table`` whose regular expression matches the start of ``param`` rewrites it; else ``param``."""
    if param is None:
        return None
    for pattern, replacement in table:
        new, n = re.subn(f"^{pattern}", replacement, param)
        if n:
            return new
    return param
