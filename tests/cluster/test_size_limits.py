"""Blast radius, kind "a message over a peer's size limit" (issue 10, item 3):
an oversized request never waits forever and never takes a neighbour with
it. A refusal names the requests it refuses, so each ends ``error`` /
``too_large`` alone, and no batch frame's fate is shared: every sender
splits its batches to fit its receiver's limit (announced in ``welcome``
and ``register``) and a request too large even alone is refused -- at submit
with a ValueError when the client can tell (every entry point: Client,
AsyncClient, JSONL rows; text, token and chat prompts, stop sequences), else
with a ``too_large`` ending of its own. Members by direction: client ->
broker (submit), broker -> client (results, error), broker -> worker
(assign), worker -> broker (iteration)."""

from __future__ import annotations

import asyncio
import io
import json

import pytest
import zmq

from client import AsyncClient, Client, RemoteError
from protocol.codec import decode, encode
from protocol.enums import ErrorCode, FinishReason
from protocol.framing import fit, request_ids
from protocol.messages import Error, Finished, Iteration, ModelInfo, Register, Results, Submit, Text, Welcome
from slotserve.job import run_job
from tests.support.cluster import ThreadCluster
from tests.support.messages import envelope
from tests.support.waits import wait_until
from worker import SimulatedLLM

LIMIT = 4096  # bytes: the broker's max_message_bytes in these tests
OK = (FinishReason.STOP, FinishReason.LENGTH)


class WideCodec:
    """A toy tokenizer: one token per character (its code point mod 1000);
    token ``t`` decodes to ``width(t)`` copies of one letter, the width chosen
    by the character ``t`` stands for (so a test picks how much text each
    request streams; text is the decode of the generated tokens)."""

    WIDTH = {"m": 1200, "w": 3900, "h": 9000}

    @classmethod
    def piece(cls, token_id: int) -> str:
        return chr(0x41 + token_id % 26) * cls.WIDTH.get(chr(token_id), 1)

    def encode(self, text):
        return [ord(c) % 1000 for c in text]

    def apply_chat_template(self, messages):
        return self.encode("".join(m["content"] for m in messages))

    def decode(self, ids, skip_special_tokens=True):
        return "".join(map(self.piece, ids))

    def decoder(self, prompt_ids):
        class Step:
            def step(self, token_id):
                return WideCodec.piece(token_id)

        return Step()


class WideText(SimulatedLLM):
    """Generates the prompt's first token over and over: a prompt starting
    "m" streams 1,200 characters a token, "h" 9,000, most others one."""

    def __init__(self):
        super().__init__(vocab_size=1000)
        self.tokenizer = WideCodec()

    def next_token(self, sequence):
        return sequence[0]


def expected_text(prompt: str, tokens) -> str:
    assert set(tokens) == {ord(prompt[0])}
    return WideCodec().decode(tokens)


@pytest.fixture(scope="module")
def cluster():
    with ThreadCluster(max_message_bytes=LIMIT) as c:
        c.add_worker(WideText(), num_slots=4, max_message_bytes=LIMIT)
        yield c


@pytest.fixture
def client(cluster):
    with Client(cluster.frontend) as c:
        c.wait_for_model(10)
        yield c


# ---------------------------------------------------------------------- client -> broker


def test_the_issues_oversized_text_is_refused_at_submit_and_the_next_request_runs():
    """The issue's input, against a broker with the default limit (64 MiB)
    and a model with a tokenizer (text prompts are accepted): a ValueError
    at submit, nothing queued; the small request after it runs."""
    with ThreadCluster() as cl:
        cl.add_worker(WideText())
        with Client(cl.frontend) as c:
            c.wait_for_model(10)
            with pytest.raises(ValueError, match="max-message-bytes"):
                c.submit_request("lorem " * 12 * 2**20, 8)
            assert c.num_in_flight == 0
            h = c.submit_request([1, 2, 3], 4)
            c.run(timeout=20)
            assert h.finish_reason in OK and c.status().counters["bad_messages"] == 0


@pytest.mark.parametrize("prompt, options", [
    ("a" * LIMIT, {}),                                          # text
    (list(range(1, 1000)) * 5, {}),                             # token ids
    ([{"role": "user", "content": "a" * LIMIT}], {}),            # chat messages
    ([1, 2], {"stop_sequences": [list(range(1, 999)), list(range(2, 1000))]}),  # stop sequences
])
def test_a_request_too_large_alone_is_refused_at_submit(client, prompt, options):
    with pytest.raises(ValueError, match="more than the broker accepts"):
        client.submit_request(prompt, 4, stop_token=None, **options)
    assert client.num_in_flight == 0


def test_async_client_and_jsonl_rows_refuse_it_too(cluster):
    async def main():
        async with await AsyncClient.connect(cluster.frontend) as ac:
            with pytest.raises(ValueError, match="more than the broker accepts"):
                await ac.generate("a" * LIMIT, 4)
            h = await ac.generate("abc", 3, stop_token=None)
            return h.finish_reason

    assert asyncio.run(main()) in OK
    rows = "\n".join(json.dumps(r) for r in [{"id": "big", "prompt": "a" * LIMIT, "max_tokens": 2},
                                             {"id": "small", "prompt": "abc", "max_tokens": 2}])
    out = io.StringIO()
    with Client(cluster.frontend) as c:
        summary = run_job(c, io.StringIO(rows), out, progress=False, timeout_s=30)
    got = {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    assert got["big"]["finish_reason"] == "error" and got["big"]["error"]["code"] == "bad_request"
    assert "more than the broker accepts" in got["big"]["error"]["message"]
    assert got["small"]["finish_reason"] in ("stop", "length") and summary.errors == 1


def test_a_burst_is_split_to_fit_so_near_limit_requests_and_small_ones_all_run(client, cluster):
    """Requests of about half the limit each, and small ones, submitted in one
    burst: together far over the limit, yet no frame is refused."""
    before = client.status().counters["bad_messages"]
    hs = [client.submit_request("a" * (LIMIT // 2) if i % 3 == 0 else "abc", 2, stop_token=None)
          for i in range(12)]
    client.run(timeout=30)
    assert all(h.finish_reason is FinishReason.LENGTH for h in hs), [h.error for h in hs]
    assert client.status().counters["bad_messages"] == before


def test_the_broker_names_every_request_of_a_frame_it_refuses(cluster):
    """A peer that ignores the limit (a raw socket): the too_large error names
    each request in the frame, so a client could end them; nothing else is lost."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(cluster.frontend)
    try:
        sock.send(encode(Submit("simulated", [envelope("big", [5] * LIMIT, 2), envelope("small", [1], 2)])))
        assert sock.poll(10_000)
        err = decode(sock.recv())
        assert isinstance(err, Error) and err.code is ErrorCode.TOO_LARGE
        assert set(err.request_ids) == {"big", "small"}
    finally:
        sock.close(0)


# ---------------------------------------------------------------------- worker -> broker, broker -> client


def test_iterations_and_results_over_the_limit_are_split_per_request(client):
    """Four requests streaming 1,200 characters a token each: every iteration
    (and every results message) is larger than the limit, so each is split
    per request; all four get every token and all their text."""
    prompts = ["m" + "x" * i for i in range(4)]
    hs = [client.submit_request(p, 3, stop_token=None) for p in prompts]
    client.run(timeout=30)
    for p, h in zip(prompts, hs):
        assert h.finish_reason is FinishReason.LENGTH and len(h.tokens) == 3
        assert h.text == expected_text(p, h.tokens)


def test_one_requests_output_over_the_limit_is_split_into_consecutive_parts(client):
    """Worker -> broker: one request's one-token text of 9,000 characters is
    over the limit alone, so it travels in consecutive parts; broker ->
    client: one whose text fits the worker's message (3,900 characters, an
    int key) but not the client's results (a 256-character id, twice) is
    split there. Every request gets all its tokens and all its text, its
    neighbours in the same iterations too."""
    specs = {"huge": ("h", "huge"), "longid": ("w", "L" * 256), "wide": ("w", "w"), "small": ("abc", "s")}
    hs = {name: client.submit_request(p, 3, stop_token=None, request_id=rid) for name, (p, rid) in specs.items()}
    client.run(timeout=30)
    for name, h in hs.items():
        assert h.finish_reason is FinishReason.LENGTH and len(h.tokens) == 3, (name, h.error)
        assert h.text == expected_text(specs[name][0], h.tokens), name
    st = client.status()
    assert st.models["simulated"].running == 0 and st.counters["workers_lost"] == 0


def test_an_ending_too_large_alone_ends_that_request_too_large(client, monkeypatch):
    """What cannot be split -- one ending whose message alone is over the
    limit -- ends its request ``too_large`` (said in a short ending of its
    own), and only it."""
    import worker.process as wp_module

    real = wp_module._finished

    def finished(key, handle):
        f = real(key, handle)
        return f._replace(message="!" * LIMIT) if handle.prompt[0] == ord("q") else f

    monkeypatch.setattr(wp_module, "_finished", finished)
    bad = client.submit_request("q", 2, stop_token=None)
    good = [client.submit_request("abc", 4, stop_token=None) for _ in range(3)]
    client.run(timeout=30)
    assert bad.finish_reason is FinishReason.ERROR and bad.error.code is ErrorCode.TOO_LARGE
    assert "exceeds the receiver's limit" in bad.error.message
    assert all(h.finish_reason is FinishReason.LENGTH for h in good)


# ---------------------------------------------------------------------- broker -> worker


def test_an_assignment_over_the_workers_limit_ends_that_request_alone():
    """A worker that accepts smaller frames than the broker: the broker, told
    the worker's limit at registration, splits assignments to fit and ends a
    request too large for the worker alone with ``too_large``."""
    with ThreadCluster(max_message_bytes=LIMIT) as cl:
        cl.add_worker(num_slots=4, max_message_bytes=1024)
        with Client(cl.frontend) as c:
            c.wait_for_model(10)
            hs = [c.submit_request([999] * 400 if i == 0 else [i, 1] * 60, 2, stop_token=None) for i in range(8)]
            c.run(timeout=30)
            assert hs[0].finish_reason is FinishReason.ERROR and hs[0].error.code is ErrorCode.TOO_LARGE
            assert all(h.finish_reason is FinishReason.LENGTH for h in hs[1:]), [h.error for h in hs]
            assert c.status().counters["workers_lost"] == 0


# ---------------------------------------------------------------------- control messages over a peer's limit


def register_models(backend: str, n: int = 40) -> None:
    """Register ``n`` models with long names from a raw socket (the broker
    lists every model ever registered in its welcome: several KiB here)."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(backend)
    try:
        for i in range(n):
            sock.send(encode(Register(f"model-{i:03d}-" + "x" * 60, 1, 1, ModelInfo(), "fake")))
            assert sock.poll(10_000) and isinstance(decode(sock.recv()), Welcome)
    finally:
        sock.close(0)


def test_a_worker_whose_limit_is_too_small_for_the_welcome_is_a_misconfigured_peer():
    """A worker announcing 1 KiB to a broker serving many models cannot be
    sent its welcome: counted as a misconfigured peer (``control_too_large``),
    not a broker bug (``internal_errors``); it gets no requests; the broker
    goes on serving the well-configured worker and the clients."""
    with ThreadCluster() as cl:
        register_models(cl.backend)
        cl.add_worker(num_slots=2, name="good")
        with Client(cl.frontend, model="simulated") as c:
            c.wait_for_model(10)
            cl.add_worker(num_slots=2, name="tiny", max_message_bytes=1024)
            wait_until(lambda: c.status().counters["control_too_large"] >= 1, 10, "the tiny worker's refusal")
            hs = [c.submit_request([i + 1, 2], 3, stop_token=None) for i in range(6)]
            c.run(timeout=30)
            assert all(h.finish_reason is FinishReason.LENGTH for h in hs), [h.error for h in hs]
            st = c.status()
            assert [w.name for w in st.workers if w.model == "simulated"] == ["good"]
            assert st.counters["internal_errors"] == 0


def test_a_client_the_broker_cannot_welcome_is_told_at_once_what_to_raise():
    """Clients announce no limit: the broker keeps to its own. One set too
    small for its welcome answers a client's hello with a short ``too_large``
    error naming the knob, which the client raises at once (not a
    ``BrokerUnavailable`` after the connect timeout); counted as
    ``control_too_large``, not ``internal_errors``."""
    with ThreadCluster(max_message_bytes=1024) as cl:
        register_models(cl.backend)
        with pytest.raises(RemoteError, match="--max-message-bytes on the broker") as refused:
            Client(cl.frontend, connect_timeout_s=20)
        assert refused.value.code is ErrorCode.TOO_LARGE
        assert cl.core.counters["control_too_large"] >= 1 and cl.core.counters["internal_errors"] == 0


# ---------------------------------------------------------------------- the splitter itself


def test_fit_keeps_each_requests_entries_together_and_in_order():
    it = Iteration(ids=[1, 2, 1, 3, 2], tokens=[10, 20, 11, 30, 21],
                   texts=[Text(1, "x" * 300), Text(2, "y" * 300), Text(3, "z" * 300)],
                   finished=[Finished(1, FinishReason.STOP), Finished(2, FinishReason.LENGTH)])
    framed = fit(it, 400)
    assert not framed.refused and len(framed.frames) == 3
    parts = [decode(data) for data, _ in framed.frames]
    for part in parts:
        (rid,) = request_ids(part)  # one request a part
        assert list(part.tokens) == [t for r, t in zip(it.ids, it.tokens) if r == rid]
        assert part.texts == tuple(x for x in it.texts if x.request_id == rid)
        assert part.finished == tuple(f for f in it.finished if f.request_id == rid)
    # One request's output: consecutive parts, its ending in the last; a long text piece split too.
    one = Results(ids=["a", "a"], tokens=[1, 2], texts=[Text("a", "q" * 500)],
                  finished=[Finished("a", FinishReason.LENGTH)])
    framed = fit(one, 200)
    parts = [decode(data) for data, _ in framed.frames]
    assert not framed.refused and len(parts) > 2
    assert [t for p in parts for t in p.tokens] == [1, 2] and "".join(x.text for p in parts for x in p.texts) == "q" * 500
    assert [p.finished for p in parts][-1] == one.finished and not any(p.finished for p in parts[:-1])
    # What cannot be split: one ending.
    refused = fit(Results(finished=[Finished("a", FinishReason.ERROR, ErrorCode.INTERNAL, "m" * 500)]), 400).refused
    assert [(request_ids(r.message), r.code) for r in refused] == [(["a"], ErrorCode.TOO_LARGE)]
