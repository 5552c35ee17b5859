"""Text through a live cluster: stop strings and streamed text from the
``Client`` and from ``slotserve run`` rows, and text that survives a move
(issue 10 item 5): a worker that hangs right after streaming the first byte
of a four-byte character loses its requests to another worker, and a broker
restart makes the client resubmit -- either way ``text`` is the decode of
the final tokens and the pieces streamed add up to it.

The broker (and a simulated worker it needs to start) are child processes;
the text workers run :class:`tests.support.tiny_text.ScriptedTextModel` (a real
tokenizer, an output known exactly) as real workers on threads of this
process, so a test can make one hang at a chosen token.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading

import pytest

pytest.importorskip("transformers")

from broker import BrokerConfig  # noqa: E402
from client import Client  # noqa: E402
from protocol.enums import FinishReason  # noqa: E402
from slotserve.launcher import ClusterConfig, LocalCluster  # noqa: E402
from tests.support.cluster import ANY_PORT, ThreadWorker, on_worker, registered  # noqa: E402
from tests.support.tiny_text import ScriptedTextModel  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402
from worker.config import WorkerConfig  # noqa: E402

SCRIPT = "Say ab 😀 日本 cd, then the quick brown fox jumps over the lazy dog."
PROMPT = [5, 6, 7]


# Liveness and hung limits of 3 s, not 1 s: room for slow steps on a loaded machine (the hanging
# worker of the migration test is still found hung, 3 s after its hang).
LIMIT_S = 3.0


def make_cluster(worker_hung_s: float | None) -> LocalCluster:
    broker = BrokerConfig(frontend=ANY_PORT, backend=ANY_PORT, heartbeat_interval_s=0.1, worker_liveness_s=LIMIT_S,
                          worker_hung_s=worker_hung_s)
    simulated = WorkerConfig(num_slots=1, heartbeat_interval_s=0.1, broker_liveness_s=2 * LIMIT_S)
    return LocalCluster(ClusterConfig(broker, (simulated,), start_timeout_s=60.0))


@pytest.fixture(scope="module")
def cluster():
    with make_cluster(worker_hung_s=LIMIT_S) as c:
        yield c


def text_worker(backend: str, name: str, model: ScriptedTextModel, slots: int = 4) -> ThreadWorker:
    """A worker on a thread of this process serving ``model`` as ``name`` (no prefetch)."""
    return ThreadWorker(backend, model, model=name, num_slots=slots, heartbeat_interval_s=0.1,
                        broker_liveness_s=LIMIT_S, prefetch=0, name=f"{name}-{id(model):x}")


@pytest.fixture(scope="module")
def scripted(cluster, tiny_text_dir):
    with text_worker(cluster.backend, "scripted", ScriptedTextModel(tiny_text_dir, SCRIPT, len(PROMPT))) as w:
        yield w


def first_byte_of_the_emoji(model: ScriptedTextModel) -> int:
    """Index (in the script's tokens) of the first byte token of "😀"."""
    codec = model.tokenizer
    j = next(k for k in range(len(model.script)) if "\ufffd" in codec.decode(model.script[:k + 1]))
    assert codec.decode(model.script[:j]).endswith(" ")  # a byte token on its own: the split the issue shows
    return j


# ---------------------------------------------------------------------- Client


def test_client_text_stops_and_streamed_text(cluster, scripted):
    codec = scripted.model.tokenizer
    with Client(cluster.frontend, model="scripted") as c:
        wait_until(lambda: registered(c, scripted.name), what="the text worker to register")
        pieces = {stop: [] for stop in ("😀 日", "quick bro", "k")}
        hs = {stop: c.submit_request(PROMPT, 60, on_text=pieces[stop].append, stop=["never", stop])
              for stop in pieces}
        included = c.submit_request(PROMPT, 60, stop="quick bro", include_stop_str_in_output=True)
        plain = c.submit_request(PROMPT, 12)  # a token-id prompt: text too
        c.run(timeout=60)
    for stop, h in hs.items():
        assert h.finish_reason is FinishReason.STOP and h.stop_reason == stop
        assert h.text == SCRIPT[:SCRIPT.index(stop)] == "".join(pieces[stop])
        k = next(k for k in range(1, 60) if stop in codec.decode(scripted.model.script[:k]))
        assert h.tokens == scripted.model.script[:k]  # up to the token that completed the match
    assert included.text == SCRIPT[:SCRIPT.index("quick bro") + len("quick bro")]
    assert plain.text == codec.decode(plain.tokens) and len(plain.tokens) == 12


def test_async_client_streams_text_as_the_client_does(cluster, scripted):
    """``AsyncClient.stream_text`` yields what ``on_text`` receives: pieces
    that add up to the text up to the stop string (never a prefix of it that
    may still match), the same pieces as the synchronous client's; leaving
    the loop early ends the request (cancelled, unless it ended meanwhile)."""
    from client import AsyncClient

    with Client(cluster.frontend, model="scripted") as c:
        wait_until(lambda: registered(c, scripted.name), what="the text worker to register")
        sync_pieces: list[str] = []
        h = c.submit_request(PROMPT, 60, on_text=sync_pieces.append, stop=["quick bro"])
        c.run(timeout=60)

    async def main():
        async with await AsyncClient.connect(cluster.frontend, model="scripted") as ac:
            pieces = [p async for p in ac.stream_text(PROMPT, 60, stop=["quick bro"])]
            gen = ac.stream_text(PROMPT, 1000, stop_token=None, request_id="early")
            first = await gen.__anext__()
            await gen.aclose()  # leaving early cancels the request (unless it ended meanwhile)
            await ac.run(timeout=30)
            return pieces, first, ac.client.num_in_flight

    pieces, first, in_flight = asyncio.run(main())
    assert "".join(pieces) == SCRIPT[:SCRIPT.index("quick bro")] == h.text == "".join(sync_pieces)
    assert all(isinstance(p, str) and p for p in pieces) and isinstance(first, str) and in_flight == 0


def test_client_refuses_text_stops_for_a_model_without_tokenizer(cluster):
    with Client(cluster.frontend, model="simulated") as c:  # no tokenizer (the cluster serves two models)
        with pytest.raises(ValueError, match="tokenizer"):
            c.submit_request([1, 2], 4, stop=["x"])
        h = c.submit_request([1, 2], 4)
        c.run(timeout=30)
    assert h.text is None and h.finish_reason is not FinishReason.ERROR


# ---------------------------------------------------------------------- slotserve run rows


def test_jsonl_rows_give_text_stops_and_token_id_stops(cluster, scripted, tmp_path):
    script = scripted.model.script
    rows = [{"id": "text", "prompt": PROMPT, "max_tokens": 60, "stop": ["quick bro"]},
            {"id": "one", "prompt": PROMPT, "max_tokens": 60, "stop": "😀"},
            {"id": "ids", "prompt": PROMPT, "max_tokens": 60, "stop": [script[4:6]]},
            {"id": "mixed", "prompt": PROMPT, "max_tokens": 60, "stop": ["lazy", script[4:6]]},
            {"id": "bad", "prompt": PROMPT, "max_tokens": 60, "stop": [7]}]
    inp, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, "-m", "slotserve", "run", str(inp), "-o", str(out), "--broker",
                           cluster.frontend, "--model", "scripted", "--no-progress"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr  # the "bad" row ended with an error
    got = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert got["text"]["text"] == SCRIPT[:SCRIPT.index("quick bro")] and got["text"]["stop_reason"] == "quick bro"
    assert got["one"]["text"] == SCRIPT[:SCRIPT.index("😀")] and got["one"]["finish_reason"] == "stop"
    assert got["ids"]["tokens"] == script[:6] and got["ids"]["stop_reason"] == script[4:6]
    assert got["mixed"]["tokens"] == script[:6]  # the id sequence comes first
    assert got["bad"]["error"]["code"] == "bad_request" and "stop[0]" in got["bad"]["error"]["message"]


# ---------------------------------------------------------------------- issue 10 item 5: text after a move


def test_text_after_a_migration_is_the_decode_of_the_tokens(cluster, tiny_text_dir):
    hanging = ScriptedTextModel(tiny_text_dir, SCRIPT, len(PROMPT))
    j = first_byte_of_the_emoji(hanging)
    # the first step after both requests have the emoji's first byte blocks (one may have joined a
    # step later than the other: the other is then a byte further, still inside the emoji)
    hanging.hang_at_output, hanging.hang_rows = j + 1, 2
    # and neither starts before the broker has both on the worker: a request a whole script
    # ahead (its 30 tokens done before the other's first) would never share the blocking step
    hanging.gate = threading.Event()
    healthy = ScriptedTextModel(tiny_text_dir, SCRIPT, len(PROMPT))
    codec = hanging.tokenizer
    with Client(cluster.frontend, model="migrating") as c, text_worker(cluster.backend, "migrating", hanging) as a:
        wait_until(lambda: registered(c, a.name), what="the hanging worker to register")
        streamed = {n: ([], []) for n in ("plain", "stop")}
        h = {n: c.submit_request(PROMPT, 30, on_token=streamed[n][0].append, on_text=streamed[n][1].append,
                                 **({"stop": [" 😀 日"]} if n == "stop" else {})) for n in streamed}
        wait_until(lambda: on_worker(c, a.name) == 2, what="both requests on the hanging worker")
        hanging.gate.set()
        assert hanging.hanging.wait(30)
        wait_until(lambda: all(len(x.tokens) >= j + 1 for x in h.values()), what="the emoji's first byte")
        assert all(len(x.tokens) <= j + 3 for x in h.values())  # inside the emoji (byte tokens j..j+3)
        assert h["plain"].text == SCRIPT[:SCRIPT.index(" 😀")] + " "  # the byte shows nothing yet
        assert h["stop"].text == SCRIPT[:SCRIPT.index(" 😀")]  # and " " may start the stop string: held
        with text_worker(cluster.backend, "migrating", healthy):
            c.run(timeout=60)  # the broker finds the first worker hung (LIMIT_S) and moves both
    plain, stop = h["plain"], h["stop"]
    assert plain.tokens == hanging.script[:30] and plain.finish_reason is FinishReason.LENGTH
    assert plain.text == codec.decode(plain.tokens) == "".join(streamed["plain"][1])
    assert "\ufffd" not in plain.text and " ab 😀 日本 cd" in plain.text
    assert stop.finish_reason is FinishReason.STOP and stop.text == SCRIPT[:SCRIPT.index(" 😀")]
    assert "".join(streamed["stop"][1]) == stop.text
    for n, x in h.items():
        assert streamed[n][0] == x.tokens  # no gap, no duplicate
    assert healthy.calls > 0


def test_text_after_a_broker_restart_resubmission_is_the_decode_of_the_tokens(tiny_text_dir):
    model = ScriptedTextModel(tiny_text_dir, SCRIPT, len(PROMPT))
    j = first_byte_of_the_emoji(model)
    model.hang_after = j + 1
    codec = model.tokenizer
    with make_cluster(worker_hung_s=None) as cl, Client(cl.frontend, model="restart", heartbeat_interval_s=0.1) as c, \
            text_worker(cl.backend, "restart", model) as w:
        wait_until(lambda: registered(c, w.name), what="the text worker to register")
        tokens, pieces = [], []
        h = c.submit_request(PROMPT, 30, on_token=tokens.append, on_text=pieces.append)
        assert model.hanging.wait(30)
        wait_until(lambda: len(h.tokens) == j + 1, what="the emoji's first byte")
        os.kill(cl.broker_process.pid, signal.SIGKILL)
        cl.restart_broker()
        wait_until(lambda: c.resubmitted >= 1 and registered(c, w.name), 30, "the client to resubmit")
        model.release.set()  # the stuck step ends; its output belongs to the old broker and is dropped
        c.run(timeout=60)
    assert h.tokens == tokens == model.script[:30] and h.finish_reason is FinishReason.LENGTH
    assert h.text == codec.decode(h.tokens) == "".join(pieces) and " ab 😀 日本 cd" in h.text
