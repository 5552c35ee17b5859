"""A text or chat prompt's length in tokens travels with the request's first
tokens (issue 22, item 6's continuous usage): the worker, which tokenises it,
puts a ``started`` entry in the iteration that carries them (once, text and
chat prompts only), the broker forwards it in the client's results, and the
client sets ``prompt_tokens`` on the handle before it delivers those tokens --
so a stream can report usage from its first chunk, not only at the end."""

from __future__ import annotations

from client import Client
from client.core import ClientCore
from protocol.codec import decode, encode
from protocol.framing import fit, request_ids, split
from protocol.messages import Iteration, Register, Results, Started, Submit
from protocol.request import RequestParams
from tests.support.cluster import ThreadCluster, iterations
from tests.support.cores import C1, INFO, W1, assigned, make_core, sent
from tests.support.messages import envelope
from worker import SimulatedLLM
from worker.config import WorkerConfig
from worker.process import WorkerProcess

CHAT = [{"role": "user", "content": "hello there"}]


class Bytes:
    """A toy TextCodec: one token per byte (+1: 0 stays the stop token)."""

    def encode(self, text):
        return [b + 1 for b in text.encode()]

    def apply_chat_template(self, messages):
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages))

    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(32 + i % 95) for i in ids)

    def decoder(self, prompt_ids):
        codec = self

        class Step:
            def step(self, token_id):
                return codec.decode([token_id])

        return Step()


class TextSim(SimulatedLLM):
    def __init__(self):
        super().__init__(vocab_size=256)
        self.tokenizer = Bytes()


def test_the_worker_sends_a_text_prompts_length_with_its_first_tokens_once():
    wp = WorkerProcess(WorkerConfig(num_slots=2), model=TextSim())
    assert wp.assign([envelope(1, "hi you", 4, stop_token=None), envelope(2, CHAT, 3, stop_token=None),
                      envelope(3, [5, 6, 7], 3, stop_token=None)]) == []
    its = iterations(wp)
    started = [(s, it) for it in its for s in it.started]
    lengths = {s.request_id: s.prompt_tokens for s, _ in started}
    finished = {f.request_id: f for it in its for f in it.finished}
    # before: nothing until the end, where Finished.prompt_tokens said it
    assert lengths == {1: 6, 2: len(Bytes().apply_chat_template(CHAT))}  # none for the token-id prompt
    assert len(started) == 2 and all(lengths[k] == finished[k].prompt_tokens for k in lengths)
    for s, it in started:  # in the message with the request's first tokens
        first = next(i for i in its if s.request_id in i.ids)
        assert it is first


def test_an_iteration_split_to_fit_keeps_the_length_before_the_tokens():
    it = Iteration((1, 2, 1), (10, 20, 11), started=(Started(1, 40), Started(2, 7)))
    a, b = split(it)
    assert (a.started, b.started) == ((Started(1, 40),), (Started(2, 7),)) and set(request_ids(it)) == {1, 2}
    one = Iteration((1, 1, 1, 1), (10, 11, 12, 13), started=(Started(1, 40),))
    first, rest = split(one)
    assert first.started == (Started(1, 40),) and first.ids and rest.started == ()
    assert decode(encode(it)) == it
    framed = fit(one, len(encode(one)) - 1)
    assert not framed.refused and [p.started for _, p in framed.frames][0] == (Started(1, 40),)


def test_the_broker_forwards_the_length_to_the_client_under_its_request_id():
    core = make_core()
    core.on_backend(W1, Register("m", 2, 2, INFO._replace(has_tokenizer=True)), 0.0)
    sends = core.on_frontend(C1, Submit("m", (envelope("chat-a", CHAT, 4),)), 0.0)
    (key,) = [e.request_id for e in assigned(sends)]
    out = core.on_backend(W1, Iteration((key,), (9,), started=(Started(key, 21),)), 0.1)
    (res,) = sent(out, identity=C1, kind=Results)
    assert res.ids == ("chat-a",) and res.started == (Started("chat-a", 21),)


def test_the_client_knows_the_length_before_the_first_token_is_delivered():
    core = ClientCore()
    seen = []
    h, _ = core.submit(RequestParams(CHAT, 4), on_token=lambda t: seen.append((t, h.prompt_tokens)),
                       request_id="r", now=0.0)
    assert h.prompt_tokens is None
    rest, endings = core.apply_plain(Results(("r",), (7,), started=(Started("r", 12),)), 0.1)
    for hh, fn, value in core.stream(rest, 0.1):
        fn(value)
    assert seen == [(7, 12)] and h.usage.prompt_tokens == 12 and not endings


def test_through_a_cluster_a_chat_requests_first_token_comes_with_its_prompt_length():
    with ThreadCluster(heartbeat_interval_s=0.1) as cl, Client(cl.frontend, model="text") as c:
        cl.add_worker(TextSim(), model="text", num_slots=2)
        c.wait_for_model(10)
        at_first = []
        h = c.submit_request(CHAT, 5, stop_token=None,
                             on_token=lambda t: at_first.append(h.prompt_tokens) if not at_first else None)
        h.result(timeout=10)
        assert at_first == [len(Bytes().apply_chat_template(CHAT))] == [h.prompt_tokens]
