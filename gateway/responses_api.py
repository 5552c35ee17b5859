"""``POST /v1/responses``, ``GET`` and ``DELETE /v1/responses/{id}``: OpenAI's Responses API as a
translation onto the chat path (:mod:`gateway.translation`).

Fields from OpenAI's API reference ("Responses" > "Create a model response"):

========================== ==================================================================
Responses field            on the chat path
========================== ==================================================================
``input`` (string)         one ``user`` message
``input`` (items)          ``message`` items (roles ``user``, ``assistant``, ``system``,
                           ``developer`` as ``system``; content a string or ``input_text`` /
                           ``output_text`` parts, at least one: ``[]`` is a 400, as OpenAI
                           answers), ``function_call`` items (the assistant's
                           ``tool_calls``, joined to the assistant message before them),
                           ``function_call_output`` items (``tool`` messages; each answers a
                           ``function_call`` before it, here or in the previous response,
                           and each call is answered before the next message or turn;
                           ``output`` a string, ``""`` taken, or parts: ``[]`` is a 400);
                           ``reasoning`` items are left out (chat templates drop past thinking)
``instructions``           a ``system`` message first (not carried to the next response)
``previous_response_id``   the stored conversation first (:mod:`gateway.response_store`)
``max_output_tokens``      ``max_tokens``
``temperature``, ``top_p`` the same
``tools``                  function tools ``{"type": "function", "name", "description",
                           "parameters", "strict"}`` -> chat's ``{"type": "function",
                           "function": {...}}``; built-in tools (``web_search``, ...) are 400
``tool_choice``            ``none`` / ``auto`` / ``required`` / ``{"type": "function", "name"}``
``parallel_tool_calls``    the same
``text.format``            ``response_format``: ``text``, ``json_object``, ``json_schema``
                           (``name``, ``schema``, ``strict``, ``description`` at its top level)
``stream``                 the chat stream, written as Responses events
========================== ==================================================================

``reasoning.effort`` becomes the chat's ``reasoning_effort`` (the template variable of that name,
:func:`gateway.options.template_option`); the rest of ``reasoning`` is checked and not used (the
model thinks as its chat template says; the thinking is split off by the reasoning parser). Checked
as OpenAI checks them (a value it refuses is a 400 naming the field: :func:`check_unused`), then not
used: ``include``, ``text.verbosity``, ``prompt_cache_retention``, ``reasoning``, ``stream_options``.
Accepted and not used: ``metadata`` (echoed back), ``user``, ``safety_identifier``, ``prompt_cache_key``.
An input item's or content part's key OpenAI's types have not is a 400 (``Unknown parameter``), those
that change nothing here are checked as typed (:data:`_ITEM_KEYS`).
``include: ["message.output_text.logprobs"]`` asks the chat path for logprobs (``top_logprobs`` 0..20
alternatives each): the ``output_text`` part has one entry per token of the text, and each text
delta its tokens' (:mod:`gateway.responses_output`); refused (400 naming ``include.N``) beside tools
or for a model whose thinking is split off (:meth:`ResponsesTranslation.check_reasoning`): which
tokens wrote the message would be a guess. ``top_logprobs`` alone is echoed and asks nothing.
Refused with a 400 naming the field: ``background: true``, ``conversation``, ``prompt``,
``max_tool_calls``, ``truncation: "auto"``, a ``service_tier`` other than
``auto`` / ``default``, built-in tools and their ``tool_choice``, input items other than the above
(images, files, item references).

The answer is the Response object: ``output`` items (:mod:`gateway.responses_output`),
``status`` ``completed``, or ``incomplete`` with ``incomplete_details.reason:
"max_output_tokens"`` when ``max_output_tokens`` cut it, and ``usage`` (``input_tokens``,
``output_tokens``, ``total_tokens``). A stream is ``response.created``, ``response.in_progress``,
the items' events, then ``response.completed`` (or ``response.incomplete``) with the whole
response; each event has ``event:`` and ``data:`` lines and a ``sequence_number`` from 0; a request
that fails once streaming ends with ``response.failed`` (its ``error``). Errors before that are
OpenAI's error shape (:mod:`gateway.errors`), naming the Responses field: the chat path's errors
about a message name the item it came from, this request's or a stored response's
(:mod:`gateway.origins`).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import replace
from typing import Annotated, Any, ClassVar

from pydantic import BaseModel, ConfigDict
from pydantic_core import to_json
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import INPUT_FIELDS, APIError, bad_request, empty_content, entry_type, misplaced_input, \
    missing_parameter, reworded
from gateway.foreign_fields import Route
from gateway.json_body import value_kind
from gateway.responses import STREAM_END, error_response, json_response, new_id
from gateway.origins import ItemKind, Origin, renamed_to_items
from gateway.responses_output import OutputItems, response_usage
from gateway.response_store import ResponseStore, Running, StoredResponse
from gateway.schemas import MAX_TEMPERATURE, PROMPT_CACHE_RETENTIONS, VERBOSITIES, ChatCompletionRequest, Metadata, \
    in_range, not_one_of, text_or_objects
from gateway.tools import check_arguments
from gateway.translation import chat_request, chunk_pieces, completion_pieces, parse_body, renamed_error, \
    string_field, unsupported_field, vendor_tool
from protocol.logprobs import MAX_LOGPROBS
from protocol.validation import clip, echo

__all__ = ["INCLUDABLES", "REASONING_KEYS", "VERBOSITIES", "ResponsesEndpoints", "ResponsesRequest", "check_unused",
           "input_items", "input_messages"]

_WHAT = "/v1/responses"


class ResponsesRequest(BaseModel):
    """``POST /v1/responses``'s body (OpenAI's ``ResponseCreateParams``; strict, unknown fields 400)."""

    hint_route: ClassVar[Route] = Route.RESPONSES  # a llama.cpp or Ollama field's 400 says what to send

    model_config = ConfigDict(extra="forbid", strict=True)
    model: str | None = None  # None: the one model served
    input: Annotated[str | list[dict[str, Any]] | None, text_or_objects("input", "input items")] = None
    instructions: str | None = None
    previous_response_id: str | None = None
    max_output_tokens: int | None = None
    temperature: Annotated[float | None, in_range("temperature", 0, MAX_TEMPERATURE, " (0 = greedy)")] = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = None
    store: bool | None = None
    # accepted, not used
    metadata: Metadata = None
    reasoning: dict[str, Any] | None = None
    include: list[str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Any = None  # checked (check_unused), not used
    stream_options: dict[str, Any] | None = None
    service_tier: str | None = None
    truncation: str | None = None
    # refused unless absent or neutral
    background: bool | None = None
    conversation: Any = None
    prompt: Any = None
    max_tool_calls: Any = None
    top_logprobs: int | None = None  # 0..20 alternatives per token, with include message.output_text.logprobs

    def unsupported(self) -> str | None:
        """The first field set to something slotserve does not serve, else None."""
        if self.background:
            return "background"
        for name in ("conversation", "prompt", "max_tool_calls"):
            if getattr(self, name) is not None:
                return name
        if self.truncation not in (None, "disabled"):
            return "truncation"
        if self.service_tier not in (None, "auto", "default"):
            return "service_tier"
        return None


# chat fields -> Responses fields, for the chat path's errors (a chat message's index is not an input
# item's -- instructions and the stored conversation come first -- nor are its keys: a message's field
# is its item's, gateway.origins; what names no message's item is "input")
_PARAMS = (
    (r"messages(\..*)?", "input"), (r"max_tokens", "max_output_tokens"),
    (r"response_format(\.json_schema)?", "text.format"),
    (r"tools\.(\d+)\.function", r"tools.\1"), (r"reasoning_effort", "reasoning.effort"),
)
_WORDS = ((r"max_tokens", "max_output_tokens"), (r"response_format(\.json_schema)?", "text.format"),
          (r"tools\.(\d+)\.function", r"tools.\1"), (r"reasoning_effort", "reasoning.effort"))
"""Chat fields -> Responses fields wherever an error's message names them (:func:`gateway.errors.reworded`)."""


def input_messages(value: str | list[dict], earlier: list[dict] | tuple = ()) -> list[dict]:
    """The chat messages of ``input`` (see the module's table), which continue the chat messages
    ``earlier`` (the stored conversation of ``previous_response_id``); 400 naming ``input.N...`` for
    an item it does not take, a message item whose content is an empty array (OpenAI's rule), or for a
    ``function_call_output`` whose ``call_id`` is the id of no ``function_call`` before it, in ``input``
    or ``earlier`` (OpenAI's rule and message), or whose call an earlier output answers already (the
    chat path's rule, OpenAI's: one answer a call), and for a ``function_call`` (of ``input``, or the
    last turn of ``earlier``) that no output answers before the next message item, the next turn's
    call or the input's end (OpenAI's "No tool output found for function call ...": the chat path's
    rule, :class:`protocol.chat.Answers`, in the Responses API's words)."""
    return input_items(value, earlier)[0]


def input_items(value: str | list[dict], earlier: list[dict] | tuple = ()) -> tuple[list[dict], list[Origin]]:
    """:func:`input_messages`, and the input items each message was made of (one :class:`Origin` a message)."""
    if isinstance(value, str):
        return [{"role": "user", "content": value}], [Origin("input")]
    call_ids = {call["id"] for m in earlier for call in m.get("tool_calls") or ()}
    answered: dict[str, str] = {m["tool_call_id"]: _STORED for m in earlier if m.get("role") == "tool"}
    # ^ a call's id -> where it is answered
    waiting: dict[str, str] = {}  # the calls of the last assistant turn not answered yet: id -> its field
    for m in earlier:  # (the stored response's own calls await their outputs in this input)
        if m.get("tool_calls"):
            waiting = {call["id"]: "input" for call in m["tool_calls"]}
        waiting.pop(m.get("tool_call_id"), None)
    out: list[dict] = []
    origins: list[Origin] = []
    for i, item in enumerate(value):
        where = f"input.{i}"
        kind = entry_type(item, where, "an input item", _ITEMS, default="message")
        if kind in _ITEM_KEYS:
            _check_keys(item, where, _ITEM_KEYS[kind])
        if waiting and (kind == "message" or kind == "function_call" and out[-1:] and out[-1]["role"] != "assistant"):
            raise _no_output(waiting)  # (another turn before the calls' outputs: a template writes each after its call)
        if kind == "message":
            role = item.get("role")
            if role not in ("user", "assistant", "system", "developer"):
                raise bad_request("a message item's role must be user, assistant, system or developer", f"{where}.role")
            if item.get("content") == []:  # (OpenAI's rule: an empty turn the client did not mean)
                raise empty_content(f"{where}.content", "input_text part")
            out.append({"role": "system" if role == "developer" else role,
                        "content": _text(item.get("content"), f"{where}.content")})
            origins.append(Origin(where))
        elif kind == "function_call":
            call = {"id": _call_id(item, where), "type": "function",
                    "function": {"name": string_field(item, "name", where),
                                 "arguments": string_field(item, "arguments", where)}}
            check_arguments(call["function"]["arguments"], f"{where}.arguments")  # (named as the item's field)
            if out and out[-1]["role"] == "assistant":  # (one assistant turn: its text, then its calls)
                out[-1].setdefault("tool_calls", []).append(call)
                origins[-1] = replace(origins[-1], calls=origins[-1].calls + (where,))
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
                origins.append(Origin(None, (where,)))
            call_ids.add(call["id"])
            answered.pop(call["id"], None)  # (a call made again may be answered again)
            waiting[call["id"]] = where
        elif kind == "function_call_output":
            call_id = _call_id(item, where)
            if call_id not in call_ids:
                raise bad_request(f"No tool call found for function call output with call_id {clip(call_id)}.",
                                  f"{where}.call_id")
            if call_id in answered:  # (as the chat path refuses a second tool message, OpenAI's rule)
                raise bad_request(f"Duplicate value for 'call_id' of {echo(call_id)}: {answered[call_id]} answers this "
                                  "call already; one function_call_output answers a call, leave the second out",
                                  f"{where}.call_id")
            answered[call_id] = f"input[{i}]"
            waiting.pop(call_id, None)
            if item.get("output") == []:  # (as a message's content []: OpenAI's rule, an array of at least one part)
                raise empty_content(f"{where}.output", "input_text part")
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(item.get("output"), f"{where}.output")})
            origins.append(Origin(where, kind=ItemKind.TOOL_OUTPUT))
        elif kind != "reasoning":
            raise unsupported_field(f"{where}.type", f"{_WHAT} (input items: {_ITEMS}; not {echo(kind)})")
    if waiting:
        raise _no_output(waiting)
    return out, origins


_STORED = "the stored conversation (previous_response_id)"


def _no_output(waiting: dict[str, str]) -> APIError:
    """400 for the first of the calls ``waiting`` (a call's id -> its ``function_call`` item's field,
    ``input.1``, or ``input`` for a call of the stored response) that no ``function_call_output`` answers
    before the next message item or turn, or before the input ends, in OpenAI's words ("No tool output
    found for function call ..."), naming the call's item."""
    call_id, field = next(iter(waiting.items()))
    item = _STORED if field == "input" else field.replace("input.", "input[") + "]"
    return bad_request(f"No tool output found for function call {clip(call_id)}. Each function_call ({item}) needs "
                       "a function_call_output item with its call_id after it, before the next message; send the "
                       "call's output, or leave the call out", field)


def _call_id(item: dict, where: str) -> str:
    """The ``call_id`` of a ``function_call`` or ``function_call_output`` item: 400 naming it when it
    is no string or empty (an output names its call by it; the chat path's rule, :class:`protocol.chat.Answers`,
    would refuse it later in a chat message's words)."""
    call_id = string_field(item, "call_id", where)
    if not call_id:
        raise bad_request(f"{where}.call_id must not be empty: a function_call_output names the "
                          "function_call it answers by its call_id", f"{where}.call_id")
    return call_id


_ITEMS = "message, function_call, function_call_output, reasoning"
"""The input items the Responses API takes here, in words."""

_STATUS = ("in_progress", "completed", "incomplete")
_STRING = ("a string", lambda v: type(v) is str)
_OBJECT = ("an object", lambda v: isinstance(v, dict))
_ARRAY = ("an array", lambda v: type(v) is list)

_ITEM_KEYS = {
    "message": (("type", "role", "content"), {"id": _STRING, "status": _STATUS, "phase": ("commentary", "final_answer")}),
    "function_call": (("type", "call_id", "name", "arguments"),
                      {"id": _STRING, "status": _STATUS, "caller": _OBJECT, "namespace": _STRING}),
    "function_call_output": (("type", "call_id", "output"), {"id": _STRING, "status": _STATUS, "caller": _OBJECT,
                                                             "name": _STRING, "namespace": _STRING}),
    "reasoning": (("type",), {"id": _STRING, "status": _STATUS, "summary": _ARRAY, "content": _ARRAY,
                              "encrypted_content": _STRING}),
}
_PART_KEYS = {"input_text": (("type", "text"), {"prompt_cache_breakpoint": _OBJECT}),
              "output_text": (("type", "text"), {"annotations": _ARRAY, "logprobs": _ARRAY}),
              "text": (("type", "text"), {})}
"""The keys of each input item and content part the Responses API takes here (the ``openai`` SDK's
``EasyInputMessageParam``, ``ResponseInputParam.Message``, ``ResponseOutputMessageParam``,
``ResponseFunctionToolCallParam``, ``FunctionCallOutput``, ``ResponseReasoningItemParam``,
``ResponseInputTextParam``, ``ResponseOutputTextParam``): the keys used, and those checked as OpenAI
types them and not used (an enum's values, or a JSON kind; null taken as absent) -- ids and statuses
a replayed output carries, a message's ``phase``, a call's ``caller`` and ``namespace``, a reasoning
item's content (left out of the chat), a part's annotations, logprobs and cache breakpoint. Another key
is a 400, as OpenAI's own (``Unknown parameter: 'input[0].foo'.``), never taken silently: a chat
message's ``tool_calls`` on an assistant item dropped its calls, a ``content`` for an output's
``output`` refused in other words."""


def _check_keys(obj: dict, where: str, keys: tuple[tuple[str, ...], dict]) -> None:
    """400 naming ``where.<key>`` for a key of ``obj`` (an input item or content part) that is not one
    of ``keys`` (:data:`_ITEM_KEYS`' used keys, then the unused ones and their types), in OpenAI's words:
    ``Unknown parameter``, ``Invalid type for ...``, ``Invalid value: ...``."""
    used, unused = keys
    for key, value in obj.items():
        if key in unused and value is not None:
            kind = unused[key]
            if not callable(kind[1]):  # (an enum's values)
                _one_of(value, kind, f"{where}.{key}")
            elif not kind[1](value):
                raise bad_request(f"Invalid type for '{where}.{key}': expected {kind[0]}, but got {value_kind(value)} "
                                  "instead.", f"{where}.{key}", "invalid_type")
        elif key not in used and key not in unused:
            raise _unknown(where, key, ", ".join((*used, *unused)))


def _text(content: Any, where: str) -> str:
    """A content string, or the text of its ``input_text`` / ``output_text`` parts, joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of input_text parts", where)
    texts = []
    for j, part in enumerate(content):
        kind = entry_type(part, f"{where}.{j}", "a content part", "input_text or output_text")
        if kind not in ("input_text", "output_text", "text"):
            raise unsupported_field(f"{where}.{j}.type", f"{_WHAT} (text parts only, not {echo(kind)})")
        _check_keys(part, f"{where}.{j}", _PART_KEYS[kind])
        if not isinstance(part.get("text"), str):
            raise bad_request("a text part needs a string 'text'", f"{where}.{j}.text")
        texts.append(part["text"])
    return "".join(texts)


_TOOL_KEYS = frozenset({"type", "name", "description", "parameters", "strict"})
"""The keys of the Responses API's function tool (``FunctionToolParam``) that the chat path takes."""

_UNUSED_TOOL_KEYS = {
    "defer_loading": (lambda v: type(v) is bool, "true or false"),
    "allowed_callers": (lambda v: v is None or type(v) is list and all(type(c) is str for c in v),
                        "a list of strings or null"),
    "output_schema": (lambda v: v is None or isinstance(v, dict), "a JSON schema (an object) or null"),
    "async": (lambda v: type(v) is bool, "true or false"),
}
"""The other keys of the Responses API's ``FunctionToolParam`` (the ``openai`` SDK's), which change nothing
here: a deferred tool is rendered as any other (no tool search here), callers and the output's schema
are not shown to the model, and every call's output is awaited as the next request's input. Checked as
typed, not used."""


def _tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses function tools as chat's: the keys the chat path takes kept for its checks to name, a
    null ``description``, ``parameters`` or ``strict`` as absent (OpenAI's types allow null: no
    description, a function of no parameters, the default), the others checked and left out
    (:func:`~gateway.translation.vendor_tool`; an unknown one refused)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if entry_type(tool, f"tools.{i}", "a tool", "function tools") != "function":
            raise unsupported_field(f"tools.{i}.type", f"{_WHAT} (function tools only; built-in tools such as "
                                    f"{echo(tool.get('type'))} need OpenAI's servers)")
        tool = vendor_tool(tool, f"tools.{i}", _TOOL_KEYS, _UNUSED_TOOL_KEYS)
        out.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type" and v is not None}})
    return out


def _tool_choice(choice: str | dict | None) -> str | dict | None:
    """``tool_choice`` as chat's: a function's, ``{"type": "function", "name"}``, named by its ``name``
    (missing: OpenAI's 400 "Missing required parameter: 'tool_choice.name'"; not a string: a 400 naming
    it); another type (a built-in tool's, ``allowed_tools``, ...) is not served here."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function":
        raise unsupported_field("tool_choice", f"{_WHAT} (tool_choice none, auto, required or "
                                "{\"type\": \"function\", \"name\": ...})")
    if choice.get("name") is None:
        raise missing_parameter("tool_choice.name", None)
    if not isinstance(choice["name"], str):
        raise bad_request(f"Invalid type for 'tool_choice.name': expected a string, but got {value_kind(choice['name'])} "
                          "instead.", "tool_choice.name", "invalid_type")
    return {"type": "function", "function": {"name": choice["name"]}}


_FORMAT_KEYS = {"text": ("type",), "json_object": ("type",),
                "json_schema": ("type", "name", "schema", "strict", "description")}
"""The keys of ``text.format`` by its type (OpenAI's ``ResponseFormatTextConfig``)."""


def _response_format(text: dict | None) -> dict | None:
    if text is None:
        return None
    extra = sorted(set(text) - {"format", "verbosity"})
    if extra:
        raise _unknown("text", extra[0], "format and verbosity")
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
        raise bad_request("text.format must be {\"type\": \"text\"}, {\"type\": \"json_object\"} or "
                          "{\"type\": \"json_schema\", \"name\", \"schema\", \"strict\"}", "text.format")
    keys = _FORMAT_KEYS[fmt["type"]]
    unknown = sorted(set(fmt) - set(keys))
    if unknown:  # (here, in this route's words: the chat path's would say what response_format takes)
        raise _unknown("text.format", unknown[0], f"{', '.join(keys[:-1])} and {keys[-1]}" if len(keys) > 1
                       else f"type alone with type {fmt['type']}")
    if fmt["type"] != "json_schema":
        return {**fmt}
    if fmt.get("schema") is None:  # (OpenAI's text.format requires it, where chat's response_format does not)
        raise (missing_parameter("text.format.schema", None) if "schema" not in fmt else
               bad_request("Invalid type for 'text.format.schema': expected an object (a JSON schema), but got null "
                           "instead.", "text.format.schema", "invalid_type"))
    return {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}



INCLUDABLES = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
               "message.input_image.image_url", "computer_call_output.output.image_url",
               "code_interpreter_call.outputs", "reasoning.encrypted_content", "message.output_text.logprobs")
"""The values of ``include`` OpenAI takes (its API's ``ResponseIncludable``; the openai SDK's)."""

REASONING_KEYS = {"effort": None, "summary": ("auto", "concise", "detailed"),
                  "generate_summary": ("auto", "concise", "detailed"), "context": ("auto", "current_turn", "all_turns"),
                  "mode": None}
"""The keys of ``reasoning`` OpenAI takes (its ``Reasoning`` object) and the values of each one that
is an enum (``effort`` is the chat path's ``reasoning_effort``, checked there; ``mode`` any string)."""


def check_unused(body: ResponsesRequest) -> None:
    """400 naming the field for a value of the fields taken and not used that OpenAI would refuse:
    ``include`` (each one of :data:`INCLUDABLES`), ``text.verbosity`` (:data:`VERBOSITIES`),
    ``prompt_cache_retention`` (:data:`PROMPT_CACHE_RETENTIONS`), ``reasoning`` (:data:`REASONING_KEYS`),
    ``stream_options`` (``include_obfuscation``, a bool).
    Each value, a wrong type included, in OpenAI's words: ``Invalid value: 'x'. Supported values are: ...``,
    ``Invalid type for 'reasoning.mode': expected a string, but got a number instead.`` (the value's kind
    in JSON's words, :func:`gateway.json_body.value_kind`, never Python's type name)."""
    for i, value in enumerate(body.include or ()):
        _one_of(value, INCLUDABLES, f"include.{i}")
    _one_of((body.text or {}).get("verbosity"), VERBOSITIES, "text.verbosity")
    _one_of(body.prompt_cache_retention, PROMPT_CACHE_RETENTIONS, "prompt_cache_retention")
    if body.reasoning is not None:
        extra = sorted(set(body.reasoning) - set(REASONING_KEYS))
        if extra:
            raise _unknown("reasoning", extra[0], ", ".join(REASONING_KEYS))
        for key, values in REASONING_KEYS.items():
            if values is not None:
                _one_of(body.reasoning.get(key), values, f"reasoning.{key}")
        mode = body.reasoning.get("mode")
        if mode is not None and type(mode) is not str:
            raise bad_request(f"Invalid type for 'reasoning.mode': expected a string, but got {value_kind(mode)} "
                              "instead.", "reasoning.mode", "invalid_type")
    if body.stream_options is not None:
        extra = sorted(set(body.stream_options) - {"include_obfuscation"})
        if extra:
            raise _unknown("stream_options", extra[0], "include_obfuscation")
        obfuscation = body.stream_options.get("include_obfuscation")
        if obfuscation is not None and type(obfuscation) is not bool:
            raise bad_request("Invalid type for 'stream_options.include_obfuscation': expected a boolean, but got "
                              f"{value_kind(obfuscation)} instead.", "stream_options.include_obfuscation",
                              "invalid_type")


def _unknown(where: str, key: str, takes: str) -> APIError:
    """400 ``unknown_parameter`` for the key ``key`` of the object ``where``, which takes ``takes``, in
    OpenAI's Responses words (``Unknown parameter: 'text.foo' (text takes format and verbosity)``), the
    key clipped in the message and ``param`` as every echo of the client's text."""
    field = f"{where}.{clip(key)}"
    return bad_request(f"Unknown parameter: '{field}' ({where} takes {takes})", field, "unknown_parameter")


def _one_of(value: Any, values: tuple[str, ...], field: str) -> None:
    """400 naming ``field`` unless ``value`` is null (absent) or one of ``values``, in OpenAI's words
    (:func:`gateway.schemas.not_one_of`, the chat body's too)."""
    message = not_one_of(value, values)
    if message is not None:
        raise bad_request(message, field)


class ResponsesTranslation:
    """One ``/v1/responses`` request on the chat path (:class:`gateway.translation.Translation`)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self.body: ResponsesRequest | None = None
        self.history: list[dict] = []  # the conversation before this response's output, without instructions
        self.origins: list[Origin] = []  # the items of each message of history (gateway.origins)
        self.id = new_id("resp", "_")
        self.run: Running | None = None  # (its handle in the store while it runs; none for store: false)
        self.on_chat_path = False  # the body became a chat request: errors name chat fields from here on
        self.created_at = int(time.time())

    def resolved(self, model: str) -> None:
        self.body.model = model

    def chat_body(self, raw: bytes) -> ChatCompletionRequest:
        try:
            body = self.body = parse_body(ResponsesRequest, raw)
        except APIError as e:  # (chat's messages here: unknown to this schema, yet the input misplaced)
            if e.code == "unknown_parameter" and e.param in INPUT_FIELDS:
                sent = json.loads(raw)  # (it parsed: pydantic refused a field, not the JSON)
                if misplaced_input("input", sent) is not None:
                    raise missing_parameter("input", sent) from None
            raise
        if body.input is None and misplaced_input("input", {"prompt": body.prompt}) is not None:
            raise missing_parameter("input", {"prompt": body.prompt})  # (a completions prompt, before its refusal)
        name = body.unsupported()
        if name is not None:
            raise unsupported_field(name, _WHAT)
        check_unused(body)
        if body.previous_response_id is not None:
            previous = self.store.get(body.previous_response_id)
            if previous is None and self.store.running(body.previous_response_id) is not None:
                raise bad_request(f"Previous response with id '{clip(body.previous_response_id)}' is still in "
                                  "progress: continue from it once it has completed (GET /v1/responses/{id} says "
                                  "its status)", "previous_response_id", "previous_response_in_progress")
            if previous is None:
                raise bad_request(f"Previous response with id '{clip(body.previous_response_id)}' not found (never "
                                  "stored, deleted, or dropped from the gateway's in-memory store)",
                                  "previous_response_id", "previous_response_not_found")
            self.history = list(previous.messages)
            self.origins = list(previous.origins)
        logprobs = self._logprobs(body)
        if body.max_output_tokens is not None and body.max_output_tokens < 1:
            raise bad_request(f"max_output_tokens must be >= 1, got {echo(body.max_output_tokens)}", "max_output_tokens")
        if body.input is None:
            raise missing_parameter("input", None)
        messages, origins = input_items(body.input, self.history)
        self.history += messages
        self.origins += origins
        system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        fields = {
            "model": body.model, "messages": system + self.history, "max_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": _tools(body.tools),
            "tool_choice": _tool_choice(body.tool_choice), "parallel_tool_calls": body.parallel_tool_calls,
            "response_format": _response_format(body.text), "stream": body.stream,
            "reasoning_effort": body.reasoning.get("effort") if isinstance(body.reasoning, dict) else None,
            "stream_options": {"include_usage": True} if body.stream else None, **logprobs}
        try:
            chat = chat_request(fields, ())  # (renamed here: a message's field as its item's)
        except APIError as e:
            raise self._renamed(e) from None
        self.on_chat_path = True
        if body.store is not False:  # (GET answers it in progress; a DELETE meanwhile keeps it from the store)
            self.run = self.store.begin(self.id, self._response("in_progress", []))
        return chat

    @staticmethod
    def _logprobs(body: ResponsesRequest) -> dict:
        """The chat request's logprobs fields: with ``include: ["message.output_text.logprobs"]``,
        ``logprobs: true`` and ``top_logprobs`` (0 when absent); else none (``top_logprobs`` alone is
        echoed and asks nothing, as OpenAI answers it: ``logprobs: []``). 400 naming ``top_logprobs``
        outside [0, 20] (OpenAI's bound), and naming ``include`` beside tools (a tool call's tokens are
        the model's text too: which are the message's cannot be told apart)."""
        top = body.top_logprobs
        if top is not None and not 0 <= top <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be an integer in [0, {MAX_LOGPROBS}], got {echo(top)}", "top_logprobs")
        if "message.output_text.logprobs" not in (body.include or ()):
            return {}
        if body.tools and body.tool_choice != "none":
            where = f"include.{body.include.index('message.output_text.logprobs')}"
            raise unsupported_field(where, f"{_WHAT} with tools (message.output_text.logprobs is served for "
                                    "answers without tools, or with tool_choice none)")
        return {"logprobs": True, "top_logprobs": top or 0}

    def check_reasoning(self, parser: str | None) -> None:
        """400 naming ``include`` for ``message.output_text.logprobs`` where the model's thinking is split
        off the answer (the thinking's tokens and the message's are one text), as OpenAI's reasoning
        models refuse logprobs."""
        include = self.body.include or ()
        if parser is not None and "message.output_text.logprobs" in include:
            raise unsupported_field(f"include.{include.index('message.output_text.logprobs')}",
                                    f"{_WHAT} for a model that thinks (reasoning parser {parser}: message."
                                    "output_text.logprobs is served where no thinking is split off)")

    def answer(self, completion: dict) -> Response:
        items = OutputItems()
        for piece in completion_pieces(completion):
            items.feed(piece)
        reason = completion["choices"][0]["finish_reason"]
        return json_response(self._finish(items, reason, completion["usage"]))

    async def events(self, chunks):
        numbers = itertools.count()

        def event(kind: str, **fields) -> bytes:
            data = {"type": kind, "sequence_number": next(numbers), **fields}
            return b"event: " + kind.encode() + b"\ndata: " + to_json(data) + b"\n\n"

        def taken() -> list[bytes]:
            return [event(e.pop("type"), **e) for e in items.take()]

        items, reason, usage, failure = OutputItems(), None, None, None
        yield event("response.created", response=self._response("in_progress", []))
        yield event("response.in_progress", response=self._response("in_progress", []))
        try:
            async for chunk in chunks:  # (read to its end: the chat stream records the call as it ends)
                if isinstance(chunk, APIError):
                    failure = chunk
                elif chunk is not STREAM_END:
                    for piece in chunk_pieces(chunk):
                        items.feed(piece)
                    for e in taken():
                        yield e
                    reason = next((c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]), reason)
                    usage = chunk.get("usage") or usage
        finally:
            if failure is not None or reason is None:  # failed, or its client went away: nothing to store
                self.abandon()
        if failure is not None:
            items.close("incomplete")
            for e in taken():
                yield e
            response = self._response("failed", items.items)
            response["error"] = {"code": _failed_code(failure.status), "message": failure.message}
            yield event("response.failed", response=response)
            return
        response = self._finish(items, reason, usage)
        for e in taken():
            yield e
        yield event("response.completed" if response["status"] == "completed" else "response.incomplete",
                    response=response)

    def abandon(self) -> None:
        """This response ended without an answer to store (it failed, or its client went away): no
        longer running. A no-op for one not running (``store: false``, refused before it began)."""
        if self.run is not None:
            self.store.end(self.run, None)

    def error(self, e: APIError) -> Response:
        self.abandon()
        if self.on_chat_path:
            self._renamed(e)
        return error_response(e)

    def _renamed(self, e: APIError) -> APIError:
        """``e``, an error of the chat path, naming the Responses field: a chat message's field as
        the item it came from (:func:`~gateway.origins.renamed_to_items`), others by ``_PARAMS``; the chat
        fields its message names elsewhere by ``_WORDS`` (was: "prompt (60 tokens) + max_tokens (8) = 68
        exceeds ..." for ``max_output_tokens: 8``)."""
        first = [Origin("instructions", kind=ItemKind.INSTRUCTIONS)] if self.body.instructions is not None else []
        if not renamed_to_items(e, first + self.origins):
            renamed_error(e, _PARAMS)
        return reworded(e, _WORDS)

    def _finish(self, items: OutputItems, reason: str | None, usage: dict | None) -> dict:
        """The whole response, once the chat answer ended with ``reason``; stored unless ``store: false``."""
        cut = reason == "length"
        items.close("incomplete" if cut else "completed")
        response = self._response("incomplete" if cut else "completed", items.items, usage)
        if cut:
            response["incomplete_details"] = {"reason": "max_output_tokens"}
        if self.run is not None:  # (unless deleted while it ran)
            origins = [o if o.response is not None else replace(o, response=self.id) for o in self.origins]
            self.store.end(self.run, StoredResponse(response, tuple(self.history + _assistant(items.items)),
                                                    tuple(origins + [_output_origin(items.items, self.id)])))
        return response

    def _response(self, status: str, output: list[dict], usage: dict | None = None) -> dict:
        body = self.body
        fmt = (body.text or {}).get("format") or {"type": "text"}
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": None, "incomplete_details": None, "instructions": body.instructions,
                "max_output_tokens": body.max_output_tokens, "model": body.model, "output": list(output),
                "parallel_tool_calls": body.parallel_tool_calls is not False,
                "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
                "store": body.store is not False, "temperature": body.temperature, "text": {"format": fmt},
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [], "top_p": body.top_p,
                "top_logprobs": body.top_logprobs,
                "truncation": "disabled", "usage": response_usage(usage), "user": body.user,
                "metadata": body.metadata or {}}


def _failed_code(status: int) -> str:
    """A failed response's ``error.code``: OpenAI's codes for it are few (``ResponseError.code``):
    ``rate_limit_exceeded`` (429), ``invalid_prompt`` (another 4xx, e.g. the context is exceeded),
    ``server_error``."""
    return "rate_limit_exceeded" if status == 429 else "invalid_prompt" if status < 500 else "server_error"


def _assistant(items: list[dict]) -> list[dict]:
    """A response's output items as the chat message that continues the conversation (reasoning left out)."""
    text = "".join(p["text"] for item in items if item["type"] == "message" for p in item["content"])
    calls = [{"id": item["call_id"], "type": "function", "function": {"name": item["name"],
                                                                      "arguments": item["arguments"]}}
             for item in items if item["type"] == "function_call"]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


def _output_origin(items: list[dict], response_id: str) -> Origin:
    """The output items the message of :func:`_assistant` was made of: its text's (the first message
    item; else the first item, or ``output`` for none), its calls'."""
    kinds = [item["type"] for item in items]
    text = f"output.{kinds.index('message')}" if "message" in kinds else "output.0" if items else "output"
    return Origin(text, tuple(f"output.{k}" for k, kind in enumerate(kinds) if kind == "function_call"),
                  response=response_id)


class ResponsesEndpoints:
    """The ``/v1/responses`` handlers over the gateway's chat path (``generate``) and its store."""

    def __init__(self, generate, store: ResponseStore) -> None:
        self.generate = generate
        self.store = store

    async def create(self, request: Request) -> Response:
        tr = ResponsesTranslation(self.store)
        response = await self.generate.translated(request, tr)
        if response.status_code == 499:  # (its client went away before the answer: nothing will be stored)
            tr.abandon()
        return response

    async def retrieve(self, request: Request) -> Response:
        """The stored response, or one being generated as ``status: "in_progress"`` (OpenAI's); else 404."""
        response_id = request.path_params["response_id"]
        stored = self.store.get(response_id)
        if stored is not None:
            return json_response(stored.response)
        running = self.store.running(response_id)
        return _not_found(response_id) if running is None else json_response(running)

    async def delete(self, request: Request) -> Response:
        response_id = request.path_params["response_id"]
        if not self.store.delete(response_id):
            return _not_found(response_id)
        return json_response({"id": response_id, "object": "response.deleted", "deleted": True})


def _not_found(response_id: str) -> Response:
    return error_response(APIError(404, f"Response with id '{clip(response_id)}' not found (never stored, deleted, "
                                        "or dropped from the gateway's in-memory store)", code="response_not_found"))
