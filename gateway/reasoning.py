"""Reasoning output on ``/v1/chat/completions``: a thinking model's ``<think>...</think>`` split off
the answer into ``reasoning_content`` (and vLLM's newer name ``reasoning``), whole or streamed as
its own deltas (issue 33, item 2).

The parser is the gateway's ``reasoning_parser`` (``--reasoning-parser``), named as vLLM names
its parsers:

- ``deepseek_r1``: the chat template opens the thinking (its generation prompt ends with
  ``<think>``, DeepSeek-R1 and its distills), so the output starts inside it: everything up to
  the first ``</think>`` is reasoning (a ``<think>`` the model writes again at the start is
  dropped); an output without ``</think>`` is reasoning only, as vLLM's parser says;
- ``qwen3``: the model opens the thinking itself (Qwen3, QwQ): an output that starts with
  ``<think>`` is reasoning up to ``</think>``; one that does not (``enable_thinking`` off: the
  template wrote an empty block into the prompt) is all answer.

- ``openai_gptoss``: gpt-oss's harmony channels (``<|channel|>analysis<|message|>...``): the
  ``analysis`` messages are reasoning, the ``final`` (and ``commentary``) ones the answer, calls
  to functions passed on to the tool-call parser (:class:`gateway.harmony.HarmonyThink`).

A reply that continues the final assistant message (``continue_final_message``, Anthropic's
prefill) starts where that message's text ends, not after the generation prompt that opens the
thinking: :func:`continued_parser` says how it splits.

The answer after ``</think>`` starts at its first non-blank character. Tool calls and
everything else the gateway reads in an answer are read in the answer only. Not a text
parser beyond the two tags: the split is :class:`ThinkStream`'s, for whole and streamed
answers alike, so the deltas add up to the whole answer at every cut.
"""

from __future__ import annotations

from gateway.harmony import HarmonyThink
from gateway.split_stream import SplitStream

__all__ = ["PARSERS", "ThinkStream", "continued_parser", "split_reasoning", "think_stream"]

PARSERS = ("deepseek_r1", "qwen3", "openai_gptoss")
"""The parsers' names."""
CHOICES = (*PARSERS, "none")
"""The names ``--reasoning-parser`` takes (``none``: no parser, whatever the model's template says)."""

_TAGGED = ("deepseek_r1", "qwen3")  # ThinkStream's
_OPEN, _CLOSE = "<think>", "</think>"
_START, _THINK, _ANSWER = "start", "think", "answer"


class ThinkStream(SplitStream):
    """The ``<think>`` parsers' :class:`SplitStream` (``deepseek_r1``, ``qwen3``): held back, a
    possible start of a tag."""

    __slots__ = ("parser", "_answer_started")

    def __init__(self, parser: str) -> None:
        if parser not in _TAGGED:
            raise ValueError(f"reasoning parser must be one of {', '.join(_TAGGED)}, got {parser!r}")
        self.parser = parser
        self._state = _START
        self._buf = ""
        self._answer_started = False

    def finish(self) -> list[tuple[str, str]]:
        out = super().finish()
        if self._buf:
            self._emit(out, "reasoning" if self._state == _THINK else "content", self._buf)
            self._buf = ""
        return out

    def _step(self, out: list, final: bool) -> bool:
        buf = self._buf
        if self._state == _START:
            head = buf.lstrip()
            if _OPEN.startswith(head) and head != _OPEN and not final:
                return False  # (a <think> may be coming)
            opened = head.startswith(_OPEN)
            if opened:
                self._buf = head[len(_OPEN):]
            self._state = _THINK if opened or self.parser == "deepseek_r1" else _ANSWER
            return True
        if self._state == _THINK:
            at = buf.find(_CLOSE)
            if at < 0:
                keep = 0 if final else _tail_match(buf, _CLOSE)
                self._emit(out, "reasoning", buf[:len(buf) - keep])
                self._buf = buf[len(buf) - keep:]
                return False
            self._emit(out, "reasoning", buf[:at])
            self._buf, self._state = buf[at + len(_CLOSE):], _ANSWER
            return True
        if not self._answer_started:  # the answer starts at its first non-blank character
            text = buf.lstrip()
            if not text:
                self._buf = ""
                return False
            self._answer_started = True
            buf = text
        self._emit(out, "content", buf)
        self._buf = ""
        return False


def _tail_match(text: str, tag: str) -> int:
    """The length of the longest end of ``text`` that is a proper start of ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def think_stream(parser: str) -> SplitStream:
    """A fresh split of one choice's output by reasoning parser ``parser`` (one of :data:`PARSERS`):
    a :class:`ThinkStream`, or gpt-oss's :class:`~gateway.harmony.HarmonyThink` (the same
    interface). ValueError naming the parsers for another name."""
    if parser == "openai_gptoss":
        return HarmonyThink()
    if parser not in PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(PARSERS)}, got {parser!r}")
    return ThinkStream(parser)


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """``(reasoning, answer)`` of a whole output (None: no reasoning), :func:`think_stream`'s split."""
    stream = think_stream(parser)
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    return (reasoning or None), "".join(t for k, t in pieces if k == "content")


def continued_parser(parser: str, text: str) -> str | None:
    """The parser of a reply that continues a final assistant message whose text is ``text``, on a
    model whose replies ``parser`` splits (``continue_final_message``: the prompt ends with ``text``,
    with no generation prompt, so a ``deepseek_r1`` template's ``<think>`` is not in it and the reply
    does not start inside the thinking). ``"deepseek_r1"`` (the reply starts inside the thinking:
    reasoning up to ``</think>``) when ``text`` opens a ``<think>`` it does not close; None (the
    reply is answer, all of it) when it does not. ValueError for ``openai_gptoss``: which harmony
    channel the template writes the message's text into is the template's, so the reply cannot be
    told apart."""
    if parser == "openai_gptoss":
        raise ValueError("a final assistant message cannot be continued on a model that answers in harmony "
                         "channels (reasoning parser openai_gptoss): the reply's channel is unknown; send the "
                         "conversation without the final assistant message")
    return "deepseek_r1" if text.rfind(_OPEN) > text.rfind(_CLOSE) else None
