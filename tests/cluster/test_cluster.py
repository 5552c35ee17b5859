"""Integration: a real broker and real workers as child processes (free ports
picked by the OS, always reaped), driven through the client SDK."""

from __future__ import annotations

import os
import random
import signal
import threading

import msgpack
import pytest
import zmq

from broker import BrokerConfig
from client import Client
from protocol.codec import decode, encode
from protocol.errors import UnsupportedError
from protocol.enums import ErrorCode, FinishReason
from protocol.messages import PROTOCOL_VERSION, Error, Results, Submit
from slotserve.launcher import ClusterConfig, LocalCluster
from tests.support.cluster import ANY_PORT
from tests.support.messages import envelope
from tests.support.reference import simulated_references
from tests.support.waits import Deadline, wait_until
from worker import BatchInferenceEngine, SimulatedLLM
from worker.config import WorkerConfig



def cluster_config(slots, *, step_delay_ms=0.0, heartbeat_s=0.2, worker_liveness_s=1.0, max_queue=100_000):
    broker = BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=heartbeat_s,
                          worker_liveness_s=worker_liveness_s, max_queue=max_queue)
    workers = tuple(WorkerConfig(num_slots=n, step_delay_ms=step_delay_ms, heartbeat_interval_s=heartbeat_s,
                                 broker_liveness_s=5.0) for n in slots)
    return ClusterConfig(broker, workers, start_timeout_s=60.0, stop_timeout_s=5.0)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(cluster_config((3, 5, 8))) as c:
        yield c


def random_requests(n, seed=0):
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        kw = {}
        r = rng.random()
        if r < 0.2:
            kw["stop_token"] = None           # run to max_tokens
        elif r < 0.3:
            kw["stop_token"] = [rng.randrange(1, 1000), 0]
        if rng.random() < 0.2:
            kw["stop_sequences"] = [[rng.randrange(1, 1000), rng.randrange(1, 1000)]]
        if rng.random() < 0.2:
            kw["priority"] = rng.randrange(-2, 3)
        prompt = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 12))]
        reqs.append((prompt, rng.randrange(1, 40), kw))
    return reqs


def engine_results(reqs):
    """(prompt + tokens, finish_reason) per request, from the fault-free in-process run."""
    ends = simulated_references(reqs, batch_size=4)
    return [(list(prompt) + tokens, reason) for (prompt, _, _), (tokens, reason) in zip(reqs, ends)]


def test_results_equal_in_process_engine_request_by_request(cluster):
    reqs = random_requests(400, seed=1)
    expected = engine_results(reqs)
    got = {}
    with Client(cluster.frontend) as c:
        handles = [c.submit_request(p, m, lambda seq, i=i: got.__setitem__(i, seq), **kw)
                   for i, (p, m, kw) in enumerate(reqs)]
        c.run(timeout=60)
        st = c.status()
    assert [(got[i], h.finish_reason) for i, h in enumerate(handles)] == expected
    assert all(h.done() and h.error is None for h in handles)
    # Every worker took part (slot counts 3, 5 and 8).
    assert len(st.workers) == 3 and st.models["simulated"].slots_total == 16
    assert st.counters["completed"] >= 400


def test_streaming_on_token_in_order_then_callback_once(cluster):
    streamed: dict[int, list[int]] = {}
    calls: dict[int, int] = {}
    order_ok = []
    reqs = random_requests(60, seed=2)

    def on_token(i, t):
        streamed.setdefault(i, []).append(t)

    def callback(i, seq):
        calls[i] = calls.get(i, 0) + 1
        order_ok.append(seq[-len(streamed.get(i, [])):] == streamed.get(i, []) if streamed.get(i) else True)

    with Client(cluster.frontend) as c:
        hs = [c.submit_request(p, m, lambda seq, i=i: callback(i, seq), on_token=lambda t, i=i: on_token(i, t), **kw)
              for i, (p, m, kw) in enumerate(reqs)]
        c.run(timeout=60)
    assert all(calls[i] == 1 for i in range(len(reqs)))
    assert all(order_ok)
    for i, h in enumerate(hs):
        assert streamed[i] == h.tokens and len(h.tokens) >= 1
        assert h.ttft_s is not None and h.ttft_s <= h.latency_s


def test_callbacks_may_submit_more_requests(cluster):
    done = []
    with Client(cluster.frontend) as c:
        def chain(seq, depth=0):
            done.append(depth)
            if depth < 5:
                c.submit_request(seq[-3:], 3, lambda s: chain(s, depth + 1))
        c.submit_request([1, 2, 3], 3, chain)
        wait_until(lambda: len(done) == 6, 30, "the chain of callbacks")
        c.run(timeout=10)
    assert done == [0, 1, 2, 3, 4, 5]


@pytest.mark.parametrize("stop", [SystemExit, KeyboardInterrupt])
def test_a_callback_that_exits_is_recorded_and_later_requests_still_arrive(cluster, stop):
    """sys.exit() (or a KeyboardInterrupt raised) in a callback, on the client's callback thread:
    recorded on the handle as any exception; the thread lives on (a break-it pass: it died, and every
    later request waited forever)."""
    def bad(_):
        raise stop(0) if stop is SystemExit else stop()

    with Client(cluster.frontend) as c:
        h1 = c.submit_request([1, 2], 2, callback=bad)
        h2 = c.submit_request([3, 4], 2, on_token=lambda t: (_ for _ in ()).throw(stop()))
        h1.result(timeout=30)
        h3 = c.submit_request([5, 6], 2, callback=lambda s: None)
        c.run(timeout=30)
    assert isinstance(h1.error, stop) and h1.finish_reason is not FinishReason.ERROR
    assert isinstance(h2.error, stop) and h2.finish_reason is FinishReason.ERROR  # a streaming callback ends it
    assert h3.done() and h3.error is None and len(h3.tokens) == 2


def test_bad_requests_get_errors_while_others_complete(cluster):
    good = random_requests(100, seed=3)
    expected = engine_results(good)
    with Client(cluster.frontend) as c:
        info = c.models["simulated"]
        assert info.vocab_size == 1000 and info.eos_token_ids == (0,)
        handles = []
        for i, (p, m, kw) in enumerate(good):
            handles.append(c.submit_request(p, m, **kw))
            if i % 10 == 0:
                # Refused before anything is sent: nothing reaches the broker.
                for bad in ([], [1, 1000], [True], "x" * 0):
                    with pytest.raises(ValueError):
                        c.submit_request(bad, 5)
                with pytest.raises(ValueError):
                    c.submit_request([1, 2], 0)
                with pytest.raises(ValueError):
                    c.submit_request([1, 2], 5, stop_sequences=[[]])
        # Text (a prompt, stop strings): the simulated model has no tokenizer. The client knows it
        # from the welcome and refuses at once; a peer that sends it anyway is answered with a code.
        for kw in ({"prompt": "hello"}, {"prompt": [1, 2], "stop": ["x"]}):
            with pytest.raises(UnsupportedError) as refused:
                c.submit_request(max_tokens=5, **kw)
            assert refused.value.code is ErrorCode.UNSUPPORTED and "tokenizer" in str(refused.value)
        # Raw frames from a second peer: garbage and semantically bad requests.
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(cluster.frontend)
        try:
            raw.send(b"\x93garbage")
            raw.send(msgpack.packb({"v": 99, "op": "submit"}))
            # One frame: three requests a client could not build (the broker rejects each
            # alone), one the worker refuses (outside the vocabulary), one fine.
            raw.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "submit", "model": "simulated", "requests": [
                ["neg", [[-1, 2], 4]], ["zero", [[1], 0]], ["resume", [[1], 2], [3, 4]],
                ["vocab", [[1, 5000], 2]], ["fine", [[5, 6], 3]], ["text", ["hello", 5]],
                ["stops", [[1, 2], 5, "default", [], 0, None, 0.0, 1.0, 0, None, 0, ["x"]]]]}))
            raw.send(msgpack.packb({"v": PROTOCOL_VERSION, "op": "submit", "model": "simulated",
                                    "requests": [["typed", "not params", [], None, "extra"]]}))
            replies = []
            finished = {}
            poller = zmq.Poller()
            poller.register(raw, zmq.POLLIN)
            deadline = Deadline(20)
            while (len([r for r in replies if isinstance(r, Error)]) < 3 or len(finished) < 7) \
                    and not deadline.passed():
                if poller.poll(100):
                    msg = decode(raw.recv())
                    replies.append(msg)
                    if isinstance(msg, Results):
                        finished.update({f.request_id: f for f in msg.finished})
        finally:
            raw.close(0)
        c.run(timeout=60)
    errors = [r for r in replies if isinstance(r, Error)]
    assert {e.code for e in errors} >= {ErrorCode.MALFORMED, ErrorCode.UNSUPPORTED_VERSION}
    assert any(e.request_ids == ("typed",) for e in errors)
    for rid in ("neg", "zero", "resume", "vocab"):
        assert finished[rid].finish_reason is FinishReason.ERROR and finished[rid].code is ErrorCode.BAD_REQUEST
        assert finished[rid].message
    assert finished["fine"].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    for rid in ("text", "stops"):
        assert finished[rid].finish_reason is FinishReason.ERROR and finished[rid].code is ErrorCode.UNSUPPORTED
    assert [(h.result(), h.finish_reason) for h in handles] == expected


def test_duplicate_id_refused_locally_and_ids_scoped_per_client(cluster):
    with Client(cluster.frontend) as a, Client(cluster.frontend) as b:
        ha = a.submit_request([1, 2, 3], 30, request_id="same", stop_token=None)
        with pytest.raises(ValueError, match="already in flight"):
            a.submit_request([4, 5], 3, request_id="same")
        hb = b.submit_request([1, 2, 3], 30, request_id="same", stop_token=None)
        a.run(timeout=20)
        b.run(timeout=20)
    assert ha.tokens == hb.tokens and len(ha.tokens) == 30
    assert ha.finish_reason is hb.finish_reason is FinishReason.LENGTH


# ---------------------------------------------------------------------- slow workers: cancel, deadline, kill


@pytest.fixture
def slow_cluster():
    with LocalCluster(cluster_config((4, 4), step_delay_ms=5.0, heartbeat_s=0.1, worker_liveness_s=0.6)) as c:
        yield c


def test_cancel_deadline_and_streaming_before_the_end(slow_cluster):
    with Client(slow_cluster.frontend) as c:
        first = threading.Event()
        long = c.submit_request([1, 2], 400, stop_token=None, on_token=lambda t: first.set())
        assert first.wait(10)
        assert not long.done()                    # tokens arrive while it still runs
        assert c.cancel(long.request_id)
        dl = c.submit_request([3, 4], 400, stop_token=None, timeout_s=0.3)
        c.run(timeout=20)
        assert not c.cancel(long.request_id)      # already ended
    assert long.finish_reason is FinishReason.CANCELLED and 1 <= len(long.tokens) < 400
    assert dl.finish_reason is FinishReason.DEADLINE and len(dl.tokens) < 400


def test_sigkilled_worker_loses_nothing_and_doubles_nothing(slow_cluster):
    reqs = [([i + 1, 7, 9], 60, {"stop_token": None}) for i in range(24)]
    expected = engine_results(reqs)
    streamed: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
    with Client(slow_cluster.frontend) as c:
        hs = [c.submit_request(p, m, on_token=streamed[i].append, **kw) for i, (p, m, kw) in enumerate(reqs)]
        victim = slow_cluster.worker_processes[0]
        name_suffix = f":{victim.pid}"

        def victim_holds_streaming_requests():
            w = [w for w in c.status().workers if w.name.endswith(name_suffix)]
            return w and w[0].inflight >= 4 and sum(len(s) for s in streamed.values()) >= 20

        wait_until(victim_holds_streaming_requests, 20, "the victim to hold requests mid-stream")
        os.kill(victim.pid, signal.SIGKILL)
        c.run(timeout=60)
        st = c.status()
    assert [(h.result(), h.finish_reason) for h in hs] == expected
    for i, h in enumerate(hs):
        assert streamed[i] == h.tokens        # each token delivered exactly once, in order
    assert st.counters["workers_lost"] >= 1 and st.counters["requeued"] >= 4


def test_broker_restart_resumes_every_request_without_gap_or_duplicate(slow_cluster):
    reqs = [([i + 1, 3, 5], 50, {"stop_token": None}) for i in range(16)]
    expected = engine_results(reqs)
    streamed: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
    with Client(slow_cluster.frontend, heartbeat_interval_s=0.1) as c:
        hs = [c.submit_request(p, m, on_token=streamed[i].append, **kw) for i, (p, m, kw) in enumerate(reqs)]
        wait_until(lambda: sum(len(s) for s in streamed.values()) >= 40, 20, "tokens to stream")
        old_id = c.broker_id
        os.kill(slow_cluster.broker_process.pid, signal.SIGKILL)
        slow_cluster.restart_broker()
        c.run(timeout=60)
        assert c.broker_id != old_id
        # Both workers register with the new broker (each as soon as it hears
        # it is unknown there, within a heartbeat plus a reconnect).
        wait_until(lambda: getattr(c.status().models.get("simulated"), "workers", 0) == 2, 10,  # (absent at first)
                   "both workers to re-register")
    assert [(h.result(), h.finish_reason) for h in hs] == expected
    for i, h in enumerate(hs):
        assert streamed[i] == h.tokens


def test_async_client_generate_stream_and_early_exit(cluster):
    import asyncio

    from client import AsyncClient

    reqs = random_requests(30, seed=5)
    expected = engine_results(reqs)

    async def main():
        async with await AsyncClient.connect(cluster.frontend) as c:
            handles = await asyncio.gather(*(c.generate(p, m, **kw) for p, m, kw in reqs))
            streamed = [t async for t in c.stream([1, 2, 3], 20, stop_token=None)]
            gen = c.stream([4, 5], 1_000_000, stop_token=None)
            first = [t async for t, _ in zip_n(gen, 3)]
            await gen.aclose()                 # leaving early cancels the request
            await c.run(timeout=20)
            return handles, streamed, first

    async def zip_n(agen, n):
        i = 0
        async for t in agen:
            yield t, i
            i += 1
            if i == n:
                return

    handles, streamed, first = asyncio.run(main())
    assert [(h.result(), h.finish_reason) for h in handles] == expected
    ref = BatchInferenceEngine(SimulatedLLM(), 2, stop_token=None)
    a, b = ref.submit_request([1, 2, 3], 20), ref.submit_request([4, 5], 1_000_000)
    for _ in range(20):
        ref.step()
    assert streamed == a.tokens and len(streamed) == 20
    assert first == b.tokens[:3]


def test_client_that_stops_reading_is_failed_with_slow_consumer_and_others_unaffected():
    # Big iterations (256 slots) fill the kernel's socket buffers quickly; the
    # job (8M tokens, about 40 MB of results) is far more than they hold.
    cfg = cluster_config((256,), max_queue=100_000)
    cfg = ClusterConfig(BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, send_hwm=5, max_pending_per_peer=20),
                        cfg.workers)
    with LocalCluster(cfg) as cl:
        ctx = zmq.Context.instance()
        raw = ctx.socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        raw.setsockopt(zmq.RCVHWM, 1)
        raw.setsockopt(zmq.RCVBUF, 2048)
        raw.connect(cl.frontend)
        try:
            raw.send(encode(Submit("simulated", [envelope(i, [i % 999 + 1], 2000, stop_token=None)
                                                 for i in range(4000)])))
            with Client(cl.frontend) as good:
                wait_until(lambda: good.status().counters["clients_lost"] >= 1, 90, "the slow client to be failed")
                hs = [good.submit_request([i + 1, 2], 5) for i in range(50)]
                good.run(timeout=30)
                st = good.status()
            assert all(h.finish_reason in (FinishReason.STOP, FinishReason.LENGTH) for h in hs)
            assert st.models["simulated"].queued == 0 and st.models["simulated"].running == 0
            # Reading now: after the buffered results, the client finds an error naming its requests.
            errors = []
            poller = zmq.Poller()
            poller.register(raw, zmq.POLLIN)
            deadline = Deadline(20)
            while not errors and not deadline.passed():
                if poller.poll(100):
                    m = decode(raw.recv())
                    if isinstance(m, Error):
                        errors.append(m)
        finally:
            raw.close(0)
    assert errors and errors[0].code is ErrorCode.SLOW_CONSUMER and len(errors[0].request_ids) > 0


def test_stop_token_rule_client_default_request_override_and_zero(cluster):
    prompt = [11, 12, 13]
    ref = BatchInferenceEngine(SimulatedLLM(), 1, stop_token=None)
    full = ref.submit_request(prompt, 200)
    ref.run()
    toks = full.tokens
    assert 0 in toks                                   # the model's default stop token occurs
    first_zero = toks.index(0)
    other = next(t for t in toks[:first_zero] if t != 0)
    with Client(cluster.frontend) as default_c, Client(cluster.frontend, stop_token=None) as none_c, \
            Client(cluster.frontend, stop_token=other) as other_c:
        a = default_c.submit_request(prompt, 200)                 # model default: 0
        b = none_c.submit_request(prompt, 200)                    # client says: no stop token
        c = other_c.submit_request(prompt, 200)                   # client default: `other`
        d = other_c.submit_request(prompt, 200, stop_token=0)     # request override; 0 is a token
        e = none_c.submit_request(prompt, 200, stop_token=[other, 0])
        for cl in (default_c, none_c, other_c):
            cl.run(timeout=20)
    assert a.tokens == toks[:first_zero + 1] and a.finish_reason is FinishReason.STOP
    assert b.tokens == toks and b.finish_reason is FinishReason.LENGTH
    assert c.tokens == toks[:toks.index(other) + 1] and c.finish_reason is FinishReason.STOP
    assert d.tokens == a.tokens
    assert e.tokens == toks[:min(toks.index(other), first_zero) + 1]


def test_a_child_freezes_its_objects_at_exit():
    """The launcher's children freeze every object at exit (the interpreter's collections as it
    clears the modules then cost a worker with torch loaded ~1 s CPU): a handler registered before
    the child's setup runs after its freeze and sees it."""
    import subprocess
    import sys

    code = ("import atexit, gc; atexit.register(lambda: print('frozen', gc.get_freeze_count() > 0)); "
            "from slotserve.launcher import _child_setup; _child_setup('slotserve test', 'WARNING', 1.0)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.split() == ["frozen", "True"], out.stdout + out.stderr
