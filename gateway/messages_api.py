"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API as a
translation onto the chat path (:mod:`gateway.translation`).

Fields from Anthropic's API reference ("Messages" > "Create a Message", "Count Message tokens"):

=========================== ==================================================================
Messages field              on the chat path
=========================== ==================================================================
``system``                  a ``system`` message first (a string, or ``text`` blocks joined)
``messages``                ``user`` / ``assistant`` messages; content a string or blocks:
                            ``text`` (joined), an assistant's ``tool_use`` (its ``tool_calls``,
                            ``input`` as the JSON text of the arguments), a user's
                            ``tool_result`` (a ``tool`` message before the user's text, its
                            ``content`` a string or ``text`` blocks; its ``tool_use_id`` that
                            of an earlier ``tool_use``); an assistant's
                            ``thinking`` / ``redacted_thinking`` blocks are left out; empty
                            content (``""``, ``[]``) only in a final assistant message
``max_tokens`` (required)   ``max_tokens``
``stop_sequences``          ``stop`` (at most 4, the chat path's bound)
``temperature``, ``top_p``, the same
``top_k``
``tools``                   ``{"name", "description", "input_schema"}`` -> chat's function tools
                            (``input_schema`` the ``parameters``); server tools (``type`` other
                            than ``custom``: web search, bash, ...) are 400
``tool_choice``             ``auto`` / ``any`` (``required``) / ``tool`` + ``name`` (that
                            function) / ``none``; ``disable_parallel_tool_use: true`` is
                            ``parallel_tool_calls: false``
``output_config``           ``format``: ``response_format`` ``json_schema`` (``{"type":
                            "json_schema", "schema"}``, structured outputs); ``effort`` (one
                            of :data:`OUTPUT_EFFORTS`, or null) checked, not used; another key
                            a 400 (``output_config.foo: Extra inputs are not permitted``).
                            ``count_tokens`` takes and checks it too (as Anthropic's does); the
                            count is the prompt's (the schema is a grammar, not prompt text)
``stream``                  the chat stream, written as Anthropic's events
``metadata``                checked as Anthropic checks it, then not used: an object whose one
                            key is ``user_id`` (a string of at most 256 characters, or null);
                            another key, another type or a longer id is a 400 naming the field
                            (``metadata.foo: Extra inputs are not permitted``). ``count_tokens``
                            takes no ``metadata`` (nor does Anthropic's): a 400 there
=========================== ==================================================================

Accepted and not used: ``output_config.effort``, ``inference_geo``, ``speed``,
``thinking`` (the model thinks as its chat template says; ``--reasoning-parser`` splits it into
``thinking`` blocks), ``service_tier``, ``cache_control`` (top-level, on blocks and tools), and a
``tool_result``'s ``is_error`` (its content is shown as any result's). Refused with a 400 naming
the field: ``container``, ``mcp_servers``, ``context_management``, image and document blocks,
server tools.

The answer is a Message: ``content`` blocks (:mod:`gateway.messages_output`), ``stop_reason``
(``end_turn``, ``max_tokens``, ``stop_sequence`` with ``stop_sequence``, ``tool_use``) and
``usage`` (``input_tokens``, ``output_tokens``). A stream is ``message_start`` (``usage.input_tokens``
already known: the prompt was read before the first token), the blocks' events, ``message_delta``
(``stop_reason``, ``usage``), ``message_stop``, each with its ``event:`` line, as Anthropic sends
them; a request that fails once streaming ends with an ``error`` event. Every error on these routes
is Anthropic's shape (``{"type": "error", "error": {"type", "message"}}``, :meth:`APIError.anthropic_body`),
naming the Messages field: the chat path's errors about a message name the message, block or
``system`` it came from (``messages.2.content.1.input``, :mod:`gateway.origins`).
``count_tokens`` answers ``{"input_tokens": N}``: the chat template's tokens of the same
translation, tools included (``/tokenize``'s count, :mod:`gateway.tokenize`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict
from pydantic_core import PydanticCustomError, to_json
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import APIError, bad_request, from_validation
from gateway.messages_output import ContentBlocks, stop_reason
from gateway.origins import Api, ItemKind, Origin, renamed_to_items
from gateway.responses import STREAM_END, json_response, new_id
from gateway.schemas import ChatCompletionRequest, TokenizeRequest
from gateway.structured import structured_option
from gateway.translation import chat_request, chunk_pieces, completion_pieces, parse_body, renamed_error, \
    string_field, unsupported_field

__all__ = ["OUTPUT_EFFORTS", "CountTokensRequest", "MessagesEndpoints", "MessagesRequest", "chat_items",
           "chat_messages", "renamed_to_messages"]

_WHAT = "/v1/messages"


MAX_USER_ID_CHARS = 256
"""The longest ``metadata.user_id`` Anthropic takes, in characters (its API's OpenAPI schema,
``Metadata.user_id``: ``maxLength: 256``)."""


def _metadata(value: Any) -> Any:
    """Anthropic's ``metadata`` (its ``Metadata`` object: no other key): null, or an object whose
    one key is ``user_id``, a string of at most :data:`MAX_USER_ID_CHARS` characters or null.
    Else the error naming the field first, in the words of Anthropic's own 400s; the field is
    not used after (an opaque id for Anthropic's abuse detection)."""
    if value is None:
        return value
    if not isinstance(value, dict):
        raise PydanticCustomError("invalid_type", f"metadata: Input should be an object with one key, user_id; got "
                                  f"{json.dumps(value)[:40]}")
    extra = next((key for key in value if key != "user_id"), None)
    if extra is not None:
        raise PydanticCustomError("invalid_value", f"metadata.{extra:.40}: Extra inputs are not permitted "
                                  "(metadata takes one key, user_id)")
    user_id = value.get("user_id")
    if user_id is not None and type(user_id) is not str:
        raise PydanticCustomError("invalid_type", f"metadata.user_id: Input should be a valid string or null; got "
                                  f"{json.dumps(user_id)[:40]}")
    if user_id is not None and len(user_id) > MAX_USER_ID_CHARS:
        raise PydanticCustomError("invalid_value", f"metadata.user_id: String should have at most {MAX_USER_ID_CHARS} "
                                  f"characters, got {len(user_id)}; send an opaque id (a uuid or a hash)")
    return value


Metadata = Annotated[dict[str, Any] | None, BeforeValidator(_metadata)]
"""A Messages body's ``metadata``: ``{"user_id": str | null}`` within Anthropic's bound (:func:`_metadata`)."""

OUTPUT_EFFORTS = ("low", "medium", "high", "xhigh", "max")
"""The values of ``output_config.effort`` Anthropic takes (its API's ``OutputConfig.effort``; the
anthropic SDK's ``OutputConfigParam``)."""


def _output_config(value: Any) -> Any:
    """Anthropic's ``output_config`` (its ``OutputConfig`` object: ``format`` and ``effort``, no
    other key): null, or such an object whose ``effort`` is one of :data:`OUTPUT_EFFORTS` or null;
    ``format`` is checked where it is translated (:func:`_response_format`). Else the error naming
    the field first, in the words of Anthropic's own 400s."""
    if value is None:
        return value
    if not isinstance(value, dict):
        raise PydanticCustomError("invalid_type", "output_config: Input should be an object (format, effort); got "
                                  f"{json.dumps(value)[:40]}")
    extra = next((key for key in value if key not in ("format", "effort")), None)
    if extra is not None:
        raise PydanticCustomError("invalid_value", f"output_config.{extra:.40}: Extra inputs are not permitted "
                                  "(output_config takes format and effort)")
    effort = value.get("effort")
    if effort is not None and (type(effort) is not str or effort not in OUTPUT_EFFORTS):
        raise PydanticCustomError("invalid_value", "output_config.effort: Input should be "
                                  f"{', '.join(map(repr, OUTPUT_EFFORTS[:-1]))} or {OUTPUT_EFFORTS[-1]!r}; got "
                                  f"{json.dumps(effort)[:40]}")
    return value


OutputConfig = Annotated[dict[str, Any] | None, BeforeValidator(_output_config)]
"""A Messages body's ``output_config`` (:func:`_output_config`), shared by ``count_tokens``."""


class CountTokensRequest(BaseModel):
    """``POST /v1/messages/count_tokens``'s body (strict, unknown fields 400)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str
    messages: list[dict[str, Any]]
    system: str | list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    output_config: OutputConfig = None  # format: structured output; effort: not used
    thinking: dict[str, Any] | None = None  # accepted, not used
    cache_control: dict[str, Any] | None = None  # accepted, not used
    # refused unless absent
    mcp_servers: Any = None
    context_management: Any = None

    def unsupported(self) -> str | None:
        return next((name for name in ("mcp_servers", "context_management", "container")
                     if getattr(self, name, None) is not None), None)


class MessagesRequest(CountTokensRequest):
    """``POST /v1/messages``'s body (Anthropic's ``MessageCreateParams``)."""

    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool | None = None
    metadata: Metadata = None  # checked as Anthropic does, not used
    # accepted, not used
    service_tier: str | None = None
    inference_geo: str | None = None
    speed: str | None = None
    # refused unless absent
    container: Any = None


# chat fields -> Messages fields, for the chat path's errors (a chat message's index is not a Messages
# message's -- the system prompt, tool results split off -- nor are its keys: a message's field is its
# message's or block's, gateway.origins; what names no message's is "messages")
_PARAMS = ((r"messages(\..*)?", "messages"), (r"stop", "stop_sequences"),
           (r"response_format(\.json_schema)?(\.schema)?", "output_config.format.schema"),
           (r"tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"), (r"tools\.(\d+)\.function", r"tools.\1"),
           (r"parallel_tool_calls", "tool_choice.disable_parallel_tool_use"))


def chat_messages(system: str | list[dict] | None, messages: list[dict]) -> list[dict]:
    """The chat messages of ``system`` and ``messages`` (see the module's table); 400 naming the
    field for a block it does not take, for a message with empty content (``""`` or ``[]``) other than
    a final assistant message (Anthropic's rule: an empty turn), or for a ``tool_result`` whose
    ``tool_use_id`` is the id of no ``tool_use`` block before it (Anthropic refuses it: a result must
    answer a call)."""
    return chat_items(system, messages)[0]


def chat_items(system: str | list[dict] | None, messages: list[dict]) -> tuple[list[dict], list[Origin]]:
    """:func:`chat_messages`, and what each chat message was made of (one :class:`Origin` a message:
    ``system``, a message, a ``tool_result`` block; an assistant message's calls its ``tool_use`` blocks)."""
    out: list[dict] = []
    origins: list[Origin] = []
    call_ids: set[str] = set()  # the ids of the tool_use blocks so far
    if system is not None:
        out.append({"role": "system", "content": _text(system, "system")})
        origins.append(Origin("system", kind=ItemKind.INSTRUCTIONS))
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant"):
            raise bad_request("a message's role must be user or assistant (the system prompt is 'system')",
                              f"{where}.role")
        if content in ("", []) and not (role == "assistant" and i == len(messages) - 1):  # (Anthropic's words)
            raise bad_request("all messages must have non-empty content except for the optional final assistant "
                              "message; send a string or at least one block, or leave the message out",
                              f"{where}.content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            origins.append(Origin(where))
            continue
        if not isinstance(content, list):
            raise bad_request("content must be a string or a list of content blocks", f"{where}.content")
        texts, calls, results, uses, answers = [], [], [], [], []  # (uses, answers: the blocks of calls, results)
        for j, block in enumerate(content):
            at = f"{where}.content.{j}"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text":
                texts.append(_text([block], at))
            elif kind == "tool_use" and role == "assistant":
                if not isinstance(block.get("input", {}), dict):  # (JSON text in a string is not Anthropic's)
                    raise bad_request(f"{at}.input must be an object (the call's arguments)", f"{at}.input")
                calls.append({"id": string_field(block, "id", at), "type": "function", "function": {
                    "name": string_field(block, "name", at), "arguments": json.dumps(block.get("input", {}))}})
                call_ids.add(calls[-1]["id"])
                uses.append(at)
            elif kind == "tool_result" and role == "user":
                use_id = string_field(block, "tool_use_id", at)
                if use_id not in call_ids:
                    raise bad_request(f"unexpected `tool_use_id` found in `tool_result` blocks: {use_id:.80}. Each "
                                      "`tool_result` block must answer a `tool_use` block of an earlier assistant "
                                      "message", f"{at}.tool_use_id")
                results.append({"role": "tool", "tool_call_id": use_id,
                                "content": _text(block.get("content", ""), f"{at}.content")})
                answers.append(Origin(at, kind=ItemKind.TOOL_RESULT))
            elif kind not in ("thinking", "redacted_thinking") or role != "assistant":
                allowed = "text, tool_use, thinking" if role == "assistant" else "text, tool_result"
                raise unsupported_field(f"{at}.type", f"{_WHAT} ({role} content blocks: {allowed}; not {kind!r:.40})")
        out += results
        origins += answers
        if texts or calls or not results:
            out.append({"role": role, "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
            origins.append(Origin(where, tuple(uses)))
    return out, origins


def _text(content: Any, where: str) -> str:
    """A string, or the text of ``text`` blocks, joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    texts = []
    for block in content:
        if not isinstance(block, dict) or block.get("type") != "text":
            raise unsupported_field(where, f"{_WHAT} (text blocks only here)")
        if not isinstance(block.get("text"), str):
            raise bad_request("a text block needs a string 'text'", where)
        texts.append(block["text"])
    return "".join(texts)


def _tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic's client tools as chat's function tools (other keys kept, for the chat path's check to name)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type", "custom") != "custom":
            raise unsupported_field(f"tools.{i}.type", f"{_WHAT} (client tools only; server tools such as "
                                    f"{tool.get('type')!r:.40} run on Anthropic's servers)")
        fn = {("parameters" if k == "input_schema" else k): v for k, v in tool.items()
              if k not in ("type", "cache_control")}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: dict | None) -> tuple[str | dict | None, bool | None]:
    """``(tool_choice, parallel_tool_calls)`` of Anthropic's ``tool_choice``."""
    if choice is None:
        return None, None
    kind = choice.get("type")
    extra = sorted(set(choice) - {"type", "name", "disable_parallel_tool_use"})
    if extra or kind not in ("auto", "any", "tool", "none") or (kind == "tool") != ("name" in choice):
        raise bad_request("tool_choice must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": \"none\"} or "
                          "{\"type\": \"tool\", \"name\": ...}", "tool_choice")
    parallel = choice.get("disable_parallel_tool_use")
    if parallel is not None and type(parallel) is not bool:
        raise bad_request("tool_choice.disable_parallel_tool_use must be true or false",
                          "tool_choice.disable_parallel_tool_use")
    named = {"type": "function", "function": {"name": choice.get("name")}}
    return {"auto": "auto", "any": "required", "none": "none", "tool": named}[kind], (
        None if parallel is None else not parallel)


def _response_format(config: dict | None) -> dict | None:
    """``output_config.format`` as chat's ``response_format`` (``effort`` is not used)."""
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or set(fmt) != {"type", "schema"}:
        raise bad_request("output_config.format must be {\"type\": \"json_schema\", \"schema\": {...}}",
                          "output_config.format")
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


def _chat_fields(body: CountTokensRequest) -> tuple[dict, list[Origin]]:
    """The chat request's fields that a count and a message share (the prompt, its tools, its output
    format), so that both check them alike, and what each chat message came from (:func:`chat_items`)."""
    name = body.unsupported()
    if name is not None:
        raise unsupported_field(name, _WHAT)
    choice, parallel = _tool_choice(body.tool_choice)
    messages, origins = chat_items(body.system, body.messages)
    return {"model": body.model, "messages": messages, "tools": _tools(body.tools), "tool_choice": choice,
            "parallel_tool_calls": parallel, "response_format": _response_format(body.output_config)}, origins


def _chat_request(fields: dict, origins: list[Origin]) -> ChatCompletionRequest:
    """:func:`~gateway.translation.chat_request` of ``fields``, its errors naming the Messages field
    (:func:`renamed_to_messages`)."""
    try:
        return chat_request(fields, ())
    except APIError as e:
        raise renamed_to_messages(e, origins) from None


def renamed_to_messages(e: APIError, origins: list[Origin]) -> APIError:
    """``e``, an error of the chat path (returned; changed in place), naming the Messages field: a
    chat message's field as the message, block or ``system`` it came from (``origins``, one per chat
    message: :func:`~gateway.origins.renamed_to_items`), others by ``_PARAMS``."""
    if not renamed_to_items(e, origins, Api.MESSAGES):
        renamed_error(e, _PARAMS)
    return e


class MessagesTranslation:
    """One ``/v1/messages`` request on the chat path (:class:`gateway.translation.Translation`)."""

    def __init__(self) -> None:
        self.body: MessagesRequest | None = None
        self.id = new_id("msg", "_")
        self.on_chat_path = False  # the body became a chat request: errors name chat fields from here on
        self.origins: list[Origin] = []  # what each chat message came from (gateway.origins)

    def chat_body(self, raw: bytes) -> ChatCompletionRequest:
        body = self.body = parse_body(MessagesRequest, raw)
        if body.max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {body.max_tokens}", "max_tokens")
        fields, self.origins = _chat_fields(body)
        chat = _chat_request({
            **fields, "max_tokens": body.max_tokens, "stop": body.stop_sequences,
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "stream": body.stream,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True} if body.stream else None},
            self.origins)
        self.on_chat_path = True
        return chat

    def answer(self, completion: dict) -> Response:
        blocks = ContentBlocks()
        for piece in completion_pieces(completion):
            blocks.feed(piece)
        blocks.close()
        choice = completion["choices"][0]
        reason, sequence = stop_reason(choice["finish_reason"], choice["stop_reason"], self.body.stop_sequences)
        message = self._message(blocks.blocks, reason, sequence)
        message["usage"] = _usage(completion["usage"])
        return json_response(message)

    async def events(self, chunks):
        def event(kind: str, data: dict) -> bytes:
            return b"event: " + kind.encode() + b"\ndata: " + to_json(data) + b"\n\n"

        blocks, started, finish, stopped_by, usage, failure = ContentBlocks(), False, None, None, None, None
        async for chunk in chunks:  # (read to its end: the chat stream records the call as it ends)
            if isinstance(chunk, APIError):
                failure = chunk
                continue
            if chunk is STREAM_END:
                continue
            usage = chunk.get("usage") or usage
            if not started:  # (the first chunk, the role's, carries the prompt's length)
                started = True
                message = self._message([], None, None)
                message["usage"] = {**_usage(usage), "output_tokens": 0}
                yield event("message_start", {"type": "message_start", "message": message})
            for piece in chunk_pieces(chunk):
                blocks.feed(piece)
            for choice in chunk["choices"]:
                if choice["finish_reason"] is not None:
                    finish, stopped_by = choice["finish_reason"], choice["stop_reason"]
            for kind, data in blocks.take():
                yield event(kind, data)
        if failure is not None:
            yield event("error", renamed_to_messages(failure, self.origins).anthropic_body())
            return
        blocks.close()
        for kind, data in blocks.take():
            yield event(kind, data)
        reason, sequence = stop_reason(finish, stopped_by, self.body.stop_sequences)
        yield event("message_delta", {"type": "message_delta", "delta": {"stop_reason": reason,
                                                                        "stop_sequence": sequence},
                                      "usage": _usage(usage)})
        yield event("message_stop", {"type": "message_stop"})

    def error(self, e: APIError) -> Response:
        if self.on_chat_path:
            renamed_to_messages(e, self.origins)
        return anthropic_error(e)

    def _message(self, content: list[dict], reason: str | None, sequence: str | None) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.body.model, "content": content,
                "stop_reason": reason, "stop_sequence": sequence}


def _usage(usage: dict | None) -> dict:
    """A chat ``usage`` as Anthropic's (0 where the prompt's length is unknown)."""
    usage = usage or {"prompt_tokens": 0, "completion_tokens": 0}
    return {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"]}


def anthropic_error(e: APIError) -> Response:
    """``e`` in Anthropic's error shape (naming a Messages field already: :func:`renamed_to_messages`)."""
    return json_response(e.anthropic_body(), e.status, e.headers)


class MessagesEndpoints:
    """The ``/v1/messages`` handlers over the gateway's chat path (``generate``) and ``/tokenize``'s
    rendering (``tokenize``, :class:`gateway.tokenize.TokenizeEndpoints`)."""

    def __init__(self, generate, tokenize) -> None:
        self.generate = generate
        self.tokenize = tokenize

    async def create(self, request: Request) -> Response:
        return await self.generate.translated(request, MessagesTranslation())

    async def count_tokens(self, request: Request) -> Response:
        from gateway.generate import _check_json_body_headers, read_body

        try:
            _check_json_body_headers(request.headers)
            body = parse_body(CountTokensRequest, await read_body(request, self.generate.config.max_body_bytes))
            fields, origins = _chat_fields(body)
            chat = _chat_request(fields, origins)
        except APIError as e:
            return anthropic_error(e)
        try:
            structured_option(chat)  # (the output format checked as a message's is; it adds no prompt token)
            _, ids, _ = await self.tokenize.tokens(TokenizeRequest(model=chat.model, messages=chat.messages,
                                                                   tools=chat.tools, tool_choice=chat.tool_choice))
        except APIError as e:
            return anthropic_error(renamed_to_messages(e, origins))
        return json_response({"input_tokens": len(ids)})
