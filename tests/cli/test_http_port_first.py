"""``slotserve up --http-port P`` with P taken (another ``slotserve up``, llama-server, any server)
started the broker and loaded every worker's model (a minute for Qwen2.5-Coder-0.5B on 2 cores, more
for a larger model), and only then, as the gateway started, said ``Error: the HTTP server cannot listen
on 127.0.0.1:P: Address already in use; ...``, where a taken broker port is said at once. Now
:meth:`slotserve.launcher.LocalCluster.start` binds the HTTP port once, and closes it, before it starts
anything: the same line, no process started. No process, no model: the broker's start is replaced by a
failure that says it was reached."""

from __future__ import annotations

import socket

import pytest

from broker import BrokerConfig
from gateway.config import GatewayConfig
from slotserve.launcher import ClusterConfig, LocalCluster
from worker.config import WorkerConfig

IN_USE = "Address already in use; another process listens there (another slotserve up, broker or serve?): " \
         "stop it, or choose another port"


class Started(Exception):
    """The cluster went on to start its broker."""


@pytest.fixture
def cluster_on(monkeypatch):
    """A LocalCluster whose gateway listens on host:port; starting its broker raises :class:`Started`."""
    monkeypatch.setattr(LocalCluster, "_start_broker", lambda self: (_ for _ in ()).throw(Started()))

    def make(host: str, port: int) -> LocalCluster:
        return LocalCluster(ClusterConfig(
            broker=BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*"),
            workers=(WorkerConfig(model="simulated"),), gateway=GatewayConfig(host=host, port=port)))
    return make


def test_a_taken_http_port_is_said_before_anything_starts(cluster_on):
    with socket.create_server(("127.0.0.1", 0)) as held:
        port = held.getsockname()[1]
        with pytest.raises(RuntimeError) as e:
            cluster_on("127.0.0.1", port).start()
    assert str(e.value) == f"the HTTP server cannot listen on 127.0.0.1:{port}: " + IN_USE


def test_a_host_not_this_machines_is_said_before_anything_starts(cluster_on):
    with pytest.raises(RuntimeError, match=r"^the HTTP server cannot listen on 192\.0\.2\.1:8000: Cannot assign "
                                           r"requested address; that host is not an address of this machine"):
        cluster_on("192.0.2.1", 8000).start()  # 192.0.2.0/24: TEST-NET-1 (RFC 5737), no machine's address


def test_a_free_port_is_left_free_for_the_gateway(cluster_on):
    """The check's socket is closed: the port can be bound again at once (the gateway binds it later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(Started):
        cluster_on("127.0.0.1", port).start()
    socket.create_server(("127.0.0.1", port)).close()


def test_port_0_is_not_checked(cluster_on, monkeypatch):
    import slotserve.launcher

    monkeypatch.setattr(slotserve.launcher, "bind", lambda host, port: pytest.fail("bound port 0"))
    with pytest.raises(Started):
        cluster_on("127.0.0.1", 0).start()
