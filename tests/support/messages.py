"""Wire messages built for tests."""

from __future__ import annotations

from protocol.messages import Envelope
from protocol.request import RequestParams


def envelope(request_id, prompt, max_tokens, *, resume_tokens=(), time_left_s=None, **options):
    """An :class:`~protocol.messages.Envelope` for ``submit``/``assign`` in tests:
    ``RequestParams(prompt, max_tokens, **options)`` and its routing data."""
    return Envelope(request_id, RequestParams(prompt, max_tokens, **options), tuple(resume_tokens), time_left_s)
