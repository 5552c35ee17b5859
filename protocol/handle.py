"""What a caller holds for a submitted request: one public surface for the
in-process engine's handles and the client SDK's.

:class:`RequestHandle` declares the surface once; ``worker.request.Request`` (the
engine's request, its own handle) and ``client.handle.ClientHandle`` fill it
in, each from its own state (the engine's running sequence; the tokens a
client received). Code written against one works against the other.
"""

from __future__ import annotations

from typing import NamedTuple

from protocol.embedding import unpack
from protocol.enums import FinishReason
from protocol.logprobs import TokenLogprob
from protocol.request import RequestId, RequestParams


class Usage(NamedTuple):
    """Token counts of a request, as OpenAI's ``usage``: ``prompt_tokens`` (None
    while unknown: a text prompt is tokenised by the worker) and
    ``completion_tokens`` (generated so far, resumed ones included). (OpenAI's
    ``prompt_tokens_details.cached_tokens`` is :attr:`RequestHandle.cached_tokens`,
    kept out of this pair so code that unpacks or compares it stays right.)"""

    prompt_tokens: int | None
    completion_tokens: int


class RequestHandle:
    """The caller's view of one request; safe to read from any thread.

    - ``request_id``: the caller's id, or the one picked for it.
    - ``params``: its :class:`~protocol.request.RequestParams`, as submitted.
    - ``prompt``: the prompt's token ids (a list) when known, else None
      (a text prompt seen from a client).
    - ``tokens``: tokens generated so far, resumed ones included (a list copy).
    - ``text``: when the model has a tokenizer, the generated text: the
      decode of ``tokens`` (special tokens left out), cut before a matched
      stop string (after it with ``include_stop_str_in_output``). While the
      request runs, the text released so far (never a prefix of a stop
      string that may still match; see :mod:`worker.text`). None for models
      without a tokenizer.
    - ``finish_reason``: None until the request ends, then a :class:`FinishReason`.
    - ``stop_reason``: for ``"stop"``, the stop token (int) the request named in its own
      ``stop_token``, stop sequence (tuple) or stop string (str) that matched, as vLLM's
      ``stop_reason``; else None -- also when the serving side's default end tokens (the
      model's EOS) stopped it.
    - ``error``: None, or the exception that ended the request (or that its
      completion callback raised).
    - ``usage``: :class:`Usage`; ``prompt_tokens`` is its first half.
    - ``cached_tokens``: prompt tokens whose KV came from the prefix cache of the engine that
      prefilled the prompt (the last one, for a request that migrated) instead of being
      prefilled; 0 for a miss and for models without a prefix cache. None until the prompt
      is prefilled (its first token), and for a request that ended before.
    - ``ttft_s`` / ``latency_s``: seconds from submission to the first token /
      to the end (None until then), on the owner's monotonic clock.
    - ``logprobs``: None unless the request asked (``params.logprobs``); then a list with one
      :class:`~protocol.logprobs.TokenLogprob` per generated token, in the order of ``tokens``
      (an entry is appended before that token's ``on_token`` runs). Resumed tokens of a migrated
      request keep the entries the caller already received.
    - ``prompt_logprobs``: None unless the request asked (``params.prompt_logprobs``) and its
      prompt was prefilled; then one entry per prompt token, the first None (nothing before it),
      set before the first generated token's ``on_token``.
    - ``embedding``: for an embedding request (``params.kind`` embed), its vector (a list of
      floats, float32 precision) once it ended ``stop``; else None. ``embedding_bytes``: the same
      as little-endian float32 bytes (:mod:`protocol.embedding`).
    - ``done()``, ``result(timeout)``: see there.
    """

    __slots__ = ("request_id", "params", "submitted_s", "first_token_s", "finished_s", "_prompt_tokens",
                 "_cached_tokens", "_finish_reason", "_stop_reason", "_error", "_done", "logprobs", "prompt_logprobs",
                 "embedding_bytes")

    def __init__(self, request_id: RequestId, params: RequestParams, submitted_s: float,
                 prompt_tokens: int | None) -> None:
        self.request_id = request_id
        self.params = params
        self.submitted_s = submitted_s
        self.first_token_s: float | None = None
        self.finished_s: float | None = None
        self._prompt_tokens = prompt_tokens
        self._cached_tokens: int | None = None
        self._finish_reason: FinishReason | None = None
        self._stop_reason: int | tuple[int, ...] | str | None = None
        self._error: BaseException | None = None
        self._done = False
        self.logprobs: list[TokenLogprob] | None = None if params.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprob | None] | None = None
        self.embedding_bytes: bytes | None = None

    # ---- filled in by the owner's handle class

    @property
    def prompt(self) -> list[int] | None:
        return list(self.params.prompt) if self.params.is_token_prompt else None

    @property
    def tokens(self) -> list[int]:
        raise NotImplementedError

    @property
    def text(self) -> str | None:
        raise NotImplementedError

    def _wait(self, timeout: float | None) -> None:
        """Block until done (TimeoutError after ``timeout`` seconds)."""
        raise NotImplementedError

    # ---- the common surface

    @property
    def finish_reason(self) -> FinishReason | None:
        return self._finish_reason

    @property
    def stop_reason(self) -> int | tuple[int, ...] | str | None:
        return self._stop_reason

    @property
    def error(self) -> BaseException | None:
        return self._error

    @property
    def usage(self) -> Usage:
        return Usage(self._prompt_tokens, len(self.tokens))

    @property
    def embedding(self) -> list[float] | None:
        """The embedding's values (see the class docstring), or None."""
        return None if self.embedding_bytes is None else unpack(self.embedding_bytes)

    @property
    def prompt_tokens(self) -> int | None:
        """``usage.prompt_tokens``: the prompt's length in tokens, or None while unknown."""
        return self._prompt_tokens

    @property
    def cached_tokens(self) -> int | None:
        """OpenAI's ``usage.prompt_tokens_details.cached_tokens``: prompt tokens taken from the
        prefix cache (see the class docstring)."""
        return self._cached_tokens

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.submitted_s

    @property
    def latency_s(self) -> float | None:
        return None if self.finished_s is None else self.finished_s - self.submitted_s

    def done(self) -> bool:
        """True once the request ended and its completion callback has returned."""
        return self._done

    def result(self, timeout: float | None = None) -> list[int]:
        """Block until done; return the final sequence: prompt token ids (when
        known) followed by the generated tokens.

        ``timeout`` in seconds (None waits forever). Raises ``TimeoutError``
        when it passes first. For every ending -- check ``finish_reason`` and
        ``error`` -- the sequence holds the tokens produced until then. Called
        from the request's own completion callback it returns at once.
        """
        if not self._done:
            self._wait(timeout)
        return (self.prompt or []) + self.tokens

    def _end(self, reason: FinishReason, stop_reason, error: BaseException | None, now: float) -> None:
        """The owner records the ending (before the completion callback runs)."""
        self._finish_reason = reason
        self._stop_reason = stop_reason
        self._error = error
        self.finished_s = now

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(request_id={self.request_id!r}, tokens={len(self.tokens)}, "
                f"finish_reason={self._finish_reason})")
