"""The protocol's exceptions: what decoding a bad message raises, requests a model cannot serve, a bad stop entry."""

from __future__ import annotations

from protocol.enums import ErrorCode
from protocol.validation import kind_of

__all__ = ["ContextLengthError", "ProtocolError", "StopEntryError", "UnsupportedError", "error_code"]


def error_code(err: BaseException | None, default: ErrorCode | None) -> ErrorCode | None:
    """The wire code of ``err``: its ``code`` when that is an :class:`ErrorCode` (slotserve's errors
    carry one: :class:`UnsupportedError`, :class:`ContextLengthError`, a worker's ``ModelError``),
    else ``default``. Another exception's ``code`` is no wire code -- an HTTP status
    (``urllib.error.HTTPError.code``: 404), an exit status, a library's own string -- and a record
    carrying it could not be encoded, or read by the peer (``malformed``)."""
    code = getattr(err, "code", None)
    return code if isinstance(code, ErrorCode) else default


class ProtocolError(Exception):
    """A message could not be decoded or broke the wire contract.

    ``code`` is the :class:`~protocol.enums.ErrorCode` to answer with
    (``malformed``, ``too_large``, ``unsupported_version``, ``unknown_op``);
    ``message`` says what was wrong, for the peer and the log. Raised by
    :func:`protocol.codec.decode`; the caller answers with an error reply
    and keeps going.
    """

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message


class UnsupportedError(ValueError):
    """The request asks for something this model cannot do -- a text prompt or
    text stop strings for a model without a tokenizer; nothing was queued.

    Raised at submission by the engine, and by a client that knows the model;
    on the wire it is the error code ``unsupported``.
    """

    code = ErrorCode.UNSUPPORTED


class ContextLengthError(ValueError):
    """The prompt and ``max_tokens`` together exceed the model's context;
    nothing was queued.

    Raised at submission (:class:`~protocol.request.ModelLimits`): by a client
    that knows the model for token ids, by the engine for every prompt (text
    and chat once tokenised). On the wire it is the error code
    ``context_length_exceeded`` (OpenAI's code for the same condition), so the
    caller sees one code whichever side found it.
    """

    code = ErrorCode.CONTEXT_LENGTH_EXCEEDED


class StopEntryError(ValueError):
    """An entry of a request's ``stop`` that is neither a string (a text stop
    string) nor a list of token ids (a stop sequence); raised by
    :func:`protocol.request.split_stop`. ``index`` and ``entry`` name it, for
    callers that word the message their own way (the HTTP gateway speaks JSON)."""

    def __init__(self, index: int, entry: object) -> None:
        super().__init__(f"stop[{index}] must be a str (a text stop string) or a list of token ids (a stop "
                         f"sequence), got {kind_of(entry)} (for one sequence of ids pass [[...]])")
        self.index = index
        self.entry = entry
