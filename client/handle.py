"""The client-side request handle: the engine's handle surface, fed by results from the broker."""

from __future__ import annotations

from typing import Callable

from protocol.handle import RequestHandle
from protocol.request import RequestId, RequestParams


class ClientHandle(RequestHandle):
    """A request submitted through a :class:`~client.Client`; the attributes are
    :class:`protocol.handle.RequestHandle`'s (the engine's handles have the same).

    Here ``error`` is a :class:`~client.RemoteError` with a ``code`` when the
    cluster ended the request with an error; ``prompt`` is None for text and
    chat prompts (the worker tokenises them; ``usage.prompt_tokens`` arrives
    with the first tokens), unless the request asked for ``prompt_logprobs``:
    their ids arrive with those entries; ``text`` is the pieces the worker released, joined (None
    while the model is not known to have a tokenizer and no text came);
    timings are on the client's monotonic clock, queueing included.
    ``cached_tokens`` arrives with a text or chat prompt's first tokens, and
    with the end of every request (the count of the worker that finished it).
    """

    __slots__ = ("callback", "on_token", "on_text", "_tokens", "_text", "_stream_error", "_owner", "_prompt_ids")

    def __init__(self, request_id: RequestId, params: RequestParams, callback: Callable | None,
                 on_token: Callable | None, submitted_s: float, owner, on_text: Callable | None = None) -> None:
        token_prompt = params.is_token_prompt
        super().__init__(request_id, params, submitted_s, len(params.prompt) if token_prompt else None)
        self.callback = callback
        self.on_token = on_token
        self.on_text = on_text
        self._tokens: list[int] = []
        self._text: list[str] = []
        self._stream_error: BaseException | None = None
        self._owner = owner
        self._prompt_ids: list[int] | None = None  # a text prompt's ids, when the worker sent them

    @property
    def prompt(self) -> list[int] | None:
        if self._prompt_ids is not None:
            return list(self._prompt_ids)
        return list(self.params.prompt) if self.params.is_token_prompt else None

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def text(self) -> str | None:
        if self._text:
            return "".join(self._text)
        # None only for a model without a tokenizer (text prompts and stop strings need one)
        text = not self.params.is_token_prompt or self.params.stop or (
            self._owner is not None and self._owner._has_tokenizer())
        return "" if text else None

    def _wait(self, timeout: float | None) -> None:
        if not self._owner._delivering_now(self):
            self._owner._wait_done(self, timeout)
