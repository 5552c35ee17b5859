"""The client-side request handle: same fields as the engine's ``RequestHandle``."""

from __future__ import annotations

from typing import Callable

from protocol.enums import FinishReason


class RequestHandle:
    """The caller's view of a request submitted through a :class:`~client.Client`.

    - ``request_id``: the caller's id, or the one the client picked (``int``).
    - ``prompt``: the prompt as submitted (token ids or text).
    - ``tokens``: generated token ids received so far (a copy).
    - ``text``: generated text so far for text prompts, else None.
    - ``finish_reason``: None until the request ends, then a
      :class:`~protocol.enums.FinishReason`.
    - ``error``: None, or the exception that ended it (:class:`~client.RemoteError`
      with a ``code``, or what ``on_token`` raised) or that its callback raised.
    - ``prompt_tokens``: prompt length in tokens (known at the end for text).
    - ``ttft_s`` / ``latency_s``: seconds from submission to the first token /
      to the end (None until known), measured on the client's monotonic clock.

    Safe to read from any thread.
    """

    __slots__ = ("request_id", "prompt", "_tokens", "_text", "_reason", "_error", "_done",
                 "callback", "on_token", "prompt_tokens", "submitted_s", "first_token_s",
                 "finished_s", "_stream_error", "_owner")

    def __init__(self, request_id, prompt, callback: Callable | None, on_token: Callable | None,
                 submitted_s: float, owner) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self._tokens: list[int] = []
        self._text: list[str] | None = None
        self._reason: FinishReason | None = None
        self._error: BaseException | None = None
        self._done = False
        self.callback = callback
        self.on_token = on_token
        self.prompt_tokens: int | None = len(prompt) if isinstance(prompt, list) else None
        self.submitted_s = submitted_s
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self._stream_error: BaseException | None = None
        self._owner = owner

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def text(self) -> str | None:
        return None if self._text is None else "".join(self._text)

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._reason

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.submitted_s

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.submitted_s

    def done(self) -> bool:
        """True once the request ended and its completion callback has returned."""
        return self._done

    def result(self, timeout: float | None = None) -> list:
        """Block until done; return the prompt followed by the generated tokens.

        ``timeout`` in seconds (None: wait forever). Raises ``TimeoutError``
        when it passes first. For every ending -- check ``finish_reason`` and
        ``error`` -- the sequence holds the tokens produced until then. Called
        from the request's own callback it returns at once; called from
        another request's callback (the thread that would finish it) it raises
        ``RuntimeError`` instead of deadlocking.
        """
        if not self._done and not self._owner._delivering_now(self):
            self._owner._wait_done(self, timeout)
        prompt = self.prompt if isinstance(self.prompt, list) else []
        return prompt + self._tokens

    def __repr__(self) -> str:
        return (f"RequestHandle(request_id={self.request_id!r}, tokens={len(self._tokens)}, "
                f"finish_reason={self._reason})")
