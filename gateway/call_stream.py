"""The interface every tool-call parser has, :class:`CallStream`, the JSON call reading the JSON
syntaxes share (Hermes', Llama 3's and Mistral's call objects: :func:`_header`), and the value
reading the other syntaxes share (a Python literal as JSON, :func:`literal_json`: pythonic calls'
values, Qwen3-Coder's typed parameters).

Protocol-level glue between generated text and OpenAI's chat deltas (content and ``tool_calls``),
for streamed and whole answers alike (:mod:`gateway.tools`); the parsers are named in
:mod:`gateway.tool_parsers`. Not a JSON parser: a call's arguments end where the bracket depth
outside JSON strings returns to zero, and their text passes through as the model wrote it.
"""

from __future__ import annotations

import ast
import json
import re
import uuid
import warnings

from protocol.validation import LONE_SURROGATE

__all__ = ["CallStream", "json_text", "literal_json", "merged"]

_WS = " \t\n\r"  # JSON's whitespace
_MORE = object()  # _header: the block may still become a call
_JSON_NAMES = {"true": True, "false": False, "null": None}  # literal_json: JSON's names for Python's constants


def json_text(value: object) -> str:
    """``value``, read from the model's output (its Python or typed values), as JSON text
    (``ensure_ascii=False``), a lone surrogate in it written as its escape: the model may write
    ``"\\ud800"``, which Python's parsers read as one, and no answer could hold it as UTF-8
    (pydantic's writer failed the answer: a 500, a stream cut off). ValueError as :func:`json.dumps`."""
    text = json.dumps(value, ensure_ascii=False, allow_nan=False)
    return text if text.isascii() else LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)


def literal_json(text: str) -> str | None:
    """The Python literal ``text`` (an argument value as the model wrote it) as JSON text, or None
    when it is none: parsed with :func:`ast.parse` and converted node by node (constants, lists,
    tuples, sets, dicts, signed numbers, and JSON's ``true``/``false``/``null``); never evaluated."""
    try:
        with warnings.catch_warnings():  # ("\d" in a string: Python warns of the escape, and reads it)
            warnings.simplefilter("ignore", SyntaxWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            node = ast.parse(text.strip(), mode="eval").body
        return json_text(_literal(node))
    except (SyntaxError, ValueError, TypeError, RecursionError, MemoryError):
        return None


def _literal(node: ast.AST) -> object:
    """The JSON value of one literal node; ValueError for any other node."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (str, int, float, bool))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)) and \
            isinstance(node.operand, ast.Constant) and type(node.operand.value) in (int, float):
        return -node.operand.value if isinstance(node.op, ast.USub) else node.operand.value
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and None not in node.keys:
        keys = [_literal(k) for k in node.keys]
        if not all(isinstance(k, str) for k in keys):
            raise ValueError("a dict key that is no string")
        return dict(zip(keys, (_literal(v) for v in node.values)))
    raise ValueError(f"not a literal: {type(node).__name__}")


class CallStream:
    """What every family's tool-call parser is (:mod:`gateway.tool_parsers` names them): one choice's
    output in (:meth:`feed`, as it is generated), OpenAI chat deltas out -- ``{"content": s}`` and
    ``{"tool_calls": [...]}`` -- and the finish reason at :meth:`finish`. The non-streamed answer
    is the same parser fed the whole output at once, so a stream and the answer say the same
    thing however the text is cut (vLLM #56263 is a bug where they differ).

    Built as ``cls(functions, parallel=True, bare=False, forced=False)``: ``functions`` the request's
    tools (name -> definition with its ``parameters`` schema); ``parallel`` False (OpenAI's
    ``parallel_tool_calls: false``) keeps the first call only; ``bare`` whether what the family's
    models write without their marker is read too (off under a ``response_format``: Hermes'
    bare call objects; Llama 3's syntax has no marker and is always read; Qwen3-Coder's
    ``<function=`` without ``<tool_call>`` is read either way, as vLLM's parser reads it);
    ``forced`` whether ``tool_choice`` forces a call (``required`` or a named function: the
    output is one call by its grammar). A subclass gives :meth:`_step` (consume what ``_buf``
    allows; True when its state changed) and :meth:`_whole` (whether the calls it holds are
    whole, for the finish reason).

    A call cut off before it became one (its arguments not begun) is no content: at
    :meth:`finish`, when the output was cut -- by ``max_tokens`` (``length``), or anyhow under a
    forced choice, whose grammar lets the model end only after the whole call -- text held back
    because it may still become a call (the family's marker and a call's header so far, a
    markerless call's start whose name is a start of a function's) is dropped: neither content nor
    a call, as OpenAI never shows its call syntax. Under a forced choice a marker's own start
    (``<tool_c``) is dropped too; otherwise it stays content (``a <`` may be just text)."""

    __slots__ = ("functions", "parallel", "bare", "forced", "calls", "_said", "_buf", "_ws", "_depth", "_in_str",
                 "_esc", "_cut", "_short", "_arg_parts")

    def __init__(self, functions: dict[str, dict], parallel: bool = True, bare: bool = False,
                 forced: bool = False) -> None:
        self.functions = functions
        self.parallel = parallel
        self.bare = bare
        self.forced = forced
        self._cut = False  # finish: the output was cut, so a call's start held back is dropped
        self.calls = 0  # calls begun so far
        self._said = False  # whether content was sent
        self._buf = ""  # text not consumed yet
        self._ws = ""  # the whitespace before a marker (content again if what follows is no call)
        self._depth, self._in_str, self._esc = 0, False, False  # the scan of argument text (_scan)
        self._short = False  # a call was cut short inside the output (its arguments broken off): not "tool_calls"
        self._arg_parts: list[str] = []  # the argument text of the call being read (_args_until)

    def feed(self, text: str) -> list[dict]:
        """The deltas ``text`` (the output's next piece) makes ready (maybe none)."""
        out: list[dict] = []
        self._buf += text
        while self._step(out, final=False):
            pass
        return out

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        """The output ended with OpenAI's ``reason``: the deltas still held, and the choice's finish
        reason (``"tool_calls"`` for one that stopped with whole calls: one whose arguments a stop
        string or token cut keeps ``"stop"``, one cut by ``max_tokens`` ``"length"``). A call's
        start held back is dropped when the output was cut (the class's docstring)."""
        out: list[dict] = []
        self._cut = self.forced or reason == "length"
        while self._step(out, final=True):
            pass
        complete = self.calls and self._whole() and not self._short
        return out, ("tool_calls" if complete and reason == "stop" else reason)

    def _step(self, out: list[dict], final: bool) -> bool:
        raise NotImplementedError

    def _whole(self) -> bool:
        raise NotImplementedError

    def _say(self, out: list[dict], text: str) -> None:
        if self.calls and not self._said:  # content that starts after a call starts at its first word
            text = text.lstrip()
        if text:
            out.append({"content": text})
            self._said = True

    def _begin(self, out: list[dict], name: str) -> None:
        """A call of ``name`` starts: its first delta (``index``, ``id``, ``type``, ``name``, no arguments)."""
        out.append({"tool_calls": [{"index": self.calls, "id": self._new_id(), "type": "function",
                                    "function": {"name": name, "arguments": ""}}]})
        self.calls += 1
        self._arg_parts = []

    @staticmethod
    def _new_id() -> str:
        """A call's ``id``: ``call_`` and 24 hex digits (vLLM's ``make_tool_call_id``)."""
        return "call_" + uuid.uuid4().hex[:24]

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

    def _args_until(self, out: list[dict], ends: tuple[str, ...], final: bool) -> bool | None:
        """Send the argument text at the start of ``_buf`` (a call's JSON arguments, from their ``{``)
        up to the brace that closes them (:meth:`_scan`), or up to the first of ``ends`` should one
        come before it: the family's markers that end a call's message or block wherever they stand,
        in a JSON string too, as the model's special tokens do and vLLM's parsers read them (a marker
        is never argument text, nor is every message after it). The possible start of a marker at
        the end of ``_buf`` is held back until more text says what it is. Returns True when the
        arguments closed, False when a marker cut them short (the marker then starts ``_buf``; the
        call was cut short, ``_short``: it keeps what it sent and is not whole), None while more
        text is needed. Arguments that closed but are no JSON object (``{"city": x}``, a ``]`` that
        closes the ``{``: :meth:`_scan` counts brackets only) were broken too: the call keeps what it
        sent and is not whole, as one a marker cut short (they ended "tool_calls", and
        ``/v1/messages`` read them as the input ``{}``, ``tool_use``)."""
        buf = self._buf
        found = [at for m in ends if (at := buf.find(m)) >= 0]
        keep = 0 if final or found else max((_tag_start(buf, m) for m in ends), default=0)
        upto = min(found) if found else len(buf) - keep
        i = self._scan(buf[:upto])
        self._args(out, buf[:i])
        self._arg_parts.append(buf[:i])
        self._buf = buf[i:]
        if i and not self._depth:
            if not _json_object("".join(self._arg_parts)):
                self._short = True
            self._arg_parts = []
            return True
        if not found:
            return None
        self._depth, self._in_str, self._esc, self._short = 0, False, False, True
        return False

    def _content_until(self, out: list[dict], markers: tuple[str, ...], final: bool) -> tuple[int, str] | None:
        """Send the content of ``_buf`` up to the first of ``markers``: ``(index, marker)`` of it
        (``_ws`` the whitespace right before it, which is not sent), or None when there is none
        (then all is sent but a possible start of a marker and trailing whitespace, kept in
        ``_buf`` until more text or the end says what they are; at the end, whitespace after calls
        is dropped)."""
        buf = self._buf
        found = [(at, m) for m in markers if (at := buf.find(m)) >= 0]
        if found:
            at, marker = min(found)
            sent = buf[:at].rstrip()
            self._say(out, sent)
            self._ws = buf[len(sent):at]
            return at, marker
        if final:
            if self.forced:  # (a marker's start: under a forced choice, the call's)
                buf = buf[:len(buf) - max((_tag_start(buf, m) for m in markers), default=0)]
            if buf.strip() or not self.calls:
                self._say(out, buf)
            self._buf = ""
            return None
        keep = max((_tag_start(buf, m) for m in markers), default=0)
        sent = buf[:len(buf) - keep].rstrip()
        self._say(out, sent)
        self._buf = buf[len(sent):]
        return None


_NAME_CHARS = re.compile(r"[A-Za-z0-9_-]*")


def _json_object(text: str) -> bool:
    """Whether ``text`` is the JSON text of an object (one nested past Python's recursion limit is not)."""
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _tag_start(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag`` (0 if none)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def is_name_start(text: str, functions: dict[str, dict]) -> bool:
    """Whether ``text`` (a call's name as read so far) may still become one of ``functions``' names."""
    return any(name.startswith(text) for name in functions)


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
    typed = _expect(s, i, '"type"')  # Llama 3's {"type": "function", "name": ...} (llama.cpp reads it too)
    if isinstance(typed, int):
        i = _expect(s, _expect(s, _expect(s, typed, ":"), '"function"'), ",")
    elif typed is _MORE:
        return _MORE
    i = _expect(s, i, '"name"')
    i = _expect(s, i, ":")
    i = _expect(s, i, '"')
    if not isinstance(i, int):
        return i
    j = _NAME_CHARS.match(s, i).end()
    if j == len(s):
        return _MORE if is_name_start(s[i:j], functions) else None
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
