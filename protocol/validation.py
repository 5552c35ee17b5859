"""Request validation: the one implementation, shared by the engine and the client SDK.

Every function is pure: it takes the caller's value, returns it normalised
(plain Python ints, tuples, frozensets) and raises :class:`ValueError` with a
message naming the field and what to send instead. Nothing here imports
anything beyond the standard library, so ``client`` can check a request before
it leaves the process and ``worker`` checks it again on arrival.

Integer rules (DESIGN.md): an "int" is anything with ``__index__`` -- Python
ints and numpy integers -- except ``bool`` (``True`` is a flag, never a
token). Floats and strings are rejected even when integral, so a caller's
type confusion surfaces at once instead of as a strange generation.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterable, Mapping, Set
from typing import NamedTuple

__all__ = [
    "DEFAULT_TEMPERATURE",
    "DEFAULT_TOP_P",
    "MAX_REQUEST_ID_LEN",
    "MAX_TOKEN_ID_SET",
    "ValidRequest",
    "token_id_set",
    "validate_max_tokens",
    "validate_messages",
    "validate_plain_request",
    "validate_priority",
    "validate_prompt",
    "validate_request",
    "validate_request_id",
    "validate_sampling",
    "validate_stop_sequences",
    "validate_stop_token",
    "validate_timeout",
    "validate_tokens",
]

_count_of = operator.countOf
_tuple_new = tuple.__new__
_EMPTY: tuple = ()

DEFAULT_TEMPERATURE = 0.0
"""A request's default ``temperature`` (greedy)."""

DEFAULT_TOP_P = 1.0
"""A request's default ``top_p`` (nucleus sampling off)."""

MAX_REQUEST_ID_LEN = 256
"""Longest accepted string request id, in characters (ids travel in every message)."""


def _as_int(value: object, field: str) -> int:
    """Return ``value`` as a Python int; ValueError for bool, float, str and friends."""
    if type(value) is int:  # the common case, checked first for speed
        return value
    if isinstance(value, bool) or type(value).__name__ in ("bool", "bool_"):
        raise ValueError(f"{field} must be an int, got bool {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{field} must be an int, got {type(value).__name__} {value!r}") from None


def _check_vocab(tokens: list[int], field: str, vocab_size: int | None) -> None:
    low = min(tokens)
    if low < 0:
        raise ValueError(f"{field} contains negative token id {low}; token ids are >= 0")
    if vocab_size is not None:
        high = max(tokens)
        if high >= vocab_size:
            raise ValueError(
                f"{field} contains token id {high}, outside the model's vocabulary "
                f"[0, {vocab_size})"
            )


def _as_token_list(value: object, field: str) -> list[int]:
    if type(value) is list:  # fast paths first: this runs for every request
        tokens = value
    elif type(value) is tuple:
        tokens = list(value)
    elif isinstance(value, (str, bytes, bytearray, Mapping, Set)) or not isinstance(
        value, Iterable
    ):
        raise ValueError(f"{field} must be a list of int token ids, got {type(value).__name__}")
    else:
        tokens = list(value)  # type: ignore[call-overload]
    if _count_of(map(type, tokens), int) != len(tokens):  # C-speed; slow path for numpy ints
        return [_as_int(t, f"{field} element") for t in tokens]
    return tokens


MAX_TOKEN_ID_SET = 1 << 18
"""Largest ``vocab_size`` for which :func:`token_id_set` builds a set (about 17 MB at this size)."""


def token_id_set(vocab_size: int | None) -> frozenset[int] | None:
    """``frozenset(range(vocab_size))`` for :func:`validate_request`'s ``token_ids``.

    None when there is no vocabulary bound or it exceeds
    :data:`MAX_TOKEN_ID_SET` (a set that large costs more memory than the
    faster check is worth; validation then uses ``min``/``max``).
    """
    if vocab_size is None or vocab_size > MAX_TOKEN_ID_SET:
        return None
    return frozenset(range(vocab_size))


def validate_tokens(tokens: object, *, field: str = "tokens", vocab_size: int | None = None,
                    allow_empty: bool = True) -> list[int]:
    """Validate a token list (any iterable of ints; numpy arrays work).

    Returns a list of Python ints (the caller's own list when it already is
    one). Raises ValueError when it is not a sequence of ints, contains a
    bool, a negative id or an id >= ``vocab_size``, or is empty while
    ``allow_empty`` is False.
    """
    out = _as_token_list(tokens, field)
    if not out:
        if not allow_empty:
            raise ValueError(f"{field} must not be empty")
        return out
    _check_vocab(out, field, vocab_size)
    return out


def validate_prompt(prompt: object, *, vocab_size: int | None = None) -> list[int]:
    """A prompt: a non-empty list of token ids in ``[0, vocab_size)``. See :func:`validate_tokens`."""
    return validate_tokens(prompt, field="prompt", vocab_size=vocab_size, allow_empty=False)


def validate_max_tokens(max_tokens: object) -> int:
    """``max_tokens``: an int >= 1 counting generated tokens only (bool/float/str rejected)."""
    n = _as_int(max_tokens, "max_tokens")
    if n < 1:
        raise ValueError(f"max_tokens must be >= 1, got {n}")
    return n


def validate_stop_token(stop_token: object, *, vocab_size: int | None = None) -> frozenset[int]:
    """Stop token(s): None (no stop token), one int, or an iterable of ints.

    Returns the set of stop token ids (empty for None). ``0`` is a real token.
    """
    if stop_token is None:
        return frozenset()
    if isinstance(stop_token, (str, bytes, bytearray, Mapping)) or not isinstance(
        stop_token, Iterable
    ):
        tokens = [_as_int(stop_token, "stop_token")]
    else:
        tokens = [_as_int(t, "stop_token element") for t in stop_token]
    if tokens:
        _check_vocab(tokens, "stop_token", vocab_size)
    return frozenset(tokens)


def validate_stop_sequences(stop_sequences: object, *,
                            vocab_size: int | None = None) -> tuple[tuple[int, ...], ...]:
    """Stop sequences: an iterable of non-empty token lists (may itself be empty).

    Returns a tuple of tuples with duplicates removed (order kept). A stop
    sequence ends the request when the *generated* tokens end with it.
    """
    if stop_sequences is None or (type(stop_sequences) is tuple and not stop_sequences):
        return ()
    if isinstance(stop_sequences, (str, bytes, bytearray, Mapping)) or not isinstance(
        stop_sequences, Iterable
    ):
        raise ValueError(
            f"stop_sequences must be a list of token lists, got {type(stop_sequences).__name__}"
        )
    out: list[tuple[int, ...]] = []
    for i, seq in enumerate(stop_sequences):
        if not isinstance(seq, Iterable) or isinstance(seq, (str, bytes, bytearray, Mapping)):
            raise ValueError(
                f"stop_sequences[{i}] must be a list of int token ids, got "
                f"{type(seq).__name__} (for one sequence pass [[...]])"
            )
        toks = tuple(validate_tokens(seq, field=f"stop_sequences[{i}]", vocab_size=vocab_size,
                                     allow_empty=False))
        if toks not in out:
            out.append(toks)
    return tuple(out)


def validate_priority(priority: object) -> int:
    """``priority``: any int; lower runs first (as in vLLM)."""
    return _as_int(priority, "priority")


def validate_messages(messages: object) -> list[dict]:
    """Chat messages: a non-empty list of ``{"role": str, "content": str}``.

    Returns plain copies holding only ``role`` and ``content``; they are
    rendered with the model's chat template by the worker.
    """
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError(f"messages must be a non-empty list of chat messages, got {messages!r}")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise ValueError(f"chat message {i} must be a map with string 'role' and 'content', got {m!r}")
        out.append({"role": m["role"], "content": m["content"]})
    return out


def validate_timeout(timeout_s: object) -> float | None:
    """``timeout_s``: None (no deadline) or a finite number of seconds > 0."""
    if timeout_s is None:
        return None
    if isinstance(timeout_s, bool) or type(timeout_s).__name__ == "bool_":
        raise ValueError(f"timeout_s must be a number of seconds or None, got {timeout_s!r}")
    try:
        value = float(timeout_s)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(
            f"timeout_s must be a number of seconds or None, got {type(timeout_s).__name__}"
        ) from None
    if isinstance(timeout_s, str) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"timeout_s must be a finite number of seconds > 0, got {timeout_s!r}")
    return value


def validate_sampling(temperature: object = 0.0, top_p: object = 1.0, top_k: object = 0,
                      seed: object = None) -> tuple[float, float, int, int | None]:
    """Sampling parameters (OpenAI / vLLM ranges).

    - ``temperature``: finite number >= 0 (0 = greedy).
    - ``top_p``: number in (0, 1].
    - ``top_k``: int >= 0 (0 = off).
    - ``seed``: None or an int >= 0.

    Returns ``(temperature, top_p, top_k, seed)`` normalised.
    """
    if (temperature == 0.0 and top_p == 1.0 and top_k == 0 and seed is None
            and type(temperature) is float and type(top_p) is float and type(top_k) is int):
        return 0.0, 1.0, 0, None  # the defaults, the common case
    t = _as_float(temperature, "temperature")
    if t < 0:
        raise ValueError(f"temperature must be >= 0 (0 = greedy), got {temperature!r}")
    p = _as_float(top_p, "top_p")
    if not 0 < p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    k = _as_int(top_k, "top_k")
    if k < 0:
        raise ValueError(f"top_k must be >= 0 (0 = off), got {k}")
    s = None if seed is None else _as_int(seed, "seed")
    if s is not None and s < 0:
        raise ValueError(f"seed must be >= 0 or None, got {s}")
    return t, p, k, s


def _as_float(value: object, field: str) -> float:
    if type(value) is float and math.isfinite(value):
        return value
    if isinstance(value, (bool, str, bytes)) or type(value).__name__ == "bool_":
        raise ValueError(f"{field} must be a number, got {type(value).__name__} {value!r}")
    try:
        out = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{field} must be a number, got {type(value).__name__}") from None
    if not math.isfinite(out):
        raise ValueError(f"{field} must be finite, got {value!r}")
    return out


def validate_request_id(request_id: object) -> str | int | None:
    """A caller-chosen request id: None (the engine picks one), a non-empty str of at
    most :data:`MAX_REQUEST_ID_LEN` characters, or an int (not bool)."""
    if request_id is None:
        return None
    if isinstance(request_id, str):
        if not request_id or len(request_id) > MAX_REQUEST_ID_LEN:
            raise ValueError(
                f"request_id must be 1..{MAX_REQUEST_ID_LEN} characters, got {len(request_id)}"
            )
        return request_id
    return _as_int(request_id, "request_id")


def validate_plain_request(prompt: object, max_tokens: object, vocab_size: int | None = None,
                           max_seq_len: int | None = None,
                           token_ids: frozenset[int] | None = None) -> tuple[list[int], int]:
    """Validate a request's prompt and ``max_tokens``; return them normalised.

    All of :func:`validate_request` for a request whose options are at their
    defaults, and its first step otherwise. Raises ValueError like it.
    """
    # Each field: a fast path for the common shape, else the per-field function,
    # which holds the rules and words the error. The prompt's fast path is C-level
    # passes: count the elements of type exactly int (bool and numpy ints take
    # the slow path), then the range [0, vocab_size).
    if (type(prompt) is list and prompt and _count_of(map(type, prompt), int) == len(prompt)
            and (token_ids.issuperset(prompt) if token_ids is not None else
                 min(prompt) >= 0 and (vocab_size is None or max(prompt) < vocab_size))):
        p = prompt
    else:
        p = validate_prompt(prompt, vocab_size=vocab_size)
    if type(max_tokens) is int and max_tokens >= 1:
        n = max_tokens
    else:
        n = validate_max_tokens(max_tokens)
    if max_seq_len is not None and len(p) + n > max_seq_len:
        raise ValueError(
            f"prompt ({len(p)} tokens) + max_tokens ({n}) = {len(p) + n} exceeds the model's "
            f"context of {max_seq_len} tokens; shorten the prompt or lower max_tokens"
        )
    return p, n


class ValidRequest(NamedTuple):
    """A request that passed :func:`validate_request`, every field normalised.

    A NamedTuple rather than a frozen dataclass: it is built once per
    request on the submission path, and tuple construction is several
    times cheaper than a frozen dataclass's ``__init__``.

    ``stop_tokens`` is None when the caller left the stop token to the
    engine's default; otherwise the (possibly empty) set of stop token ids.
    """

    prompt: list[int]
    max_tokens: int
    stop_tokens: frozenset[int] | None
    stop_sequences: tuple[tuple[int, ...], ...]
    priority: int
    timeout_s: float | None
    request_id: str | int | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    resume_tokens: list[int]


def validate_request(prompt: object, max_tokens: object, stop_token: object = None,
                     use_default_stop: bool = False, stop_sequences: object = (),
                     priority: object = 0, timeout_s: object = None, request_id: object = None,
                     temperature: object = DEFAULT_TEMPERATURE, top_p: object = DEFAULT_TOP_P,
                     top_k: object = 0, seed: object = None, resume_tokens: object = (),
                     vocab_size: int | None = None, max_seq_len: int | None = None,
                     token_ids: frozenset[int] | None = None) -> ValidRequest:
    """Validate a whole generation request; see the per-field functions for the rules.

    ``use_default_stop=True`` means the caller omitted ``stop_token`` (the
    result's ``stop_tokens`` is then None). ``resume_tokens`` are tokens
    already generated elsewhere: valid token ids, fewer than ``max_tokens``.
    ``prompt + max_tokens`` must fit ``max_seq_len`` when the model has one.
    ``token_ids``: optionally :func:`token_id_set` of ``vocab_size``, kept by
    a caller that validates many requests: the prompt's range check is then
    one set lookup per token instead of a ``min`` and a ``max`` pass (same rules).

    Raises ValueError with a message naming the first bad field.
    """
    p, n = validate_plain_request(prompt, max_tokens, vocab_size, max_seq_len, token_ids)
    # `is _EMPTY`: the default () (CPython has one empty tuple).
    if resume_tokens is _EMPTY or type(resume_tokens) is list and not resume_tokens:
        resume: list[int] = []
    else:
        resume = validate_tokens(resume_tokens, field="resume_tokens", vocab_size=vocab_size)
        if len(resume) >= n:
            raise ValueError(
                f"resume_tokens holds {len(resume)} tokens but max_tokens is {n}: "
                "the request is already complete"
            )
    stops = None if use_default_stop else validate_stop_token(stop_token, vocab_size=vocab_size)
    if stop_sequences is _EMPTY or type(stop_sequences) is list and not stop_sequences:
        stop_seqs: tuple[tuple[int, ...], ...] = _EMPTY
    else:
        stop_seqs = validate_stop_sequences(stop_sequences, vocab_size=vocab_size)
    if (seed is None and type(temperature) is float and type(top_p) is float
            and type(top_k) is int and temperature == 0.0 and top_p == 1.0 and top_k == 0):
        t, tp, k, s = 0.0, 1.0, 0, None  # the defaults, the common case
    else:
        t, tp, k, s = validate_sampling(temperature, top_p, top_k, seed)
    # tuple.__new__ skips the NamedTuple's Python-level __new__ (same object, built in C).
    return _tuple_new(ValidRequest, (
        p, n, stops, stop_seqs,
        priority if type(priority) is int else validate_priority(priority),
        None if timeout_s is None else validate_timeout(timeout_s),
        None if request_id is None else validate_request_id(request_id),
        t, tp, k, s, resume,
    ))
