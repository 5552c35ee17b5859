"""The HTTP server's listening socket: :func:`bind`, apart from :mod:`gateway.server` so that the
launcher checks the port before its workers load (:meth:`slotserve.launcher.LocalCluster.start`)
without loading the HTTP stack."""

from __future__ import annotations

import socket

from protocol.endpoints import bind_error

LISTEN_BACKLOG = 2048
"""Pending TCP connections the kernel queues before uvicorn accepts them (bursts of new clients)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0`` picks a free one).
    Raises :class:`~protocol.endpoints.BindError` (an OSError) when the address is taken or is not
    this machine's, or the host does not resolve."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)
    except OSError as e:  # socket.gaierror (a host name that does not resolve) included
        address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        # create_server adds '(while attempting to bind on address ...)' to the reason: the address is said once
        reason = (e.strerror or str(e)).partition(" (while attempting")[0]
        raise bind_error("the HTTP server", address, e.errno, reason) from None
