"""OpenAI tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice``, tool calls in the
answer, and ``tool`` messages in the history.

The tools travel with the chat prompt (the request's ``tools`` field and
the messages' ``tool_calls``, :mod:`protocol.tools`) to the worker, which
renders the chat: through the model's chat template when the template
renders ``tools`` (Qwen2.5's, Hermes'), else in the Hermes format
(NousResearch's Hermes 2 Pro function calling, :mod:`worker.models.hermes`:
a system prompt listing the functions, calls as ``<tool_call>`` blocks,
``tool`` messages as ``<tool_response>`` user turns; SmolLM2's template has
no tools). A ``tool`` message's ``tool_call_id`` and a message's ``name``
travel too (Mistral's templates read the id). The answer is read in the
syntax of the gateway's tool-call parser (``--tool-call-parser``,
:mod:`gateway.tool_parsers`): Hermes' by default,
``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen2.5's and
the Hermes rendering's), or Llama 3's JSON, Mistral's ``[TOOL_CALLS]`` or
Qwen3-Coder's XML; another syntax's calls stay content.

``tool_choice``:

- ``"none"``: the tools are not shown and the answer is not parsed;
- ``"auto"`` (the default with tools): the model may answer or call; its
  output is parsed for calls;
- ``"required"`` / ``{"type": "function", "function": {"name": N}}``: the
  output is *constrained* to one call, its ``name`` among the tools (or
  ``N``) and its ``arguments`` valid against that function's ``parameters``
  schema, in the parser's syntax -- a Lark grammar with llguidance's ``%json``
  schemas (:mod:`gateway.tool_grammars`), compiled on the worker as any
  ``structured`` constraint.

The answer: when the output holds calls, ``message.tool_calls`` (``id``,
``type: "function"``, ``function: {name, arguments}`` with the arguments as
the JSON text the model wrote), ``message.content`` the text outside them
(or null) and ``finish_reason: "tool_calls"`` (``"length"`` for a choice cut
by ``max_tokens``, its last call's arguments cut with it). A stream sends
the same incrementally, in OpenAI's chunk shapes: content deltas as the text
comes (holding back only what may start a call), per call a first delta
with its ``index``, ``id``, ``type``, ``name`` and ``arguments: ""``, then
argument fragments as they are generated, then the finish reason. Both come
from one parser, a :class:`~gateway.call_stream.CallStream` (the answer is
it fed the whole output), so the concatenated deltas are the answer exactly.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from gateway.errors import APIError, bad_request, missing_parameter, unknown_key
from gateway.schemas import _shown
from gateway.structured import field_of
from gateway.tool_grammars import call_grammar
from gateway.tool_parsers import DEFAULT, parser_class
from gateway.tool_stream import CallStream, ToolStream, merged
from protocol.chat import AnswerError, Answers
from protocol.request import MAX_MESSAGE_NAME_CHARS
from protocol.structured import Constraint
from protocol.tools import arguments_problem, call_arguments, is_tool_name, parameters_error
from protocol.validation import check_json_text, echo

__all__ = ["ToolPlan", "ToolStream", "apply_tool_calls", "check_arguments", "parse_tool_calls", "render_messages",
           "is_tool_name", "shown", "stream_choices", "tool_plan"]

_JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools: ``functions`` (name -> definition, in order), ``choice`` ("auto",
    "required" or a function name) and the ``structured`` constraint that enforces it (None for auto)."""

    functions: dict[str, dict]
    choice: str
    constraint: Constraint | None
    parallel: bool = True
    """``parallel_tool_calls``: False keeps only the answer's first call (the others are dropped)."""
    bare: bool = False
    """Whether an answer that starts with a call object without its tags is read as calls
    (:class:`~gateway.tool_stream.ToolStream`'s ``bare``): with ``tool_choice`` auto and no
    ``response_format``."""
    parser: str = DEFAULT
    """The tool-call syntax the answer is read in (:mod:`gateway.tool_parsers`; the gateway's
    ``tool_call_parser``), and the one ``constraint`` asks for."""

    @property
    def thinks(self) -> bool:
        """Whether ``constraint`` lets the model think first itself (harmony's grammar: the channels
        are the syntax), so that the reasoning parser's ``think`` is not to be added to it."""
        return self.constraint is not None and self.parser == "openai"

    def stream(self) -> CallStream:
        """A fresh parser of one choice's output under this plan (``forced`` when ``constraint``
        makes the output one call: ``required`` or a named function)."""
        return parser_class(self.parser)(self.functions, self.parallel, self.bare, self.constraint is not None)

    def definitions(self) -> list[dict]:
        """The tools as the request's ``tools`` field takes them (OpenAI's definitions, normalised)."""
        return [{"type": "function", "function": f} for f in self.functions.values()]


def tool_plan(body, parser: str = DEFAULT) -> ToolPlan | None:
    """The request's :class:`ToolPlan` with its calls read in ``parser``'s syntax (a name of
    :data:`gateway.tool_parsers.PARSERS`), or None when it gives no tools or ``tool_choice`` is
    ``"none"``. 400 naming the field for a malformed tool or choice."""
    tools, choice = body.tools, body.tool_choice
    if tools in (None, []):
        if choice not in (None, "none", "auto"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")
    functions: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        where = f"tools.{i}"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f"{where} must be {{\"type\": \"function\", \"function\": {{name, description, "
                              f"parameters}}}}", where)
        fn = tool["function"]
        if set(tool) != {"type", "function"}:
            raise unknown_key(where, sorted(set(tool) - {"type", "function"})[0], "type and function")
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise unknown_key(f"{where}.function", unknown[0], "name, description, parameters and strict")
        name = fn.get("name")
        if not is_tool_name(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'", f"{where}.function.name")
        if name in functions:
            raise bad_request(f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad_request(f"{where}.function.description must be a string", f"{where}.function.description")
        if fn.get("strict") is not None and type(fn["strict"]) is not bool:
            raise bad_request(f"{where}.function.strict must be true or false", f"{where}.function.strict")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict) or params.get("type", "object") != "object":
            # (a call's arguments are an object: a string schema was written as content, never a call)
            raise bad_request(f"{where}.function.parameters must be the JSON schema of an object "
                              "({\"type\": \"object\", \"properties\": {...}})", f"{where}.function.parameters")
        problem = parameters_error(params, f"{where}.function.parameters")
        if problem is not None:
            raise bad_request(problem[1], problem[0])
        functions[name] = {"name": name, "description": fn.get("description", ""), "parameters": params}
    parallel = getattr(body, "parallel_tool_calls", None) is not False  # (/tokenize has none)
    if choice is None or choice == "auto":  # (a bare JSON answer is the user's when they asked for JSON)
        return ToolPlan(functions, "auto", None, parallel, bare=field_of(body) is None, parser=parser)
    if choice == "none":
        return None
    if choice == "required":
        names = list(functions)
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name is None:  # (OpenAI's words: the function named is the choice)
            raise missing_parameter("tool_choice.function.name", None)
        if not isinstance(name, str):
            raise bad_request(f"tool_choice.function.name must be a string, got {_shown(name)}",
                              "tool_choice.function.name", "invalid_type")
        if name not in functions:
            raise bad_request(f"tool_choice names function {echo(name)}, which is not in tools", "tool_choice")
        names = [name]
    elif isinstance(choice, dict) and choice.get("type") == "function" and choice.get("function") is None:
        raise missing_parameter("tool_choice.function", None)
    else:
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")
    return ToolPlan(functions, names[0] if isinstance(choice, dict) else "required",
                    _call_grammar(functions, names, parser), parallel, parser=parser)


def _call_grammar(functions: dict[str, dict], names: list[str], parser: str = DEFAULT) -> Constraint:
    """One call of one of ``names`` with valid arguments, in ``parser``'s syntax
    (:func:`gateway.tool_grammars.call_grammar`)."""
    return Constraint("grammar", call_grammar(functions, names, parser))


def render_messages(messages: list[dict], raw: list) -> list[dict]:
    """The chat messages to submit: ``messages`` (role/content from the body, text joined), an
    assistant message's ``tool_calls`` (``raw[i].tool_calls``, OpenAI's shape) checked and carried
    (the worker renders them), a ``tool`` message's ``tool_call_id`` checked and carried, and a
    message's ``name`` carried (templates read them: Mistral's the id, others the tool's name;
    :class:`protocol.request.ChatMessage`). 400 naming the message for a malformed call or id,
    and for a message that breaks the rule of answers every entry point keeps
    (:class:`protocol.chat.Answers`: a tool message without ``tool_call_id``, with the id of no call in an
    earlier assistant message, or answering a call answered already; an assistant message whose calls the
    tool messages right after it do not all answer), in its words, the messages named ``messages[3]``."""
    out = []
    answers = Answers()
    for i, (m, r) in enumerate(zip(messages, raw)):
        calls = getattr(r, "tool_calls", None)
        if calls:
            if m["role"] != "assistant" or not isinstance(calls, list):
                raise bad_request("tool_calls belong to assistant messages, as a list", f"messages.{i}.tool_calls")
            m = {**m, "tool_calls": [_checked_call(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(calls)]}
        call_id = getattr(r, "tool_call_id", None)
        if call_id is not None and (not isinstance(call_id, str) or len(call_id) > MAX_MESSAGE_NAME_CHARS):
            raise bad_request(f"messages[{i}].tool_call_id must be a string of at most {MAX_MESSAGE_NAME_CHARS} "
                              f"characters, got {echo(call_id)}", f"messages.{i}.tool_call_id")
        try:
            answers.check(i, m["role"], (c["id"] for c in m.get("tool_calls", ())), call_id or "")
        except AnswerError as e:
            raise _answer_error(e) from None
        if m["role"] == "tool":
            m = {**m, "tool_call_id": call_id}
        name = getattr(r, "name", None)
        if name:
            if len(name) > MAX_MESSAGE_NAME_CHARS:
                raise bad_request(f"a message's name is at most {MAX_MESSAGE_NAME_CHARS} characters",
                                  f"messages.{i}.name")
            m = {**m, "name": name}
        out.append(m)
    try:
        answers.end()
    except AnswerError as e:
        raise _answer_error(e) from None
    return out


def _answer_error(e: AnswerError) -> APIError:
    """The 400 of ``e``, in the words of every entry point (the messages named ``messages[2]``): its
    ``param`` the tool message's ``tool_call_id`` (``messages.3.tool_call_id``), or the ``tool_calls`` of
    the assistant message whose calls are unanswered (``messages.1.tool_calls``)."""
    field = "tool_calls" if e.unanswered else "tool_call_id"
    return bad_request(e.said(lambda j: f"messages[{j}]", f"messages[{e.index}].{field}"),
                       f"messages.{e.index}.{field}")


_CALL_KEYS = frozenset({"id", "type", "function", "index"})
"""The keys of a tool call in a request's message: OpenAI's ``ChatCompletionMessageToolCallParam``'s, and the
``index`` a client that gathered the call from a stream's deltas (``choices[].delta.tool_calls[].index``)
keeps on it, which OpenAI's API takes (its refusal of it in April 2024 was taken back:
RageAgainstThePixel/OpenAI-DotNet#278); it says nothing the list's order does not, and is not used."""
_FUNCTION_KEYS = frozenset({"name", "arguments"})
"""The keys of a tool call's ``function`` (OpenAI's ``Function``: the name and the arguments' JSON text)."""


def _checked_call(call: Any, where: str) -> dict:
    """The tool call ``call`` (an entry of a request message's ``tool_calls``, at the body field ``where``:
    ``messages.1.tool_calls.0``) as the worker renders it, ``{"id", "type": "function", "function": {"name",
    "arguments"}}`` (the arguments JSON text; none, null or blank: ``"{}"``). 400 naming the field for a call
    that is no such object, a key of the call or of its function other than :data:`_CALL_KEYS` and
    :data:`_FUNCTION_KEYS` (``unknown_parameter``, as a message's own unknown key and its text part's are),
    an ``index`` that is no count, a name that is no tool name, another type, an id that is no string, or
    arguments that are not the JSON text of an object (or the object)."""
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("a tool call must be {\"id\", \"type\": \"function\", \"function\": {\"name\", "
                          "\"arguments\"}}", where)
    unknown = sorted(set(call) - _CALL_KEYS)
    if unknown:
        raise unknown_key(where, unknown[0], "id, type and function; index is taken and not used")
    unknown = sorted(set(fn) - _FUNCTION_KEYS)
    if unknown:
        raise unknown_key(f"{where}.function", unknown[0], "name and arguments")
    index = call.get("index")
    if index is not None and (type(index) is not int or index < 0):
        raise bad_request(f"{where}.index must be an integer >= 0 or null; got {_shown(index)}", f"{where}.index",
                          "invalid_type")
    if not is_tool_name(fn["name"]):  # (its own field: a Messages tool_use block's name, a function_call item's)
        raise bad_request(f"a tool call's name must be 1-64 letters, digits, '_' or '-', got {echo(fn['name'])}",
                          f"{where}.function.name")
    if call.get("type", "function") != "function":
        raise bad_request("a tool call's type must be \"function\"", f"{where}.type")
    call_id = call.get("id")
    if call_id is not None and not isinstance(call_id, str):
        raise bad_request("a tool call's id must be a string", f"{where}.id")
    args = call_arguments(fn.get("arguments"))  # ("", null or none at all: "{}", as every entry point takes it)
    if isinstance(args, dict):
        args = json.dumps(args, ensure_ascii=False)
    check_arguments(args, f"{where}.function.arguments")
    return {"id": call_id if isinstance(call_id, str) else "", "type": "function",
            "function": {"name": fn["name"], "arguments": args}}


def check_arguments(args: Any, param: str) -> None:
    """400 naming ``param`` (a body field, ``messages.1.tool_calls.0.function.arguments``) unless
    ``args`` is the JSON text of an object whose numbers JSON holds (NaN, Infinity and 1e400 are named:
    :func:`protocol.tools.arguments_problem`) and whose strings UTF-8 can encode: the escape of half a
    surrogate pair (``"\\ud800"``), which Python's parser reads as a lone surrogate, is named with its
    line and column in ``args`` (no chat template could render it). Blank text is ``{}`` (what some
    clients send for a call without arguments)."""
    if isinstance(args, str) and not args.strip():
        return
    why = arguments_problem(args)  # (NaN, Infinity and 1e400 are no JSON numbers: named where they are)
    if why is not None:
        raise bad_request(f"a tool call's arguments must be the JSON text of an object{why}", param)
    try:
        check_json_text(args, shown(param))
    except ValueError as e:
        raise bad_request(str(e), param) from None


def shown(param: str) -> str:
    """A body field's path as messages write it, list indexes in brackets (``messages[1].tool_calls[0]``;
    ``param`` writes them as keys, ``messages.1.tool_calls.0``)."""
    return re.sub(r"\.(\d+)(?=\.|$)", r"[\1]", param)


def parse_tool_calls(text: str, functions: dict[str, dict], parallel: bool = True, bare: bool = False,
                     parser: str = DEFAULT, *, reason: str | None = None,
                     forced: bool = False) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of a whole output: ``parser``'s :class:`~gateway.call_stream.CallStream`
    fed it at once (so a stream of the same output says the same), ending with the finish
    ``reason`` (``"length"``: cut by ``max_tokens``), under a ``forced`` tool choice or not.
    ``calls`` in OpenAI's shape (``id``, ``type``, ``function: {name, arguments}``, the arguments
    the JSON text the model wrote); ``content`` the text outside them, None when empty and there
    are calls. No call: ``(text, [])``, less a call's start that the output cut off."""
    stream = parser_class(parser)(functions, parallel, bare, forced)
    deltas = stream.feed(text)
    deltas += stream.finish(reason)[0]
    return merged(deltas)


def apply_tool_calls(completion: dict, plan: ToolPlan) -> dict:
    """A chat completion's choices with their tool calls parsed (in place; returns it): a choice
    with calls gets ``message.tool_calls``, and ``finish_reason: "tool_calls"`` when it ended
    ``stop`` with whole calls (one cut by ``max_tokens`` stays ``length``, one whose last call's
    arguments a stop string or token cut stays ``stop``: :meth:`CallStream.finish`); a call cut
    off before its arguments began is left out of ``message.content`` (the parser drops it)."""
    for choice in completion["choices"]:
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            continue
        message = choice["message"]
        stream = plan.stream()  # (the parse and the finish reason a stream of it gives)
        text = message.get("content") or ""
        deltas = stream.feed(text)
        more, final = stream.finish(reason)
        content, calls = merged(deltas + more)
        if calls:
            message["content"] = content
            message["tool_calls"] = calls
            choice["finish_reason"] = final
        elif content != text:  # (a call's start cut off: dropped, as a stream of it drops it)
            message["content"] = content
    return completion


def stream_choices(stream: CallStream, choice: dict, finished: bool) -> list[dict]:
    """A chat stream's choice (:meth:`gateway.responses.ResponseBuilder.delta_choice`: a content delta,
    token ids, logprobs, finish and stop reasons) as ``stream`` shows it, one choice (one chunk) per
    delta its text makes ready: the token ids and logprobs on the first, the finish reason (the
    parser's: ``tool_calls`` for a choice that stopped with calls) on the last, one empty delta
    when nothing is ready."""
    deltas = stream.feed(choice["delta"].get("content", ""))
    reason = choice["finish_reason"]
    if finished:
        more, reason = stream.finish(reason)
        deltas += more
    out = []
    for k, delta in enumerate(deltas or [{}]):
        c = {**choice, "delta": delta, "finish_reason": None, "stop_reason": None}
        if k:
            c.update(logprobs=None, token_ids=[])
        out.append(c)
    out[-1].update(finish_reason=reason, stop_reason=choice["stop_reason"])
    return out
