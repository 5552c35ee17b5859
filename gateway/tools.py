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

The answer: when the output holds calls, ``message.tool_calls`` (``id``,
``type: "function"``, ``function: {name, arguments}`` with the arguments as
the JSON text the model wrote), ``message.content`` the text outside them
(or null) and ``finish_reason: "tool_calls"`` (``"length"`` for a choice cut
by ``max_tokens``, its last call's arguments cut with it). A stream sends
the same incrementally, in OpenAI's chunk shapes: content deltas as the text
comes (holding back only what may start a ``<tool_call>``), per call a first
delta with its ``index``, ``id``, ``type``, ``name`` and ``arguments: ""``,
then argument fragments as they are generated, then the finish reason. Both
come from one parser, :class:`ToolStream` (the answer is it fed the whole
output), so the concatenated deltas are the answer exactly.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from gateway.errors import bad_request
from protocol.structured import Constraint

__all__ = ["ToolPlan", "ToolStream", "apply_tool_calls", "merged", "parse_tool_calls", "render_messages",
           "stream_choices", "tool_plan"]

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
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
    """``(content, calls)`` of a whole output: :class:`ToolStream` fed it at once (so a stream of the
    same output says the same). ``calls`` in OpenAI's shape (``id``, ``type``, ``function: {name,
    arguments}``, the arguments the JSON text the model wrote); ``content`` the text outside them,
    None when empty and there are calls. No call: ``(text, [])``."""
    stream = ToolStream(functions)
    deltas = stream.feed(text)
    deltas += stream.finish(None)[0]
    return merged(deltas)


def merged(deltas: list[dict]) -> tuple[str | None, list[dict]]:
    """``(content, calls)`` that ``deltas`` (:class:`ToolStream`'s) add up to, as a client adds them."""
    content, calls = [], []
    for d in deltas:
        if "content" in d:
            content.append(d["content"])
        for tc in d.get("tool_calls", ()):
            if "id" in tc:
                calls.append({"id": tc["id"], "type": "function",
                              "function": {"name": tc["function"]["name"], "arguments": ""}})
            calls[tc["index"]]["function"]["arguments"] += tc["function"]["arguments"]
    text = "".join(content)
    return (text or None) if calls else text, calls


def apply_tool_calls(completion: dict, plan: ToolPlan) -> dict:
    """A chat completion's choices with their tool calls parsed (in place; returns it): a choice
    with calls gets ``message.tool_calls``, and ``finish_reason: "tool_calls"`` when it ended
    ``stop`` (one cut by ``max_tokens`` stays ``length``, its last call's arguments cut too)."""
    for choice in completion["choices"]:
        reason = choice.get("finish_reason")
        if reason not in ("stop", "length"):
            continue
        message = choice["message"]
        content, calls = parse_tool_calls(message.get("content") or "", plan.functions)
        if calls:
            message["content"] = content
            message["tool_calls"] = calls
            choice["finish_reason"] = "tool_calls" if reason == "stop" else reason
    return completion


def stream_choices(stream: ToolStream, choice: dict, finished: bool) -> list[dict]:
    """A chat stream's choice (:meth:`gateway.responses.Envelope.delta_choice`: a content delta,
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


class ToolStream:
    """The incremental Hermes parser of one choice's output: text in (:meth:`feed`, as it is
    generated), OpenAI chat deltas out -- ``{"content": s}`` and ``{"tool_calls": [...]}`` -- and
    the finish reason at :meth:`finish`. The non-streamed answer is this same parser fed the whole
    output at once (:func:`parse_tool_calls`), so a stream and the answer say the same thing
    however the text is cut into deltas (vLLM #56263 is a bug where they differ).

    The grammar it reads (Hermes 2 Pro, as the ``<tool_call>`` system prompt asks and Qwen2.5's
    templates render): ``<tool_call>`` ws ``{"name": "N", "arguments": {...}}`` ws
    ``</tool_call>``, JSON whitespace allowed between the tokens, ``"parameters"`` accepted for
    ``"arguments"``, a call without arguments (``{"name": "N"}``) has ``"{}"``; ``N`` must be one of
    ``functions``. Holding back as little as it can:

    - content is sent as it comes, except a possible start of ``<tool_call>`` and trailing
      whitespace (sent once more text follows it; whitespace right before a call is dropped, and
      so is whitespace at either end of the content of an output that has calls);
    - a block becomes a call at the opening brace of its arguments: the first delta carries
      ``index``, ``id``, ``type``, ``name`` and ``arguments: ""``; the argument text then goes out
      as it arrives, exactly as the model wrote it (their concatenation is the answer's
      ``arguments`` string), its end found by bracket depth outside JSON strings (protocol glue,
      not a JSON parser). A block that does not get that far in the grammar (not JSON, another
      key order, an unknown function) stays content, whole, as does one still open at the end;
    - a call is not taken back: once its arguments started, a block that then breaks the grammar
      keeps the arguments it sent and the rest of the block is dropped; arguments cut by
      ``max_tokens`` stay cut (finish reason ``length``). OpenAI's own ``arguments`` are not
      guaranteed to be valid JSON either: callers validate them (``json.loads``) before use.
    """

    __slots__ = ("functions", "calls", "_said", "_state", "_buf", "_ws", "_depth", "_in_str", "_esc", "_tail")

    def __init__(self, functions: dict[str, dict]) -> None:
        self.functions = functions
        self.calls = 0  # calls begun so far
        self._said = False  # whether content was sent
        self._state = _TEXT
        self._buf = ""  # TEXT: unsent text (whitespace, a possible tag start); HEAD: the block after <tool_call>
        self._ws = ""  # HEAD: the whitespace before the block (content again if the block is not a call)
        self._depth, self._in_str, self._esc = 0, False, False  # ARGS: the scan of the argument text
        self._tail = ""  # TAIL: what must follow the arguments ("}" then "</tool_call>")

    def feed(self, text: str) -> list[dict]:
        """The deltas ``text`` (the output's next piece) makes ready (maybe none)."""
        out: list[dict] = []
        self._buf += text
        while self._step(out, final=False):
            pass
        return out

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        """The output ended with OpenAI's ``reason``: the deltas still held, and the choice's finish
        reason (``"tool_calls"`` for one that stopped with calls)."""
        out: list[dict] = []
        while self._step(out, final=True):
            pass
        if self._state == _TEXT and self._buf:
            if self._buf.strip() or not self.calls:
                self._say(out, self._buf)
            self._buf = ""
        return out, ("tool_calls" if self.calls and reason == "stop" else reason)

    def _step(self, out: list[dict], final: bool) -> bool:
        """Consume what ``_buf`` allows in the current state; True when the state changed."""
        buf, state = self._buf, self._state
        if state == _TEXT:
            at = buf.find(_OPEN)
            if at < 0:
                keep = _tag_start(buf)
                rest = buf[:len(buf) - keep]
                sent = rest.rstrip()
                self._say(out, sent)
                self._buf = buf[len(sent):]
                return False
            before = buf[:at]
            sent = before.rstrip()
            self._say(out, sent)
            self._ws, self._buf, self._state = before[len(sent):], buf[at + len(_OPEN):], _HEAD
            return True
        if state == _HEAD:
            head = _header(buf, self.functions)
            if head is _MORE and not final:
                return False
            if head is None or head is _MORE:  # not a call: the block is content, and read on as text
                self._say(out, self._ws + _OPEN)
                self._ws, self._state = "", _TEXT
                return True
            name, end, has_args = head
            out.append({"tool_calls": [{"index": self.calls, "id": "call_" + uuid.uuid4().hex[:24],
                                        "type": "function", "function": {"name": name, "arguments": ""}}]})
            self.calls += 1
            if has_args:
                self._buf, self._state = buf[end:], _ARGS
                self._depth, self._in_str, self._esc = 0, False, False
            else:
                self._args(out, "{}")
                self._buf, self._state, self._tail = buf[end:], _TAIL, _CLOSE
            return True
        if state == _ARGS:
            i = self._scan(buf)
            self._args(out, buf[:i])
            self._buf = buf[i:]
            if self._depth == 0:
                self._state, self._tail = _TAIL, "}" + _CLOSE
                return True
            return False
        if state == _TAIL:
            rest, need = buf, self._tail
            while need:
                if need in _TAILS:  # JSON whitespace may come before "}" and before "</tool_call>"
                    rest = rest.lstrip(_WS)
                if not rest:
                    break
                if rest[0] != need[0]:  # the call broke the grammar after its arguments
                    self._buf, self._state = rest, _SKIP
                    return True
                rest, need = rest[1:], need[1:]
            self._buf, self._tail = rest, need
            if need:
                return False
            self._state = _TEXT
            return True
        at = buf.find(_CLOSE)  # _SKIP: drop the rest of the broken call
        if at < 0:
            self._buf = buf[len(buf) - _tag_start(buf, _CLOSE):]
            return False
        self._buf, self._state = buf[at + len(_CLOSE):], _TEXT
        return True

    def _say(self, out: list[dict], text: str) -> None:
        if self.calls and not self._said:  # content that starts after a call starts at its first word
            text = text.lstrip()
        if text:
            out.append({"content": text})
            self._said = True

    def _args(self, out: list[dict], text: str) -> None:
        if text:
            out.append({"tool_calls": [{"index": self.calls - 1, "function": {"arguments": text}}]})

    def _scan(self, buf: str) -> int:
        """How much of ``buf`` is argument text: all of it, or up to the brace that closes them."""
        depth, in_str, esc = self._depth, self._in_str, self._esc
        for i, c in enumerate(buf):
            if in_str:
                if esc:
                    esc = False
                elif c == "\\":
                    esc = True
                elif c == '"':
                    in_str = False
            elif c == '"':
                in_str = True
            elif c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    self._depth, self._in_str, self._esc = 0, False, False
                    return i + 1
        self._depth, self._in_str, self._esc = depth, in_str, esc
        return len(buf)


_TEXT, _HEAD, _ARGS, _TAIL, _SKIP = "text", "head", "args", "tail", "skip"  # ToolStream's states
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_TAILS = ("}" + _CLOSE, _CLOSE)
_WS = " \t\n\r"  # JSON's whitespace
_MORE = object()  # _header: the block may still become a call
_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]*")


def _tag_start(text: str, tag: str = _OPEN) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag`` (0 if none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def _expect(s: str, i: object, lit: str) -> object:
    """After JSON whitespace at ``i``: the index past ``lit``, _MORE when ``s`` ends inside it, else None."""
    if not isinstance(i, int):
        return i
    while i < len(s) and s[i] in _WS:
        i += 1
    part = s[i:i + len(lit)]
    if part == lit:
        return i + len(lit)
    return _MORE if i + len(part) == len(s) and lit.startswith(part) else None


def _header(s: str, functions: dict[str, dict]) -> object:
    """A ``<tool_call>`` block's start ``s`` read up to its arguments: ``(name, end, has_args)``
    (``end`` the index of the arguments' ``{``, or past the ``}`` of a call without them), _MORE
    while ``s`` may still become one, None when it cannot (not the grammar, an unknown name)."""
    i = _expect(s, 0, "{")
    i = _expect(s, i, '"name"')
    i = _expect(s, i, ":")
    i = _expect(s, i, '"')
    if not isinstance(i, int):
        return i
    j = _NAME_CHARS.match(s, i).end()
    if j == len(s):
        return _MORE if j - i <= 64 else None
    name = s[i:j]
    if s[j] != '"' or name not in functions:
        return None
    k = _expect(s, j + 1, "}")
    if isinstance(k, int):
        return name, k, False
    i = _expect(s, j + 1, ",")
    if not isinstance(i, int):
        return _MORE if i is _MORE or k is _MORE else None
    a, p = _expect(s, i, '"arguments"'), _expect(s, i, '"parameters"')
    i = a if isinstance(a, int) else p if isinstance(p, int) else _MORE if _MORE in (a, p) else None
    i = _expect(s, i, ":")
    i = _expect(s, i, "{")
    return i if not isinstance(i, int) else (name, i - 1, True)
