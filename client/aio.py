"""asyncio access to a slotserve cluster: a thin layer over :class:`~client.Client`.

One core, two faces: :class:`AsyncClient` drives the same
:class:`~client.core.ClientCore` (the request ledger, endings, resubmission),
connection, I/O thread, callback thread and handles as the synchronous
client; completions and tokens are handed to the event loop with
``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import functools
from typing import AsyncIterator

from client.client import DEFAULT_ADDRESS, Client
from client.handle import ClientHandle
from protocol.enums import FinishReason
from protocol.logprobs import TokenLogprob
from protocol.messages import Status

_END = object()


class AsyncClient:
    """Use ``await AsyncClient.connect(address, **Client options)`` (or
    ``async with await AsyncClient.connect(...) as c``).

    - :meth:`generate` awaits one request and returns its handle (final
      ``tokens``, ``finish_reason``, ``error``).
    - :meth:`stream` yields tokens as they arrive, :meth:`stream_text` the
      text (models with a tokenizer): the async faces of the synchronous
      client's ``on_token`` and ``on_text``; :meth:`stream_logprobs` yields
      ``(token, TokenLogprob)`` pairs; leaving the loop early cancels the
      request.
    - :meth:`submit_request` is the synchronous client's (callbacks run on the
      client's callback thread, not in the event loop).
    """

    def __init__(self, client: Client) -> None:
        if not isinstance(client, Client):
            raise TypeError(f"AsyncClient wraps a Client, got {type(client).__name__}; "
                            "to connect to an address use 'await AsyncClient.connect(address)'")
        self.client = client

    @classmethod
    async def connect(cls, address: str = DEFAULT_ADDRESS, **options) -> "AsyncClient":
        """Connect without blocking the loop; raises what :class:`Client` raises."""
        loop = asyncio.get_running_loop()
        return cls(await loop.run_in_executor(None, functools.partial(Client, address, **options)))

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def submit_request(self, prompt, max_tokens, callback=None, **kw) -> ClientHandle:
        """Exactly :meth:`Client.submit_request` (does not block)."""
        return self.client.submit_request(prompt, max_tokens, callback, **kw)

    async def generate(self, prompt, max_tokens, **kw) -> ClientHandle:
        """Submit one request and wait for its end; returns its handle.

        Arguments as :meth:`Client.submit_request` (no ``callback``); raises
        ValueError on bad input. Cancelling the awaiting task cancels the request.
        """
        return await self._await(self.client.submit_request, (prompt, max_tokens), kw)

    async def _await(self, submit, args: tuple, kw: dict) -> ClientHandle:
        """``submit(*args, done, **kw)`` (a :class:`Client` method taking the completion callback
        after its positional arguments), awaited to the request's end; its handle."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()

        def done(seq) -> None:  # the client's callback thread
            _threadsafe(loop, _resolve, fut)

        h = submit(*args, done, **kw)
        try:
            await fut
        except asyncio.CancelledError:
            self.client.cancel(h.request_id)
            raise
        return h

    async def embed(self, prompt, **kw) -> ClientHandle:
        """Send one embedding request and wait for its end; returns its handle (``embedding``,
        ``finish_reason``, ``error``). Arguments as :meth:`Client.embed` (no ``callback``); raises
        ValueError on bad input. Cancelling the awaiting task cancels the request."""
        return await self._await(self.client.embed, (prompt,), kw)

    def stream(self, prompt, max_tokens, **kw) -> AsyncIterator[int]:
        """Yield each generated token as it arrives; a request that ends with an
        error raises it (see :meth:`_stream`). Arguments as :meth:`Client.submit_request`
        (no ``callback``/``on_token``)."""
        return self._stream("on_token", prompt, max_tokens, kw)

    def stream_logprobs(self, prompt, max_tokens, logprobs: int = 0,
                        **kw) -> AsyncIterator[tuple[int, TokenLogprob]]:
        """Yield ``(token, TokenLogprob)`` for each generated token as it arrives:
        :meth:`stream` with each token's :class:`~protocol.logprobs.TokenLogprob`
        (its logprob and the ``logprobs`` most likely alternatives, 0..20; see
        :mod:`protocol.logprobs`), the entries ``handle.logprobs`` holds.
        Arguments as :meth:`Client.submit_request` (no ``callback``/``on_token``);
        ``prompt_logprobs`` may be asked too (they are on the handle, which
        :meth:`submit_request` returns: not here). Raises ValueError on bad input
        (``logprobs=None`` at once, the rest at the first iteration); a model without logits ends the request
        ``bad_request``: the iteration raises that :class:`~client.RemoteError`."""
        if logprobs is None:
            raise ValueError("stream_logprobs needs logprobs (0..20 alternatives per token), got None")
        return self._stream("on_token", prompt, max_tokens, {**kw, "logprobs": logprobs}, scored=True)

    def stream_text(self, prompt, max_tokens, **kw) -> AsyncIterator[str]:
        """Yield each piece of text the worker releases, as
        :meth:`Client.submit_request`'s ``on_text`` receives it: after the
        tokens it came with, never a prefix of a ``stop`` string that may
        still match; the pieces add up to the handle's ``text``. For models
        with a tokenizer (otherwise nothing is yielded). Arguments as
        :meth:`Client.submit_request` (no ``callback``/``on_text``)."""
        return self._stream("on_text", prompt, max_tokens, kw)

    async def _stream(self, hook: str, prompt, max_tokens, kw: dict, scored: bool = False) -> AsyncIterator:
        """The synchronous client's streaming callback ``hook`` (``on_token`` or
        ``on_text``) as an async iterator: each value is handed to the event
        loop (with ``scored``, as ``(token, handle.logprobs[i])``); the request's
        end closes it, and an ending ``finish_reason="error"`` raises the
        handle's ``error`` (a :class:`~client.RemoteError`: e.g. a model
        without logits, or a worker failure) after the values that came
        before it; leaving early cancels the request."""
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()
        h = self.client.submit_request(prompt, max_tokens, lambda seq: _threadsafe(loop, q.put_nowait, _END),
                                       **{hook: lambda v: _threadsafe(loop, q.put_nowait, v)}, **kw)
        finished = False
        try:
            i = 0
            while True:
                item = await q.get()
                if item is _END:
                    finished = True
                    if h.finish_reason is FinishReason.ERROR and h.error is not None:
                        raise h.error
                    return
                # (a token's logprobs entry is appended before its on_token runs: here already)
                yield (item, h.logprobs[i]) if scored else item
                i += 1
        finally:
            if not finished:
                self.client.cancel(h.request_id)

    def cancel(self, request_id) -> bool:
        return self.client.cancel(request_id)

    async def run(self, timeout: float | None = None) -> None:
        """Wait (in a thread) until every request of this client has ended."""
        await asyncio.get_running_loop().run_in_executor(None, self.client.run, timeout)

    async def status(self, timeout_s: float = 5.0) -> Status:
        return await asyncio.get_running_loop().run_in_executor(None, self.client.status, timeout_s)

    async def order(self, action: str, model: str, timeout_s: float = 5.0) -> Status:
        """:meth:`Client.order <client.client.Client.order>` in a thread."""
        return await asyncio.get_running_loop().run_in_executor(None, self.client.order, action, model, timeout_s)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.client.close)


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)


def _threadsafe(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:
        pass  # the event loop is closed: nobody is waiting any more
