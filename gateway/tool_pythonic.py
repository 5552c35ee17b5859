"""Llama 3.2's (and Llama 4's) "pythonic" tool calls: :class:`PythonicStream` (``--tool-call-parser
pythonic``, vLLM's name).

The syntax, as Llama 3.2's chat template asks for it ("If you decide to invoke any of the
function(s), you MUST put it in the format of [func_name1(params_name1=params_value1,
params_name2=params_value2...), func_name2(params)]")::

    [get_weather(city="Paris", days=3), get_time(zone='UTC')]

as the whole answer (``<|python_tag|>`` before it allowed, as Llama 3.x's ipython turns write
it), keyword arguments only, each once, each value a Python literal: strings in either quotes,
numbers, ``True``/``False``/``None``, lists, tuples and dicts of them (JSON's
``true``/``false``/``null`` are taken too: what a JSON-minded model writes, and what the
``tool_choice`` grammar asks for). A call's ``arguments`` are the JSON object of its keyword
arguments, in the order written. Values are read with :mod:`ast` (never evaluated;
:func:`gateway.call_stream.literal_json`), as vLLM's ``PythonicToolParser`` reads them. A call that is not this syntax (a positional argument, ``*x``,
a value that is no literal, a keyword given twice) is no call: the arguments a client gets are
always a whole JSON object, never text that breaks off.
"""

from __future__ import annotations

import json
import re

from gateway.call_stream import _WS, CallStream, is_name_start, literal_json

__all__ = ["PythonicStream"]

_START, _HEAD, _ARG, _VALUE, _AFTER, _TEXT, _DROP = "start", "head", "arg", "value", "after", "text", "drop"
_KEY = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)[ \t]*=")  # a keyword argument's "k="
_PARTIAL_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_]*[ \t]*")  # its start
_NAME = re.compile(r"[A-Za-z0-9_-]*")
_SPACE = re.compile(f"[{_WS}]*")
_PREFIX = "<|python_tag|>"
_CLOSERS = {"(": ")", "[": "]", "{": "}"}


class PythonicStream(CallStream):
    """The incremental parser of pythonic calls (the syntax: :mod:`gateway.tool_pythonic`).

    An answer that starts (after whitespace and an optional ``<|python_tag|>``) with ``[`` and a
    call ``N(`` of one of ``functions`` may be calls. Each call is read whole before it goes out --
    its name, each keyword argument, its ``)`` -- and then sent as two deltas: its first (``index``,
    ``id``, ``type``, ``name``) and its ``arguments``, the JSON object of its keyword arguments.
    Calls are separated by ``,``, and the list ends at ``]``, after which text is content. Any
    other answer is content, whole (as Llama 3's JSON: the syntax has no marker, so it is read at
    the answer's start only, ``bare`` or not, and a call needs a given function's name).

    A call that breaks the syntax (a positional argument or ``*x``, a value that is no literal, a
    keyword given twice, a wrong bracket, an output that ended inside the call on its own) is no
    call: when it is the answer's first the whole answer is content, as vLLM's parser answers an
    output it cannot read; after a whole call it and the rest of the answer are dropped, as is
    every call after the first when ``parallel`` is False. A call the output was cut in
    (``max_tokens``, or anyhow under a forced choice) is dropped, neither content nor call
    (:class:`~gateway.call_stream.CallStream`). So a call's arguments are always a whole JSON
    object; what a stream gives up is their arrival in pieces."""

    __slots__ = ("_state", "_at", "_name", "_key", "_parts", "_keys", "_value")

    def __init__(self, functions: dict[str, dict], parallel: bool = True, bare: bool = False,
                 forced: bool = False) -> None:
        super().__init__(functions, parallel, bare, forced)
        self._state = _START
        self._at = 0  # where the call being read continues in _buf (its text stays there until it is whole)
        self._name = self._key = ""  # the call being read, and the keyword whose value is being read
        self._parts: list[str] = []  # its keyword arguments read, each as '"k": <JSON>'
        self._keys: set[str] = set()
        self._value = _ValueScan(0)  # VALUE: the scan of the value being read, resumed as text comes

    def _whole(self) -> bool:
        return True  # (a call goes out whole, or not at all)

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
            self._at, self._state = head, _HEAD  # (the answer's text stays: content, should the call break)
            return True
        if state == _HEAD:  # at a call's name: "N("
            i = _SPACE.match(buf, self._at).end()
            j = _NAME.match(buf, i).end()
            if j == len(buf):
                return False if not final else self._broken(more=True)
            if buf[i:j] not in self.functions or buf[j] != "(":
                return self._broken()
            self._name, self._parts, self._keys = buf[i:j], [], set()
            self._at, self._state = j + 1, _ARG
            return True
        if state == _ARG:  # "k=" or ")"
            i = _SPACE.match(buf, self._at).end()
            if buf.startswith(")", i):
                self._begin(out, self._name)
                self._args(out, "{" + ", ".join(self._parts) + "}")
                self._buf, self._at, self._state = buf[i + 1:], 0, _AFTER
                return True
            m = _KEY.match(buf, i)
            if m is None:
                if i == len(buf) or _PARTIAL_KEY.fullmatch(buf, i):
                    return False if not final else self._broken(more=True)
                return self._broken()  # (a positional argument, *x, a stray bracket)
            if m.group(1) in self._keys:
                return self._broken()  # (a keyword given twice: no Python call, and no one JSON object)
            self._key, self._at, self._state, self._value = m.group(1), m.end(), _VALUE, _ValueScan(m.end())
            return True
        if state == _VALUE:
            end = self._value.end(buf)
            if end is None:
                return False if not final else self._broken(more=True)
            value = literal_json(buf[self._at:end])
            if value is None:
                return self._broken()
            self._parts.append(json.dumps(self._key) + ": " + value)
            self._keys.add(self._key)
            self._at, self._state = end + 1 if buf.startswith(",", end) else end, _ARG  # (")" ends the call, in _ARG)
            return True
        if state == _AFTER:  # "," and the next call, or "]"
            rest = buf.lstrip(_WS)
            if not rest:
                self._buf = ""
                return False
            if rest[0] == "]":
                self._buf, self._state = rest[1:], _TEXT
            elif rest[0] == "," and self.parallel:
                self._buf, self._at, self._state = rest[1:], 0, _HEAD
            else:
                self._state = _DROP
            return True
        if state == _TEXT:
            self._content_until(out, (), final)
            return False
        self._buf = ""  # _DROP
        return False

    def _broken(self, more: bool = False) -> bool:
        """The call being read is none. ``more``: the output ended where more text might have made
        it one -- dropped when the output was cut (:class:`~gateway.call_stream.CallStream`), else
        broken like any call that breaks the syntax: the answer's first makes the whole answer
        content (its text is all still in ``_buf``), a later one is dropped with the rest."""
        if (more and self._cut) or self.calls:
            self._buf, self._state = "", _DROP
        else:
            self._at, self._state = 0, _TEXT
        return True


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


class _ValueScan:
    """The search for the ``,`` or ``)`` that ends a keyword argument's value (outside brackets and
    Python strings), resumed where it stopped as more text comes, so each character is looked at
    once: a value searched from its start at every delta cost time quadratic in its length (a 32 kB
    string value fed 4 characters a delta, ~23 s of CPU; Qwen3-Coder's typed values likewise, fixed
    in c662d38)."""

    __slots__ = ("_i", "_stack", "_quote")

    def __init__(self, start: int) -> None:
        self._i = start  # where the search goes on: the value starts at ``start`` of the text
        self._stack: list[str] = []  # the closers of the brackets open
        self._quote = ""  # the quote of the string open ("'", '"', or three of either)

    def end(self, s: str) -> int | None:
        """The index in ``s`` (the text so far; each call's ``s`` goes on from the last's) of the ``,``
        or ``)`` that ends the value, or None when ``s`` has none yet (a quote that may still become
        three, at the end of ``s``, waits for the text after it)."""
        stack, quote, i, n = self._stack, self._quote, self._i, len(s)
        while i < n:
            c = s[i]
            if quote:
                if c == "\\":
                    i += 1
                elif c == quote[0] and len(quote) == 3 and n - i < 3 and quote.startswith(s[i:]):
                    break  # (the end of a triple-quoted string, or a quote inside it: the next text says)
                elif s.startswith(quote, i):
                    i += len(quote) - 1
                    quote = ""
            elif c in "'\"":
                if s[i:] in (c, c * 2):
                    break  # (a string's start, or three quotes' start: the next text says)
                quote = c * 3 if s.startswith(c * 3, i) else c
                i += len(quote) - 1
            elif c in _CLOSERS:
                stack.append(_CLOSERS[c])
            elif stack and c == stack[-1]:
                stack.pop()
            elif not stack and c in ",)":
                return i
            elif c in ")]}":
                if not stack:
                    return i  # (a closer that does not match: the value ends, broken)
                break  # (inside brackets: no end, however much text comes)
            i += 1
        self._i, self._quote = i, quote
        return None
