"""The msgpack codec: :func:`encode` a message to bytes, :func:`decode` bytes to a message.

Wire format: one ZeroMQ frame per message holding one msgpack map
(``use_bin_type=True``; strings as UTF-8) with ``v`` (the
:data:`~protocol.messages.PROTOCOL_VERSION`), ``op`` and the message's
fields by name. Records inside messages (NamedTuples: envelopes, request
parameters, finished entries, ...) are msgpack arrays of their fields in
declaration order; enums travel as their string values. A record's trailing
fields may be left out (an older peer's, which knows fewer): they decode as
their defaults. The encoder leaves out those of envelopes and request
parameters that equal their defaults (:func:`_wire_envelope`; a plain request
is ``[id, [prompt, max_tokens, stop_token]]``, not 4 + 22 values: every hop
packs, unpacks and checks it), so the far side decodes exactly what was sent.

Both directions are generic, derived once from each class's type
annotations (:func:`typing.get_type_hints`): encoding lets msgpack pack the
fields as they are (tuples and NamedTuples are arrays to it); decoding checks
every value against its field's declared type. Three types decode their own
way: a :class:`~protocol.logprobs.TokenLogprob` (per token: one flat check;
its floats may be ``-inf``, a probability of 0, where every other float on
the wire is finite); :class:`~protocol.request.RequestParams` is built by its constructor,
which validates every field (the one definition of a valid request), and an
:class:`~protocol.messages.Envelope` whose parameters are invalid decodes as
a :class:`~protocol.messages.Rejected` entry naming its request, so one bad
request in a batch fails alone.

:func:`decode` never lets a peer's bytes crash the caller: anything
oversized, undecodable, of another version, of an unknown or unexpected
``op``, or with a value of the wrong type raises :class:`ProtocolError` with
the code to answer with. It raises nothing else (a bug in a check would;
tests/test_protocol.py looks for one).
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import math
import operator
import re
import types
import typing
from typing import Any, Callable, Collection, Union

import msgpack

from protocol.defaults import MAX_MESSAGE_BYTES
from protocol.enums import ErrorCode
from protocol.errors import ProtocolError
from protocol.logprobs import TokenLogprob
from protocol.messages import MESSAGE_TYPES, PROTOCOL_VERSION, Envelope, Iteration, Message, Op, Rejected, Results
from protocol.request import (
    _AFTER_STOP_DEFAULTS, MAX_REQUEST_ID_CHARS, RequestId, RequestParams, from_wire, from_wire_plain, to_wire,
)
from protocol.validation import echo

_count_of = operator.countOf
_ENVELOPE_FIELDS = len(Envelope._fields)
_PARAMS_FIELDS = len(RequestParams._fields)
_tuple_new = tuple.__new__
_ID_TYPES = frozenset({int, str})

Decoder = Callable[[Any, str], Any]
"""Checks one decoded value against a field's type: ``(value, field name) -> value``."""


def encode(msg: Message) -> bytes:
    """Serialize ``msg`` to one msgpack frame (bytes), adding ``v`` and ``op``. The envelopes of a
    ``submit`` or ``assign`` go as :func:`_wire_envelope` puts them (their trailing defaults left out);
    an ``iteration`` or ``results`` without embeddings leaves its ``embeddings`` field out."""
    d = {"v": PROTOCOL_VERSION, "op": msg.op.value}
    for name in _FIELDS[type(msg)]:
        d[name] = getattr(msg, name)
    if type(msg) in _TOKEN_BATCHES and not msg.embeddings:  # (left out when empty: see _TOKEN_BATCHES)
        del d["embeddings"]
    if type(msg) in _WITH_ENVELOPES:  # (_wire_envelope's common case inline: once per request on every hop)
        d["requests"] = [(e[0], p[:3]) if type(e) is Envelope and type(p := e[1]) is RequestParams
                         and p[3:] == _AFTER_STOP_DEFAULTS and e[3] is None and e[2] == () else _wire_envelope(e)
                         for e in d["requests"]]
    return msgpack.packb(d, use_bin_type=True)


def _wire_envelope(entry: Any) -> Any:
    """An :class:`~protocol.messages.Envelope` as it travels: an array of its fields whose trailing
    defaults are left out, ``resume_tokens`` and ``time_left_s`` (``[request_id, params]`` for a
    fresh request) and those of its parameters (:func:`~protocol.request.to_wire`), which the
    decoder gives back (:func:`_envelope`, :func:`~protocol.request.from_wire`). Anything else (a
    test's hand-made entry) goes as it is."""
    if type(entry) is not Envelope:
        return entry
    rid, params, resume, time_left = entry
    if type(params) is RequestParams:
        params = to_wire(params)
    if time_left is None:
        if resume == ():
            return rid, params
        return rid, params, resume
    return rid, params, resume, time_left


def decode(data: bytes, allowed: Collection[Op] | None = None, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
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
        d: Any = msgpack.unpackb(data, raw=False, use_list=False)
    except (ValueError, TypeError, RecursionError) as e:  # msgpack's errors: ExtraData, FormatError, StackError, ...
        raise ProtocolError(ErrorCode.MALFORMED, f"not a msgpack message: {unreadable(e)}") from None
    if type(d) is not dict:
        raise ProtocolError(ErrorCode.MALFORMED, "a message must be a msgpack map")
    v = d.pop("v", None)
    if v != PROTOCOL_VERSION or type(v) is not int:
        raise ProtocolError(ErrorCode.UNSUPPORTED_VERSION,
                            f"protocol version {echo(v)} is not supported; this peer speaks v{PROTOCOL_VERSION}")
    op = d.pop("op", None)
    try:
        op = Op(op)
    except (ValueError, TypeError):
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {echo(op)}") from None
    if allowed is not None and op not in allowed:
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"op {op.value!r} is not accepted on this socket")
    return _DECODERS[MESSAGE_TYPES[op]](d, op.value)


MAX_MSGPACK_DEPTH = 1024
"""How many levels of arrays and maps a frame may nest: msgpack's C unpacker's stack (deeper raises
its ``StackError``); far past what any message holds (a request's JSON values nest at most
:data:`~protocol.validation.MAX_JSON_DEPTH` levels)."""


_KEY_TYPE = re.compile(r"(\w+) is not allowed for map key")  # msgpack's words: the key's Python type first
_KEY_KINDS = {"bool": "a boolean", "int": "an integer", "float": "a float", "NoneType": "nil", "tuple": "an array",
              "list": "an array", "dict": "a map", "ExtType": "an extension value", "Timestamp": "a timestamp",
              "str": "a string", "bytes": "binary data"}
"""A decoded value's Python type (as msgpack names it refusing a map key; a field's value by its
type) -> the msgpack kind in words."""


def _kind(tp: type) -> str:
    """The msgpack kind of the values of type ``tp`` in words (:data:`_KEY_KINDS`; a type msgpack has
    no word for, such as a record, by its name): what a malformed field's message says was expected
    and was got, never Python's name for it (``got tuple`` named no value a peer sends)."""
    return _KEY_KINDS.get(tp.__name__, tp.__name__)


def unreadable(err: Exception) -> str:
    """Why msgpack could not read a frame (``err``, what :func:`msgpack.unpackb` raised), in our
    words: its exceptions' names and texts (``StackError``, ``ExtraData``, "Unpack failed: incomplete
    input") are the library's, never a peer's to read."""
    if isinstance(err, (msgpack.StackError, RecursionError)):  # (RecursionError: the pure-Python fallback's)
        return f"it nests arrays and maps more than {MAX_MSGPACK_DEPTH:,} levels deep"
    if isinstance(err, msgpack.ExtraData):
        return "more bytes follow its value (a frame holds one msgpack map)"
    if isinstance(err, msgpack.FormatError):
        return "it holds a byte that starts no msgpack value"
    if isinstance(err, UnicodeDecodeError):
        return "a string in it is not valid UTF-8"
    text = str(err)
    if "incomplete input" in text:
        return "it ends inside a value (the frame is cut short)"
    key = _KEY_TYPE.match(text)
    if key:  # (msgpack's strict_map_key, its default: a key is a string, or bytes)
        kind = _KEY_KINDS.get(key[1])
        return f"a map's key is {kind}, not a string" if kind else "a map's key is not a string"
    if "exceeds max_" in text:
        return "an array, map, string or binary claims more entries or bytes than the frame holds"
    return "its bytes are no msgpack value"


def as_plain(value: Any) -> Any:
    """``value`` (a message, a record, or anything inside one) as plain JSON-like
    data: messages and records become maps of their fields by name, tuples
    lists, enums their values. For humans and JSON output, not the wire."""
    if dataclasses.is_dataclass(value):
        return {f.name: as_plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if _is_record(type(value)):
        return {name: as_plain(v) for name, v in zip(value._fields, value)}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, (tuple, list)):
        return [as_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: as_plain(v) for k, v in value.items()}
    return value


def peek_request_ids(data: bytes) -> list:
    """Best effort: the request ids named in a frame that failed to decode
    (too large, malformed, an invalid field): the ``requests`` of a
    ``submit`` / ``assign``, the ``ids``, ``texts``, ``finished``, ``started`` and ``logprobs`` of an
    ``iteration`` / ``results`` (and ``embeddings``), the ``request_ids`` of a ``cancel`` / ``error``.

    Lets the receiver end exactly those requests with the decoding error
    instead of leaving them waiting. Reads the frame as a stream, keeping
    only the ids (an oversized frame costs no more memory than its bytes).
    Returns the ids found before anything unreadable, each once, in order;
    never raises.
    """
    ids: dict = {}
    try:
        u = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1))
        u.feed(data)
        for _ in range(u.read_map_header()):
            key = u.unpack()
            if key in _RECORD_LISTS:  # arrays of records, the request id first
                for _ in range(u.read_array_header()):
                    n = u.read_array_header()
                    if n:
                        _note_id(u.unpack(), ids)
                        for _ in range(n - 1):
                            u.skip()
            elif key in _ID_LISTS:
                for _ in range(u.read_array_header()):
                    _note_id(u.unpack(), ids)
            else:
                u.skip()
    except Exception:  # noqa: BLE001 -- hostile bytes: anything may be raised; keep what was found
        pass
    return list(ids)


_RECORD_LISTS = frozenset({"requests", "texts", "finished", "started", "logprobs", "embeddings"})
_ID_LISTS = frozenset({"ids", "request_ids"})


def _note_id(rid: Any, ids: dict) -> None:
    t = type(rid)
    if t is int or (t is str and 0 < len(rid) <= MAX_REQUEST_ID_CHARS):
        ids[rid] = None


# --------------------------------------------------------------------------- decoders by type


def _bad(name: str, expected: str, value: Any) -> ProtocolError:
    return ProtocolError(ErrorCode.MALFORMED, f"field {name!r}: expected {expected}, got {_kind(type(value))}")


def _exact(tp: type) -> Decoder:
    def check(v: Any, name: str) -> Any:
        if type(v) is not tp:
            raise _bad(name, _kind(tp), v)
        return v
    return check


def _float(v: Any, name: str) -> float:
    if (type(v) is float or type(v) is int) and math.isfinite(v):
        return float(v)
    raise _bad(name, "a finite number", v)


def _logprob(v: Any, name: str) -> float:
    """A log-probability: a number, ``-inf`` allowed (probability 0), NaN and ``+inf`` not."""
    if (type(v) is float or type(v) is int) and v == v and v != math.inf:
        return float(v)
    raise _bad(name, "a log-probability (a number, -inf allowed)", v)


def _token_logprob(v: Any, name: str) -> TokenLogprob:
    """A :class:`~protocol.logprobs.TokenLogprob`: ``[logprob, [[token id, logprob], ...]?]``.
    (Once per token of the requests that ask, with up to 20 pairs: a flat loop.)"""
    if type(v) is not tuple or not 1 <= len(v) <= 2:
        raise _bad(name, "an array [logprob, [[token id, logprob], ...]?]", v)
    lp = _logprob(v[0], name)
    top = v[1] if len(v) == 2 else ()
    if type(top) is not tuple:
        raise _bad(name, "an array of [token id, logprob] pairs", top)
    floats = True
    for pair in top:
        if type(pair) is not tuple or len(pair) != 2 or type(pair[0]) is not int:
            raise _bad(name, "a [token id, logprob] pair", pair)
        x = pair[1]
        if type(x) is not float:
            floats = False
            _logprob(x, name)
        elif x != x or x == math.inf:
            raise _bad(name, "a log-probability (a number, -inf allowed)", x)
    if not floats:  # (an int logprob, from a peer that packs 0 so: a float here)
        top = tuple([(i, float(x)) for i, x in top])
    return _tuple_new(TokenLogprob, (lp, top))


def _none(v: Any, name: str) -> None:
    if v is not None:
        raise _bad(name, "nil", v)


def _request_id(v: Any, name: str) -> RequestId:
    t = type(v)
    if t is int or (t is str and 0 < len(v) <= MAX_REQUEST_ID_CHARS):
        return v
    raise _bad(name, f"a request id (an integer, or a string of 1..{MAX_REQUEST_ID_CHARS} characters)", v)


def _int_tuple(v: Any, name: str) -> tuple[int, ...]:
    if type(v) is not tuple:
        raise _bad(name, "an array of integers", v)
    if _count_of(map(type, v), int) != len(v):  # C speed: these can be long
        i = next(i for i, x in enumerate(v) if type(x) is not int)
        raise _bad(f"{name}[{i}]", "an integer", v[i])
    return v


def _id_tuple(v: Any, name: str) -> tuple[RequestId, ...]:
    if type(v) is not tuple:
        raise _bad(name, "an array of request ids", v)
    types_ = set(map(type, v))
    if not _ID_TYPES.issuperset(types_) or (
            str in types_ and not all(0 < len(x) <= MAX_REQUEST_ID_CHARS for x in v if type(x) is str)):
        i = next(i for i, x in enumerate(v)
                 if not (type(x) is int or type(x) is str and 0 < len(x) <= MAX_REQUEST_ID_CHARS))
        raise _bad(f"{name}[{i}]", f"a request id (an integer, or a string of 1..{MAX_REQUEST_ID_CHARS} characters)",
                   v[i])
    return v


def _enum(cls: type[enum.Enum]) -> Decoder:
    members = cls._value2member_map_

    def check(v: Any, name: str) -> Any:
        member = members.get(v) if type(v) is str else None
        if member is None:
            raise ProtocolError(ErrorCode.MALFORMED, f"field {name!r}: unknown value {echo(v, 40)}")
        return member
    return check


def _tuple_of(item: Decoder) -> Decoder:
    def check(v: Any, name: str) -> tuple:
        if type(v) is not tuple:
            raise _bad(name, "an array", v)
        return tuple([item(x, name) for x in v])
    return check


def _dict_of(item: Decoder) -> Decoder:
    def check(v: Any, name: str) -> dict:
        if type(v) is not dict:
            raise _bad(name, "a map", v)
        for k in v:
            if type(k) is not str:
                raise _bad(name, "string keys", k)
        return {k: item(x, name) for k, x in v.items()}
    return check


def _union(arms: tuple) -> Decoder:
    by_type: dict[type, Decoder] = {}
    for arm in arms:
        dec = _decoder(arm)
        kinds = ((int, float) if arm is float else (type(None),) if arm is type(None)
                 else (str,) if isinstance(arm, type) and issubclass(arm, (str, enum.Enum)) else
                 (tuple,) if arm is tuple or typing.get_origin(arm) is tuple or _is_record(arm) else (arm,))
        for kind in kinds:
            if kind in by_type:
                raise TypeError(f"ambiguous union {arms}: two arms take {kind.__name__}")
            by_type[kind] = dec

    def check(v: Any, name: str) -> Any:
        dec = by_type.get(type(v))
        if dec is None:
            raise _bad(name, " or ".join(sorted(map(_kind, by_type))), v)
        return dec(v, name)
    return check


def _is_record(tp: Any) -> bool:
    return isinstance(tp, type) and issubclass(tp, tuple) and hasattr(tp, "_fields")


def _record(cls: type) -> Decoder:
    """A NamedTuple from an array of its fields (trailing defaults may be left out).

    A value whose type the field takes as it is (an int for ``int``, None for an
    optional field, ...) skips its field's check: records are decoded per
    request, several per message."""
    hints = typing.get_type_hints(cls)
    fields = [(name, _decoder(hints[name]), _as_is_types(hints[name])) for name in cls._fields]
    required = len(fields) - len(cls._field_defaults)
    full = len(fields)
    # The fields to check, by the types of a record's values (a message's records mostly share a
    # few: one lookup per record, not a test per field); bounded, as a peer chooses the types.
    to_check: dict[tuple[type, ...], tuple[int, ...]] = {}

    def check(v: Any, name: str) -> Any:
        if type(v) is not tuple or not required <= len(v) <= full:
            raise _bad(name, f"an array of {required}..{full} {cls.__name__} fields", v)
        types = tuple(map(type, v))
        indexes = to_check.get(types)
        if indexes is None:
            indexes = tuple(i for i, (t, (_, _, as_is)) in enumerate(zip(types, fields)) if t not in as_is)
            if len(to_check) < _MAX_SHAPES:
                to_check[types] = indexes
        if not indexes:
            return _tuple_new(cls, v) if len(v) == full else cls(*v)
        values = list(v)
        for i in indexes:
            f, dec, _ = fields[i]
            values[i] = dec(values[i], f)
        return _tuple_new(cls, values) if len(v) == full else cls(*values)
    return check


_MAX_SHAPES = 64
"""Most type signatures of its values a record decoder remembers (see :func:`_record`)."""

_STR_ONLY = frozenset({str})
_COLUMNS_FROM = 4
"""Fewest records an array of them must hold to be checked a column at a time (see :func:`_records`)."""


def _records(cls: type) -> Decoder:
    """An array of ``cls`` records (``tuple[cls, ...]``): :func:`_record`'s check of each, the same
    values and the same errors, done a column at a time where it can be -- every record an array
    of all its fields, and each field's values of the types it takes as they are, or the strings of
    an enum field's values (turned into its members): one C pass per field instead of a Python call
    per record (an iteration's and a results message's endings, one per request, on every hop).
    Anything else is checked record by record, which says what is wrong."""
    one = _record(cls)
    hints = typing.get_type_hints(cls)
    full = len(cls._fields)
    plan = tuple((_as_is_types(hints[name]),
                  hints[name]._value2member_map_ if isinstance(hints[name], type)
                  and issubclass(hints[name], enum.Enum) else None) for name in cls._fields)

    def check(v: Any, name: str) -> tuple:
        if type(v) is not tuple:
            raise _bad(name, "an array", v)
        if len(v) < _COLUMNS_FROM or _count_of(map(type, v), tuple) != len(v):
            return tuple([one(x, name) for x in v])
        try:
            columns = list(zip(*v, strict=True))  # (ValueError: records of several lengths)
        except ValueError:
            columns = ()
        if len(columns) != full:
            return tuple([one(x, name) for x in v])
        for i, (as_is, members) in enumerate(plan):
            if members is None or as_is:
                kinds = set(map(type, columns[i]))
                if kinds <= as_is:
                    continue
                if members is None or kinds != _STR_ONLY:
                    return tuple([one(x, name) for x in v])
            # An enum field's strings turned into its members at once: its members' strings are the
            # only keys, and msgpack gives no other value equal to a str (an unhashable one raises).
            try:
                column = tuple(map(members.get, columns[i]))
            except TypeError:
                column = (None,)
            if None not in column:  # (every value one of the enum's)
                columns[i] = column
                continue
            return tuple([one(x, name) for x in v])
        return tuple(map(_tuple_new, itertools.repeat(cls, len(v)), zip(*columns)))  # (no partial: a call less each)
    return check


def _as_is_types(tp: Any) -> frozenset[type]:
    """The types whose values a field of type ``tp`` takes unchecked (msgpack already
    bounds ints, and decodes valid UTF-8 only; floats are checked for being finite,
    and request ids that are strings for their length)."""
    if tp == RequestId:
        return frozenset({int})
    if tp in (int, str, bool, bytes, type(None)):
        return frozenset({tp})
    if typing.get_origin(tp) in (Union, types.UnionType):
        return frozenset().union(*(_as_is_types(arm) for arm in typing.get_args(tp)))
    return frozenset()


def _request_params(v: Any, name: str) -> RequestParams:
    """Built by its constructor: the one place that knows a valid request (ValueError: invalid).

    Fields travel by position, new ones appended at the end: a shorter array
    (an older peer's) gets the defaults of the fields it lacks; a longer one
    (a newer peer's) is refused, never misread."""
    if type(v) is not tuple:
        raise _bad(name, "an array of request parameters", v)
    if not 2 <= len(v) <= len(RequestParams._fields):
        raise ValueError(f"request parameters with {len(v)} fields, this peer knows {len(RequestParams._fields)} "
                         f"({', '.join(RequestParams._fields)}; the first two required): "
                         "a newer peer's? upgrade this one")
    return from_wire(v)


def _envelope(v: Any, name: str) -> Envelope | Rejected:
    """An envelope, or a :class:`Rejected` entry when only its request is invalid.
    (Once per request on every hop: the common case calls as little as it can.)"""
    n = len(v) if type(v) is tuple else 0
    if not 2 <= n <= _ENVELOPE_FIELDS:
        raise _bad(name, "an array [request_id, params, resume_tokens?, time_left_s?]", v)
    rid = v[0]
    if type(rid) is not int:
        rid = _request_id(rid, "request_id")
    try:
        params = v[1]  # (as _request_params, inline: once per request)
        params = (from_wire(params) if type(params) is tuple and 2 <= len(params) <= _PARAMS_FIELDS
                  else _request_params(params, "params"))
        resume = v[2] if n > 2 else ()
        if resume != () or type(resume) is not tuple:  # (the empty tuple is one object)
            resume = params.check_resume(_int_tuple(resume, "resume_tokens"))
        time_left = v[3] if n > 3 else None
        if time_left is not None:
            time_left = _float(time_left, "time_left_s")
    except (ValueError, ProtocolError) as e:
        return Rejected(rid, getattr(e, "message", None) or str(e))
    return _tuple_new(Envelope, (rid, params, resume, time_left))


def _envelopes(v: Any, name: str) -> tuple[Envelope | Rejected, ...]:
    """An array of envelopes (a ``submit``'s, an ``assign``'s): :func:`_envelope` of each, the
    same values and errors, with its common case inline -- an int request id, no resume tokens nor
    time left (left out, as :func:`_wire_envelope` sends a fresh request, or nil and empty), parameters that
    :func:`~protocol.request.from_wire` accepts -- one call per request less, on every hop."""
    if type(v) is not tuple:
        raise _bad(name, "an array", v)
    plain = _plain_envelopes(v)
    if plain is not None:
        return plain
    out = []
    add = out.append
    for x in v:
        if type(x) is tuple and ((n := len(x)) == 2 or n == _ENVELOPE_FIELDS and x[2] == () and type(x[2]) is tuple
                                 and x[3] is None) and type(x[0]) is int:
            params = x[1]
            if type(params) is tuple and 2 <= len(params) <= _PARAMS_FIELDS:
                try:
                    add(_tuple_new(Envelope, (x[0], from_wire(params), (), None)))
                    continue
                except (ValueError, ProtocolError):
                    pass  # (_envelope below says why, in its Rejected entry)
        add(_envelope(x, name))
    return tuple(out)


def _plain_envelopes(v: tuple) -> tuple[Envelope, ...] | None:
    """Every envelope of ``v`` when all are fresh plain requests as a client sends them --
    ``[int id, [token-id prompt, max_tokens, stop_token]]`` (:func:`~protocol.request.from_wire_plain`)
    -- else None. A column at a time, as :func:`_records`: a submit's requests are mostly alike."""
    n = len(v)
    if not n or _count_of(map(type, v), tuple) != n:
        return None
    try:
        rids, arrays = zip(*v, strict=True)  # (ValueError: not all of 2 values)
    except ValueError:
        return None
    if _count_of(map(type, rids), int) != n:
        return None
    params = from_wire_plain(arrays)
    if params is None:
        return None
    return tuple(map(_tuple_new, itertools.repeat(Envelope, n), zip(rids, params, itertools.repeat((), n),
                                                                     itertools.repeat(None, n))))


def _message(cls: type) -> Callable[[dict, str], Message]:
    """A message from its map of fields (minus ``v`` and ``op``)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: _decoder(hints[f.name]) for f in dataclasses.fields(cls)}
    required = {f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}

    def check(d: dict, op: str) -> Message:
        unknown = [k for k in d if k not in fields]
        if unknown:
            raise ProtocolError(ErrorCode.MALFORMED, f"{op!r} has no field {echo(unknown[0])}")
        missing = required.difference(d)
        if missing:
            raise ProtocolError(ErrorCode.MALFORMED, f"{op!r} is missing field {sorted(missing)[0]!r}")
        try:
            return cls(**{k: fields[k](x, k) for k, x in d.items()})
        except ValueError as e:  # a rule of __post_init__
            raise ProtocolError(ErrorCode.MALFORMED, f"bad {op!r} message: {e}") from None
    return check


def _decoder(tp: Any) -> Decoder:
    """The check for values of the declared type ``tp`` (built once per type)."""
    if tp == RequestId:
        return _request_id
    if tp is RequestParams:
        return _request_params
    if tp is Envelope:
        return _envelope
    if tp is TokenLogprob:
        return _token_logprob
    if tp in (int, str, bool, bytes):
        return _exact(tp)
    if tp is float:
        return _float
    if tp is type(None):
        return _none
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return _enum(tp)
    if _is_record(tp):
        return _record(tp)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        return _union(args)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        if args[0] is int:
            return _int_tuple
        if args[0] == RequestId:
            return _id_tuple
        if args[0] is Envelope:
            return _envelopes
        if _is_record(args[0]) and args[0] not in (Envelope, TokenLogprob, RequestParams):  # (their own checks)
            return _records(args[0])
        return _tuple_of(_decoder(args[0]))
    if origin is dict and args[0] is str:
        return _dict_of(_decoder(args[1]))
    raise TypeError(f"no wire decoder for {tp!r}")


_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in MESSAGE_TYPES.values()}
_WITH_ENVELOPES = frozenset(cls for cls in MESSAGE_TYPES.values()
                            if typing.get_type_hints(cls).get("requests") == tuple[Envelope, ...])
"""The message types whose ``requests`` are envelopes (``submit``, ``assign``): see :func:`encode`."""
_DECODERS = {cls: _message(cls) for cls in MESSAGE_TYPES.values()}
_TOKEN_BATCHES = frozenset({Iteration, Results})
"""The messages whose ``embeddings`` (protocol v10) is left out when empty, as the decoder defaults it:
a generation worker's iterations, by far the most frequent messages, stay the size they were in v9."""
