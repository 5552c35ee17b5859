"""Defaults every process agrees on, declared once: endpoints, limits, timing.

The broker, workers and clients each have their own config, but where their
defaults must match (the endpoints, the frame size limit, the heartbeat
period, the aging rule), they come from here.
"""

from __future__ import annotations

CLIENT_ENDPOINT = "tcp://127.0.0.1:5555"
"""Where the broker listens for clients by default (its frontend)."""

WORKER_ENDPOINT = "tcp://127.0.0.1:5556"
"""Where the broker listens for workers by default (its backend)."""

MAX_MESSAGE_BYTES = 64 * 1024 * 1024
"""Largest frame a peer decodes by default (bytes): room for a ``submit`` of
many thousands of long prompts, small enough to bound memory."""

MIN_MESSAGE_BYTES = 1024
"""Smallest frame limit a peer may announce or be configured with (bytes): every
control message (welcome, heartbeat, error, status of a few models) fits in it.
A peer announcing less could be sent nothing at all; its register or welcome is
refused as malformed."""

MIN_HEARTBEAT_INTERVAL_S = 0.01
"""Shortest heartbeat interval a broker may announce or be configured with
(seconds): peers heartbeat at the broker's interval when it is shorter than
their own, so a smaller one announced would make every peer heartbeat in a
busy loop; a welcome announcing less is refused as malformed."""

HEARTBEAT_INTERVAL_S = 1.0
"""Seconds between heartbeats of an otherwise silent peer."""

AGING_WINDOW = 1000
"""Submissions per priority level of aging, in the broker's queues and the
engine's (see :mod:`protocol.queue` for the starvation bound)."""
