"""Enumerations shared by every process: finish reasons and error codes.

Both are ``str`` enums so they travel over msgpack as their plain string
value and compare equal to it (``FinishReason.STOP == "stop"``).
"""

from __future__ import annotations

import enum


class FinishReason(str, enum.Enum):
    """Why a request ended (the ``finish_reason`` of vLLM / OpenAI).

    - ``STOP``: a stop token or a stop sequence was generated (it is included
      in the output, as in vLLM's ``token_ids``).
    - ``LENGTH``: ``max_tokens`` tokens were generated.
    - ``CANCELLED``: the caller (or the broker, for a vanished client)
      cancelled it.
    - ``DEADLINE``: its ``timeout_s`` passed, queued or running.
    - ``ERROR``: it failed; the handle's ``error`` / the wire ``code`` says why.
    """

    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"
    DEADLINE = "deadline"
    ERROR = "error"

    def __str__(self) -> str:  # so f-strings print "stop", not "FinishReason.STOP"
        return self.value


class RequestKind(str, enum.Enum):
    """What a request asks of its model (the request field ``kind``).

    - ``GENERATE``: generated tokens (completions, chat): a decoder's slot loop.
    - ``EMBED``: the prompt's pooled embedding and no token (``/v1/embeddings``): one
      forward of an embedding model (an encoder, or a decoder with ``--pooling``; see
      ``worker.embedding``). A worker serves one kind; a request of the other kind ends
      ``unsupported`` there.
    """

    GENERATE = "generate"
    EMBED = "embed"

    def __str__(self) -> str:
        return self.value


class ModelState(str, enum.Enum):
    """The state of a model loaded on demand (``status``'s ``on_demand``; ``GET /v1/models``'s
    ``status.value``), llama.cpp's router's words and one of slotserve's own.

    - ``UNLOADED``: no worker runs it, and no load is under way (a failed one says so beside:
      :class:`~protocol.messages.DemandState`).
    - ``LOADING``: a load was accepted (``POST /models/load``, a request naming it) and has not
      ended: waiting for room or a failed load's back-off, its worker starting, loading or warming up.
    - ``LOADED``: a worker serves it.
    - ``UNLOADING``: an unload was accepted (``POST /models/unload``, idle past ``--idle-unload-s``,
      room for another) and has not ended: it goes once idle (it serves what it runs, and what comes
      meanwhile), then its worker stops. llama.cpp's router has no such word (its model stays
      ``loaded`` until its process exits): slotserve's own.
    """

    UNLOADED = "unloaded"
    LOADING = "loading"
    LOADED = "loaded"
    UNLOADING = "unloading"

    def __str__(self) -> str:
        return self.value


class ModelAction(str, enum.Enum):
    """What a ``model_order`` asks of a model on demand: ``POST /models/load`` or ``/models/unload``."""

    LOAD = "load"
    UNLOAD = "unload"

    def __str__(self) -> str:
        return self.value


class ErrorCode(str, enum.Enum):
    """Error codes carried by error replies and failed requests on the wire."""

    BAD_REQUEST = "bad_request"          # failed validation (the message says which field)
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"  # prompt + max_tokens over the model's context (OpenAI's code)
    MALFORMED = "malformed"              # not decodable msgpack / not a map / missing fields
    UNSUPPORTED_VERSION = "unsupported_version"
    UNKNOWN_OP = "unknown_op"
    TOO_LARGE = "too_large"              # message over the size limit
    QUEUE_FULL = "queue_full"            # admission refused: the model's queue is at its bound
    DUPLICATE_REQUEST = "duplicate_request"
    UNKNOWN_MODEL = "unknown_model"      # no worker ever registered this model, nor is one loading it
    UNSUPPORTED = "unsupported"          # e.g. a text prompt for a model without a tokenizer, or a request
    #                                      kind the worker does not serve (an embedding for a generation model)
    WORKER_FAILED = "worker_failed"      # the request failed on too many workers in a row
    MODEL_ERROR = "model_error"          # the model raised while running the request
    SLOW_CONSUMER = "slow_consumer"      # the client stopped reading; its requests were failed
    CLIENT_SILENT = "client_silent"      # no heartbeat from the client for the broker's liveness window
    UNAUTHORIZED = "unauthorized"
    NOT_REGISTERED = "not_registered"    # a worker the broker does not know (it restarted): register again
    BROKER_UNAVAILABLE = "broker_unavailable"
    INTERNAL = "internal"

    def __str__(self) -> str:
        return self.value
