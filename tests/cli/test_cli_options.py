"""CLI details (issue 22, item 5): --version; --log-level after the subcommand too;
`slotserve up` takes the broker's options from the one definition `slotserve broker`
uses, and they reach the broker's config; the job summary's durations in s or ms."""

from __future__ import annotations

import importlib.metadata
import logging
import subprocess
import sys

import click
import pytest
from click.testing import CliRunner

from slotserve.cli import main
from slotserve.job import JobSummary, format_duration
from tests.support.launcher import record_clusters

BROKER_ARGS = {  # option -> (value on the command line, the BrokerConfig field, the value there)
    "--max-queue": ("7", "max_queue", 7),
    "--heartbeat-interval-s": ("0.5", "heartbeat_interval_s", 0.5),
    "--worker-liveness-s": ("2.5", "worker_liveness_s", 2.5),
    "--client-liveness-s": ("3", "client_liveness_s", 3.0),
    "--worker-hung-s": ("0", "worker_hung_s", None),  # 0: never
    "--max-attempts": ("2", "max_attempts", 2),
    "--register-grace-s": ("1.5", "register_grace_s", 1.5),
    "--metrics-port": ("9123", "metrics_port", 9123),
    "--metrics-host": ("0.0.0.0", "metrics_host", "0.0.0.0"),
    "--send-hwm": ("50", "send_hwm", 50),
    "--max-pending-per-peer": ("60", "max_pending_per_peer", 60),
    "--max-message-bytes": ("4096", "max_message_bytes", 4096),
}


@pytest.fixture(autouse=True)
def root_logger_kept():
    """--log-level sets the root logger's level: put it back after each test."""
    root = logging.getLogger()
    level = root.level
    yield
    root.setLevel(level)


@pytest.fixture
def fake_cluster(monkeypatch):
    """`slotserve up` over a stand-in LocalCluster: the ClusterConfigs it was given."""
    return record_clusters(monkeypatch)


@pytest.fixture
def fake_broker(monkeypatch):
    """`slotserve broker` over a stand-in run_broker: the BrokerConfigs it was given."""
    import broker

    configs = []
    monkeypatch.setattr(broker, "run_broker", lambda cfg, stop=None: configs.append(cfg))
    return configs


# ---------------------------------------------------------------------- --version


def test_version_comes_from_the_package_metadata():
    version = importlib.metadata.version("slotserve")
    r = CliRunner().invoke(main, ["--version"])
    assert r.exit_code == 0 and r.output == f"slotserve {version}\n"
    p = subprocess.run([sys.executable, "-m", "slotserve", "--version"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0 and p.stdout == f"slotserve {version}\n", p.stderr


# ---------------------------------------------------------------------- --log-level after the subcommand


def test_every_subcommand_takes_log_level_after_its_name():
    ctx = click.Context(main, info_name="slotserve", **main.context_settings)  # (click keeps each command's
    for name, cmd in main.commands.items():  # help option as first made: without -h, later tests' -h were unknown)
        assert "--log-level" in [o for p in cmd.params for o in getattr(p, "opts", [])], name
        cmd.make_context(name, ["--log-level", "info", *(["DIR"] if name == "keygen" else []),
                                *(["-o", "x"] if name == "run" else [])], parent=ctx, resilient_parsing=True)


def test_log_level_after_the_subcommand_reaches_the_children(fake_cluster):
    # before: `slotserve up --log-level info` was "No such option: --log-level"
    for args, env, want in ((["up"], {}, "WARNING"),
                            (["up", "--log-level", "info"], {}, "INFO"),
                            (["--log-level", "debug", "up"], {}, "DEBUG"),
                            (["--log-level", "debug", "up", "--log-level", "error"], {}, "ERROR"),  # the later wins
                            (["up"], {"SLOTSERVE_LOG_LEVEL": "info"}, "INFO"),
                            (["up", "--log-level", "error"], {"SLOTSERVE_LOG_LEVEL": "info"}, "ERROR"),
                            # the variable does not override a flag given before the subcommand
                            (["--log-level", "debug", "up"], {"SLOTSERVE_LOG_LEVEL": "info"}, "DEBUG")):
        r = CliRunner().invoke(main, args, env=env)
        assert r.exit_code == 0, (args, r.output)
        assert fake_cluster[-1].log_level == want, (args, env)


def test_log_level_after_the_subcommand_sets_this_process_level(tmp_path):
    r = CliRunner().invoke(main, ["keygen", str(tmp_path / "keys"), "--log-level", "debug"])
    assert r.exit_code == 0, r.output
    assert logging.getLogger().level == logging.DEBUG
    r = CliRunner().invoke(main, ["keygen", str(tmp_path / "keys"), "--log-level", "loud"])
    assert r.exit_code == 2 and "--log-level" in r.output


# ---------------------------------------------------------------------- `up` has the broker's options, one definition


def test_up_help_lists_the_broker_options():
    r = CliRunner().invoke(main, ["up", "--help"], terminal_width=200)
    assert r.exit_code == 0
    for opt in BROKER_ARGS:
        assert opt in r.output, opt
        assert f"SLOTSERVE_UP_{opt[2:].upper().replace('-', '_')}" in r.output
    broker, up = main.commands["broker"], main.commands["up"]
    broker_opts = {p.opts[0]: p for p in broker.params if isinstance(p, click.Option)}
    up_opts = {p.opts[0]: p for p in up.params if isinstance(p, click.Option)}
    assert set(broker_opts) <= set(up_opts), set(broker_opts) - set(up_opts)
    for opt, p in broker_opts.items():  # one definition: same type, default and help on both
        q = up_opts[opt]
        assert (repr(q.type), q.default, q.help) == (repr(p.type), p.default, p.help), opt


def test_broker_options_of_up_reach_the_broker_config(fake_cluster, fake_broker):
    args = [a for opt, (value, _, _) in BROKER_ARGS.items() for a in (opt, value)]
    r = CliRunner().invoke(main, ["up", *args])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["broker", *args])
    assert r.exit_code == 0, r.output
    for cfg in (fake_cluster[-1].broker, fake_broker[-1]):
        for opt, (_, field, want) in BROKER_ARGS.items():
            assert getattr(cfg, field) == want, (opt, getattr(cfg, field))
    assert fake_cluster[-1].workers[0].max_message_bytes == 4096  # `up`'s workers follow the broker's limit


def test_broker_options_of_up_from_the_environment(fake_cluster):
    r = CliRunner().invoke(main, ["up"], env={"SLOTSERVE_UP_METRICS_PORT": "9101",
                                              "SLOTSERVE_UP_HEARTBEAT_INTERVAL_S": "0.25",
                                              "SLOTSERVE_UP_WORKER_LIVENESS_S": "1"})
    assert r.exit_code == 0, r.output
    b = fake_cluster[-1].broker
    assert (b.metrics_port, b.heartbeat_interval_s, b.worker_liveness_s) == (9101, 0.25, 1.0)
    r = CliRunner().invoke(main, ["up", "--heartbeat-interval-s", "1", "--worker-liveness-s", "2"])
    assert r.exit_code == 2 and "3" in r.output  # the broker's own check (>= 3 heartbeats), as `broker` says it


# ---------------------------------------------------------------------- durations in the job summary


@pytest.mark.parametrize("seconds, shown", [(41.1346, "41.1 s"), (1.0, "1.0 s"), (0.9996, "1.0 s"),
                                            (0.9994, "999 ms"), (0.012, "12 ms"), (0.0123, "12 ms"),
                                            (0.0025, "2.5 ms"), (0.0001, "0.1 ms")])
def test_durations_are_in_seconds_or_milliseconds_as_fits(seconds, shown):
    assert format_duration(seconds) == shown


def test_the_job_summary_shows_long_and_short_durations_readably():
    long = JobSummary(requests=10, errors=0, prompt_tokens=50, completion_tokens=500, wall_s=41.1346,
                      p50_latency_ms=41134.6, p99_latency_ms=41200.0, p50_ttft_ms=812.0).format()
    assert "wall time          41.1 s" in long and "41.1 s / 41.2 s" in long and "812 ms" in long
    assert "41134.6 ms" not in long
    short = JobSummary(requests=1, errors=0, prompt_tokens=2, completion_tokens=3, wall_s=0.012,
                       p50_latency_ms=8.25, p99_latency_ms=8.25, p50_ttft_ms=None).format()
    assert "wall time          12 ms" in short and "0.00 s" not in short and "8.2 ms / 8.2 ms" in short
    assert "TTFT p50           -" in short


# ---------------------------------------------------------------------- the /v1/responses store's bounds


def test_responses_store_options_reach_the_gateway_config(fake_cluster):
    r = CliRunner().invoke(main, ["up", "--http-port", "0", "--responses-store-max", "5",
                                  "--responses-store-max-age-s", "2.5"])
    assert r.exit_code == 0, r.output
    gw = fake_cluster[-1].gateway
    assert (gw.responses_store_max, gw.responses_store_max_age_s) == (5, 2.5)
    r = CliRunner().invoke(main, ["up", "--http-port", "0"], env={"SLOTSERVE_UP_RESPONSES_STORE_MAX": "7"})
    assert r.exit_code == 0 and fake_cluster[-1].gateway.responses_store_max == 7, r.output
    assert CliRunner().invoke(main, ["up", "--http-port", "0", "--responses-store-max", "0"]).exit_code == 2
