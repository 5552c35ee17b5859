"""The HTTP server's access log (``--access-log`` on ``slotserve serve`` and ``slotserve up``): one line a
request, whatever the log level. uvicorn's config set its access logger to the server's level, WARNING,
so ``slotserve serve --access-log`` logged nothing, and ``up`` had no such option.

The gateway runs on a thread of this process (its log records reach caplog) with no broker: the
routes asked for here (``/metrics``, a route it does not serve) answer without one."""

from __future__ import annotations

import logging
import threading

import httpx
from click.testing import CliRunner

from gateway import GatewayConfig, run
from tests.support.launcher import record_clusters
from tests.support.waits import wait_until


def access_lines(caplog, access_log: bool) -> list[str]:
    """Serve a gateway with ``access_log``, send it three requests, stop it; the access log's lines."""
    caplog.clear()
    stop, ready = threading.Event(), []
    cfg = GatewayConfig(broker="tcp://127.0.0.1:1", port=0, access_log=access_log)
    t = threading.Thread(target=run, args=(cfg,), kwargs={"stop": stop, "on_ready": ready.append})
    t.start()
    try:
        url = wait_until(lambda: ready and ready[0], 10, "the gateway to bind")
        with httpx.Client(base_url=url, timeout=30) as c:  # (the line is logged before the answer is sent)
            assert c.get("/metrics").status_code == 200
            assert c.post("/nope", json={"prompt": "x"}).status_code == 404
            assert c.get("/metrics?x=1").status_code == 200
    finally:
        stop.set()
        t.join(30)
    assert not t.is_alive()
    return [r.getMessage() for r in caplog.records if r.name == "uvicorn.access"]


def test_the_access_log_has_a_line_a_request_whatever_the_level_and_none_when_off(caplog):
    assert logging.getLogger().getEffectiveLevel() > logging.INFO  # (the root's level: WARNING, as slotserve's)
    assert access_lines(caplog, access_log=False) == []  # (off first: uvicorn then stops its propagation)
    lines = access_lines(caplog, access_log=True)
    assert len(lines) == 3, lines
    assert lines[0].startswith("127.0.0.1:") and lines[0].endswith('"GET /metrics HTTP/1.1" 200'), lines
    assert lines[1].endswith('"POST /nope HTTP/1.1" 404'), lines
    assert lines[2].endswith('"GET /metrics?x=1 HTTP/1.1" 200'), lines
    assert access_lines(caplog, access_log=False) == []


def test_up_takes_access_log_for_its_http_server(monkeypatch):
    from slotserve.cli import main

    clusters = record_clusters(monkeypatch, http_url="http://127.0.0.1:3")
    r = CliRunner().invoke(main, ["up", "--http-port", "0", "--access-log"])
    assert r.exit_code == 0, r.output
    assert clusters[-1].gateway.access_log is True
    r = CliRunner().invoke(main, ["up", "--http-port", "0"], env={"SLOTSERVE_UP_ACCESS_LOG": "1"})
    assert r.exit_code == 0 and clusters[-1].gateway.access_log is True
    r = CliRunner().invoke(main, ["up", "--http-port", "0"])
    assert r.exit_code == 0 and clusters[-1].gateway.access_log is False
    r = CliRunner().invoke(main, ["up", "--access-log"])  # no HTTP server to log
    assert r.exit_code == 2 and "--access-log" in r.output and "--http-port" in r.output and len(clusters) == 3
