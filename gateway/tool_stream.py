"""The incremental parser of Hermes tool calls in a model's output: :class:`ToolStream` (a
:class:`~gateway.call_stream.CallStream`, the interface every family's parser has).

Written after vLLM's Hermes tool parser
(``vllm/tool_parsers/hermes_tool_parser.py``) in what it sends, not in how:
vLLM re-parses the partial JSON on every delta and diffs it, where this reads
each character once.
"""

from __future__ import annotations

import re

from gateway.call_stream import _MORE, _WS, CallStream, _header, _tag_start, merged

__all__ = ["CallStream", "ToolStream", "merged"]  # (CallStream and merged: where callers found them)


_TEXT, _HEAD, _ARGS, _TAIL, _SKIP, _DROP = "text", "head", "args", "tail", "skip", "drop"  # ToolStream's states
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_TAILS = ("}" + _CLOSE, _CLOSE, "}")
_FENCE = "```"
_FENCE_OPEN = re.compile(r"```(?:json)?[ \t]*\r?\n[ \t\r\n]*")  # a Markdown code fence's first line (bare calls)


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
      key order, an unknown function) stays content, whole, as does one still open at the end
      of an output the model ended itself; one the output cut off is dropped
      (:class:`~gateway.call_stream.CallStream`);
    - a call is not taken back: once its arguments started, a block that then breaks the grammar
      keeps the arguments it sent and the rest of the block is dropped; a ``</tool_call>`` (or
      the next block's ``<tool_call>``) before the arguments close ends them there, in a JSON string
      too (Qwen2.5's and Hermes' special tokens, and vLLM's parser ends the block at the first
      one): it is never argument text, the call keeps what it sent (finish reason ``stop``), and
      the text after it is read on; arguments cut by
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

    def __init__(self, functions: dict[str, dict], parallel: bool = True, bare: bool = False,
                 forced: bool = False) -> None:
        super().__init__(functions, parallel, bare, forced)
        # bare: still possible: nothing said yet and no call (then, after a bare call, the next one)
        self._in_bare = False  # the call being read has no tags
        self._fenced = False  # the bare calls are inside a ```json fence (its end is dropped too)
        self._state = _TEXT
        # _buf: TEXT: unsent text (whitespace, a possible tag start); HEAD: the block after <tool_call>
        self._tail = ""  # TAIL: what must follow the arguments ("}" then "</tool_call>")

    def finish(self, reason: str | None) -> tuple[list[dict], str | None]:
        out, reason = super().finish(reason)
        if self._state == _TEXT:
            self._content_until(out, tuple(m for m in (self.OPEN, self.PREFIX) if m), True)
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
                    if final and self._cut and not rest:  # (the marker alone: a call cut off)
                        self._buf, self._state = "", _DROP
                        return True
                elif self.PREFIX.startswith(rest) and not final:
                    return False
                elif rest and self.PREFIX.startswith(rest) and self.forced:  # (the marker's start, cut off)
                    self._buf, self._state = "", _DROP
                    return True
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
            if head is _MORE and self._cut:  # a call cut off before its arguments: neither content nor a call
                self._buf, self._ws, self._state = "", "", _DROP
                return True
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
        if state == _ARGS:  # to the "}" that closes them; in a block, a <tool_call> or </tool_call> before it ends them
            ended = self._args_until(out, () if self._in_bare else (_CLOSE, _OPEN), final)
            if ended is None:
                return False
            if ended:
                self._state, self._tail = _TAIL, "}" + ("" if self._in_bare else _CLOSE)
                return True
            # (cut short: its </tool_call> ends the block, a <tool_call> starts the next one)
            self._buf = self._buf.removeprefix(_CLOSE)
            self._state = _TEXT
            return True
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
