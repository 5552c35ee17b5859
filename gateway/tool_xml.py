"""Qwen3-Coder's XML tool calls: :class:`Qwen3CoderStream` (``--tool-call-parser qwen3_coder``).

The syntax, as Qwen3-Coder's chat template renders a call and asks for one::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between ``<parameter=P>`` and ``</parameter>``, less one newline at either
end; a value the model left without its ``</parameter>`` ends at the next tag of the call (the
next ``<parameter=``, ``</function>``, the block's ``</tool_call>``), as vLLM's
``qwen3coder_tool_parser.py`` reads it (``tool_call_parameter_regex``). Its JSON type is the
function's schema's for ``P`` (vLLM's ``_convert_param_value``): a parameter the schema types
``string``, types not at all, or does not list keeps the text as a string; any other type (its
``anyOf`` branches' where it has no ``type``) takes the text as JSON (``3``, ``true``,
``{"a": 1}``, ``null``), else as the Python literal it is (``True``, ``None``, ``['a']``: the
chat template writes the history's values in Python's spelling), else as a string.
"""

from __future__ import annotations

import json

from gateway.call_stream import _NAME_CHARS, _WS, CallStream, _tag_start, is_name_start, json_text, literal_json

__all__ = ["Qwen3CoderStream", "param_is_text"]

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_FN, _FN_END = "<function=", "</function>"
_P, _P_END = "<parameter=", "</parameter>"
_MAX_NAME = 256  # the longest parameter name read: a "<parameter=" without ">" in so many characters names none
_TEXT, _HEAD, _PARAMS, _PNAME, _VSTART, _VALUE, _AGAIN, _TAIL, _SKIP = (
    "text", "head", "params", "pname", "vstart", "value", "again", "tail", "skip")  # Qwen3CoderStream's states


class Qwen3CoderStream(CallStream):
    """The incremental parser of Qwen3-Coder's calls (the syntax: :mod:`gateway.tool_xml`).

    A call starts at ``<tool_call>`` (or at a ``<function=`` without it, which vLLM also reads)
    anywhere in the answer; the text before it is content, whitespace right before it dropped.
    Its first delta comes once ``<function=N>`` is read and ``N`` is one of ``functions`` (else
    the block is content, tag and all); its ``arguments`` are the JSON object of its parameters,
    built as they come: ``{`` at once, ``"P": `` when a parameter's name is read, a string
    value's characters (escaped) as they are generated (holding back only what may be the start
    of a tag that ends it, ``\\n</parameter>`` or another), any other value whole at its end,
    ``}`` at ``</function>`` (or at the block's ``</tool_call>``, should the model leave
    ``</function>`` out). A value without its ``</parameter>`` ends at the next ``<parameter=``
    or at one of these tags, as vLLM's parser reads it. Text between the tags that is no
    parameter (a stray word, a ``<parameter=`` with no name) is read past, as vLLM's parser finds
    parameters by their tags; so is a parameter given again (its first value stands, as it went
    out when read: an object names each key once; vLLM's whole answer keeps the last value, its
    stream sends both). The arguments are always the JSON object of the parameters read, never
    text that breaks off: a call the output ended inside (the model's end, a stop string) is
    closed there, its last value what was written of it (vLLM's parser reads a parameter or
    function the output ended inside to the end); only one cut by ``max_tokens`` keeps what it
    sent, as every family's call cut so does. Every call after the first is dropped when
    ``parallel`` is False. Calls are whole (``finish_reason: "tool_calls"``) once their ``}``
    went out at ``</function>`` or ``</tool_call>``; one closed at the output's end was cut short
    (``stop``)."""

    __slots__ = ("_state", "_tagged", "_fn", "_params", "_text_value", "_open_args", "_names", "_length", "_seen")

    def __init__(self, functions: dict[str, dict], parallel: bool = True, bare: bool = False,
                 forced: bool = False) -> None:
        super().__init__(functions, parallel, bare, forced)
        self._state = _TEXT
        self._tagged = False  # the call opened with <tool_call> (so it closes with </tool_call>)
        self._fn: dict = {}  # the called function's definition
        self._params = 0  # parameters begun in the current call
        self._text_value = False  # VALUE: the value is a string, streamed as it comes
        self._open_args = False  # a call's arguments began and their "}" has not gone out
        self._names: set[str] = set()  # the parameters of the current call read so far
        self._length = False  # finish: max_tokens cut the output (a call open then keeps what it sent)
        self._seen = 0  # VALUE, AGAIN: the characters of _buf searched for an end tag without one found

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        self._length = reason == "length"
        return super().finish(reason)

    def _whole(self) -> bool:
        return not self._open_args  # (and one closed at the output's end was cut short: CallStream._short)

    def _step(self, out: list[dict], final: bool) -> bool:
        buf, state = self._buf, self._state
        if state == _TEXT:
            found = self._content_until(out, (_OPEN, _FN), final)
            if found is None:
                return False
            at, marker = found
            self._tagged = marker == _OPEN
            self._buf = buf[at + len(marker):]
            if self.calls and not self.parallel:
                self._state = _SKIP
            else:
                self._state = _HEAD
            return True
        if state == _HEAD:
            head = _head(buf, self._tagged, self.functions)
            if head is None and not final:
                return False
            if head is None and self._cut:  # a call cut off before its parameters (CallStream)
                self._buf, self._ws, self._state = "", "", _SKIP
                return True
            if not head:  # not a call: the block is content, and read on as text
                self._say(out, self._ws + (_OPEN if self._tagged else _FN))
                self._ws, self._state = "", _TEXT
                return True
            name, end = head
            self._begin(out, name)
            self._args(out, "{")
            self._fn, self._params, self._open_args, self._names = self.functions[name], 0, True, set()
            self._buf, self._state = buf[end:], _PARAMS
            return True
        if state == _PARAMS:  # the next <parameter=, the </function> (or the block's </tool_call>) that ends them
            ends = self._tags()
            found = _first(buf, ends)
            if not found:  # (text between the tags is no parameter: read past, as vLLM's parser reads them by tag)
                if final:
                    return self._ended_inside(out)
                self._buf = buf[len(buf) - max(_tag_start(buf, tag) for tag in ends):]
                return False
            at, tag = found
            if tag == _P:
                self._buf, self._state = buf[at + len(tag):], _PNAME
                return True
            self._args(out, "}")  # (a </tool_call> without </function>: the call ends there too)
            self._open_args = False
            self._buf, self._state = buf[at + len(tag):], _TAIL if tag == _FN_END and self._tagged else _TEXT
            return True
        if state == _PNAME:
            end = buf.find(">")
            if end < 0:
                if final:
                    return self._ended_inside(out)
                if len(buf) > _MAX_NAME or "<" in buf:  # no parameter's name: read on past it, to the next tag
                    self._state = _PARAMS
                    return True
                return False
            name = buf[:end]
            if len(name) > _MAX_NAME or "<" in name:  # (as above, seen whole)
                self._state = _PARAMS
                return True
            if name in self._names:  # given again: read past to its end (the first value stands)
                self._buf, self._state, self._seen = buf[end + 1:], _AGAIN, 0
                return True
            self._names.add(name)
            self._text_value = param_is_text(self._fn, name)
            key = json.dumps(name, ensure_ascii=False) + ": " + ('"' if self._text_value else "")
            self._args(out, (", " if self._params else "") + key)
            self._params += 1
            self._buf, self._state = buf[end + 1:], _VSTART
            return True
        if state == _VSTART:  # one newline after <parameter=P> is the syntax's, not the value's
            if not buf and not final:
                return False
            if not buf:
                return self._ended_inside(out, "")
            self._buf, self._state, self._seen = buf[1:] if buf.startswith("\n") else buf, _VALUE, 0
            return True
        if state in (_VALUE, _AGAIN):  # to its </parameter>, or to a tag that ends it without one (vLLM's reading)
            ends = (_P_END, *self._tags())
            found = _first(buf, ends, self._seen)
            # (a typed value is held whole: the next search starts where a tag may still begin; none is longer)
            self._seen = max(0, len(buf) - len(_P_END))
            if not found and state == _AGAIN:
                if final:
                    return self._ended_inside(out)
                self._buf, self._seen = buf[len(buf) - _held(buf, ends):], 0
                return False
            if not found:
                if final and not self._length:
                    return self._ended_inside(out, buf)
                if self._text_value:
                    keep = 0 if final else _held(buf, ends)
                    self._args(out, _escaped(buf[:len(buf) - keep]))
                    self._buf, self._seen = buf[len(buf) - keep:], 0
                elif final:
                    self._buf = ""  # a typed value cut before its end: it is not sent
                return False
            at, tag = found
            if state == _VALUE:  # (less the newline before its end, which is the syntax's)
                value = buf[:at - 1] if buf[:at].endswith("\n") else buf[:at]
                self._args(out, _escaped(value) + '"' if self._text_value else _typed(value))
            # (a tag that ends the value without </parameter> is read on as the parameters' own)
            self._buf, self._state = buf[at + len(_P_END):] if tag == _P_END else buf[at:], _PARAMS
            return True
        if state == _TAIL:
            rest = buf.lstrip(_WS)
            if rest.startswith(_CLOSE):
                self._buf, self._state = rest[len(_CLOSE):], _TEXT
                return True
            if not final and _CLOSE.startswith(rest):
                self._buf = rest
                return False
            self._buf, self._state = rest, _SKIP
            return True
        close = _CLOSE if self._tagged else _FN_END  # _SKIP: drop the rest of the block
        at = buf.find(close)
        if at < 0:
            self._buf = "" if final else buf[len(buf) - _tag_start(buf, close):]
            return False
        self._buf, self._state = buf[at + len(close):], _TEXT
        return True

    def _ended_inside(self, out: list[dict], value: str = "") -> bool:
        """The output ended inside the call's parameters: unless ``max_tokens`` cut it (then it
        keeps what it sent), the call is closed -- a value open in it (its text not sent yet,
        ``value``) ends, less what may have been the start of a tag that ends it (``\\n</parameter>``,
        ``\\n<parameter=``, ...), then ``}`` -- and it was cut short (``stop``, not ``tool_calls``)."""
        if not self._length:
            if self._state in (_VSTART, _VALUE):
                value = value[:len(value) - _held(value, (_P_END, *self._tags()))]
                self._args(out, _escaped(value) + '"' if self._text_value else _typed(value))
            self._args(out, "}")
            self._open_args, self._short = False, True
        self._buf, self._state = "", _SKIP
        return True

    def _tags(self) -> tuple[str, ...]:
        """The tags that end a call's parameters (and a value without its ``</parameter>``): the
        next ``<parameter=``, ``</function>``, and the ``</tool_call>`` of a block that opened with
        ``<tool_call>`` (vLLM's parser reads the call inside its block)."""
        return (_P, _FN_END, _CLOSE) if self._tagged else (_P, _FN_END)


def _first(buf: str, tags: tuple[str, ...], start: int = 0) -> tuple[int, str] | None:
    """``(index, tag)`` of the first of ``tags`` in ``buf`` from ``start`` on, or None."""
    found = [(at, tag) for tag in tags if (at := buf.find(tag, start)) >= 0]
    return min(found) if found else None


def _held(value: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of ``value`` (a value's text so far) may be the start of one
    of ``tags`` that would end it, with the newline before it (the syntax's, not the value's)."""
    return max(max(_tag_start(value, "\n" + tag), _tag_start(value, tag)) for tag in tags)


def _head(s: str, tagged: bool, functions: dict[str, dict]) -> tuple[str, int] | None | bool:
    """The block after its marker read up to the parameters: ``(name, end)`` (``end`` past
    ``<function=N>`` and its newline), None while more text may make it one, False when it cannot."""
    i = 0
    if tagged:
        i = len(s) - len(s.lstrip(_WS))
        part = s[i:i + len(_FN)]
        if part != _FN:
            return None if i + len(part) == len(s) and _FN.startswith(part) else False
        i += len(_FN)
    j = _NAME_CHARS.match(s, i).end()
    if j == len(s):
        return None if is_name_start(s[i:j], functions) else False
    if s[j] != ">" or s[i:j] not in functions:
        return False
    return s[i:j], j + 1


def param_is_text(function: dict, name: str) -> bool:
    """Whether parameter ``name`` of ``function`` (a definition with its ``parameters`` schema) takes
    the value's text as a string: typed ``string`` (alone or with ``null``), not typed, or not in
    the schema (vLLM's rule). Its type is the schema's ``type``, or where it has none the types of
    its ``anyOf`` (or ``oneOf``) branches (vLLM reads ``anyOf`` so: ``Optional[int]`` in pydantic's
    schema is ``{"anyOf": [{"type": "integer"}, {"type": "null"}]}``); of several types, ``null``
    aside, it takes none (the text stays a string)."""
    props = function.get("parameters", {}).get("properties")
    prop = props.get(name) if isinstance(props, dict) else None
    kinds = _types(prop)
    kinds = [k for k in kinds if k != "null"] if len(kinds) > 1 else kinds
    return len(kinds) != 1 or kinds[0] == "string"


def _types(prop: object) -> list:
    """The JSON types a parameter's schema ``prop`` names: its ``type`` (one or a list), else those
    of its ``anyOf`` or ``oneOf`` branches; [] where it names none."""
    if not isinstance(prop, dict):
        return []
    kind = prop.get("type")
    if kind is not None:
        return kind if isinstance(kind, list) else [kind]
    branches = prop.get("anyOf", prop.get("oneOf"))
    if not isinstance(branches, list):
        return []
    kinds = [_types(b) for b in branches]
    return [] if any(not k for k in kinds) else [k for ks in kinds for k in ks]


def _escaped(text: str) -> str:
    """``text`` as it is inside a JSON string (a piece of one: escapes never span two pieces)."""
    return json.dumps(text, ensure_ascii=False)[1:-1]


def _typed(text: str) -> str:
    """A typed parameter's value text as JSON: itself where it is JSON, else the Python literal it
    is (``True``, ``None``, ``['a', 'b']``: Qwen3-Coder's chat template writes a call's values of
    the history with Jinja's ``string``, Python's spelling; vLLM's parser reads them with
    ``ast.literal_eval``), else the text as a string."""
    try:
        return json_text(json.loads(text, parse_constant=_refuse))
    except (ValueError, RecursionError):
        literal = literal_json(text)
        return literal if literal is not None else json.dumps(text, ensure_ascii=False)


def _refuse(constant: str):
    raise ValueError(constant)
