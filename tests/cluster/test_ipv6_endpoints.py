"""Blast radius, kind "IPv6 endpoints" (issue 10, item 8): every socket that
binds or connects (broker frontend and backend, worker, client, and so
`slotserve status`) takes IPv6 literals (``tcp://[::1]:port``, ``tcp://[::1]:*``
binds), the ``*`` wildcard (both families), IPv4 literals and host names, by
one rule in protocol/endpoints.py. The cluster tests skip cleanly on a machine
without an IPv6 loopback."""

from __future__ import annotations

import socket

import pytest
from click.testing import CliRunner

from broker import BrokerConfig
from client import Client
from protocol.endpoints import endpoint_host, wants_ipv6
from slotserve.cli import main
from slotserve.launcher import ClusterConfig, LocalCluster
from worker import BatchInferenceEngine, SimulatedLLM
from worker.config import WorkerConfig


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


needs_ipv6 = pytest.mark.skipif(not _has_ipv6_loopback(), reason="this machine has no IPv6 loopback (::1)")


@pytest.mark.parametrize("endpoint, bind, expected", [
    ("tcp://[::1]:5555", False, True),
    ("tcp://[::1]:*", True, True),
    ("tcp://::1:5555", False, True),                # unbracketed: libzmq splits at the last colon
    ("tcp://[fe80::1%lo]:5555", False, True),       # with a zone id
    ("tcp://*:5555", True, True),                   # wildcard bind: both families
    ("tcp://127.0.0.1:*", True, False),
    ("tcp://127.0.0.1:5555", False, False),
    ("tcp://127.1:5555", False, False),             # inet_aton's shorthand for 127.0.0.1, as libzmq reads it
    ("tcp://0.0.0.0:5555", True, False),
    ("tcp://10.0.0.1;[::1]:5555", False, True),     # a connect with a source address: the target decides
    ("ipc:///tmp/x.sock", True, False),
    ("inproc://x", False, False),
    ("tcp://name-that-does-not-resolve.invalid:5555", False, False),  # unresolvable: IPv4 default, as before
])
def test_which_endpoints_need_ipv6(endpoint, bind, expected):
    assert wants_ipv6(endpoint, bind=bind) is expected


def test_a_host_name_means_its_ipv4_address_when_it_has_one():
    families = {info[0] for info in socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)}
    # localhost with an IPv4 address must keep meeting a broker bound to 127.0.0.1.
    assert wants_ipv6("tcp://localhost:5555", bind=False) is (socket.AF_INET not in families)


def test_endpoint_host():
    assert endpoint_host("tcp://[::1]:5555") == "[::1]"
    assert endpoint_host("tcp://host.example:1") == "host.example"
    assert endpoint_host("tcp://nohost") is None and endpoint_host("ipc:///x") is None


def _expected(prompts, max_tokens):
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=4, stop_token=0)
    hs = [engine.submit_request(p, max_tokens) for p in prompts]
    engine.run()
    return [h.tokens for h in hs]


def _run(address, prompts, max_tokens=6):
    with Client(address, connect_timeout_s=20) as c:
        hs = [c.submit_request(p, max_tokens) for p in prompts]
        c.run(timeout=30)
    return [h.tokens for h in hs]


@needs_ipv6
def test_cluster_over_ipv6_literals_and_status():
    """The issue's input: both broker sockets on tcp://[::1]:*; the worker and
    the clients connect over ::1; `slotserve status` reads it over ::1."""
    broker = BrokerConfig(frontend="tcp://[::1]:*", backend="tcp://[::1]:*")
    with LocalCluster(ClusterConfig(broker, (WorkerConfig(num_slots=3),), start_timeout_s=60.0)) as cl:
        assert cl.frontend.startswith("tcp://[::1]:") and cl.backend.startswith("tcp://[::1]:")
        prompts = [[i + 1, 7] for i in range(8)]
        assert _run(cl.frontend, prompts) == _expected(prompts, 6)
        r = CliRunner().invoke(main, ["status", "--broker", cl.frontend])
        assert r.exit_code == 0, r.output
        assert "simulated" in r.output and "0/3" in r.output


@needs_ipv6
def test_wildcard_bind_serves_both_families_and_host_names():
    """Frontend on tcp://*:* (both families), backend on an IPv6 literal:
    clients over [::1], 127.0.0.1 and localhost all reach the same broker."""
    broker = BrokerConfig(frontend="tcp://*:*", backend="tcp://[::1]:*")
    with LocalCluster(ClusterConfig(broker, (WorkerConfig(num_slots=2),), start_timeout_s=60.0)) as cl:
        port = cl.frontend.rsplit(":", 1)[1]
        prompts = [[i + 3, 1, 2] for i in range(5)]
        want = _expected(prompts, 6)
        for host in ("[::1]", "127.0.0.1", "localhost"):
            assert _run(f"tcp://{host}:{port}", prompts) == want, host
        r = CliRunner().invoke(main, ["status", "--broker", f"tcp://[::1]:{port}"])
        assert r.exit_code == 0 and "simulated" in r.output, r.output
