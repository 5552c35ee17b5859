"""Llama 3.2's (and Llama 4's) "pythonic" tool calls: :class:`PythonicStream` (``--tool-call-parser
pythonic``, vLLM's name).

The syntax, as Llama 3.2's chat template asks for it ("If you decide to invoke any of the
function(s), you MUST put it in the format of [func_name1(params_name1=params_value1,
params_name2=params_value2...), func_name2(params)]")::

    [get_weather(city="Paris", days=3), get_time(zone='UTC')]

as the whole answer (``<|python_tag|>`` before it allowed, as Llama 3.x's ipython turns write
it), keyword arguments only, each value a Python literal: strings in either quotes, numbers,
``True``/``False``/``None``, lists, tuples and dicts of them (JSON's ``true``/``false``/``null``
are taken too: what a JSON-minded model writes, and what the ``tool_choice`` grammar asks for).
A call's ``arguments`` are the JSON object of its keyword arguments, in the order written.
Values are read with :mod:`ast` (never evaluated), as vLLM's ``PythonicToolParser`` reads them.
"""

from __future__ import annotations

import ast
import json
import re
import warnings

from gateway.call_stream import _WS, CallStream, is_name_start, json_text

__all__ = ["PythonicStream", "literal_json"]

_START, _HEAD, _ARG, _VALUE, _AFTER, _TEXT, _DROP = "start", "head", "arg", "value", "after", "text", "drop"
_KEY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)[ \t]*=")  # a keyword argument's "k="
_PARTIAL_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*[ \t]*")  # its start
_NAME = re.compile(r"[A-Za-z0-9_-]*")
_PREFIX = "<|python_tag|>"
_JSON_NAMES = {"true": True, "false": False, "null": None}
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


class PythonicStream(CallStream):
    """The incremental parser of pythonic calls (the syntax: :mod:`gateway.tool_pythonic`).

    An answer that starts (after whitespace and an optional ``<|python_tag|>``) with ``[`` and a
    call ``N(`` of one of ``functions`` is calls: held back until that header says so, then the
    call's first delta (``index``, ``id``, ``type``, ``name``) and ``{``; each keyword argument
    goes out as ``"k": <JSON>`` once its value ends (the ``,`` or ``)`` after it, outside brackets
    and strings), ``}`` at the call's ``)``; calls are separated by ``,``, and the list ends at
    ``]``, after which text is content. Any other answer is content, whole (as Llama 3's JSON: the
    syntax has no marker, so it is read at the answer's start only, ``bare`` or not, and a call
    needs a given function's name). A call that breaks the syntax after it began (a positional
    argument, a value that is no literal) keeps what it sent and the rest of the answer is
    dropped, as is every call after the first when ``parallel`` is False. Calls are whole
    (``finish_reason: "tool_calls"``) once their ``}`` went out."""

    __slots__ = ("_state", "_args_said", "_open")

    def __init__(self, functions: dict[str, dict], parallel: bool = True, bare: bool = False,
                 forced: bool = False) -> None:
        super().__init__(functions, parallel, bare, forced)
        self._state = _START
        self._args_said = 0  # keyword arguments sent in the current call
        self._open = False  # a call's "{" went out and its "}" has not

    def _whole(self) -> bool:
        return not self._open

    def _step(self, out: list[dict], final: bool) -> bool:
        buf, state = self._buf, self._state
        if state == _START:
            head = _list_head(buf, self.functions)
            if head is None and not final:
                return False
            said = buf.strip()  # (auto: the start of <|python_tag|> alone may be text; the whole tag is a marker)
            if head is None and self._cut and said and (self.forced or said == _PREFIX or not _PREFIX.startswith(said)):
                self._buf, self._state = "", _DROP  # a call cut off before its arguments (CallStream)
                return True
            if not head:
                self._state = _TEXT
                return True
            self._buf, self._state = buf[head:], _HEAD
            return True
        if state == _HEAD:  # at a call's name: "N("
            i = len(buf) - len(buf.lstrip(_WS))
            j = _NAME.match(buf, i).end()
            if j == len(buf) and not final:
                return False
            if buf[i:j] not in self.functions or buf[j:j + 1] != "(":
                self._state = _DROP  # (after a call: the rest is no call, and dropped)
                return True
            self._begin(out, buf[i:j])
            self._args(out, "{")
            self._open, self._args_said = True, 0
            self._buf, self._state = buf[j + 1:], _ARG
            return True
        if state == _ARG:  # "k=" or ")"
            rest = buf.lstrip(_WS)
            if rest.startswith(")"):
                self._args(out, "}")
                self._open = False
                self._buf, self._state = rest[1:], _AFTER
                return True
            m = _KEY.match(rest)
            if m is None:
                if not final and (not rest or _PARTIAL_KEY.fullmatch(rest)):
                    self._buf = rest
                    return False
                self._state = _DROP
                return True
            self._buf, self._state = rest[m.end():], _VALUE
            self._args(out, (", " if self._args_said else "") + json.dumps(m.group(1)) + ": ")
            self._args_said += 1
            return True
        if state == _VALUE:
            end = _value_end(buf)
            if end is None:
                if final:
                    self._state = _DROP
                    return True
                return False
            value = literal_json(buf[:end])
            if value is None:
                self._state = _DROP
                return True
            self._args(out, value)
            tail = buf[end:]
            self._buf = tail[1:] if tail.startswith(",") else tail  # (")" is read as the call's end)
            self._state = _ARG
            return True
        if state == _AFTER:  # "," and the next call, or "]"
            rest = buf.lstrip(_WS)
            if not rest:
                self._buf = ""
                return False
            if rest[0] == "]":
                self._buf, self._state = rest[1:], _TEXT
            elif rest[0] == "," and self.parallel:
                self._buf, self._state = rest[1:], _HEAD
            else:
                self._state = _DROP
            return True
        if state == _TEXT:
            self._content_until(out, (), final)
            return False
        self._buf = ""  # _DROP
        return False


def _list_head(s: str, functions: dict[str, dict]) -> int | bool | None:
    """The answer's start ``s`` read up to its first call's name: the index of that name, None
    while more text may make it one, False when it cannot."""
    i = len(s) - len(s.lstrip(_WS))
    part = s[i:i + len(_PREFIX)]
    if part == _PREFIX:
        i += len(_PREFIX)
        i += len(s[i:]) - len(s[i:].lstrip(_WS))
    elif _PREFIX.startswith(part) and part:
        return None if i + len(part) == len(s) else False
    if i == len(s):
        return None
    if s[i] != "[":
        return False
    j = i + 1 + len(s[i + 1:]) - len(s[i + 1:].lstrip(_WS))
    k = _NAME.match(s, j).end()
    if k == len(s):
        return None if is_name_start(s[j:k], functions) else False
    return j if s[k] == "(" and s[j:k] in functions else False


def _value_end(s: str) -> int | None:
    """The index of the ``,`` or ``)`` that ends the argument value at the start of ``s``
    (outside brackets and Python strings), or None when ``s`` has none yet."""
    stack: list[str] = []
    quote, i = "", 0
    while i < len(s):
        c = s[i]
        if quote:
            if c == "\\":
                i += 1
            elif s.startswith(quote, i):
                i += len(quote) - 1
                quote = ""
        elif c in "'\"":
            quote = c * 3 if s.startswith(c * 3, i) else c
            i += len(quote) - 1
        elif c in _CLOSERS:
            stack.append(_CLOSERS[c])
        elif stack and c == stack[-1]:
            stack.pop()
        elif not stack and c in ",)":
            return i
        elif c in ")]}":
            return i if not stack else None  # (a closer that does not match: the value ends, broken)
        i += 1
    return None


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
