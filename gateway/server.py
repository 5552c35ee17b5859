"""Run the gateway: :func:`run` binds the HTTP socket and serves the app on uvicorn.

Imported on first use of ``gateway.run`` (it loads the HTTP stack)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Callable, Protocol

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig

LISTEN_BACKLOG = 2048
"""Pending TCP connections the kernel queues before uvicorn accepts them (bursts of new clients)."""


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (``port=0`` picks a free one).
    Raises OSError when the address is taken or invalid."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    return socket.create_server((host, port), family=family, backlog=LISTEN_BACKLOG)


class StopFlag(Protocol):
    """Anything with ``is_set()``: a ``threading.Event``, :class:`slotserve.signals.StopFlag`."""

    def is_set(self) -> bool: ...


def run(config: GatewayConfig, *, stop: StopFlag | None = None,
        on_ready: Callable[[str], None] | None = None) -> None:
    """Serve ``config`` until ``stop`` is set. With ``stop`` the caller owns the
    signals (its handlers set ``stop``); without it, uvicorn handles SIGINT and
    SIGTERM when called from the main thread.

    ``on_ready(url)`` is called once the socket listens, with the bound
    ``http://host:port``; connections made from then on are queued until the
    server accepts them. Open requests get ``config.stop_timeout_s`` to finish
    at shutdown; then the broker connections close (the broker cancels what
    they still run). Raises OSError when the address cannot be bound.
    """
    sock = bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    if on_ready is not None:
        on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")
    ucfg = uvicorn.Config(create_app(config), lifespan="on", log_config=None, log_level="warning",
                          access_log=config.access_log, timeout_graceful_shutdown=config.stop_timeout_s)
    server = _Server(ucfg, capture_signals=stop is None)
    with asyncio.Runner(loop_factory=ucfg.get_loop_factory()) as runner:
        runner.run(_serve(server, sock, stop))


class _Server(uvicorn.Server):
    """uvicorn's server, leaving the signal handlers alone when the caller owns them."""

    def __init__(self, config: uvicorn.Config, *, capture_signals: bool) -> None:
        super().__init__(config)
        self._capture = capture_signals

    @contextlib.contextmanager
    def capture_signals(self):
        if self._capture:
            with super().capture_signals():
                yield
        else:
            yield


async def _serve(server, sock: socket.socket, stop: StopFlag | None) -> None:
    async def watch() -> None:
        while not stop.is_set():
            await asyncio.sleep(0.1)  # uvicorn's own main loop ticks at this rate too
        server.should_exit = True

    watcher = asyncio.create_task(watch()) if stop is not None else None
    try:
        await server.serve(sockets=[sock])
    finally:
        if watcher is not None:
            watcher.cancel()
        sock.close()
