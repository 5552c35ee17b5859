"""The incremental tool-call parsers' interface, :class:`CallStream`, and the Hermes one, :class:`ToolStream`.

Protocol-level glue between generated text and OpenAI's chat deltas (content
and ``tool_calls``), used for streamed and whole answers alike
(:mod:`gateway.tools`). Not a JSON parser: it finds where a call's
arguments end by bracket depth outside JSON strings, and passes their text
through as the model wrote it. Written after vLLM's Hermes tool parser
(``vllm/tool_parsers/hermes_tool_parser.py``) in what it sends, not in how:
vLLM re-parses the partial JSON on every delta and diffs it, where this reads
each character once.
"""

from __future__ import annotations

import re
import uuid

__all__ = ["CallStream", "ToolStream", "merged"]


_TEXT, _HEAD, _ARGS, _TAIL, _SKIP, _DROP = "text", "head", "args", "tail", "skip", "drop"  # ToolStream's states
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_TAILS = ("}" + _CLOSE, _CLOSE, "}")
_WS = " \t\n\r"  # JSON's whitespace
_MORE = object()  # _header: the block may still become a call
_FENCE = "```"
_FENCE_OPEN = re.compile(r"```(?:json)?[ \t]*\r?\n[ \t\r\n]*")  # a Markdown code fence's first line (bare calls)



class CallStream:
    """What every family's tool-call parser is (:mod:`gateway.tool_parsers` names them): one choice's
    output in (:meth:`feed`, as it is generated), OpenAI chat deltas out -- ``{"content": s}`` and
    ``{"tool_calls": [...]}`` -- and the finish reason at :meth:`finish`. The non-streamed answer
    is the same parser fed the whole output at once, so a stream and the answer say the same
    thing however the text is cut (vLLM #56263 is a bug where they differ).

    Built as ``cls(functions, parallel=True, bare=False)``: ``functions`` the request's tools (name
    -> definition with its ``parameters`` schema); ``parallel`` False (OpenAI's
    ``parallel_tool_calls: false``) keeps the first call only; ``bare`` whether what the family's
    models write without their marker is read too (off under a ``response_format``). A
    subclass gives :meth:`_step` (consume what ``_buf`` allows; True when its state changed) and
    :meth:`_whole` (whether the calls it holds are whole, for the finish reason)."""

    __slots__ = ("functions", "parallel", "bare", "calls", "_said", "_buf", "_ws", "_depth", "_in_str", "_esc")

    def __init__(self, functions: dict[str, dict], parallel: bool = True, bare: bool = False) -> None:
        self.functions = functions
        self.parallel = parallel
        self.bare = bare
        self.calls = 0  # calls begun so far
        self._said = False  # whether content was sent
        self._buf = ""  # text not consumed yet
        self._ws = ""  # the whitespace before a marker (content again if what follows is no call)
        self._depth, self._in_str, self._esc = 0, False, False  # the scan of argument text (_scan)

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
        string or token cut keeps ``"stop"``, one cut by ``max_tokens`` ``"length"``)."""
        out: list[dict] = []
        while self._step(out, final=True):
            pass
        complete = self.calls and self._whole()
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
            if buf.strip() or not self.calls:
                self._say(out, buf)
            self._buf = ""
            return None
        keep = max((_tag_start(buf, m) for m in markers), default=0)
        sent = buf[:len(buf) - keep].rstrip()
        self._say(out, sent)
        self._buf = buf[len(sent):]
        return None


class ToolStream(CallStream):
    """The incremental Hermes parser of one choice's output (``--tool-call-parser hermes``, the
    default; a :class:`CallStream`). The non-streamed answer is this same parser fed the whole
    output at once (:func:`gateway.tools.parse_tool_calls`).

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
      ``max_tokens`` stay cut (finish reason ``length``), and so do arguments a stop string or a stop
      token cut (finish reason ``stop``, not ``tool_calls``, which says the calls are whole).
      OpenAI's own ``arguments`` are not guaranteed to be valid JSON either: callers validate them
      (``json.loads``) before use.

    ``parallel=False`` (OpenAI's ``parallel_tool_calls: false``): the first call is the only one;
    every later ``<tool_call>`` block is dropped whole (neither a call nor content).

    ``bare=True``: an answer that *starts* with a call object without the tags -- ``{"name": "N",
    "arguments": {...}}``, what small Qwen2.5-Coder models write (issue 33), as llama.cpp's and
    vLLM's Hermes parsers also take it -- is read as calls: that object, and more of them after it
    separated by commas or whitespace, also inside a Markdown fence (```` ```json ````, as the same
    models write it); text after them is content. The same hold-back as a tag:
    an answer starting with ``{`` is held until its header says whether it is a call. Off where
    the answer may be JSON the user asked for (a ``response_format``).
    """

    __slots__ = ("_state", "_tail", "_in_bare", "_fenced")

    OPEN: str | None = _OPEN
    """The tag that opens a call anywhere in the answer (None: calls only at its start, bare)."""
    SEPARATORS = ","
    """What may separate bare calls, besides JSON whitespace."""
    PREFIX = ""
    """A marker that may come before the bare calls at the answer's start (dropped with them)."""

    def __init__(self, functions: dict[str, dict], parallel: bool = True, bare: bool = False) -> None:
        super().__init__(functions, parallel, bare)
        # bare: still possible: nothing said yet and no call (then, after a bare call, the next one)
        self._in_bare = False  # the call being read has no tags
        self._fenced = False  # the bare calls are inside a ```json fence (its end is dropped too)
        self._state = _TEXT
        # _buf: TEXT: unsent text (whitespace, a possible tag start); HEAD: the block after <tool_call>
        self._tail = ""  # TAIL: what must follow the arguments ("}" then "</tool_call>")

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        out, reason = super().finish(reason)
        if self._state == _TEXT:
            self._content_until(out, (), True)
        return out, reason

    def _whole(self) -> bool:
        return self._state != _ARGS

    def _step(self, out: list[dict], final: bool) -> bool:
        """Consume what ``_buf`` allows in the current state; True when the state changed."""
        buf, state = self._buf, self._state
        if state == _TEXT and self.bare:
            rest = buf.lstrip(_WS + (self.SEPARATORS if self.calls else ""))
            if self.PREFIX and not self.calls:  # (the marker before the first call goes with the calls)
                if rest.startswith(self.PREFIX):
                    rest = rest[len(self.PREFIX):].lstrip(_WS)
                elif self.PREFIX.startswith(rest) and not final:
                    return False
            closed = self._fenced and rest.startswith(_FENCE)  # the fence's end, after the calls
            if closed:
                rest = rest[len(_FENCE):]
            opener = None if self.calls else _FENCE_OPEN.match(rest)
            if opener is not None:  # ```json then the calls: the fence is no content either
                rest = rest[opener.end():]
            if not final and (not rest or (self.calls and self._fenced and not closed and _FENCE.startswith(rest))
                              or (not self.calls and opener is None and _may_open_fence(rest))):
                return False  # (the answer may still start with a call, or its fence still end)
            self._fenced = self._fenced and not closed
            if rest.startswith("{") and (self.parallel or not self.calls):
                self._ws, self._buf, self._state, self._in_bare = buf[:len(buf) - len(rest)], rest, _HEAD, True
                self._fenced = self._fenced or opener is not None
                return True
            self.bare = False
            if self.calls:  # (after bare calls: their separators are not content)
                if not self.parallel and rest.startswith("{"):
                    self._buf, self._state = "", _DROP  # one call only: the rest is dropped
                    return True
                self._buf = buf = rest
        if state == _TEXT:
            found = self._content_until(out, (self.OPEN,) if self.OPEN else (), False)
            if found is None:
                return False
            self._buf = buf[found[0] + len(self.OPEN):]
            self._state = _SKIP if self.calls and not self.parallel else _HEAD  # (one call only: drop the block)
            return True
        if state == _HEAD:
            head = _header(buf, self.functions)
            if head is _MORE and not final:
                return False
            if head is None or head is _MORE:  # not a call: the block is content, and read on as text
                self._say(out, self._ws + ("" if self._in_bare else self.OPEN))
                self._ws, self._state, self.bare, self._in_bare = "", _TEXT, False, False
                return True
            name, end, has_args = head
            self._begin(out, name)
            close = "" if self._in_bare else _CLOSE
            if has_args:
                self._buf, self._state = buf[end:], _ARGS
                self._depth, self._in_str, self._esc = 0, False, False
            else:
                self._args(out, "{}")
                self._buf, self._state, self._tail = buf[end:], _TAIL, close
                if not close:
                    self._state, self._in_bare = _TEXT, False
            return True
        if state == _ARGS:
            i = self._scan(buf)
            self._args(out, buf[:i])
            self._buf = buf[i:]
            if self._depth == 0:
                self._state, self._tail = _TAIL, "}" + ("" if self._in_bare else _CLOSE)
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
                    self._buf, self._state = rest, (_DROP if self._in_bare else _SKIP)
                    return True
                rest, need = rest[1:], need[1:]
            self._buf, self._tail = rest, need
            if need:
                return False
            self._state, self._in_bare = _TEXT, False
            return True
        if state == _DROP:  # a bare call broke the grammar, or a second one where one is allowed
            self._buf = ""
            return False
        at = buf.find(_CLOSE)  # _SKIP: drop the rest of the broken call
        if at < 0:
            self._buf = buf[len(buf) - _tag_start(buf, _CLOSE):]
            return False
        self._buf, self._state = buf[at + len(_CLOSE):], _TEXT
        return True


def _may_open_fence(s: str) -> bool:
    """Whether ``s`` is the start of a fence's first line (more text may make it one)."""
    return any(f.startswith(s) for f in ("```json\n", "```\n")) or re.fullmatch(r"```(?:json)?[ \t]*\r?", s) is not None
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
