"""Kind "an address slotserve listens on cannot be bound": a second ``slotserve up`` (the broker's
default ports 5555 and 5556 taken by the first), an HTTP or metrics port another server holds, a
host that is not this machine's. ``slotserve up`` printed the broker's or gateway's child traceback
(``zmq.error.ZMQError: Address already in use`` from ``s.bind``, or the socket module's
``OSError: [Errno 98] ...``) and then ``Error: the broker exited with code 1 while starting (port in
use? see its log above)``; ``slotserve broker`` ended in the ZMQError's traceback; ``slotserve
serve`` repeated the address in Python's words. Now each bind raises
:class:`protocol.endpoints.BindError`, one line naming what listens, the address, the reason and
what to do, and every command prints that line and exits 1: ``up`` (its children send it to the
parent: no traceback in their log), ``broker`` and ``serve``."""

from __future__ import annotations

import errno
import socket
import subprocess
import sys

import pytest
from click.testing import CliRunner

from broker import BrokerConfig
from broker.metrics import BrokerMetrics
from broker.server import BrokerServer
from gateway.listen import bind
from protocol.endpoints import BindError
from slotserve.cli import main

SLOTSERVE = [sys.executable, "-m", "slotserve"]
IN_USE = "Address already in use; another process listens there (another slotserve up, broker or serve?): " \
         "stop it, or choose another port"


@pytest.fixture
def held_port():
    """A TCP port on 127.0.0.1 that another socket listens on for the test."""
    with socket.create_server(("127.0.0.1", 0)) as s:
        yield s.getsockname()[1]


def _open_each(member: str, port: int) -> None:
    """Bind ``member``'s address on ``port`` (and close what did bind)."""
    if member == "frontend":
        BrokerServer(BrokerConfig(frontend=f"tcp://127.0.0.1:{port}", backend="tcp://127.0.0.1:*")).close()
    elif member == "backend":
        BrokerServer(BrokerConfig(frontend="tcp://127.0.0.1:*", backend=f"tcp://127.0.0.1:{port}")).close()
    elif member == "metrics":
        BrokerServer(BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*",
                                  metrics_port=port)).close()
    else:
        bind("127.0.0.1", port).close()


@pytest.mark.parametrize("member, words", [
    ("frontend", "the broker's client endpoint (--frontend) cannot listen on tcp://127.0.0.1:{port}: "),
    ("backend", "the broker's worker endpoint (--backend) cannot listen on tcp://127.0.0.1:{port}: "),
    ("metrics", "the broker's metrics endpoint (--metrics-port) cannot listen on 127.0.0.1:{port}: "),
    ("http", "the HTTP server cannot listen on 127.0.0.1:{port}: "),
])
def test_a_taken_port_is_one_line_naming_it(held_port, member, words):
    with pytest.raises(BindError) as e:
        _open_each(member, held_port)
    assert str(e.value) == words.format(port=held_port) + IN_USE
    assert e.value.errno == errno.EADDRINUSE and isinstance(e.value, OSError)


def test_the_metrics_port_taken_leaves_no_broker_socket_bound(held_port):
    """The broker's endpoints bound before its metrics port failed are closed: bound again at once."""
    from tests.support.cluster import free_port

    front, back = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(BindError):
        BrokerServer(BrokerConfig(frontend=front, backend=back, metrics_port=held_port))
    BrokerServer(BrokerConfig(frontend=front, backend=back)).close()


def test_a_host_not_this_machines_says_so():
    with pytest.raises(BindError) as e:  # 192.0.2.0/24 is TEST-NET-1 (RFC 5737): no machine's address
        bind("192.0.2.1", 8000)
    assert str(e.value) == ("the HTTP server cannot listen on 192.0.2.1:8000: Cannot assign requested address; "
                            "that host is not an address of this machine: bind one it has (127.0.0.1, or 0.0.0.0 "
                            "for every interface)")
    with pytest.raises(BindError, match=r"^the broker's metrics endpoint \(--metrics-port\) cannot listen on "
                                        r"192\.0\.2\.1:8000: Cannot assign requested address; "):
        BrokerMetrics(8000, "192.0.2.1")


@pytest.mark.parametrize("args", [["broker", "--frontend", "tcp://127.0.0.1:{port}", "--backend", "tcp://127.0.0.1:*"],
                                  ["broker", "--frontend", "tcp://127.0.0.1:*", "--backend", "tcp://127.0.0.1:*",
                                   "--metrics-port", "{port}"],
                                  ["serve", "--port", "{port}"]])
def test_broker_and_serve_print_the_line_and_exit_1(held_port, args):
    r = CliRunner().invoke(main, [a.format(port=held_port) for a in args])
    assert r.exit_code == 1, r.output
    assert r.output.splitlines()[-1].startswith("Error: the ") and r.output.endswith(IN_USE + "\n")
    assert "Traceback" not in r.output and "Errno" not in r.output and "while attempting" not in r.output


@pytest.mark.parametrize("taken", ["--frontend", "--http-port"])
def test_up_prints_the_line_and_no_child_traceback(held_port, taken):
    """Through the real command: the broker's child process cannot bind, or the HTTP port is taken (said
    before any child starts: tests/cli/test_http_port_first.py)."""
    args = {"--frontend": "tcp://127.0.0.1:*", "--backend": "tcp://127.0.0.1:*", "--http-port": "0"}
    args[taken] = f"tcp://127.0.0.1:{held_port}" if taken == "--frontend" else str(held_port)
    proc = subprocess.run(SLOTSERVE + ["up", "--workers", "1", "--slots", "1",
                                       *(x for kv in args.items() for x in kv)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    what = ("the broker's client endpoint (--frontend)" if taken == "--frontend" else "the HTTP server")
    assert proc.stderr.splitlines()[-1] == (f"Error: {what} cannot listen on "
                                            f"{args[taken] if taken == '--frontend' else f'127.0.0.1:{held_port}'}: "
                                            + IN_USE)
    assert "Traceback" not in proc.stderr, proc.stderr
