"""``POST /v1/messages`` and ``POST /v1/messages/count_tokens``: Anthropic's Messages API as a
translation onto the chat path (:mod:`gateway.translation`).

Fields from Anthropic's API reference ("Messages" > "Create a Message", "Count Message tokens"):

=========================== ==================================================================
Messages field              on the chat path
=========================== ==================================================================
``system``                  a ``system`` message first (a string, or ``text`` blocks joined;
                            ``[]``: none, as absent)
``messages``                ``user`` / ``assistant`` messages (and ``system`` ones, the SDK's
                            ``SystemMessageParam``: a string or ``text`` blocks, in place);
                            content a string or blocks:
                            ``text`` (joined; empty text is a 400 wherever a block is, in
                            Anthropic's words), an assistant's ``tool_use`` (its ``tool_calls``,
                            ``input`` as the JSON text of the arguments), a user's
                            ``tool_result`` (a ``tool`` message before the user's text, its
                            ``content`` a string or ``text`` blocks, none or ``[]`` taken as
                            Anthropic takes them; its ``tool_use_id`` that
                            of an earlier ``tool_use``, one result a call; a
                            ``tool_use`` id is used once; each ``tool_use`` is
                            answered in the next message); an assistant's
                            ``thinking`` / ``redacted_thinking`` blocks are left out; empty
                            content (``""``, ``[]``) only in a final assistant message, which
                            the answer continues (Anthropic's prefill: ``continue_final_message``;
                            the answer's content is the new text; a final text ending in
                            whitespace and a final ``tool_use`` are Anthropic's 400s)
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
                            of ``OUTPUT_EFFORTS``, or null) checked, not used; another key
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

Checked as Anthropic checks them (a wrong type or value is a 400 naming the field, in the words
of Anthropic's 400s: :mod:`gateway.messages_body`), then not used: ``metadata``,
``output_config.effort``, ``thinking`` (``budget_tokens`` an int of at least 1024 and below
``max_tokens``; the model thinks as its chat template says, ``--reasoning-parser`` splits it into
``thinking`` blocks), ``service_tier``, ``speed``, ``cache_control`` (top-level, on blocks and
tools), a ``tool_result``'s ``is_error`` (a boolean; its content is shown as any result's), an
assistant's ``thinking`` and ``redacted_thinking`` blocks (``thinking`` and ``signature``, ``data``:
strings, required). Accepted and not used: ``inference_geo`` (a string). A ``tool_use`` block needs
its ``input``. A key of a message or block that Anthropic's type has not is a 400, as Anthropic's own
(``messages.0.name: Extra inputs are not permitted``: :data:`_KEYS`). Refused with a 400 naming the field: ``container``,
``mcp_servers``, ``context_management``, image and document blocks, server tools.

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
from typing import Any

from pydantic_core import to_json
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import APIError, bad_request, entry_type, reworded
from gateway.messages_body import CountTokensRequest, MessagesRequest, cache_control_error, json_shown
from gateway.messages_output import ContentBlocks, stop_reason
from gateway.origins import Api, ItemKind, Origin, renamed_to_items
from gateway.responses import STREAM_END, json_response, new_id
from gateway.schemas import ChatCompletionRequest, TokenizeRequest
from gateway.structured import structured_option
from gateway.tools import is_tool_name
from gateway.translation import chat_request, check_keys, chunk_pieces, completion_pieces, parse_body, renamed_error, \
    string_field, unsupported_field, vendor_tool
from protocol.request import MAX_MESSAGE_NAME_CHARS
from protocol.validation import clip, echo

__all__ = ["CountTokensRequest", "MessagesEndpoints", "MessagesRequest", "chat_items", "chat_messages",
           "renamed_to_messages"]

_WHAT = "/v1/messages"


# chat fields -> Messages fields, for the chat path's errors (a chat message's index is not a Messages
# message's -- the system prompt, tool results split off -- nor are its keys: a message's field is its
# message's or block's, gateway.origins; what names no message's is "messages")
_PARAMS = ((r"messages(\..*)?", "messages"), (r"stop", "stop_sequences"),
           (r"response_format(\.json_schema)?(\.schema)?", "output_config.format.schema"),
           (r"tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"), (r"tools\.(\d+)\.function", r"tools.\1"),
           (r"parallel_tool_calls", "tool_choice.disable_parallel_tool_use"))
_WORDS = ((r"stop\[(\d+)\]", r"stop_sequences[\1]"), (r"response_format\.json_schema\.schema", "output_config.format.schema"),
          (r"response_format(\.json_schema)?", "output_config.format"),
          (r"tools\.(\d+)\.function\.parameters", r"tools.\1.input_schema"), (r"tools\.(\d+)\.function", r"tools.\1"),
          (r"parallel_tool_calls", "tool_choice.disable_parallel_tool_use"))
"""Chat fields -> Messages fields wherever an error's message names them (:func:`gateway.errors.reworded`):
a stop string's index is its own (``stop_sequences`` is the chat request's ``stop``, in order)."""


def chat_messages(system: str | list[dict] | None, messages: list[dict]) -> list[dict]:
    """The chat messages of ``system`` and ``messages`` (see the module's table); 400 naming the
    field for a block it does not take, for a message with empty content (``""`` or ``[]``) other than
    a final assistant message (Anthropic's rule: an empty turn), for a ``tool_result`` whose
    ``tool_use_id`` is the id of no ``tool_use`` block before it (Anthropic refuses it: a result must
    answer a call), for a ``tool_use`` block whose id an earlier one has, and for a second
    ``tool_result`` of one call (Anthropic refuses both, in these words: "`tool_use` ids must be
    unique", "each tool_use must have a single result"), and for a message whose ``tool_use`` blocks
    the next message does not each answer with a ``tool_result`` (or that ends the conversation),
    naming that message in Anthropic's words ("`tool_use` ids were found without `tool_result`
    blocks immediately after")."""
    return chat_items(system, messages)[0]


def chat_items(system: str | list[dict] | None, messages: list[dict]) -> tuple[list[dict], list[Origin]]:
    """:func:`chat_messages`, and what each chat message was made of (one :class:`Origin` a message:
    ``system``, a message, a ``tool_result`` block; an assistant message's calls its ``tool_use`` blocks)."""
    out: list[dict] = []
    origins: list[Origin] = []
    call_ids: set[str] = set()  # the ids of the tool_use blocks so far
    answered: set[str] = set()  # the tool_use_ids of the tool_result blocks so far
    waiting: list[str] = []  # the ids of the previous message's tool_use blocks (the next one answers them)
    if system is not None and system != []:  # ([]: no system prompt, as Anthropic takes it; clients send it)
        out.append({"role": "system", "content": _text(system, "system")})
        origins.append(Origin("system", kind=ItemKind.INSTRUCTIONS))
    for i, m in enumerate(messages):
        where = f"messages.{i}"
        _check_keys(m, where, "message")
        role, content = m.get("role"), m.get("content")
        if role not in ("user", "assistant", "system"):
            raise bad_request("a message's role must be user, assistant or system", f"{where}.role")
        if content in ("", []) and not (role == "assistant" and i == len(messages) - 1):  # (Anthropic's words)
            raise bad_request("all messages must have non-empty content except for the optional final assistant "
                              "message; send a string or at least one block, or leave the message out",
                              f"{where}.content")
        final = role == "assistant" and i == len(messages) - 1  # (a prefill: the answer continues it)
        if role == "system":  # (the SDK's SystemMessageParam: a string or text blocks, a system message in place)
            if waiting:
                raise _unanswered(waiting, f"messages.{i - 1}")
            out.append({"role": "system", "content": _text(content, f"{where}.content")})
            origins.append(Origin(where))
            continue
        if isinstance(content, str):
            if waiting:  # (a string answers no call)
                raise _unanswered(waiting, f"messages.{i - 1}")
            if final:
                _check_prefill(content, f"{where}.content")
            out.append({"role": role, "content": content})
            origins.append(Origin(where))
            continue
        if not isinstance(content, list):
            raise bad_request("content must be a string or a list of content blocks", f"{where}.content")
        texts, calls, results, uses, answers = [], [], [], [], []  # (uses, answers: the blocks of calls, results)
        last_text = f"{where}.content"  # (the field of the message's text's end)
        allowed = "text, tool_use, thinking" if role == "assistant" else "text, tool_result"
        for j, block in enumerate(content):
            at = f"{where}.content.{j}"
            kind = entry_type(block, at, "a content block", f"{role} content blocks: {allowed}")
            if kind == "text":
                texts.append(_text_block(block, at))
                last_text = f"{at}.text"
            elif kind == "tool_use" and role == "assistant":
                calls.append(_tool_use(block, at))
                if calls[-1]["id"] in call_ids:  # (Anthropic's rule and words: a result names its call by id)
                    raise bad_request(f"`tool_use` ids must be unique: {clip(calls[-1]['id'])} is the id of an "
                                      "earlier tool_use block; give each call its own id", at)
                call_ids.add(calls[-1]["id"])
                uses.append(at)
            elif kind == "tool_result" and role == "user":
                results.append(_tool_result(block, at, call_ids))
                if results[-1]["tool_call_id"] in answered:  # (Anthropic's rule and words)
                    raise bad_request(f"each tool_use must have a single result: {clip(results[-1]['tool_call_id'])} "
                                      "is answered by an earlier tool_result block; send one result per call",
                                      f"{at}.tool_use_id")
                answered.add(results[-1]["tool_call_id"])
                answers.append(Origin(at, kind=ItemKind.TOOL_RESULT))
            elif kind in ("thinking", "redacted_thinking") and role == "assistant":
                _check_keys(block, at, kind)
                _check_fields(block, at, _THINKING[kind])  # (left out of the chat: checked, not used)
            else:
                raise unsupported_field(f"{at}.type", f"{_WHAT} ({role} content blocks: {allowed}; not {echo(kind)})")
        if waiting:  # (the previous message's calls: each answered by a tool_result of this one)
            missing = [c for c in waiting if c not in {r["tool_call_id"] for r in results}]
            if missing:
                raise _unanswered(missing, f"messages.{i - 1}")
        waiting = [c["id"] for c in calls]
        if final:
            if calls:  # (a continued message ends at its text: a template writes the calls after it)
                raise _unanswered(waiting, where)
            _check_prefill("".join(texts), last_text)
        out += results
        origins += answers
        if texts or calls or not results:
            out.append({"role": role, "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
            origins.append(Origin(where, tuple(uses)))
    return out, origins


def _unanswered(ids: list[str], where: str) -> APIError:
    """400 naming ``where`` (the message whose ``tool_use`` blocks ``ids`` the next message does not
    answer, or that ends the conversation), in Anthropic's words."""
    return bad_request(f"`tool_use` ids were found without `tool_result` blocks immediately after: "
                       f"{clip(', '.join(ids))}. Each `tool_use` block must have a corresponding `tool_result` block "
                       "in the next message; send the results in a user message right after this one", where)


def _check_prefill(text: str, field: str) -> None:
    """400 naming ``field`` (the final assistant message's content, or its last text block's text)
    when ``text``, the message the answer continues, ends with whitespace: Anthropic refuses it, in
    these words ("final assistant content cannot end with trailing whitespace")."""
    if text != text.rstrip():
        raise bad_request("final assistant content cannot end with trailing whitespace; end the prefill at its "
                          "last word (the model writes the space or line break that follows)", field)


def is_prefill(messages: list[dict]) -> bool:
    """Whether ``messages`` (a Messages body's) end with an assistant message: the answer continues it."""
    return bool(messages) and isinstance(messages[-1], dict) and messages[-1].get("role") == "assistant"


def _text(content: Any, where: str) -> str:
    """A string, or the text of ``text`` blocks (:func:`_text_block`, ``where.N``), joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text blocks", where)
    return "".join(_text_block(block, f"{where}.{j}") for j, block in enumerate(content))


def _text_block(block: Any, at: str) -> str:
    """The text of the ``text`` block ``block`` (the field ``at``): 400 for another block (or no block:
    :func:`~gateway.errors.entry_type`), for text
    that is no string, or empty (Anthropic's rule and words: "text content blocks must be
    non-empty", wherever the block is: a message, ``system``, a ``tool_result``'s content), or
    for a ``cache_control`` Anthropic would refuse."""
    kind = entry_type(block, at, "a content block", "text blocks only here")
    if kind != "text":
        raise unsupported_field(f"{at}.type", f"{_WHAT} (text blocks only here, not {echo(kind)})")
    _check_keys(block, at, "text")
    text = block.get("text")
    if not isinstance(text, str):
        raise bad_request(f"a text block's text must be a string; got {json_shown(text)}", f"{at}.text")
    if not text:
        raise bad_request("text content blocks must be non-empty; write the text, or leave the block out",
                          f"{at}.text")
    _check_cache_control(block, at)
    return text


def _tool_use(block: dict, at: str) -> dict:
    """The chat tool call of the ``tool_use`` block ``block`` (the field ``at``); 400 naming its
    field, in the Messages API's words, for an id that is no string or empty, a name no tool can
    have, an ``input`` that is no object (JSON text in a string is not Anthropic's) or holds a
    number JSON cannot write back (``1e400``: infinity once read; ``NaN``, which the body's parser takes)."""
    _check_keys(block, at, "tool_use")
    call_id, name = string_field(block, "id", at), string_field(block, "name", at)
    if not call_id:
        raise bad_request("a tool_use block's id must not be empty: it is what its tool_result's tool_use_id "
                          "names", f"{at}.id")
    if not is_tool_name(name):
        raise bad_request(f"a tool_use block's name must be 1-64 letters, digits, '_' or '-', got {echo(name)}",
                          f"{at}.name")
    _check_fields(block, at, _TOOL_USE)
    arguments = block["input"]
    if not isinstance(arguments, dict):
        raise bad_request(f"{at}.input must be an object (the call's arguments)", f"{at}.input")
    try:
        arguments = json.dumps(arguments, allow_nan=False)
    except ValueError:
        raise bad_request("a number in this tool_use block's input is no JSON number: NaN, Infinity, or one past a "
                          "double's range (about 1.8e308: 1e400 reads as infinity); send it within range, or as a "
                          "string", f"{at}.input") from None
    _check_cache_control(block, at)
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def in_tool_use_input(body: object, path: tuple) -> bool:
    """Whether ``path`` (keys and indexes into the parsed ``body``) lies in a ``tool_use`` block's
    ``input``: :func:`_tool_use` refuses a number there that no double holds in the Messages API's
    words, naming the block's input (the body's own check, :func:`gateway.errors.nonfinite_number`,
    passes over it)."""
    if len(path) < 5 or path[0] != "messages" or path[2] != "content" or path[4] != "input":
        return False
    try:
        block = body["messages"][path[1]]["content"][path[3]]  # type: ignore[index]
    except (KeyError, IndexError, TypeError):
        return False
    return isinstance(block, dict) and block.get("type") == "tool_use"


def _tool_result(block: dict, at: str, call_ids: set[str]) -> dict:
    """The chat ``tool`` message of the ``tool_result`` block ``block`` (the field ``at``); 400 naming
    its field, in the Messages API's words, for a ``tool_use_id`` that is empty, longer than
    :data:`MAX_MESSAGE_NAME_CHARS` or the id of no ``tool_use`` block before it (``call_ids``: Anthropic
    refuses it), or content that is neither a string nor text blocks. No content, ``""`` and ``[]`` are
    taken: Anthropic's ``content`` is optional, with no least length (a tool may answer nothing)."""
    _check_keys(block, at, "tool_result")
    _check_fields(block, at, _TOOL_RESULT)
    use_id = string_field(block, "tool_use_id", at)
    if not use_id or len(use_id) > MAX_MESSAGE_NAME_CHARS:
        raise bad_request(f"a tool_result block's tool_use_id must be the id of the tool_use block it answers, 1 to "
                          f"{MAX_MESSAGE_NAME_CHARS} characters; got {len(use_id)}", f"{at}.tool_use_id")
    if use_id not in call_ids:
        raise bad_request(f"unexpected `tool_use_id` found in `tool_result` blocks: {clip(use_id)}. Each "
                          "`tool_result` block must answer a `tool_use` block of an earlier assistant "
                          "message", f"{at}.tool_use_id")
    _check_cache_control(block, at)
    return {"role": "tool", "tool_call_id": use_id, "content": _text(block.get("content", ""), f"{at}.content")}


_KEYS = {"message": ("role", "content"),
         "text": ("type", "text", "cache_control", "citations"),
         "tool_use": ("type", "id", "name", "input", "cache_control", "caller", "toolset_name"),
         "tool_result": ("type", "tool_use_id", "content", "is_error", "cache_control", "toolset_name"),
         "thinking": ("type", "thinking", "signature"),
         "redacted_thinking": ("type", "data")}
"""The keys of Anthropic's ``MessageParam`` and of each block it takes here (the ``anthropic`` SDK's
``TextBlockParam``, ``ToolUseBlockParam``, ``ToolResultBlockParam``, ``ThinkingBlockParam``,
``RedactedThinkingBlockParam``): another key is a 400, as Anthropic's own
(``messages.0.name: Extra inputs are not permitted``), never taken silently (a ``tool_result``'s
``contents`` for ``content`` was an empty result; an OpenAI-style ``name`` or ``tool_calls`` was lost)."""

_UNUSED_KEYS = {
    "citations": (lambda v: v is None or type(v) is list and all(isinstance(c, dict) for c in v),
                  "a list of citation objects or null"),
    "caller": (lambda v: v is None or isinstance(v, dict), 'an object ({"type": "direct"}, ...) or null'),
    "toolset_name": (lambda v: v is None or type(v) is str, "a string or null"),
}
"""The keys of those blocks that change nothing here, checked as the SDK types them: a text block's
``citations`` (a replayed answer's; the text is shown as is), a ``tool_use``'s ``caller`` (who called:
every call here is the model's) and ``toolset_name`` (a tool's family; the name is the tool's). Null is
taken for each: an answer's blocks dumped whole (``block.model_dump()``) carry them as null."""


def _check_keys(obj: dict, at: str, kind: str) -> None:
    """400 naming ``at.<key>`` for a key of ``obj`` (a message, or a block of type ``kind``) that
    Anthropic's type has not (:data:`_KEYS`), or one of :data:`_UNUSED_KEYS` of another type."""
    keys = _KEYS[kind]
    check_keys(obj, at, frozenset(keys) - set(_UNUSED_KEYS), {k: v for k, v in _UNUSED_KEYS.items() if k in keys},
               f"{', '.join(keys[:-1])} and {keys[-1]}")


_THINKING = {"thinking": {"thinking": (True, str, "a string"), "signature": (True, str, "a string")},
             "redacted_thinking": {"data": (True, str, "a string")}}
_TOOL_USE = {"input": (True, None, "an object (the call's arguments)")}
_TOOL_RESULT = {"is_error": (False, bool, "true or false")}
"""Fields of Anthropic's blocks (``ThinkingBlockParam``, ``RedactedThinkingBlockParam``, ``ToolUseBlockParam``,
``ToolResultBlockParam``) that the chat path takes without looking at them, or needs present: field ->
(required, type or None: any, the type in words), for :func:`_check_fields`."""


def _check_fields(block: dict, at: str, fields: dict[str, tuple[bool, type | None, str]]) -> None:
    """400 naming ``at.<field>`` in Anthropic's words for a required field of ``block`` that is missing
    ("Field required") or a field of another type than Anthropic's ("Input should be ..."): a thinking
    block's ``thinking`` and ``signature``, a redacted one's ``data`` (replayed, not shown to the
    model), a ``tool_use``'s ``input``, a ``tool_result``'s ``is_error`` (its content is shown as any
    result's). Null is a value of another type, not an absent field: none of these is nullable in
    Anthropic's types (the ``anthropic`` SDK's ``ToolResultBlockParam.is_error: bool``; its nullable
    fields are ``Optional``, as ``cache_control``), so an optional one is left out or given, never null."""
    for name, (required, kind, words) in fields.items():
        value = block.get(name)
        if name not in block:
            if required:
                raise bad_request(f"Field required: a {block['type']} block needs {name}, {words}", f"{at}.{name}",
                                  "missing_required_parameter")
            continue
        if kind is not None and type(value) is not kind:
            raise bad_request(f"Input should be {words}; got {json_shown(value)}", f"{at}.{name}", "invalid_type")


def _check_cache_control(block: dict, at: str) -> None:
    """400 naming ``at.cache_control`` for a block's or tool's ``cache_control`` Anthropic would refuse."""
    error = cache_control_error(block.get("cache_control"))
    if error is not None:
        raise bad_request(f"{at}.cache_control{error}", f"{at}.cache_control")


_TOOL_KEYS = frozenset({"type", "name", "description", "input_schema", "strict", "cache_control"})
"""The keys of Anthropic's client tool (``ToolParam``) that the chat path takes (``input_schema`` as its
``parameters``; ``type`` and ``cache_control`` checked here)."""

_UNUSED_TOOL_KEYS = {
    "eager_input_streaming": (lambda v: v is None or type(v) is bool, "true, false or null"),
    "defer_loading": (lambda v: type(v) is bool, "true or false"),
    "input_examples": (lambda v: type(v) is list and all(isinstance(e, dict) for e in v), "a list of objects"),
    "allowed_callers": (lambda v: type(v) is list and all(type(c) is str for c in v), "a list of strings"),
}
"""The other keys of Anthropic's ``ToolParam`` (the ``anthropic`` SDK's), which change nothing here: the
tool's input streams as the model writes it (``input_json_delta``), a deferred tool is rendered as any
other (no tool search here), examples and callers are not shown to the model. Checked as typed, not used."""


def _tools(tools: list[dict] | None) -> list[dict] | None:
    """Anthropic's client tools as chat's function tools: ``type`` custom (or null, its default), an
    ``input_schema`` (required, as Anthropic's), the keys the chat path takes kept for its checks to
    name (:func:`~gateway.translation.vendor_tool`: the others checked and left out, an unknown one refused)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") not in ("custom", None):
            raise unsupported_field(f"tools.{i}.type", f"{_WHAT} (client tools only; server tools such as "
                                    f"{echo(tool.get('type'))} run on Anthropic's servers)")
        _check_cache_control(tool, f"tools.{i}")
        tool = vendor_tool(tool, f"tools.{i}", _TOOL_KEYS, _UNUSED_TOOL_KEYS)
        if "input_schema" not in tool:
            raise bad_request("Field required: a tool needs an input_schema, the JSON schema of its input "
                              "({\"type\": \"object\", \"properties\": {...}})", f"tools.{i}.input_schema",
                              "missing_required_parameter")
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
    if kind == "tool" and not extra:  # (its name, in Anthropic's words: required, a string)
        if choice.get("name") is None:
            raise bad_request("Field required: a tool_choice of type tool names the tool to call, {\"type\": "
                              "\"tool\", \"name\": ...}", "tool_choice.name", "missing_required_parameter")
        if not isinstance(choice["name"], str):
            raise bad_request(f"Input should be a valid string; got {json_shown(choice['name'])}", "tool_choice.name",
                              "invalid_type")
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
    if fmt["schema"] is None:  # (Anthropic's schema is required, not nullable: chat's null would be any JSON)
        raise bad_request("Input should be an object (a JSON schema); got null", "output_config.format.schema",
                          "invalid_type")
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
            "parallel_tool_calls": parallel, "response_format": _response_format(body.output_config),
            "continue_final_message": is_prefill(body.messages) or None}, origins


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
    message: :func:`~gateway.origins.renamed_to_items`), others by ``_PARAMS``; the chat fields its
    message names elsewhere by ``_WORDS`` (was: "stop_sequences: stop[0] has 5000 characters; ...")."""
    if not renamed_to_items(e, origins, Api.MESSAGES):
        renamed_error(e, _PARAMS)
    return reworded(e, _WORDS)


class MessagesTranslation:
    """One ``/v1/messages`` request on the chat path (:class:`gateway.translation.Translation`)."""

    def __init__(self) -> None:
        self.body: MessagesRequest | None = None
        self.id = new_id("msg", "_")
        self.on_chat_path = False  # the body became a chat request: errors name chat fields from here on
        self.origins: list[Origin] = []  # what each chat message came from (gateway.origins)

    def resolved(self, model: str) -> None:
        self.body.model = model

    def chat_body(self, raw: bytes) -> ChatCompletionRequest:
        body = self.body = parse_body(MessagesRequest, raw, in_tool_use_input)
        if body.max_tokens < 1:
            raise bad_request(f"max_tokens must be >= 1, got {echo(body.max_tokens)}", "max_tokens")
        budget = (body.thinking or {}).get("budget_tokens")
        if budget is not None and budget >= body.max_tokens:  # (Anthropic's rule: the thinking is in max_tokens)
            raise bad_request(f"max_tokens must be greater than thinking.budget_tokens ({echo(body.max_tokens)} <= "
                              f"{echo(budget)}): the thinking counts in max_tokens; raise max_tokens or lower the budget",
                              "thinking.budget_tokens")
        fields, self.origins = _chat_fields(body)
        chat = _chat_request({
            **fields, "max_tokens": body.max_tokens, "stop": body.stop_sequences,
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "stream": body.stream,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True} if body.stream else None},
            self.origins)
        self.on_chat_path = True
        return chat

    def check_reasoning(self, parser: str | None) -> None:
        """Nothing to refuse: the thinking becomes ``thinking`` blocks."""

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
            body = parse_body(CountTokensRequest, await read_body(request, self.generate.config.max_body_bytes),
                              in_tool_use_input)
            fields, origins = _chat_fields(body)
            chat = _chat_request(fields, origins)
        except APIError as e:
            return anthropic_error(e)
        try:
            structured_option(chat)  # (the output format checked as a message's is; it adds no prompt token)
            _, ids, _ = await self.tokenize.tokens(TokenizeRequest(
                model=chat.model, messages=chat.messages, tools=chat.tools, tool_choice=chat.tool_choice,
                continue_final_message=chat.continue_final_message))
        except APIError as e:
            return anthropic_error(renamed_to_messages(e, origins))
        return json_response({"input_tokens": len(ids)})
