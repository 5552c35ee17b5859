"""OpenAI tool calling on ``/v1/chat/completions``: ``tools``, ``tool_choice``, tool calls in the
answer, and ``tool`` messages in the history.

The tools reach the model in the Hermes format (NousResearch's Hermes 2 Pro
function calling, which Qwen2.5's and many other templates use): a system
message lists the function definitions in ``<tools></tools>`` and asks for
each call as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``;
an assistant message's ``tool_calls`` are rendered so, and a ``tool``
message's content (the result, with its ``tool_call_id``) as
``<tool_response>...</tool_response>`` in a user turn. The messages are then
role/content pairs that any chat template renders (the worker applies the
model's own, as for every chat). (A model whose template has its own tool
syntax is still given the Hermes one: the answer is parsed in that format.)

``tool_choice``:

- ``"none"``: the tools are not shown and the answer is not parsed;
- ``"auto"`` (the default with tools): the model may answer or call; its
  output is parsed for ``<tool_call>`` blocks;
- ``"required"`` / ``{"type": "function", "function": {"name": N}}``: the
  output is *constrained* to one call, its ``name`` among the tools (or
  ``N``) and its ``arguments`` valid against that function's ``parameters``
  schema -- a Lark grammar with llguidance's ``%json`` schemas, compiled on
  the worker as any ``structured`` constraint.

The answer: when the output holds calls that parse, ``message.tool_calls``
(``id``, ``type: "function"``, ``function: {name, arguments}`` with the
arguments as a JSON string), ``message.content`` the text outside them (or
null) and ``finish_reason: "tool_calls"``; a choice cut by ``max_tokens``
is not parsed. A stream of a request with tools is answered once the
choices end, with the same parse as the non-streamed answer, in OpenAI's
chunk shapes: the role, then per call a delta with its index, id, type,
name and the whole arguments, then the finish reason.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request
from protocol.structured import Constraint

__all__ = ["ToolPlan", "apply_tool_calls", "chunks", "parse_tool_calls", "render_messages", "tool_plan"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)
_JSON_STYLE = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False}

SYSTEM = ("You are a function calling AI model. You are provided with function signatures within <tools></tools> "
          "XML tags. You may call one or more functions to assist with the user query. Don't make assumptions "
          "about what values to plug into functions. Here are the available tools: <tools>{tools}</tools> "
          "For each function call return a json object with function name and arguments within <tool_call>"
          "</tool_call> XML tags as follows:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": "
          "<args-dict>}}\n</tool_call>")
"""The Hermes 2 Pro system prompt (NousResearch/Hermes-Function-Calling), tools as JSON."""


@dataclass(frozen=True)
class ToolPlan:
    """A chat request's tools: ``functions`` (name -> definition, in order), ``choice`` ("auto",
    "required" or a function name) and the ``structured`` constraint that enforces it (None for auto)."""

    functions: dict[str, dict]
    choice: str
    constraint: Constraint | None


def tool_plan(body) -> ToolPlan | None:
    """The request's :class:`ToolPlan`, or None when it gives no tools or ``tool_choice`` is
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
                              "parameters}}}}", where)
        fn = tool["function"]
        unknown = sorted(set(fn) - {"name", "description", "parameters", "strict"})
        if unknown:
            raise bad_request(f"{where}.function does not take {unknown}", f"{where}.function.{unknown[0]}")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME.match(name):
            raise bad_request(f"{where}.function.name must be 1-64 letters, digits, '_' or '-'", f"{where}.function.name")
        if name in functions:
            raise bad_request(f"{where}.function.name {name!r} is given twice", f"{where}.function.name")
        if "description" in fn and not isinstance(fn["description"], str):
            raise bad_request(f"{where}.function.description must be a string", f"{where}.function.description")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema (an object)",
                              f"{where}.function.parameters")
        functions[name] = {"name": name, "description": fn.get("description", ""), "parameters": params}
    if choice is None or choice == "auto":
        return ToolPlan(functions, "auto", None)
    if choice == "none":
        return None
    if choice == "required":
        names = list(functions)
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in functions:
            raise bad_request(f"tool_choice names function {name!r:.64}, which is not in tools", "tool_choice")
        names = [name]
    else:
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", "
                          "\"function\": {\"name\": ...}}", "tool_choice")
    return ToolPlan(functions, names[0] if isinstance(choice, dict) else "required", _call_grammar(functions, names))


def _call_grammar(functions: dict[str, dict], names: list[str]) -> Constraint:
    """One ``<tool_call>`` whose JSON is a call of one of ``names`` with valid arguments (Lark, ``%json``)."""
    calls = [{"type": "object", "additionalProperties": False, "required": ["name", "arguments"],
              "properties": {"name": {"const": n}, "arguments": functions[n]["parameters"]}} for n in names]
    schema = {"x-guidance": _JSON_STYLE, **(calls[0] if len(calls) == 1 else {"anyOf": calls})}
    lark = f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'
    return Constraint("grammar", lark)


def render_messages(messages: list[dict], raw: list, plan: ToolPlan | None) -> list[dict]:
    """The role/content messages to submit: ``messages`` (from the body, text joined), with the tools'
    system prompt first (merged into a leading system message) when ``plan`` shows them, an assistant
    message's ``tool_calls`` (``raw[i].tool_calls``) as ``<tool_call>`` blocks and a ``tool``
    message as a ``<tool_response>`` user turn. 400 naming the message for a malformed call."""
    out = []
    for i, (m, r) in enumerate(zip(messages, raw)):
        role, content = m["role"], m["content"]
        calls = getattr(r, "tool_calls", None)
        if calls:
            if role != "assistant" or not isinstance(calls, list):
                raise bad_request("tool_calls belong to assistant messages, as a list", f"messages.{i}.tool_calls")
            blocks = [_call_block(c, f"messages.{i}.tool_calls.{j}") for j, c in enumerate(calls)]
            content = "\n".join(([content] if content else []) + blocks)
        if role == "tool":
            call_id = getattr(r, "tool_call_id", None)
            if not isinstance(call_id, str) or not call_id:
                raise bad_request("a tool message needs the tool_call_id of the call it answers",
                                  f"messages.{i}.tool_call_id")
            role, content = "user", f"<tool_response>\n{content}\n</tool_response>"
        out.append({"role": role, "content": content})
    if plan is not None:
        listed = "\n".join(json.dumps({"type": "function", "function": f}) for f in plan.functions.values())
        system = SYSTEM.format(tools="\n" + listed + "\n")
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + system}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def _call_block(call: Any, where: str) -> str:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request("a tool call must be {\"id\", \"type\": \"function\", \"function\": {\"name\", "
                          "\"arguments\"}}", where)
    args = fn.get("arguments", "{}")
    try:
        parsed = json.loads(args) if isinstance(args, str) else args
    except ValueError:
        raise bad_request("a tool call's arguments must be a JSON string", f"{where}.function.arguments") from None
    return "<tool_call>\n" + json.dumps({"name": fn["name"], "arguments": parsed}, ensure_ascii=False) + \
        "\n</tool_call>"


def parse_tool_calls(text: str, functions: dict[str, dict]) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` of a model's output: every ``<tool_call>`` block whose JSON is
    ``{"name": one of functions, "arguments": {...}}`` becomes a call (OpenAI's shape, arguments
    as a JSON string); the text outside the calls, stripped, is the content (None when empty).
    Blocks that do not parse stay in the content. No call: ``(text, [])``."""
    calls, kept, end = [], [], 0
    for m in _CALL.finditer(text):
        call = _call_of(m.group(1), functions)
        if call is None:
            continue
        kept.append(text[end:m.start()])
        end = m.end()
        calls.append(call)
    if not calls:
        return text, []
    kept.append(text[end:])
    content = "".join(kept).strip()
    return content or None, calls


def _call_of(payload: str, functions: dict[str, dict]) -> dict | None:
    try:
        obj = json.loads(payload)
    except ValueError:
        return None
    if not isinstance(obj, dict) or obj.get("name") not in functions:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if not isinstance(args, dict):
        return None
    return {"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
            "function": {"name": obj["name"], "arguments": json.dumps(args, ensure_ascii=False)}}


def apply_tool_calls(completion: dict, plan: ToolPlan) -> dict:
    """A chat completion's choices with their tool calls parsed (in place; returns it): a choice
    that ended ``stop`` with calls gets ``message.tool_calls`` and ``finish_reason: "tool_calls"``."""
    for choice in completion["choices"]:
        if choice.get("finish_reason") != "stop":
            continue
        message = choice["message"]
        content, calls = parse_tool_calls(message.get("content") or "", plan.functions)
        if calls:
            message["content"] = content
            message["tool_calls"] = calls
            choice["finish_reason"] = "tool_calls"
    return completion


def chunks(completion: dict, include_usage: bool) -> list[dict]:
    """The chunk bodies of a stream that says what ``completion`` says (OpenAI's shapes: per choice
    the role, its content, then each tool call -- index, id, type, name and arguments --, then the
    finish reason; the usage chunk last when asked)."""
    head = {"id": completion["id"], "object": "chat.completion.chunk", "created": completion["created"],
            "model": completion["model"]}
    extra = {"usage": None} if include_usage else {}
    out = []

    def chunk(index: int, delta: dict, reason: str | None = None, **more) -> None:
        out.append({**head, "choices": [{"index": index, "delta": delta, "logprobs": None,
                                         "finish_reason": reason, **more}], **extra})

    for choice in completion["choices"]:
        i, message = choice["index"], choice["message"]
        chunk(i, {"role": "assistant", "content": ""})
        if message.get("content"):
            chunk(i, {"content": message["content"]})
        for j, call in enumerate(message.get("tool_calls") or []):
            chunk(i, {"tool_calls": [{"index": j, **call}]})
        chunk(i, {}, choice["finish_reason"], stop_reason=choice.get("stop_reason"))
    if include_usage:
        out.append({**head, "choices": [], "usage": completion.get("usage")})
    return out
