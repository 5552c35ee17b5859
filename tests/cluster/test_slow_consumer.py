"""Blast radius, kind "whatever discards queued frames accounts for every
request they carry" (issue 10, item 10): a client that stops reading past the
broker's buffer bound (``send_hwm`` + ``max_pending_per_peer``) loses no
ending silently. Each of its requests ends exactly once -- with all its
tokens, or with ``slow_consumer`` (the error names the requests whose endings
were in the discarded frames too) -- and the broker's counters count
``completed`` only the endings that left. Members: the buffer overflow of a
stalled client (the issue's setup, a real SIGSTOP), a peer that vanished
with frames still queued for it, and the bound on the command line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

from click.testing import CliRunner

from broker.config import BrokerConfig
from broker.core import BrokerCore
from broker.outbox import Side
from client import Client
from protocol.enums import ErrorCode, FinishReason
from protocol.messages import Error, Finished, Heartbeat, Iteration, ModelInfo, Register, Results, Submit
from slotserve.cli import main
from slotserve.launcher import ClusterConfig, LocalCluster
from tests.support.messages import envelope
from tests.support.waits import wait_until
from worker import BatchInferenceEngine, SimulatedLLM
from worker.config import WorkerConfig

N, MAX_TOKENS = 3000, 8

# The stalled client: submits N short requests, waits until the broker has them
# all, then freezes itself (SIGSTOP) while their results flow; the test resumes
# it (SIGCONT) once the broker holds none of them, and it reports every handle.
# Its request ids are long (200 characters, in every results entry), so the
# results outgrow what the kernel's socket buffers absorb (about 3 MB on
# loopback even with a small receive buffer) and the broker's bound is hit.
CLIENT = textwrap.dedent("""
    import json, os, signal, sys, time
    from client import Client
    calls = {}
    def ended(i):
        calls[i] = calls.get(i, 0) + 1
    with Client(sys.argv[1], model="simulated") as c:
        c.wait_for_model(30)
        hs = [c.submit_request([i % 999 + 1, 2], MAX_TOKENS, callback=lambda seq, i=i: ended(i), stop_token=None,
                               request_id=f"{i:0200d}") for i in range(N)]
        deadline = time.monotonic() + 60
        while c.status().counters["submitted"] < len(hs):
            assert time.monotonic() < deadline, "the broker never took every request"
        print("frozen", flush=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        c.run(timeout=60)
        report = [[h.finish_reason.value, h.error.code.value if h.error else None, h.tokens, calls.get(i, 0)]
                  for i, h in enumerate(hs)]
    print(json.dumps(report), flush=True)
""").replace("MAX_TOKENS", str(MAX_TOKENS)).replace("range(N)", f"range({N})")


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def test_a_stalled_client_past_the_buffer_bound_gets_every_ending_exactly_once():
    broker = BrokerConfig(frontend="tcp://127.0.0.1:*", backend="tcp://127.0.0.1:*", send_hwm=10,
                          max_pending_per_peer=20)
    cfg = ClusterConfig(broker, (WorkerConfig(num_slots=16, step_delay_ms=1.0),))
    with LocalCluster(cfg) as cl, Client(cl.frontend, name="observer") as obs:
        proc = subprocess.Popen([sys.executable, "-c", CLIENT, cl.frontend], stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout.readline().strip() == "frozen"
            wait_until(lambda: stopped(proc.pid), 10, "the client to be stopped")
            wait_until(lambda: (lambda m: m.running == 0 and m.queued == 0)(obs.status().models["simulated"]),
                       60, "the broker to end or drop every request of the frozen client")
            os.kill(proc.pid, signal.SIGCONT)
            out, _ = proc.communicate(timeout=90)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGCONT)
                proc.kill()
                proc.wait(10)
        st = obs.status()
    report = json.loads(out)
    assert len(report) == N and all(calls == 1 for *_, calls in report)  # one ending each, no more, no less
    ref = BatchInferenceEngine(SimulatedLLM(), 16, stop_token=None)
    refs = [ref.submit_request([i % 999 + 1, 2], MAX_TOKENS) for i in range(N)]
    ref.run()
    completed = slow = 0
    for (reason, code, tokens, _), r in zip(report, refs):
        if reason == "length":
            assert tokens == r.tokens
            completed += 1
        else:
            assert (reason, code) == ("error", "slow_consumer")
            assert tokens == r.tokens[:len(tokens)]  # what arrived is a prefix: no gap, no duplicate
            slow += 1
    assert slow > 0 and st.counters["clients_lost"] == 1  # the bound was hit
    c = st.counters
    assert c["completed"] == completed and c["errors"] == slow and c["cancelled"] == 0  # not counted completed


INFO = ModelInfo(1000, None, (0,), False)


def test_endings_in_discarded_frames_are_named_and_recounted():
    """The core's side of a discard: the socket loop took the held frames'
    endings out of the counters; the client is told each request they name
    ended ``slow_consumer``, those ended already included, and they count as
    errors, never ``completed``."""
    core = BrokerCore(BrokerConfig(), "b", now=0.0)
    core.on_backend(b"w", Register("simulated", 4, 4, INFO, "w"), 0.0)
    out = core.on_frontend(b"c", Submit("simulated", [envelope(i, [i + 1], 3) for i in range(3)]), 0.0)
    keys = sorted(core.workers.get(b"w").inflight)
    out = core.on_backend(b"w", Iteration(ids=keys[:2], tokens=[5, 6], finished=[
        iteration_end(k) for k in keys[:2]]), 0.1)
    (held,) = [s.message for s in out if isinstance(s.message, Results)]
    assert core.counters["completed"] == 2
    core.count_endings(held.finished, -1)  # what the socket loop does when it must hold the frame
    out = core.client_unreachable(b"c", ErrorCode.SLOW_CONSUMER, [held])
    (err,) = [s.message for s in out if s.side is Side.FRONTEND and isinstance(s.message, Error)]
    assert err.code is ErrorCode.SLOW_CONSUMER and sorted(err.request_ids) == [0, 1, 2]
    assert core.counters["completed"] == 0 and core.counters["errors"] == 2
    # The running one ends on the worker's word, as the broker decided: an error, not "cancelled".
    core.on_backend(b"w", Iteration(finished=[iteration_end(keys[2], FinishReason.CANCELLED)]), 0.2)
    assert core.counters["errors"] == 3 and core.counters["cancelled"] == 0 and not core.jobs


def iteration_end(key, reason=FinishReason.LENGTH):
    return Finished(key, reason)


def test_a_vanished_clients_queued_endings_never_count_completed():
    """EHOSTUNREACH with frames still queued: they are discarded and their
    endings count as errors (nobody received them)."""
    core = BrokerCore(BrokerConfig(), "b", now=0.0)
    core.on_backend(b"w", Register("simulated", 4, 4, INFO, "w"), 0.0)
    core.on_frontend(b"c", Submit("simulated", [envelope(0, [1], 3)]), 0.0)
    (key,) = core.workers.get(b"w").inflight
    out = core.on_backend(b"w", Iteration(ids=[key], tokens=[5], finished=[iteration_end(key)]), 0.1)
    (held,) = [s.message for s in out if isinstance(s.message, Results)]
    core.count_endings(held.finished, -1)
    assert core.client_unreachable(b"c", None, [held]) == []  # gone: nothing to tell it
    assert core.counters["completed"] == 0 and core.counters["errors"] == 1
    assert core.on_frontend(b"c2", Heartbeat(), 0.2) == []


def test_the_buffer_bound_is_on_the_command_line(monkeypatch):
    import broker as broker_pkg

    seen = []
    monkeypatch.setattr(broker_pkg, "run_broker", lambda cfg, stop: seen.append(cfg))
    r = CliRunner().invoke(main, ["broker", "--frontend", "tcp://127.0.0.1:0", "--backend", "tcp://127.0.0.1:0",
                                  "--send-hwm", "10", "--max-pending-per-peer", "20"])
    assert r.exit_code == 0, r.output
    assert (seen[0].send_hwm, seen[0].max_pending_per_peer) == (10, 20)
    for cmd in ("broker", "up"):
        r = CliRunner().invoke(main, [cmd, "--help"], terminal_width=200)
        assert "--max-pending-per-peer" in r.output and "slow_consumer" in r.output and "(messages)" in r.output
    r = CliRunner().invoke(main, ["up", "--max-pending-per-peer", "0"])
    assert r.exit_code == 2 and "--max-pending-per-peer" in r.output
