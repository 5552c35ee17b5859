"""Tool calling on the wire: a chat request's ``tools`` and an assistant message's tool calls.

A request's ``tools`` field (:class:`~protocol.request.RequestParams`) is None
or the JSON text of OpenAI's list of function definitions,
``[{"type": "function", "function": {"name", "description", "parameters"}}]``,
checked here as far as the edge can (a non-empty list of such objects, each
name 1-64 letters, digits, ``_`` or ``-``, given once, ``parameters`` the
schema of an object (``"type"`` left out or ``"object"``); at most
:data:`MAX_TOOLS_CHARS`) and normalised to compact JSON text, order kept.
It needs a chat prompt: whoever renders the chat (the worker, which holds the
tokenizer) shows the tools to the model -- through the model's chat template
when the template renders ``tools``, else in the Hermes format
(:mod:`worker.models.hermes`).

An assistant :class:`~protocol.request.ChatMessage` may carry the calls it
made (:class:`ToolCall`: ``id``, function ``name``, ``arguments`` as the JSON
text of an object), so a chat template that renders ``tool_calls`` renders
them itself. On the wire a call is the array ``[id, name, arguments]``.

JSON given as text (``tools``, a call's ``arguments``) must not escape half a
UTF-16 surrogate pair (``"\\ud800"``: Python's parser reads it as a lone
surrogate, which neither the wire nor a tokenizer takes), and objects must not
hold a lone surrogate (:func:`protocol.validation.check_json_text`,
:func:`~protocol.validation.check_json_unicode`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import NamedTuple

from protocol.json_numbers import first_nonfinite, loads, nonfinite_message, nonfinite_words, path_text
from protocol.validation import (
    MAX_JSON_DEPTH, as_text, check_depth, check_json_text, check_json_unicode, echo, is_sequence, json_depth, too_deep,
)

__all__ = ["MAX_TOOLS_CHARS", "ToolCall", "arguments_problem", "call_arguments", "check_tool_calls", "check_tools",
           "is_tool_name", "parameters_error"]

MAX_TOOLS_CHARS = 200_000
"""Longest ``tools`` text, in characters (it is rendered into the prompt of every request that has it)."""

_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for function names (whole: fullmatch, never a
# $-anchored match, whose $ also matches before a final newline: "get_time\n" passed as a name)


def is_tool_name(name: object) -> bool:
    """Whether ``name`` is a string a tool may be named by: 1-64 letters, digits, ``_`` or ``-``
    (OpenAI's rule for function names, which Anthropic's tool names follow too), nothing after, not
    even a newline. One rule for every entry point: HTTP (chat, Responses, Messages), the SDK, the wire."""
    return isinstance(name, str) and _NAME.fullmatch(name) is not None


class ToolCall(NamedTuple):
    """One call of an assistant message: ``id`` (the ``tool_call_id`` its answer names; may be
    ``""``), the function's ``name`` and its ``arguments``, the JSON text of an object."""

    id: str
    name: str
    arguments: str

    def template_dict(self) -> dict:
        """The call as chat templates read it (transformers' convention: OpenAI's shape, with the
        arguments as a mapping, which templates render with ``tojson``)."""
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": json.loads(self.arguments)}}


def check_tools(value: object, field: str = "tools") -> str | None:
    """``value`` (None, a list of tool definitions, or its JSON text) as normalised JSON text, or
    None. ValueError naming ``field`` (and the entry) for anything else."""
    if value is None:
        return None
    if isinstance(value, str):
        if len(value) > MAX_TOOLS_CHARS:
            raise ValueError(f"{field} is {len(value)} characters; at most {MAX_TOOLS_CHARS}")
        try:
            parsed, _ = loads(value)  # (a NaN or 1e400 kept as written, for the words below)
        except RecursionError:  # (nested deeper than Python's limit: a JSON list all the same)
            raise ValueError(too_deep(field)) from None
        except ValueError:
            raise ValueError(f"{field} must be a JSON list of tool definitions") from None
        check_json_text(value, field)  # ("\ud800": a string UTF-8 cannot encode)
        value = parsed
    if not isinstance(value, (list, tuple)) or not value:
        raise ValueError(f"{field} must be a non-empty list of {{\"type\": \"function\", \"function\": {{...}}}}")
    check_depth(value, field)
    names = set()
    for i, tool in enumerate(value):
        fn = tool.get("function") if isinstance(tool, Mapping) and tool.get("type") == "function" else None
        if not isinstance(fn, Mapping):
            raise ValueError(f"{field}[{i}] must be {{\"type\": \"function\", \"function\": {{name, description, "
                             "parameters}}}}")
        name = fn.get("name")
        if not is_tool_name(name) or name in names:
            raise ValueError(f"{field}[{i}].function.name must be 1-64 letters, digits, '_' or '-', "
                             f"each name once; got {echo(name)}")
        names.add(name)
        params = fn.get("parameters", {})
        if not isinstance(params, Mapping) or params.get("type", "object") != "object":
            raise ValueError(f"{field}[{i}].function.parameters must be the JSON schema of an object "
                             "(a call's arguments are one)")
        problem = parameters_error(params, f"{field}[{i}].function.parameters")
        if problem is not None:
            raise ValueError(problem[1])
    try:
        text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as e:  # (NaN, infinity: named where they are)
        raise ValueError(nonfinite_message(value, field) or f"{field} must be JSON: {e}") from None
    check_json_unicode(text, value, field)
    if len(text) > MAX_TOOLS_CHARS:
        raise ValueError(f"{field} is {len(text)} characters as JSON; at most {MAX_TOOLS_CHARS}")
    return text


def parameters_error(params: Mapping, field: str) -> tuple[str, str] | None:
    """What is wrong with the shape of a function's ``parameters`` (the JSON schema of an object,
    ``field`` its name): ``(the field at fault, the message)``, or None. JSON Schema's own rules
    for the parts every tool-call grammar and parser reads: ``properties`` an object of schemas
    (objects, or ``true``/``false``), ``required`` a list of property names, a property's ``enum``
    a non-empty list. The rest of the schema is the grammar engine's to judge."""
    props, required = params.get("properties"), params.get("required")
    if props is not None:
        if not isinstance(props, Mapping):
            return f"{field}.properties", f"{field}.properties must be an object of JSON schemas, got {echo(props)}"
        for name, prop in props.items():
            if not isinstance(prop, (Mapping, bool)):
                return (f"{field}.properties", f"{field}.properties gives {echo(name)} {echo(prop)}, which is not a "
                        "JSON schema (an object)")
            enum = prop.get("enum", [None]) if isinstance(prop, Mapping) else [None]
            if not isinstance(enum, (list, tuple)) or not enum:
                return (f"{field}.properties", f"{field}.properties gives {echo(name)} the enum {echo(enum)}; an "
                        "enum must be a non-empty list of the values allowed")
    if required is not None and (not isinstance(required, (list, tuple))
                                 or not all(isinstance(r, str) for r in required)):
        return f"{field}.required", f"{field}.required must be a list of property names, got {echo(required)}"
    return None


def check_tool_calls(value: object, field: str) -> tuple[ToolCall, ...]:
    """An assistant message's calls: OpenAI's ``[{"id", "type": "function", "function": {"name",
    "arguments"}}]`` (arguments a JSON object's text, or the object; none, null or blank text is
    ``{}``: :func:`call_arguments`) or :class:`ToolCall` arrays (off the wire), as ToolCalls. None
    or empty: ``()``. ValueError naming ``field``."""
    if value is None:
        return ()
    if not is_sequence(value) or isinstance(value, (str, Mapping)):
        raise ValueError(f"{field} must be a list of tool calls")
    out = []
    for i, call in enumerate(value):
        where = f"{field}[{i}]"
        if isinstance(call, Mapping):
            fn = call.get("function")
            if not isinstance(fn, Mapping):
                raise ValueError(f"{where} must be {{\"id\", \"type\": \"function\", \"function\": {{\"name\", "
                                 "\"arguments\"}}}}")
            call_id, name, args = call.get("id") or "", fn.get("name"), call_arguments(fn.get("arguments"))
        elif isinstance(call, (list, tuple)) and len(call) == 3:
            call_id, name, args = call
        else:
            raise ValueError(f"{where} must be a tool call, got {echo(call)}")
        call_id = as_text(call_id, f"{where} id")
        if not is_tool_name(name):
            raise ValueError(f"{where} needs a function name of 1-64 letters, digits, '_' or '-'")
        given = args
        if isinstance(args, Mapping):
            check_depth(args, f"{where} arguments")  # (then json.dumps, which recurses, can write it)
            try:
                args = json.dumps(args, ensure_ascii=False)
            except (TypeError, ValueError):
                args = None
        why = arguments_problem(args)
        if why is not None:
            raise ValueError(f"{where} arguments must be the JSON text of an object{why}")
        if isinstance(given, Mapping):  # (a lone surrogate in a string of the caller's object)
            check_json_unicode(args, given, f"{where} arguments")
        else:  # (a lone surrogate itself, or the escape "\ud800", which parses to one)
            as_text(args, f"{where} arguments")
            check_json_text(args, f"{where} arguments")
        out.append(ToolCall(call_id, name, args))
    return tuple(out)


def call_arguments(value: object) -> object:
    """A call's ``function.arguments`` as given (OpenAI's: the JSON text of an object), or ``"{}"``
    for none: left out, null or blank text, as clients send a call without arguments. The one rule of
    every entry point (the HTTP gateway's chat history, the SDK, JSONL rows); the value is checked
    after (:func:`arguments_problem`)."""
    if value is None or isinstance(value, str) and not value.strip():
        return "{}"
    return value


def arguments_problem(args: object) -> str | None:
    """None when ``args`` is the JSON text of an object whose numbers JSON holds; else what to add to
    "the arguments must be the JSON text of an object": ``""`` for no such text (not a string, not
    JSON, not an object), ``"; this one nests ..."`` for one nested past
    :data:`~protocol.validation.MAX_JSON_DEPTH` (:func:`~protocol.validation.too_deep`: it is an
    object, too deep to read), or ", with JSON
    numbers only: ..." naming the first NaN, Infinity or number past a double's range (``1e400``,
    infinity once read: a template's ``tojson`` wrote ``Infinity`` into the prompt) by its place in
    the object (:mod:`protocol.json_numbers`)."""
    try:
        parsed, nonfinite = loads(args) if isinstance(args, str) else (None, False)
    except RecursionError:
        return f"; {too_deep('this one')}"
    except ValueError:
        return ""
    if not isinstance(parsed, dict):
        return ""
    if json_depth(parsed) > MAX_JSON_DEPTH:
        return f"; {too_deep('this one')}"
    found = first_nonfinite(parsed) if nonfinite else None
    if found is None:
        return None
    return f", with JSON numbers only: {nonfinite_words(path_text('', found[0]), found[1])}"
