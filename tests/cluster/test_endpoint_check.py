"""Blast radius, kind "a ZeroMQ endpoint that can never work": libzmq takes
``tcp://127.0.0.1:99999`` (it keeps the port's low 16 bits) and
``tcp://256.1.1.1:5`` (a host name to it, looked up on every retry), so
`slotserve worker --broker` either retried forever with warnings or (another
transport, no port) died with a ZMQError traceback. Now one check
(protocol.endpoints.check_endpoint) refuses them at once wherever an endpoint
enters: every endpoint option of every command (a usage error naming it),
BrokerConfig, WorkerConfig, GatewayConfig, Client and AsyncClient (a
ValueError); a well-formed endpoint with no broker behind it yet is still
waited for."""

from __future__ import annotations

import asyncio
import re
import subprocess
import sys

import pytest
import zmq
from click.testing import CliRunner

from broker import BrokerConfig
from client import AsyncClient, BrokerUnavailable, Client
from gateway.config import GatewayConfig
from protocol.endpoints import MAX_IPC_PATH_BYTES, check_endpoint, endpoint_host, ipv4_literal
from slotserve.cli import EndpointType, main
from tests.support.cluster import free_port
from worker.config import WorkerConfig

SLOTSERVE = [sys.executable, "-m", "slotserve"]

# (endpoint, words of the reason): never works, bound or connected
NEVER = [
    ("tcp://127.0.0.1:99999", "the port 99999 is beyond 65535"),
    ("tcp://127.0.0.1:65536", "the port 65536 is beyond 65535"),
    ("tcp://256.1.1.1:5", "'256.1.1.1' is not an IPv4 address"),
    ("tcp://1.2.3.4.5:5", "'1.2.3.4.5' is not an IPv4 address"),
    ("tcp://4294967296:5", "'4294967296' is not an IPv4 address"),   # one number past 32 bits
    ("tcp://127.0.0.1.:5", "'127.0.0.1.' is not an IPv4 address"),
    ("tcp://0x100.1:5", "its last label is a number"),                 # a hex part past its byte
    ("tcp://010.0.0.1:5", "reads as octal: it means 8.0.0.1"),         # taken by libzmq, not as written
    ("tcp://0177.1:5", "reads as octal: it means 127.0.0.1"),
    ("tcp://host.123:5", "its last label is a number"),
    ("tcp://bad host:5", "neither an IP address nor a host name"),
    ("tcp://-host:5", "neither an IP address nor a host name"),
    ("tcp://" + "a" * 64 + ":5", "neither an IP address nor a host name"),
    ("tcp://[::1:5", "is not an IPv6 address"),
    ("tcp://[::g]:5", "is not an IPv6 address"),
    ("tcp://127.0.0.1", "it needs a port"),
    ("tcp://:5555", "it has no host"),
    ("tcp://127.0.0.1:55x", "the port '55x' is not a number"),
    ("tcp://127.0.0.1:-1", "the port '-1' is not a number"),
    ("http://127.0.0.1:5555", "the transport 'http' is not one of tcp://, ipc://"),
    ("TCP://127.0.0.1:5555", "the transport 'TCP'"),
    ("inproc://broker", "inproc:// reaches only sockets in the same ZeroMQ context"),
    ("127.0.0.1:5555", "it has no transport"),
    ("ipc://", "ipc:// needs a path"),
    ("ipc:///tmp/" + "x" * MAX_IPC_PATH_BYTES, f"at most {MAX_IPC_PATH_BYTES} bytes"),
]
# never works when connecting, fine to bind
BIND_ONLY = [
    ("tcp://127.0.0.1:*", "the port * only binds"),
    ("tcp://127.0.0.1:0", "the port 0 only binds"),
    ("tcp://*:5555", "the host * only binds"),
    ("ipc://*", "ipc://* only binds"),
]
SHORTHAND_IPV4 = ["tcp://127.1:5555", "tcp://127.1.2:5555", "tcp://2130706433:5555", "tcp://0x7f.1:5555",
                  "tcp://0x7f000001:5555", "tcp://0.0.0.0:5555", "tcp://127.1.65535:5555"]  # inet_aton's forms
WORKS = SHORTHAND_IPV4 + ["tcp://127.0.0.1:5555", "tcp://localhost:1", "tcp://broker_1.internal:65535",
                          "tcp://[::1]:5555", "tcp://::1:5555", "tcp://0xdead.0xbeef:5", "tcp://10.1.2:5", "tcp://[fe80::1%lo]:5555", "ipc:///tmp/slotserve.sock",
                          "tcp://name-that-does-not-resolve.invalid:5555"]  # (may resolve later: waited for, not refused)


@pytest.mark.parametrize("endpoint, why", NEVER + BIND_ONLY)
def test_a_connect_endpoint_that_can_never_work_is_refused(endpoint, why):
    with pytest.raises(ValueError, match="is not a ZeroMQ endpoint that can work") as e:
        check_endpoint(endpoint, bind=False, name="broker")
    assert str(e.value).startswith("broker: ") and why in str(e.value)


@pytest.mark.parametrize("endpoint, why", NEVER)
def test_a_bind_endpoint_that_can_never_work_is_refused(endpoint, why):
    with pytest.raises(ValueError, match="is not a ZeroMQ endpoint that can work") as e:
        check_endpoint(endpoint, bind=True)
    assert why in str(e.value)


@pytest.mark.parametrize("endpoint", WORKS + [e for e, _ in BIND_ONLY] + ["tcp://*:*", "tcp://eth0:5555"])
def test_a_bind_endpoint_that_can_work_is_taken(endpoint):
    assert check_endpoint(endpoint, bind=True) == endpoint


@pytest.mark.parametrize("endpoint", WORKS + ["tcp://10.0.0.1;[::1]:5555", "tcp://eth0;host:5", "tcp://[::1];h:5",
                                              "tcp://10.0.0.1:0;127.0.0.1:5"])
def test_a_connect_endpoint_that_can_work_is_taken(endpoint):
    assert check_endpoint(endpoint, bind=False) == endpoint


@pytest.mark.parametrize("endpoint", SHORTHAND_IPV4 + [e for e, why in NEVER if "IPv4" in why or "127.0.0.1" in why])
def test_an_ipv4_literal_is_what_libzmq_binds(endpoint):
    """The rule is libzmq's own (getaddrinfo, so inet_aton's forms): a host taken as an IPv4
    literal binds at ipv4_literal's address; one refused as no address does not bind; one refused
    as octal binds at the address the error names, not the one written. (Loopback addresses: one
    this machine has.)"""
    host = endpoint_host(endpoint)
    with zmq.Context() as ctx, ctx.socket(zmq.ROUTER) as sock:
        sock.linger = 0
        try:
            sock.bind(f"tcp://{host}:0")
        except zmq.ZMQError:
            bound = None
        else:
            bound = sock.getsockopt_string(zmq.LAST_ENDPOINT).removeprefix("tcp://").rpartition(":")[0]
    assert bound == ipv4_literal(host)
    try:
        check_endpoint(endpoint, bind=True)
    except ValueError as e:
        assert bound is None or f"it means {bound}" in str(e)
    else:
        assert bound is not None


def test_a_source_address_is_checked_and_only_connects():
    with pytest.raises(ValueError, match="its source address: the host '300.0.0.1'"):
        check_endpoint("tcp://300.0.0.1;127.0.0.1:5", bind=False)
    with pytest.raises(ValueError, match="a source address .* is for connecting only"):
        check_endpoint("tcp://10.0.0.1;127.0.0.1:5", bind=True)


def test_not_a_string_and_a_long_endpoint_are_refused_in_few_words():
    with pytest.raises(ValueError, match="a ZeroMQ endpoint is a string like tcp://127.0.0.1:5555, got int"):
        check_endpoint(5555, bind=False)
    with pytest.raises(ValueError) as e:
        check_endpoint("tcp://" + "h" * 100_000 + ":5", bind=False)
    assert len(str(e.value)) < 400 and "(100008 characters)" in str(e.value)


@pytest.mark.parametrize("endpoint, why", [NEVER[0], NEVER[2], NEVER[14], BIND_ONLY[0]])
def test_every_config_and_the_sdk_refuse_it(endpoint, why):
    for build, name in [(lambda e: WorkerConfig(broker=e), "broker"), (lambda e: GatewayConfig(broker=e), "broker"),
                        (lambda e: Client(e, connect_timeout_s=0.1), "address"),
                        (lambda e: asyncio.run(AsyncClient.connect(e, connect_timeout_s=0.1)), "address")]:
        with pytest.raises(ValueError, match=f"^{name}: .*{re.escape(why)}"):
            build(endpoint)
    if (endpoint, why) not in BIND_ONLY:
        for field in ("frontend", "backend"):
            with pytest.raises(ValueError, match=f"^{field}: .*{re.escape(why)}"):
                BrokerConfig(**{field: endpoint})


def test_every_config_and_the_sdk_take_a_shorthand_ipv4_address():
    """tcp://127.1:PORT (libzmq's 127.0.0.1) was refused as 'not an IPv4 address (four numbers)'."""
    endpoint = f"tcp://127.1:{free_port()}"
    assert WorkerConfig(broker=endpoint).broker == endpoint
    assert GatewayConfig(broker=endpoint).broker == endpoint
    assert BrokerConfig(frontend=endpoint).frontend == endpoint
    with pytest.raises(BrokerUnavailable, match="no slotserve broker answered"):  # checked, then waited for
        Client(endpoint, connect_timeout_s=0.2)
    r = CliRunner().invoke(main, ["status", "--broker", endpoint, "--timeout-s", "0.2"])
    assert r.exit_code == 1 and "no slotserve broker answered at tcp://127.1:" in r.output, r.output


def test_a_well_formed_endpoint_without_a_broker_is_still_waited_for():
    with pytest.raises(BrokerUnavailable, match="no slotserve broker answered"):
        Client(f"tcp://127.0.0.1:{free_port()}", connect_timeout_s=0.3)
    assert WorkerConfig(broker="tcp://name-that-does-not-resolve.invalid:5556").broker.endswith(":5556")


def endpoint_options():
    """(command, option, binds) for every endpoint option of every command."""
    return [(name, p.opts[0], p.type.bind) for name, cmd in sorted(main.commands.items()) for p in cmd.params
            if isinstance(p.type, EndpointType)]


def test_every_endpoint_option_is_checked():
    found = endpoint_options()
    names = {(c, o) for c, o, _ in found}
    assert {("worker", "--broker"), ("run", "--broker"), ("status", "--broker"), ("serve", "--broker"),
            ("broker", "--frontend"), ("broker", "--backend"), ("up", "--frontend"), ("up", "--backend")} <= names
    assert not [(name, p.opts[0]) for name, cmd in main.commands.items() for p in cmd.params
                if p.opts[0] in ("--broker", "--frontend", "--backend") and not isinstance(p.type, EndpointType)]


@pytest.mark.parametrize("endpoint, why", NEVER[:3] + [NEVER[14], NEVER[16]] + BIND_ONLY[:1])
@pytest.mark.parametrize("command, option, binds", endpoint_options())
def test_every_endpoint_option_refuses_it_as_a_usage_error(tmp_path, command, option, binds, endpoint, why):
    if binds and (endpoint, why) in BIND_ONLY:
        return  # (a bind endpoint: taken)
    args = [command, option, endpoint]
    if command == "run":
        inp = tmp_path / "in.jsonl"
        inp.write_text('{"prompt": [1], "max_tokens": 1}\n')
        args = [command, str(inp), "-o", str(tmp_path / "out.jsonl"), option, endpoint]
    r = CliRunner().invoke(main, args)
    assert r.exit_code == 2, r.output
    assert f"Invalid value for '{option}'" in r.output and why in r.output
    assert "Traceback" not in r.output
    if command == "run":
        assert not (tmp_path / "out.jsonl").exists()  # a usage error leaves -o alone


@pytest.mark.parametrize("endpoint", ["tcp://127.0.0.1:99999", "tcp://256.1.1.1:5"])
def test_the_issue_input_a_worker_stops_at_once(endpoint):
    """The issue's input, a real process: it used to retry forever, warning every 5 s."""
    p = subprocess.run(SLOTSERVE + ["worker", "--broker", endpoint], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2, p.stderr
    assert "is not a ZeroMQ endpoint that can work" in p.stderr and "registering again" not in p.stderr


@pytest.mark.process  # (run starts its cluster: the lanes' reading does not follow the CLI)
def test_an_embedded_run_still_binds_wildcard_ports(tmp_path):
    """`slotserve run` without --broker binds tcp://127.0.0.1:* (its workers meet the bound port)."""
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"id": "a", "prompt": [1, 2], "max_tokens": 3}\n')
    out = tmp_path / "out.jsonl"
    r = CliRunner().invoke(main, ["run", str(inp), "-o", str(out), "--workers", "1", "--slots", "1",
                                  "--no-progress"])
    assert r.exit_code == 0, r.output
    assert '"id": "a"' in out.read_text()
