"""CURVE through real processes: keys from `slotserve keygen`, an encrypted
cluster end to end, and the handshakes that must fail (an unknown key, a
client key on the worker socket, a worker key on the client socket, no
CURVE at all). Failures are observed as ZeroMQ handshake events on the
connecting socket (zmq >= 4.3), never by waiting for silence."""

from __future__ import annotations

import os

import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from broker import BrokerConfig
from client import BrokerUnavailable, Client
from protocol.curve import broker_paths, peer_paths
from slotserve.launcher import ClusterConfig, LocalCluster, make_curve_keys
from tests.support.cluster import ANY_PORT
from tests.support.waits import wait_until
from worker import BatchInferenceEngine, SimulatedLLM
from worker.config import WorkerConfig

_EVENTS = (zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_HANDSHAKE_FAILED_AUTH
           | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    d = tmp_path_factory.mktemp("curve")
    make_curve_keys(str(d), clients=2, workers=1)
    return str(d)


@pytest.fixture(scope="module")
def cluster(keys):
    b = broker_paths(keys)
    w = peer_paths(keys, "worker")
    broker = BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, curve_secret_file=b.secret_file,
                          curve_clients_dir=b.clients_dir, curve_workers_dir=b.workers_dir)
    worker = WorkerConfig(num_slots=4, curve_secret_file=w.secret_file, curve_broker_key_file=w.broker_public_file)
    with LocalCluster(ClusterConfig(broker, (worker, worker), client_curve=keys)) as c:
        yield c


def handshake(endpoint: str, public: bytes | None, secret: bytes | None, server: bytes | None) -> int:
    """Connect a DEALER with these keys (None: plain); return the first handshake event."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if public is not None:
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = public, secret, server
    mon = s.get_monitor_socket(_EVENTS)
    try:
        s.connect(endpoint)
        wait_until(lambda: mon.poll(100), 10, "a handshake event", pause_s=0)
        return recv_monitor_message(mon)["event"]
    finally:
        s.disable_monitor()
        mon.close(0)
        s.close(0)


def load(path):
    return zmq.auth.load_certificate(path)


def test_keygen_layout_and_separate_allow_lists(keys):
    assert sorted(os.listdir(os.path.join(keys, "clients"))) == ["client.key", "client2.key"]
    assert sorted(os.listdir(os.path.join(keys, "workers"))) == ["worker.key"]
    assert oct(os.stat(os.path.join(keys, "broker.key_secret")).st_mode & 0o777) == "0o600"
    pubs = {load(os.path.join(keys, f"{n}.key"))[0] for n in ("broker", "client", "client2", "worker")}
    assert len(pubs) == 4


def test_encrypted_cluster_end_to_end(cluster, keys):
    reqs = [([i + 1, 2, 3], 12, {}) for i in range(40)]
    engine = BatchInferenceEngine(SimulatedLLM(), 4, stop_token=0)
    expected = [engine.submit_request(p, m) for p, m, _ in reqs]
    engine.run()
    second = (os.path.join(keys, "client2.key_secret"), os.path.join(keys, "broker.key"))
    with Client(cluster.frontend, curve=keys) as a, Client(cluster.frontend, curve=second) as b:
        hs = [(a if i % 2 else b).submit_request(p, m) for i, (p, m, _) in enumerate(reqs)]
        a.run(timeout=30)
        b.run(timeout=30)
        assert a.status().models["simulated"].workers == 2   # both workers got in with their key
    assert [h.tokens for h in hs] == [h.tokens for h in expected]


def test_unknown_key_is_rejected(cluster, keys):
    server = load(os.path.join(keys, "broker.key"))[0]
    public, secret = zmq.curve_keypair()
    assert handshake(cluster.frontend, public, secret, server) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    assert handshake(cluster.backend, public, secret, server) == zmq.EVENT_HANDSHAKE_FAILED_AUTH


def test_client_key_cannot_register_as_worker_and_vice_versa(cluster, keys):
    server = load(os.path.join(keys, "broker.key"))[0]
    client = load(os.path.join(keys, "client.key_secret"))
    worker = load(os.path.join(keys, "worker.key_secret"))
    assert handshake(cluster.backend, *client, server) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    assert handshake(cluster.frontend, *worker, server) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
    # The right keys on the right sockets do get in.
    assert handshake(cluster.frontend, *client, server) == zmq.EVENT_HANDSHAKE_SUCCEEDED
    assert handshake(cluster.backend, *worker, server) == zmq.EVENT_HANDSHAKE_SUCCEEDED


def test_plain_client_gets_no_service(cluster):
    assert handshake(cluster.frontend, None, None, None) != zmq.EVENT_HANDSHAKE_SUCCEEDED
    with pytest.raises(BrokerUnavailable):
        Client(cluster.frontend, connect_timeout_s=0.5)


def test_bad_curve_arguments_are_value_errors(keys, tmp_path):
    with pytest.raises(ValueError, match="curve"):
        Client("tcp://127.0.0.1:1", curve=42)
    with pytest.raises(ValueError, match="CURVE key"):
        Client("tcp://127.0.0.1:1", curve=str(tmp_path))          # no keys there
    with pytest.raises(ValueError, match="CURVE"):
        BrokerConfig(curve_secret_file=os.path.join(keys, "broker.key_secret"))
    with pytest.raises(ValueError, match="CURVE"):
        WorkerConfig(curve_secret_file=os.path.join(keys, "worker.key_secret"))
