"""gpt-oss's output in OpenAI's harmony format: its channels split into reasoning and answer
(:class:`HarmonyThink`, ``--reasoning-parser openai_gptoss``, vLLM's name) and its function calls
read as tool calls (:class:`HarmonyStream`, ``--tool-call-parser openai``, vLLM's name).

The format (OpenAI's harmony docs, ``docs/format.md`` of openai/harmony): the output is messages,
each ``header<|message|>content`` ended by ``<|end|>`` (another message follows, opened by
``<|start|>``) or by the stop tokens ``<|return|>`` (the answer is done) and ``<|call|>`` (a
tool is called). The generation prompt ends with ``<|start|>assistant``, so the first message's
header has no role and no ``<|start|>``::

    <|channel|>analysis<|message|>User asks the weather. Call get_weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

    <|channel|>analysis<|message|>Simple.<|end|><|start|>assistant<|channel|>final<|message|>2 + 2 = 4.<|return|>

A header holds the role (``assistant``), the channel (``<|channel|>analysis``, ``commentary`` or
``final``), the recipient of a tool call (``to=functions.N``, "in the role or channel section of
the header": before ``<|channel|>`` as well as after it) and the content type of its arguments
(``<|constrain|>json``, or ``json`` alone). These markers are special tokens of gpt-oss's
tokenizer; the worker decodes them as their text (``worker.models.tool_markers``), except the stop
tokens, which end the output and are no text (as EOS in every family), so neither parser needs
them.

The channels (vLLM's and llama.cpp's reading): ``analysis`` is the reasoning; ``final`` the
answer; ``commentary`` without a recipient a preamble shown to the user (answer); a message to
``functions.N`` a call of tool ``N``. Other recipients (the built-in ``browser``, ``python``
tools) are read by their channel.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from gateway.call_stream import _WS, CallStream, _tag_start
from gateway.split_stream import SplitStream

__all__ = ["HarmonyStream", "HarmonyThink", "Header", "parse_header"]

START, MESSAGE, END, RETURN, CALL = "<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>"
_ENDS = (END, RETURN, CALL)
_MAX_HEADER = 256  # characters a header may take before its <|message|> (gpt-oss's are ~60)
_HEADER = re.compile(r"\s*(?:assistant\b)?[ \t]*(?:to=(?P<r1>[^\s<]+))?[ \t]*(?:<\|channel\|>(?P<ch>\w+))?[ \t]*"
                     r"(?:to=(?P<r2>[^\s<]+))?[ \t]*(?:<\|constrain\|>)?[ \t]*(?P<ct>\w+)?\s*")  # (one line)
_FUNCTIONS = "functions."


class Header(NamedTuple):
    """A message's header: ``channel`` (``""`` when it names none), ``recipient`` (``""`` for none)."""

    channel: str
    recipient: str

    @property
    def function(self) -> str | None:
        """The function a message to ``functions.N`` calls (``N``), else None."""
        return self.recipient[len(_FUNCTIONS):] if self.recipient.startswith(_FUNCTIONS) else None

    @property
    def kind(self) -> str:
        """What its content is: ``"call"``, ``"reasoning"`` (analysis) or ``"content"`` (the rest)."""
        if self.function is not None:
            return "call"
        return "reasoning" if self.channel == "analysis" else "content"


def parse_header(text: str) -> Header | None:
    """The header ``text`` (what comes before ``<|message|>``, after ``<|start|>`` if any), or None
    when it is none (it names neither a channel nor a recipient, or is not in the format)."""
    m = _HEADER.fullmatch(text) if len(text) <= _MAX_HEADER else None
    if m is None or not (m["ch"] or m["r1"] or m["r2"]):
        return None
    return Header(m["ch"] or "", m["r1"] or m["r2"] or "")


def _may_be_header(text: str) -> bool:
    """Whether ``text`` (without ``<|message|>`` yet) may still become a header: it starts as one
    (``<|channel|>``, ``to=``, after an optional ``assistant``), on one line, within the bound."""
    if len(text) > _MAX_HEADER or "\n" in text.strip() or any(m in text for m in (START, *_ENDS)):
        return False
    t = text.lstrip()
    if "assistant".startswith(t):
        return True
    if t.startswith("assistant"):
        t = t[len("assistant"):].lstrip()
    return any(t.startswith(h) or h.startswith(t) for h in ("to=", "<|channel|>"))


_HEAD, _BODY = "head", "body"  # HarmonyThink's states


class HarmonyThink(SplitStream):
    """One choice's harmony output split into reasoning and answer as it is generated (a
    :class:`~gateway.split_stream.SplitStream`: :meth:`feed` the text, get ``[("reasoning" |
    "content", text), ...]``, then :meth:`finish`).

    An ``analysis`` message's content is reasoning; a ``final`` or ``commentary`` one's is answer,
    without its header and end marker; a message to ``functions.N`` is passed on as answer *whole*,
    header and markers and all, so that the harmony tool-call parser (:class:`HarmonyStream`)
    reads the call in it. A message without a header (an output not in the format) is answer,
    as it is. Held back: a header until its ``<|message|>`` (or until it cannot be one), and
    what may be the start of a marker."""

    __slots__ = ("_marker", "_kind")

    def __init__(self) -> None:
        self._state = _HEAD
        self._buf = ""
        self._marker = ""  # the message's <|start|>, when it had one (passed on with a call's message)
        self._kind = "content"  # BODY: what the message's content is

    def _step(self, out: list, final: bool) -> bool:
        buf = self._buf
        if self._state == _HEAD:
            if not self._marker:
                rest = buf.lstrip()  # (blanks between two messages are neither's)
                if rest.startswith(START):
                    self._marker, self._buf = START, rest[len(START):]
                    return True
                if not final and START.startswith(rest) and rest:
                    return False
            at = buf.find(MESSAGE)
            header = parse_header(buf[:at]) if at >= 0 else None
            if at < 0 and not final and _may_be_header(buf):
                return False
            if header is None:  # not a header: the message is answer, as written
                if final and not buf.strip():
                    self._buf = ""
                    return False
                self._emit(out, "content", self._marker)
                self._kind = "content"
            else:
                self._kind = header.kind
                if self._kind == "call":
                    self._emit(out, "content", self._marker + buf[:at + len(MESSAGE)])
                buf = self._buf = buf[at + len(MESSAGE):]
            self._marker, self._state = "", _BODY
            return True
        kind = "content" if self._kind == "call" else self._kind  # _BODY
        found = [(at, m) for m in (*_ENDS, START) if (at := buf.find(m)) >= 0]
        if not found:
            keep = 0 if final else max(_tag_start(buf, m) for m in (*_ENDS, START))
            self._emit(out, kind, buf[:len(buf) - keep])
            self._buf = buf[len(buf) - keep:]
            return False
        at, marker = min(found)
        self._emit(out, kind, buf[:at] + (marker if self._kind == "call" and marker != START else ""))
        self._buf = buf[at:] if marker == START else buf[at + len(marker):]
        self._state = _HEAD
        return True


_START, _CALL_HEAD, _CALL_BODY, _TEXT, _ARGS, _TAIL, _SKIP = (
    "start", "head", "body", "text", "args", "tail", "skip")  # HarmonyStream's states


class HarmonyStream(CallStream):
    """The incremental parser of harmony tool calls (``--tool-call-parser openai``; a
    :class:`~gateway.call_stream.CallStream`): a message whose header has the recipient
    ``functions.N`` (``N`` one of ``functions``) and whose content is a JSON object is a call of
    ``N`` with that object as its arguments, as the model wrote it (its end found by bracket depth,
    as every JSON parser here); ``<|call|>`` or ``<|end|>`` after it is dropped with it.

    A call message starts at ``<|start|>`` anywhere in the answer, or at the answer's start
    without it (the first message of the output: what :class:`HarmonyThink` passes on). Everything
    else is content as it comes, markers and all -- the answer :class:`HarmonyThink` left, or a
    raw output when no reasoning parser split it. Held back: a possible ``<|start|>``, a header
    until its ``<|message|>``, and the blanks before a content's first character. A message that
    is no call (another recipient, an unknown function, content that is no JSON object) is
    content, whole; a call that breaks the format after its arguments began keeps what it sent and
    the rest of its message is dropped, as is every call message after the first when
    ``parallel`` is False. A marker that ends the message (``<|call|>``, ``<|end|>``,
    ``<|return|>``, ``<|start|>``) before its arguments close ends them there, as it ends the
    message for vLLM's token-level reading and for :class:`HarmonyThink`: it is never argument
    text, and the messages after it are read on; that call keeps what it sent and was cut short,
    as one the output ended inside (no ``"tool_calls"`` finish reason:
    :meth:`~gateway.call_stream.CallStream._args_until`). ``bare`` changes nothing: the format
    always marks its calls."""

    __slots__ = ("_state", "_marker", "_header")

    def __init__(self, functions: dict[str, dict], parallel: bool = True, bare: bool = False,
                 forced: bool = False) -> None:
        super().__init__(functions, parallel, bare, forced)
        self._state = _START
        self._marker = ""  # the call message's <|start|>, or "" (content again if it is no call)
        self._header = ""  # the header read and its <|message|> (content again if it is no call)

    def _whole(self) -> bool:
        return self._state != _ARGS

    def _step(self, out: list[dict], final: bool) -> bool:
        buf, state = self._buf, self._state
        if state == _START:  # the answer's start: a call message without its <|start|>?
            rest = buf.lstrip(_WS)
            if rest.startswith(START):
                self._ws, self._marker, self._buf, self._state = buf[:len(buf) - len(rest)], START, \
                    rest[len(START):], _CALL_HEAD
                return True
            if not final and (not rest or START.startswith(rest)):
                return False
            self._state = _CALL_HEAD
            return True
        if state == _TEXT:
            found = self._content_until(out, (START,), final)
            if found is None:
                return False
            self._buf, self._marker, self._state = buf[found[0] + len(START):], START, _CALL_HEAD
            return True
        if state == _CALL_HEAD:
            at = buf.find(MESSAGE)
            if at < 0 and not final and _may_be_header(buf):
                return False
            if at < 0 and self._cut and (buf.strip() or self._marker) and _may_be_header(buf) and \
                    (self.forced or self._marker or "<|channel|>" in buf or "to=" in buf):
                return self._cut_off()  # (auto: a header's start before a whole marker may be text; a
                # <|start|> alone, cut off, is a message's start: the second call's, after a first)
            header = parse_header(buf[:at]) if at >= 0 else None
            if header is None or header.function not in self.functions:
                return self._no_call(out)
            self._header, self._buf = buf[:at + len(MESSAGE)], buf[at + len(MESSAGE):]
            self._state = _SKIP if self.calls and not self.parallel else _CALL_BODY
            return True
        if state == _CALL_BODY:  # the arguments' "{" makes it a call
            rest = buf.lstrip(_WS)
            if not rest and not final:
                return False
            if not rest and self._cut:
                return self._cut_off()
            if not rest.startswith("{"):
                self._buf = self._header + buf
                return self._no_call(out)
            self._begin(out, parse_header(self._header[:-len(MESSAGE)]).function)
            self._depth, self._in_str, self._esc = 0, False, False
            self._buf, self._state = rest, _ARGS
            return True
        if state == _ARGS:  # to the "}" that closes them, or a marker that ends the message before it (gpt-oss's
            # special tokens end a message wherever they come, and HarmonyThink ends it there as well)
            if self._args_until(out, (*_ENDS, START), final) is None:
                return False
            self._state = _TAIL
            return True
        if state == _TAIL:  # the message's end marker, the next message, or the answer's end
            rest = buf.lstrip(_WS)
            end = next((m for m in _ENDS if rest.startswith(m)), None)
            if end is not None or rest.startswith(START):
                self._buf, self._state = rest[len(end or ""):], _TEXT
                return True
            if not final and any(m.startswith(rest) for m in (*_ENDS, START)):
                self._buf = rest
                return False
            self._state = _SKIP if rest else _TEXT  # (something else after the arguments: dropped)
            return True
        found = [(at, m) for m in (*_ENDS, START) if (at := buf.find(m)) >= 0]  # _SKIP: to the message's end
        if not found:
            self._buf = "" if final else buf[len(buf) - max(_tag_start(buf, m) for m in (*_ENDS, START)):]
            return False
        at, marker = min(found)
        self._buf, self._state = buf[at:] if marker == START else buf[at + len(marker):], _TEXT
        return True

    def _cut_off(self) -> bool:
        """The output was cut in a call message's header (:class:`CallStream`): it is dropped."""
        self._buf, self._ws, self._marker, self._header, self._state = "", "", "", "", _SKIP
        return True

    def _no_call(self, out: list[dict]) -> bool:
        """The message read so far is no call: its marker is content, and the rest is read as text."""
        self._say(out, self._ws + self._marker)
        self._ws, self._marker, self._header, self._state = "", "", "", _TEXT
        return True
