"""Run the gateway: :func:`run` binds the HTTP socket, serves the app on uvicorn, and drains it at stop.

Imported on first use of ``gateway.run`` (it loads the HTTP stack)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Callable, Protocol

import uvicorn

from gateway.app import create_app
from gateway.config import GatewayConfig
from gateway.drain import END_GRACE_S, HALTED, TICK_S, Drain, deadline_passed
from gateway.listen import bind

log = logging.getLogger(__name__)


class StopFlag(Protocol):
    """Anything with ``is_set()``: a ``threading.Event``, :class:`slotserve.signals.SignalStopFlag`."""

    def is_set(self) -> bool: ...


def run(config: GatewayConfig, *, stop: StopFlag | None = None, halt: Callable[[], bool | str] | None = None,
        on_ready: Callable[[str], None] | None = None, load_tokenizer=None) -> None:
    """Serve ``config`` until ``stop`` is set, then drain and return.

    Draining (:mod:`gateway.drain`): new requests get 503 and ``/health``
    503 at once; the requests and streams in flight get
    ``config.shutdown_timeout_s`` to finish; those still open then are
    ended (a stream's final error event and ``[DONE]``, or a 503) and their
    broker requests cancelled; then the server and its broker connections
    close. ``halt()`` (checked while draining; e.g. a second signal) ends
    the wait at once; what it returns, when a str, is the message the
    requests it ends get (:data:`~gateway.drain.PARENT_GONE`), else
    :data:`~gateway.drain.HALTED` (a second stop signal).

    With ``stop`` the caller owns the signals (its handlers set ``stop``,
    and make ``halt()`` true on a second one); without it, when called from
    the main thread, the first SIGINT or SIGTERM drains and the second halts.

    ``on_ready(url)`` is called once the socket listens, with the bound
    ``http://host:port``; connections made from then on are queued until the
    server accepts them. Raises :class:`~protocol.endpoints.BindError` when the address cannot be bound.
    ``load_tokenizer``: the CLI's tokenizer loader (see :func:`gateway.app.create_app`).
    """
    sock = bind(config.host, config.port)
    host, port = sock.getsockname()[:2]
    if on_ready is not None:
        on_ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")
    app = create_app(config, load_tokenizer)
    # uvicorn's own graceful timeout is only a backstop: the drain has ended every request before it applies
    ucfg = uvicorn.Config(app, lifespan="on", log_config=None, log_level="warning", access_log=config.access_log,
                          timeout_graceful_shutdown=END_GRACE_S)
    _access_log(config.access_log)
    server = _Server(ucfg, capture_signals=stop is None)
    if stop is None:
        should_stop, should_halt = (lambda: server.stops >= 1), (lambda: server.stops >= 2)
    else:
        should_stop, should_halt = stop.is_set, halt or _never
    shutdown = _Shutdown(app.state.drain, config.shutdown_timeout_s, should_stop, should_halt)
    with asyncio.Runner(loop_factory=ucfg.get_loop_factory()) as runner:
        runner.run(_serve(server, sock, shutdown))


def _never() -> bool:
    return False


def _access_log(on: bool) -> None:
    """Let uvicorn's access log (one INFO line a request: client, method, path, status) through when
    ``on``: uvicorn's config sets its logger to the server's level, WARNING, which dropped every line,
    and a server run before in this process with the log off left it not propagating to the root
    logger's handler (slotserve's, whatever ``--log-level``)."""
    if on:
        access = logging.getLogger("uvicorn.access")
        access.setLevel(logging.INFO)
        access.propagate = True


class _Server(uvicorn.Server):
    """uvicorn's server, leaving the signal handlers alone when the caller owns them; when
    it handles them itself, a signal only counts (the drain decides when the server exits)."""

    def __init__(self, config: uvicorn.Config, *, capture_signals: bool) -> None:
        super().__init__(config)
        self._capture = capture_signals
        self.stops = 0

    @contextlib.contextmanager
    def capture_signals(self):
        if self._capture:
            with super().capture_signals():
                yield
        else:
            yield

    def handle_exit(self, sig, frame) -> None:  # only counts (STYLE 9); _Shutdown looks at it
        self.stops += 1


class _Shutdown:
    """The stop sequence, on the server's event loop: wait for ``stop()``, drain for up to
    ``timeout_s`` (or until ``halt()``), end what is left, then let uvicorn exit."""

    def __init__(self, drain: Drain, timeout_s: float, stop: Callable[[], bool],
                 halt: Callable[[], bool | str]) -> None:
        self.drain = drain
        self.timeout_s = timeout_s
        self.stop = stop
        self.halt = halt

    async def watch(self, server: uvicorn.Server) -> None:
        while not self.stop():
            await asyncio.sleep(TICK_S)  # a flag a signal handler sets: looked at as often as uvicorn ticks
        try:
            await self.drain_and_end(server)
        finally:
            server.should_exit = True

    async def drain_and_end(self, server: uvicorn.Server) -> None:
        drain = self.drain
        n = drain.begin()
        if n:
            log.warning("stopping: %d request(s) in flight get up to %g s to finish; new ones get 503 "
                        "(stop again to end them now)", n, self.timeout_s)
        if await drain.wait_idle(self.timeout_s, self.halt):
            return
        halted = self.halt()  # (a str: why, in the words the requests it ends get)
        n = drain.end_all(halted if isinstance(halted, str) else HALTED if halted else deadline_passed(self.timeout_s))
        log.warning("stopping: %d request(s) %s: ended with 503 or a stream's final error event", n,
                    "stopped at once" if halted else f"still open after {self.timeout_s:g} s")
        if await drain.wait_idle(END_GRACE_S):
            return
        closed = _close_busy_connections(server)
        log.warning("stopping: %d request(s) did not send their last words within %g s (a client not reading?): "
                    "closed %d connection(s)", drain.in_flight, END_GRACE_S, closed)


def _close_busy_connections(server: uvicorn.Server) -> int:
    """Abort the connections whose response is not complete (a client that stopped reading its
    stream, or never sent all of its body): uvicorn then ends their requests as disconnects,
    with no error logged. Returns how many. (uvicorn's protocols, h11 and httptools alike,
    keep the request being served as ``cycle``.)"""
    closed = 0
    for conn in list(server.server_state.connections):
        cycle = getattr(conn, "cycle", None)
        transport = getattr(conn, "transport", None)
        if cycle is not None and not cycle.response_complete and transport is not None:
            transport.abort()
            closed += 1
    return closed


async def _serve(server: uvicorn.Server, sock: socket.socket, shutdown: _Shutdown) -> None:
    watcher = asyncio.create_task(shutdown.watch(server))
    try:
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()
        sock.close()
