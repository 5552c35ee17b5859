"""Every duration in a process's config is a finite number of seconds: ``inf``
cannot travel on the wire (msgpack values are checked finite), so a broker
configured with ``register_grace_s=inf`` could never send a welcome and its
cluster hung at start (a breaker found it through ``slotserve up
--register-grace-s inf``); ``inf`` liveness windows meant a dead peer was
never noticed. "Never" is ``None`` where a config allows it."""

from __future__ import annotations

import math

import pytest
from click.testing import CliRunner

from broker import BrokerConfig
from client import Client
from gateway.config import GatewayConfig
from protocol.validation import as_seconds
from slotserve.cli import main
from slotserve.launcher import ClusterConfig
from worker.config import WorkerConfig

BAD = [math.inf, -math.inf, math.nan, True, "3", None, -1.0]

DURATIONS = [
    (BrokerConfig, "heartbeat_interval_s"), (BrokerConfig, "worker_liveness_s"),
    (BrokerConfig, "client_liveness_s"), (BrokerConfig, "worker_hung_s"), (BrokerConfig, "register_grace_s"),
    (BrokerConfig, "tick_s"), (WorkerConfig, "heartbeat_interval_s"), (WorkerConfig, "broker_liveness_s"),
    (GatewayConfig, "status_interval_s"), (GatewayConfig, "connect_timeout_s"),
    (GatewayConfig, "shutdown_timeout_s"),
]


@pytest.mark.parametrize("value", [math.inf, math.nan, True, "3", -0.5])
def test_as_seconds_refuses_what_is_not_a_finite_duration(value):
    with pytest.raises(ValueError, match="^ttl_s must be a finite number of seconds > 0"):
        as_seconds(value, "ttl_s")


def test_as_seconds_takes_ints_floats_and_zero_only_when_allowed():
    assert as_seconds(2, "t") == 2.0 and type(as_seconds(2, "t")) is float
    assert as_seconds(0, "t", allow_zero=True) == 0.0
    with pytest.raises(ValueError, match=">= 0"):
        as_seconds(-1e-9, "t", allow_zero=True)
    with pytest.raises(ValueError, match="> 0"):
        as_seconds(0, "t")


@pytest.mark.parametrize("config, field", DURATIONS, ids=[f"{c.__name__}.{f}" for c, f in DURATIONS])
def test_every_config_duration_refuses_infinity_nan_and_non_numbers(config, field):
    nullable = field == "worker_hung_s"  # None: a worker is never declared hung
    for value in BAD:
        if value is None and nullable:
            continue
        with pytest.raises(ValueError, match=field):
            config(**{field: value})


@pytest.mark.parametrize("field", ["start_timeout_s", "stop_timeout_s"])
def test_the_cluster_config_refuses_infinite_timeouts(field):
    workers = (WorkerConfig(model="simulated"),)
    with pytest.raises(ValueError, match=field):
        ClusterConfig(BrokerConfig(), workers, **{field: math.inf})


@pytest.mark.parametrize("kw", ["connect_timeout_s", "heartbeat_interval_s"])
def test_the_client_refuses_infinite_durations_before_it_connects(kw):
    with pytest.raises(ValueError, match=kw):
        Client("tcp://127.0.0.1:1", **{kw: math.inf})


@pytest.mark.parametrize("option", ["--register-grace-s", "--worker-liveness-s", "--client-liveness-s",
                                    "--worker-hung-s"])
@pytest.mark.parametrize("command", ["up", "broker"])
def test_the_cli_answers_an_infinite_duration_with_a_usage_error(command, option):
    result = CliRunner().invoke(main, [command, option, "inf"])
    assert result.exit_code == 2, result.output
    assert "finite" in result.output
