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

from protocol.enums import FinishReason
from protocol.handle import RequestHandle


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
    without a tokenizer), ``finished`` (True once, with the last delta), and
    ``logprobs``: the new tokens' :class:`~protocol.logprobs.TokenLogprob`
    entries, one per token, when the request asked for them (else None)."""

    tokens: list[int]
    text: str
    finished: bool
    logprobs: list | None = None


class Generation:
    """One submitted slotserve request of an HTTP request: choice ``index``.

    ``handle`` is the client's :class:`~client.RequestHandle`; ``finished``
    becomes True (on the callback thread) only after the handle holds every
    token, the text, ``finish_reason`` and ``error``.

    ``hidden``: the request's output is not shown (``max_tokens: 0`` with
    ``echo``: one token is generated and dropped, with its text and logprob).
    ``echo_tokens`` / ``echo_text``: a token-id prompt's ids (else None: see
    :attr:`prompt_ids`) and the text that an ``echo`` shows before the output; ``text_offset``: where the
    next streamed token's text starts (:mod:`gateway.logprobs`). ``eos_ids``: the model's EOS token ids
    the gateway put in the request's ``stop_token`` itself (``stop_token_ids`` without ``ignore_eos``:
    :func:`gateway.options.model_eos`), which :attr:`stop_reason` reports as None, as vLLM does.
    """

    __slots__ = ("index", "handle", "finished", "hidden", "echo_tokens", "echo_text", "text_offset", "eos_ids",
                 "_signal", "_sent_tokens", "_sent_text", "_reported")

    def __init__(self, index: int, signal: Signal, hidden: bool = False) -> None:
        self.index = index
        self.handle: RequestHandle | None = None
        self.finished = False
        self.hidden = hidden
        self.echo_tokens: list[int] | None = None
        self.echo_text: str | None = None
        self.text_offset = 0
        self.eos_ids: frozenset[int] = frozenset()
        self._signal = signal
        self._sent_tokens = 0
        self._sent_text = 0
        self._reported = False

    def on_end(self, seq) -> None:
        """The request's completion callback (client callback thread)."""
        self.finished = True
        self._signal.poke()

    def take(self) -> Delta | None:
        """New tokens and text since the last call (of :attr:`tokens` and :attr:`text`, those shown), or
        None when nothing is new (event loop)."""
        if self._reported:
            return None
        finished = self.finished  # read first: once True, everything below is complete
        h = self.handle
        if self.hidden:
            if not finished:
                return None
            self._reported = True
            return Delta([], "", True, None if h.logprobs is None else [])
        new_tokens = self.tokens[self._sent_tokens:]  # (the shown ones: a subclass may show fewer)
        entries = None
        if h.logprobs is not None:  # tokens first: each token's entry is appended before the token
            entries = h.logprobs[self._sent_tokens:self._sent_tokens + len(new_tokens)]
            if len(entries) < len(new_tokens):  # (defensive) a token whose entry is not there yet waits
                new_tokens = new_tokens[:len(entries)]
        self._sent_tokens += len(new_tokens)
        text = self.text
        new_text = text[self._sent_text:]
        self._sent_text = len(text)
        if finished:
            self._reported = True
        elif not new_tokens and not new_text:
            return None
        return Delta(new_tokens, new_text, finished, entries)

    @property
    def finish_reason(self) -> FinishReason | None:
        """The handle's, once finished; ``length`` for a hidden output that stopped (its one token
        was dropped: ``max_tokens`` 0 was reached, whatever the token)."""
        if not self.finished:
            return None
        reason = self.handle.finish_reason
        return FinishReason.LENGTH if self.hidden and reason is FinishReason.STOP else reason

    @property
    def prompt_ids(self) -> list[int] | None:
        """The prompt's token ids: a token-id prompt's, or a text or chat prompt's once its
        worker sent them (with its prompt logprobs); else None."""
        return self.echo_tokens if self.echo_tokens is not None else self.handle.prompt

    @property
    def stop_reason(self):
        """The handle's ``stop_reason`` once finished: the stop string, sequence or token id that
        ended it; None for a hidden output, and for the model's EOS (vLLM's "None if the completion
        finished for some other reason including encountering the EOS token")."""
        if self.hidden or not self.finished:
            return None
        reason = self.handle.stop_reason
        return None if type(reason) is int and reason in self.eos_ids else reason

    @property
    def error(self) -> BaseException | None:
        return self.handle.error if self.finished else None

    @property
    def ended_s(self) -> float | None:
        """When the answer ended, on the handle's clock (its ``finished_s``), None while it runs."""
        return self.handle.finished_s

    @property
    def prompt_tokens(self) -> int | None:
        """The prompt's length in tokens, or None while unknown (a text or chat
        prompt no worker has tokenised for this request)."""
        return self.handle.prompt_tokens

    @property
    def cached_tokens(self) -> int | None:
        """Prompt tokens the worker's prefix cache gave (``RequestHandle.cached_tokens``), None
        while unknown."""
        return self.handle.cached_tokens

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
        return 0 if self.hidden else len(self.handle.tokens)

    @property
    def tokens(self) -> list[int]:
        """The generated tokens shown (none when hidden)."""
        return [] if self.hidden else self.handle.tokens

    @property
    def text(self) -> str:
        """The generated text shown (``""`` when hidden or without a tokenizer)."""
        return "" if self.hidden else (self.handle.text or "")

    @property
    def logprobs(self) -> list | None:
        """The shown tokens' logprob entries (None unless asked)."""
        lp = self.handle.logprobs
        return None if lp is None else ([] if self.hidden else list(lp))
