"""Errors raised or recorded by the in-process engine.

Each carries the wire :class:`~protocol.enums.ErrorCode` it maps to, so the
worker process can forward it without a lookup table. Bad input is a plain
``ValueError`` (code ``bad_request``) from :mod:`protocol.validation`.
"""

from __future__ import annotations

from protocol.enums import ErrorCode

__all__ = ["DuplicateRequestError", "LoadInterrupted", "ModelError", "ModelFileError", "ModelLoadError",
           "QueueFullError"]


class QueueFullError(RuntimeError):
    """``submit_request`` found the queue at ``max_queue``; nothing was queued.

    Retry later, or raise the engine's ``max_queue``.
    """

    code = ErrorCode.QUEUE_FULL


class DuplicateRequestError(ValueError):
    """A request with this ``request_id`` is already queued or running in this engine."""

    code = ErrorCode.DUPLICATE_REQUEST


class ModelError(RuntimeError):
    """The model raised, or returned the wrong number of tokens, during an iteration.

    Recorded on the handle of every request in that iteration's batch (their
    ``finish_reason`` is ``"error"``); the original exception is ``__cause__``.
    """

    code = ErrorCode.MODEL_ERROR


class ModelFileError(ValueError):
    """A model's files are missing, unreadable, cut short, corrupt or not a model's: a path or name that
    names no checkpoint here, a GGUF file whose header or tensor data is cut short or garbled (an
    unknown tensor type, a tensor or metadata key its family needs missing), a Hugging Face folder
    whose weights file is missing or garbled or whose weights do not fit its config.json (a tensor
    of another shape, or one it needs missing), an alias whose package or part packages are missing,
    not as published or do not hash to the published file, a zipped model folder that does not
    unzip, a sentence-transformers file that does not parse. The message names the file and what
    to do (reinstall, download again) for the server's log.

    Raised where the file is found bad (:mod:`worker.models.names`, :mod:`worker.models.gguf_header`,
    :mod:`worker.models.checkpoint`, :mod:`worker.models.parts`, :mod:`worker.models.zipped`,
    :mod:`worker.models.pooling`, :mod:`worker.models.embedder`); a caller that adds context to one
    raises a ModelFileError again, so its type survives the wrap. A ValueError, as every load error
    is, so ``except ValueError`` still takes it; the worker tells clients "its files could not be
    read" for this type (and for an ``OSError``), "its configuration is not valid" for any other
    ValueError (:func:`worker.process._load_failure`).

    ``cause``: what clients may read instead of "its files could not be read", where the fault is
    known more precisely and can be said without a path (weights that do not fit config.json:
    :mod:`worker.models.weights_fit`); None: those words."""

    def __init__(self, message: str, cause: str | None = None) -> None:
        super().__init__(message)
        self.cause = cause


class ModelLoadError(ValueError):
    """The worker's model could not be loaded (unknown name, missing file,
    no hub access); the message names the model and the cause, for the server's log and its operator
    (a path, a library's words). ``public``: what clients may read (the worker's goodbye, which the
    broker puts in the error of the requests waiting for the model and in ``/v1/models``' failed
    reason): the served name and a short cause in slotserve's words, no path and no library text;
    the message itself when not given (a message of slotserve's own words)."""

    def __init__(self, message: str, public: str | None = None) -> None:
        super().__init__(message)
        self.public = message if public is None else public


class LoadInterrupted(BaseException):
    """A stop signal ended the worker's model load or warm-up part-way (raised on the main thread by
    :meth:`slotserve.signals.SignalStopFlag.interrupting`). A BaseException, as KeyboardInterrupt is, so
    that a loader's ``except Exception`` cannot take it for a failed load; the worker catches it and
    stops as a signal asks (no load error, exit status 0)."""
