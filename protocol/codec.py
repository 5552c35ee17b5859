"""The msgpack codec: :func:`encode` a message to bytes, :func:`decode` bytes to a message.

Wire format: one ZeroMQ frame per message holding one msgpack map
(``use_bin_type=True``; strings as UTF-8 ``str``) with ``v`` (the
:data:`~protocol.messages.PROTOCOL_VERSION`), ``op`` and the message's
fields. :func:`decode` never lets a peer's bytes crash the caller: anything
oversized, undecodable, of another version, of an unknown or unexpected
``op``, or with a wrongly typed field raises :class:`ProtocolError` with
the code to answer with.
"""

from __future__ import annotations

from typing import Any, Collection

import msgpack

from protocol.enums import ErrorCode
from protocol.errors import ProtocolError
from protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Message, Op

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest frame :func:`decode` accepts by default (bytes): room for a
``submit`` of many thousands of long prompts, small enough to bound memory."""

_packer_opts = {"use_bin_type": True}


def encode(msg: Message) -> bytes:
    """Serialize ``msg`` to one msgpack frame (bytes), adding ``v`` and ``op``."""
    d = msg.to_wire()
    d["v"] = PROTOCOL_VERSION
    d["op"] = msg.op.value
    return msgpack.packb(d, use_bin_type=True)


def peek_request_ids(data: bytes, max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> list:
    """Best effort: the request ids named in a ``submit`` frame that failed to decode.

    Lets the broker end those requests with an error instead of leaving the
    client waiting. Returns ``[]`` when nothing usable is found; never raises.
    """
    try:
        if len(data) > max_bytes:
            return []
        d = msgpack.unpackb(data, raw=False)
        ids = []
        for r in d.get("requests", []):
            rid = r.get("id") if type(r) is dict else None
            if type(rid) in (int, str):
                ids.append(rid)
        return ids
    except Exception:  # noqa: BLE001 -- hostile bytes: anything may be raised
        return []


def decode(data: bytes, allowed: Collection[Op] | None = None,
           max_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Message:
    """Parse one frame into its message class.

    - ``data``: the frame's bytes.
    - ``allowed``: ops accepted on this socket (e.g.
      :data:`~protocol.messages.CLIENT_TO_BROKER`); others raise ``unknown_op``.
    - ``max_bytes``: frames longer than this raise ``too_large``.

    Raises :class:`ProtocolError` (``too_large``, ``malformed``,
    ``unsupported_version``, ``unknown_op``); never anything else.
    """
    if len(data) > max_bytes:
        raise ProtocolError(ErrorCode.TOO_LARGE, f"message of {len(data)} bytes exceeds the limit of {max_bytes}")
    try:
        d: Any = msgpack.unpackb(data, raw=False)
    except Exception as e:  # noqa: BLE001 -- msgpack raises several types on garbage
        raise ProtocolError(ErrorCode.MALFORMED, f"not a msgpack message ({type(e).__name__})") from None
    if type(d) is not dict:
        raise ProtocolError(ErrorCode.MALFORMED, "a message must be a msgpack map")
    v = d.get("v")
    if v != PROTOCOL_VERSION or type(v) is not int:
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION,
                            f"protocol version {v!r:.20} is not supported; this peer speaks v{PROTOCOL_VERSION}")
    op = d.get("op")
    try:
        op = Op(op)
    except (ValueError, TypeError):
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r:.40}") from None
    if allowed is not None and op not in allowed:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"op {op.value!r} is not accepted on this socket")
    try:
        return MESSAGE_TYPES[op].from_wire(d)
    except ProtocolError:
        raise
    except Exception as e:  # noqa: BLE001 -- defensive: a checker missed a shape
        raise ProtocolError(ErrorCode.MALFORMED, f"bad {op.value!r} message ({type(e).__name__}: {e})"[:300]) from None
