"""One slotserve request as the event loop sees it, fed from the client's callback thread.

The client SDK runs ``on_token`` and ``callback`` on its callback thread.
Here they only *poke* a :class:`Signal`; the HTTP handler, on the event
loop, then reads what is new from the request's handle (:meth:`Generation.take`).
Pokes coalesce: one ``call_soon_threadsafe`` per burst, whatever the number
of tokens, so the loop's cost follows iterations, not tokens.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from client import RequestHandle
from protocol.enums import FinishReason


class Signal:
    """Wakes the one task waiting in :meth:`wait` from any thread (:meth:`poke`).

    A poke that comes while one is pending is merged into it. Spurious
    wake-ups are possible; lost ones are not: the waiter reads state *after*
    ``wait`` returns, and a change made after that read pokes again.
    """

    __slots__ = ("_loop", "_event", "_pending")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._event = asyncio.Event()
        self._pending = False

    def poke(self, *_ignored) -> None:
        """Any thread; the arguments (a token, a sequence) are ignored."""
        if not self._pending:
            self._pending = True
            try:
                self._loop.call_soon_threadsafe(self._fire)
            except RuntimeError:
                pass  # the loop is closed: nobody waits any more

    def _fire(self) -> None:
        self._pending = False
        self._event.set()

    def set(self) -> None:
        """Wake the waiter from the event loop's own thread."""
        self._event.set()

    async def wait(self) -> None:
        await self._event.wait()
        self._event.clear()


@dataclass(slots=True)
class Delta:
    """What a :class:`Generation` produced since the last :meth:`Generation.take`:
    ``tokens`` (new token ids), ``text`` (new text, ``""`` for a model
    without a tokenizer), and ``finished`` (True once, with the last delta)."""

    tokens: list[int]
    text: str
    finished: bool


class Generation:
    """One submitted slotserve request of an HTTP request: choice ``index``.

    ``handle`` is the client's :class:`~client.RequestHandle`; ``finished``
    becomes True (on the callback thread) only after the handle holds every
    token, the text, ``finish_reason`` and ``error``.
    """

    __slots__ = ("index", "handle", "finished", "_signal", "_sent_tokens", "_sent_text", "_reported")

    def __init__(self, index: int, signal: Signal) -> None:
        self.index = index
        self.handle: RequestHandle | None = None
        self.finished = False
        self._signal = signal
        self._sent_tokens = 0
        self._sent_text = 0
        self._reported = False

    def on_end(self, seq) -> None:
        """The request's completion callback (client callback thread)."""
        self.finished = True
        self._signal.poke()

    def take(self) -> Delta | None:
        """New tokens and text since the last call, or None when nothing is new (event loop)."""
        if self._reported:
            return None
        finished = self.finished  # read first: once True, everything below is complete
        h = self.handle
        new_tokens = h.tokens[self._sent_tokens:]
        self._sent_tokens += len(new_tokens)
        text = h.text or ""
        new_text = text[self._sent_text:]
        self._sent_text = len(text)
        if finished:
            self._reported = True
        elif not new_tokens and not new_text:
            return None
        return Delta(new_tokens, new_text, finished)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.handle.finish_reason if self.finished else None

    @property
    def error(self) -> BaseException | None:
        return self.handle.error if self.finished else None

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's length in tokens, or None while unknown (a text or chat
        prompt no worker has tokenised for this request)."""
        return self.handle.prompt_tokens

    @property
    def prompt_key(self) -> object:
        """The prompt as submitted (hashable): requests with equal keys have prompts of equal length."""
        return self.handle.params.prompt

    @property
    def streamed_tokens(self) -> int:
        """Tokens handed out by :meth:`take` so far."""
        return self._sent_tokens

    @property
    def completion_tokens(self) -> int:
        return len(self.handle.tokens)
