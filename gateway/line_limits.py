"""llama.cpp's ``n_indent`` and ``t_max_predict_ms`` on ``/completion`` and ``/infill``: two ways an
editor's completion ends at a line, as llama.cpp's server ends it (``process_token`` in its
``tools/server``; llama.vscode sends both with every ``/infill``).

- ``n_indent`` N > 0: every line after the first generated newline must start with at least N
  indentation characters (spaces or tabs, one each). A line whose first other character (an empty
  line's newline included) comes after fewer ends the generation there: the text keeps everything
  before that character -- the newline and the short indentation -- and drops the rest. The first
  line (the cursor's) is never judged; a line of indentation alone so far waits for its next
  character. 0 (llama.cpp's default): off.
- ``t_max_predict_ms`` N > 0: once N milliseconds have passed since the first generated token, the
  next piece of text holding a newline ends the generation, that piece kept (so a completion ends at
  a line's end, never mid-line; before any newline it runs on). 0 or -1 (llama.cpp's defaults, new
  and old): off.

Either ends the request as llama.cpp's limits do: ``stop: true``, ``stop_type`` ``"limit"``,
``stopping_word`` ``""``, ``tokens_predicted`` and the timings counting the tokens up to the piece
that ended it. The gateway judges the text as the worker releases it (``on_text`` pieces, one per
token in plain decoding) and cancels the rest upstream at once (:meth:`LimitedGeneration.on_text`,
the cancel a client's disconnect sends), so the worker's slot is freed.

Where this differs from llama.cpp's server: llama.cpp judges a new line one token later (its check of
the line runs on the next token), so its ``tokens_predicted`` may count a token more and a generation
that ends naturally on that token keeps the line; and its stream has already sent the token that
begins the cut line when it stops, where here a stream carries exactly the text of the whole answer.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from gateway.generation import Generation, Signal
from protocol.enums import FinishReason

__all__ = ["LimitedGeneration", "LineLimits"]

INDENT = " \t"
"""The characters llama.cpp counts as indentation (one each)."""


class LineLimits:
    """The state of one generation's ``n_indent`` and ``t_max_predict_ms`` (module docstring), fed
    in order from one thread: :meth:`token` per generated token, :meth:`feed` per released piece of
    text. ``clock()``: seconds on a monotonic clock (injectable: tests pass a fake one).

    ``text`` is the text judged so far (cut once stopped); ``tokens`` the tokens generated when the
    last piece came (the count at the stop, once stopped); ``stopped`` True once a limit ended it."""

    __slots__ = ("n_indent", "t_max_predict_ms", "clock", "text", "tokens", "stopped", "_count", "_start_s",
                 "_scan", "_line")

    def __init__(self, n_indent: int = 0, t_max_predict_ms: int = 0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.n_indent = n_indent
        self.t_max_predict_ms = t_max_predict_ms
        self.clock = clock
        self.text = ""
        self.tokens = 0
        self.stopped = False
        self._count = 0  # tokens generated so far
        self._start_s: float | None = None  # the clock at the first token
        self._scan = 0  # where the next newline is looked for
        self._line: int | None = None  # the start of a line not judged yet (its indentation incomplete)

    @staticmethod
    def active(n_indent: int | None, t_max_predict_ms: int | None) -> bool:
        """Whether either limit is on (``n_indent`` > 0 or ``t_max_predict_ms`` > 0)."""
        return (n_indent or 0) > 0 or (t_max_predict_ms or 0) > 0

    def token(self) -> None:
        """A token was generated (the first starts the time limit's clock)."""
        if self._start_s is None:
            self._start_s = self.clock()
        self._count += 1

    def feed(self, piece: str) -> bool:
        """Judge the next released ``piece`` of text; True when a limit ends the generation here
        (``text`` then holds what is kept). Nothing is judged once stopped. ``text`` is assigned
        once per piece, its final value (another thread may read it meanwhile)."""
        if self.stopped:
            return True
        self.tokens = self._count
        text = self.text + piece
        cut = self._short_line(text) if self.n_indent > 0 else None
        self.text = text if cut is None else text[:cut]
        if cut is not None:
            self.stopped = True
        elif self.t_max_predict_ms > 0 and "\n" in piece and self._start_s is not None and \
                (self.clock() - self._start_s) * 1000.0 > self.t_max_predict_ms:
            self.stopped = True
        return self.stopped

    def _short_line(self, text: str) -> int | None:
        """Judge each line of ``text`` begun since the last call: where to cut it (before the first
        character past the indentation of the first line indented less than ``n_indent``), or None."""
        while True:
            if self._line is None:
                nl = text.find("\n", self._scan)
                if nl < 0:
                    self._scan = len(text)
                    return None
                self._line = nl + 1
            pos = self._line
            while pos < len(text) and text[pos] in INDENT:
                pos += 1
            if pos == len(text):  # (indentation alone so far: its next character decides)
                return None
            if pos - self._line < self.n_indent:
                return pos
            self._line, self._scan = None, pos


class LimitedGeneration(Generation):
    """A :class:`~gateway.generation.Generation` under :class:`LineLimits`: submit it with
    ``on_token=g.on_token, on_text=g.on_text`` and call :meth:`arm` with the request's cancel once
    submitted. While it runs it shows only the text the limits judged (and the tokens that came with
    it); once a limit ends it, it is ``finished`` at once (the answer is complete: ``finish_reason``
    ``length``, the text cut, the tokens up to the stop) and the rest is cancelled upstream.
    ``stream``: poke the call's signal per token and piece (a stream shows them as they come)."""

    __slots__ = ("limits", "stream", "cut_s", "_cancel", "_cancelled", "_lock")

    def __init__(self, index: int, signal: Signal, limits: LineLimits, stream: bool) -> None:
        super().__init__(index, signal)
        self.limits = limits
        self.stream = stream
        self.cut_s: float | None = None  # the handle's clock (time.monotonic) when a limit ended it
        self._cancel: Callable[[], object] | None = None
        self._cancelled = False
        self._lock = threading.Lock()  # (the cancel is sent once, by whichever thread sees the stop armed)

    def arm(self, cancel: Callable[[], object]) -> None:
        """The request's cancel (event loop, right after submission); sent at once when a limit
        already ended it (``on_text`` may run before the handle is returned)."""
        with self._lock:
            self._cancel = cancel
        self._cancel_once()

    def _cancel_once(self) -> None:
        """Send the cancel, once, when a limit ended it and it is armed."""
        with self._lock:
            if self._cancelled or self._cancel is None or not self.limits.stopped:
                return
            self._cancelled = True
        self._cancel()

    def on_token(self, token: int) -> None:
        """The request's ``on_token`` (client callback thread)."""
        self.limits.token()
        if self.stream:
            self._signal.poke()

    def on_text(self, piece: str) -> None:
        """The request's ``on_text`` (client callback thread): judge ``piece``; on a stop, end the
        answer and cancel the rest upstream (the client's cancel, as a disconnect sends it)."""
        if self.limits.stopped:
            return
        if self.limits.feed(piece):
            self.cut_s = time.monotonic()
            self.finished = True
            self._cancel_once()
            self._signal.poke()
        elif self.stream:
            self._signal.poke()

    @property
    def cut(self) -> bool:
        """Whether a limit ended it."""
        return self.limits.stopped

    def _upstream_done(self) -> bool:
        return self.finished and not self.cut

    @property
    def finish_reason(self) -> FinishReason | None:
        return FinishReason.LENGTH if self.cut else Generation.finish_reason.fget(self)

    @property
    def stop_reason(self):
        return None if self.cut else Generation.stop_reason.fget(self)

    @property
    def error(self) -> BaseException | None:
        return None if self.cut else Generation.error.fget(self)

    @property
    def completion_tokens(self) -> int:
        return len(self.tokens)

    @property
    def tokens(self) -> list[int]:
        """The tokens shown: all once it ended upstream; else those that came with the judged text
        (up to the stop once a limit ended it)."""
        tokens = self.handle.tokens
        return tokens if self._upstream_done() else tokens[:self.limits.tokens]

    @property
    def text(self) -> str:
        """The text shown: the handle's once it ended upstream, else the judged (cut) text."""
        return (self.handle.text or "") if self._upstream_done() else self.limits.text

    @property
    def logprobs(self) -> list | None:
        lp = self.handle.logprobs
        return None if lp is None else list(lp[:len(self.tokens)])

    @property
    def ended_s(self) -> float | None:
        return self.cut_s if self.cut else self.handle.finished_s
