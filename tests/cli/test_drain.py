"""Graceful drain (issue 22, item 1) of the commands, with real processes and
real signals: `slotserve serve` against a cluster, and `slotserve up
--http-port 0 --model simulated`, each with a worker slowed to 20 ms per
iteration, during a stream and a non-streamed request.

On SIGINT, SIGTERM or SIGHUP: new requests get 503 with ``Retry-After`` and
``/health`` 503 while what is in flight finishes (the drained case: the whole
output and ``[DONE]``); with a short ``--shutdown-timeout-s`` a stream ends with
a final error event and ``[DONE]`` and the request with a 503 (the timed-out
case); a second signal ends the drain at once. Always: exit status 0, no
ERROR line or traceback on stderr, no process of the command left. For `up`,
Ctrl-C reaches the whole process group (the children ignore it and the
parent stops them in order: gateway, workers, broker -- the drained stream
completing shows the workers and the broker served until the gateway was
done). The gateway's own drain, in detail: tests/gateway/test_drain.py."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest
from click.testing import CliRunner

psutil = pytest.importorskip("psutil")

from broker import BrokerConfig  # noqa: E402
from gateway import GatewayConfig  # noqa: E402
from slotserve.cli import main, serve, up  # noqa: E402
from slotserve.launcher import ClusterConfig, LocalCluster  # noqa: E402
from tests.support.cluster import ANY_PORT  # noqa: E402
from tests.support.gateway import CallInFlight, error_of, wait_until  # noqa: E402
from tests.support.reference import simulated_reference  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402

SLOTSERVE = [sys.executable, "-m", "slotserve"]
STEP_MS = "20"
PROMPT = [7, 8]
SHORT_S = 0.5  # the timed-out case's --shutdown-timeout-s


def completion(max_tokens: int, stream: bool) -> dict:
    return {"model": "simulated", "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}


def reference(max_tokens: int) -> list[int]:
    return simulated_reference(PROMPT, max_tokens, stop_token=None)[0]


class Command:
    """`slotserve ARGS` in a session of its own (so a group signal reaches it and its
    children only), stderr read on a thread; :attr:`url` is the HTTP address it prints."""

    def __init__(self, args: list[str]) -> None:
        self.proc = subprocess.Popen(SLOTSERVE + args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self._reader.start()
        self.url = wait_until(self._printed_url, 60, "the command's HTTP address", self.stderr)
        wait_until(self._healthy, 60, "/health 200", self.stderr)

    def _printed_url(self) -> str | None:
        assert self.proc.poll() is None, f"exited with {self.proc.returncode}: {self.stderr()}"
        m = re.search(r"http://[\d.]+:\d+(?=/v1)", "".join(self.lines))
        return m and m.group(0)

    def _healthy(self) -> bool:
        assert self.proc.poll() is None, f"exited with {self.proc.returncode}: {self.stderr()}"
        return httpx.get(self.url + "/health", timeout=5).status_code == 200

    def stderr(self) -> str:
        return "".join(self.lines)

    def signal(self, sig: int, *, group: bool = False) -> float:
        """Send ``sig`` to the command (``group``: to its whole process group, as Ctrl-C does);
        returns the monotonic time it was sent."""
        t = time.monotonic()
        (os.killpg if group else os.kill)(self.proc.pid, sig)
        return t

    def wait(self, timeout_s: float) -> tuple[int, float]:
        """The exit status and the monotonic time of the exit; then the stderr is complete."""
        status = self.proc.wait(timeout_s)
        t = time.monotonic()
        self._reader.join(10)
        return status, t

    def left(self) -> list:
        """Processes of its group still running (the command, its children, theirs)."""
        out = []
        for p in psutil.process_iter():
            try:
                if os.getpgid(p.pid) == self.proc.pid and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p)
            except (psutil.Error, ProcessLookupError):
                pass
        return out

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(10)
        for p in self.left():
            p.kill()
        self._reader.join(10)
        self.proc.stderr.close()


def assert_clean_stop(cmd: Command, status: int) -> None:
    err = cmd.stderr()
    assert status == 0, err
    assert not re.search(r"\bERROR\b", err) and "Traceback" not in err, err
    wait_until(lambda: not cmd.left(), 20, "no process of the command left", cmd.left)


def assert_refused_while_draining(url: str) -> None:
    health = httpx.get(url + "/health", timeout=5)
    assert health.status_code == 503 and health.json()["status"] == "draining", health.text
    r = httpx.post(url + "/v1/completions", json=completion(2, True), timeout=5)
    assert error_of(r, 503)["type"] == "service_unavailable_error" and r.headers["retry-after"] == "1"


def start_calls(cmd: Command, max_tokens: int) -> tuple[CallInFlight, CallInFlight]:
    """A stream and a non-streamed request of ``max_tokens`` each; returns once the stream is under way."""
    stream = CallInFlight(cmd.url, "/v1/completions", completion(max_tokens, True))
    plain = CallInFlight(cmd.url, "/v1/completions", completion(max_tokens, False))
    wait_until(lambda: len(stream.events) >= 3, 30, "the stream under way", lambda: (stream.error, cmd.stderr()))
    return stream, plain


def check_drained(stream: CallInFlight, plain: CallInFlight, max_tokens: int) -> None:
    assert stream.events[-1] == "[DONE]" and stream.streamed_tokens() == reference(max_tokens), stream.events[-2:]
    assert plain.status == 200 and plain.json["choices"][0]["token_ids"] == reference(max_tokens), plain.json


def check_timed_out(stream: CallInFlight, plain: CallInFlight, says: str) -> None:
    assert stream.status == 200 and stream.events[-1] == "[DONE]", stream.events[-2:]
    assert stream.events[-2]["error"]["type"] == "service_unavailable_error"
    assert says in stream.events[-2]["error"]["message"]
    tokens = stream.streamed_tokens()
    assert tokens == reference(5000)[:len(tokens)]
    assert plain.status == 503 and plain.headers["retry-after"] == "1", plain.json
    assert says in plain.json["error"]["message"]


# ---------------------------------------------------------------------- slotserve serve


@pytest.fixture(scope="module")
def cluster():
    broker = BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.2)
    with LocalCluster(ClusterConfig(broker, (WorkerConfig(num_slots=8, step_delay_ms=float(STEP_MS)),),
                                    start_timeout_s=60.0)) as c:
        yield c


@pytest.fixture
def served(cluster):
    """Start `slotserve serve` on the cluster with extra args; stopped at the test's end."""
    cmds = []

    def start(*args: str) -> Command:
        cmds.append(Command(["serve", "--broker", cluster.frontend, "--port", "0", *args]))
        return cmds[-1]

    yield start
    for c in cmds:
        c.close()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP], ids=lambda s: s.name)
def test_serve_drains_on_a_stop_signal(served, sig):
    cmd = served()
    stream, plain = start_calls(cmd, 100)  # 2 s at 20 ms per token
    t0 = cmd.signal(sig)
    wait_until(lambda: httpx.get(cmd.url + "/health", timeout=5).status_code == 503, 10, "/health 503")
    assert_refused_while_draining(cmd.url)
    assert not stream.done and not plain.done
    status, t_exit = cmd.wait(30)
    check_drained(stream.wait(), plain.wait(), 100)
    assert t_exit - t0 < 10
    assert_clean_stop(cmd, status)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=lambda s: s.name)
def test_serve_ends_what_is_left_at_its_shutdown_timeout(served, sig):
    cmd = served("--shutdown-timeout-s", str(SHORT_S))
    stream, plain = start_calls(cmd, 5000)
    t0 = cmd.signal(sig)
    status, t_exit = cmd.wait(30)
    check_timed_out(stream.wait(), plain.wait(), f"shutdown timeout of {SHORT_S:g} s")
    assert SHORT_S <= t_exit - t0 < SHORT_S + 6
    assert_clean_stop(cmd, status)


def test_serve_stops_at_once_on_a_second_signal(served):
    cmd = served()  # the default 30 s drain
    stream, plain = start_calls(cmd, 5000)
    cmd.signal(signal.SIGINT)
    wait_until(lambda: httpx.get(cmd.url + "/health", timeout=5).status_code == 503, 10, "/health 503")
    t0 = cmd.signal(signal.SIGINT)
    status, t_exit = cmd.wait(30)
    check_timed_out(stream.wait(), plain.wait(), "second stop signal")
    assert t_exit - t0 < 6
    assert_clean_stop(cmd, status)


# ---------------------------------------------------------------------- slotserve up --http-port


def start_up(*args: str) -> Command:
    return Command(["up", "--http-port", "0", "--model", "simulated", "--workers", "1", "--slots", "4",
                    "--step-delay-ms", STEP_MS, "--frontend", ANY_PORT, "--backend", ANY_PORT, *args])


def test_up_drains_on_ctrl_c_before_its_workers_and_broker_stop():
    cmd = start_up()
    try:
        stream, plain = start_calls(cmd, 100)
        t0 = cmd.signal(signal.SIGINT, group=True)  # Ctrl-C: the children get it too, and ignore it
        wait_until(lambda: httpx.get(cmd.url + "/health", timeout=5).status_code == 503, 10, "/health 503")
        assert_refused_while_draining(cmd.url)
        status, t_exit = cmd.wait(30)
        check_drained(stream.wait(), plain.wait(), 100)
        assert t_exit - t0 < 15
        assert_clean_stop(cmd, status)
    finally:
        cmd.close()


def test_up_ends_what_is_left_at_its_shutdown_timeout_on_sigterm():
    cmd = start_up("--shutdown-timeout-s", str(SHORT_S))
    try:
        stream, plain = start_calls(cmd, 5000)
        t0 = cmd.signal(signal.SIGTERM)  # `kill PID`: the parent alone
        status, t_exit = cmd.wait(30)
        check_timed_out(stream.wait(), plain.wait(), f"shutdown timeout of {SHORT_S:g} s")
        assert SHORT_S <= t_exit - t0 < SHORT_S + 10
        assert_clean_stop(cmd, status)
    finally:
        cmd.close()


def test_up_stops_at_once_on_a_second_signal():
    cmd = start_up()  # the default 30 s drain
    try:
        stream, plain = start_calls(cmd, 5000)
        cmd.signal(signal.SIGTERM)
        wait_until(lambda: httpx.get(cmd.url + "/health", timeout=5).status_code == 503, 10, "/health 503")
        t0 = cmd.signal(signal.SIGINT, group=True)
        status, t_exit = cmd.wait(30)
        check_timed_out(stream.wait(), plain.wait(), "second stop signal")
        assert t_exit - t0 < 10
        assert_clean_stop(cmd, status)
    finally:
        cmd.close()


# ---------------------------------------------------------------------- the option


def test_shutdown_timeout_is_one_option_of_serve_and_up_and_needs_the_http_server():
    def option(cmd):
        return next(p for p in cmd.params if p.name == "shutdown_timeout_s")

    a, b = option(serve), option(up)
    assert (a.help, a.default, a.envvar, a.type.min) == (b.help, b.default, b.envvar, b.type.min)
    assert a.default == GatewayConfig().shutdown_timeout_s == 30.0
    r = CliRunner().invoke(main, ["up", "--shutdown-timeout-s", "5"])
    assert r.exit_code == 2 and "give --http-port too" in r.output, r.output
    r = CliRunner().invoke(main, ["up"], env={"SLOTSERVE_UP_SHUTDOWN_TIMEOUT_S": "5"})
    assert r.exit_code == 2 and "give --http-port too" in r.output, r.output
    r = CliRunner().invoke(main, ["serve", "--shutdown-timeout-s", "-1"])
    assert r.exit_code == 2
