"""HTTP body fields -> slotserve request options: the one place they are mapped.

:func:`request_options` is the whole mapping. Everything it passes on is
validated by the client SDK at submission (the same rules and messages as a
Python caller gets), so this module only translates names and defaults:

=========================  ==============================================================
HTTP field                 slotserve request option
=========================  ==============================================================
``temperature``            ``temperature`` (default 1, OpenAI's; 0 = greedy)
``top_p``                  ``top_p`` (default 1)
``top_k``                  ``top_k`` (0 or -1 = off, vLLM's convention)
``seed``                   ``seed``; choice ``i`` of ``n`` gets ``seed + i``
``stop`` token-id lists    ``stop_sequences`` (e.g. ``"stop": [[13, 13]]``)
``stop`` strings           refused with 501 until text stops exist (see below)
``stop_token_ids``         ``stop_token`` = the model's EOS tokens + these
``ignore_eos``             ``stop_token`` = ``stop_token_ids`` only
``min_tokens``             ``min_tokens`` (default 0)
``priority``               ``priority`` (lower first)
``timeout_s``              ``timeout_s``
=========================  ==============================================================

Text stop strings: when the request definition gains them, replace the
``raise`` marked ``TEXT STOPS`` below with the option (one line).
"""

from __future__ import annotations

from dataclasses import dataclass

from client import DEFAULT
from gateway.errors import bad_request, unsupported
from gateway.schemas import MAX_STOP, _Sampling
from protocol.messages import ModelInfo

DEFAULT_TEMPERATURE = 1.0
"""OpenAI's default ``temperature`` (the Python SDK's is 0, greedy)."""


@dataclass(frozen=True, slots=True)
class RequestOptions:
    """Keyword arguments for ``Client.submit_request`` shared by every choice of one HTTP request."""

    stop_token: object
    stop_sequences: tuple[tuple[int, ...], ...]
    priority: int
    timeout_s: float | None
    temperature: float
    top_p: float
    top_k: int
    seed: int | None
    min_tokens: int

    def for_choice(self, index: int) -> dict:
        """``submit_request`` keyword arguments for choice ``index`` (``seed + index``)."""
        return {"stop_token": self.stop_token, "stop_sequences": self.stop_sequences, "priority": self.priority,
                "timeout_s": self.timeout_s, "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": None if self.seed is None else self.seed + index,
                "min_tokens": self.min_tokens}


def request_options(body: _Sampling, info: ModelInfo | None) -> RequestOptions:
    """Map ``body``'s sampling and stopping fields onto slotserve options.

    ``info``: the model's :class:`ModelInfo` (its EOS tokens, for
    ``stop_token_ids``), or None when unknown. Raises :class:`APIError`: 400
    for a ``stop`` list too long or holding an empty entry, 501 for text stop
    strings.
    """
    texts, sequences = _split_stop(body.stop)
    if texts:  # TEXT STOPS: becomes `stop_strings=tuple(texts)` in the options once the worker matches text
        raise unsupported("stop", "text stop strings are not supported yet; pass stop sequences as token-id "
                                  "lists (\"stop\": [[id, ...]]) or single stop tokens in \"stop_token_ids\"")
    stop_token = DEFAULT  # the model's EOS tokens (the worker's default)
    if body.stop_token_ids or body.ignore_eos:
        base = () if body.ignore_eos or info is None else info.eos_token_ids
        stop_token = sorted({*base, *(body.stop_token_ids or ())})
    return RequestOptions(
        stop_token=stop_token,
        stop_sequences=tuple(sequences),
        priority=0 if body.priority is None else body.priority,
        timeout_s=body.timeout_s,
        temperature=DEFAULT_TEMPERATURE if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=0 if body.top_k in (None, -1) else body.top_k,
        seed=body.seed,
        min_tokens=body.min_tokens or 0,
    )


def _split_stop(stop) -> tuple[list[str], list[tuple[int, ...]]]:
    """``stop`` -> (text stop strings, token-id stop sequences). 400 when it has
    more than :data:`MAX_STOP` entries or an empty one."""
    if stop is None:
        return [], []
    entries = [stop] if isinstance(stop, str) else stop
    if len(entries) > MAX_STOP:
        raise bad_request(f"stop holds {len(entries)} entries; at most {MAX_STOP} are allowed", "stop")
    texts, sequences = [], []
    for e in entries:
        if not e:
            raise bad_request("stop entries must not be empty", "stop")
        if isinstance(e, str):
            texts.append(e)
        else:
            sequences.append(tuple(e))
    return texts, sequences
