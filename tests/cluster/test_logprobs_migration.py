"""Token logprobs through a live cluster (issue 20 item 3): a request whose
worker stops mid-request (its model step hangs: the broker finds it hung and
moves the request, with the tokens so far, to a healthy worker) ends with
exactly one logprob entry per token, streamed in order without a gap or a
duplicate, and the same values as an uninterrupted run (greedy, fp32, the
tiny random Llama on slotserve's runner); the hung worker's late output,
entries included, reaches nobody. AsyncClient streams (token, TokenLogprob)
pairs; a model without logits refuses such a request with bad_request.
Broker and workers run on threads of this process."""

from __future__ import annotations

import asyncio
import threading

import pytest

pytest.importorskip("transformers")

from client import AsyncClient, Client, RemoteError  # noqa: E402
from protocol.enums import ErrorCode, FinishReason  # noqa: E402
from tests.support.cluster import ThreadCluster, iterations, registered  # noqa: E402
from tests.support.slot_models import tiny_llama  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402
from worker import SimulatedLLM  # noqa: E402

PROMPT = [1, 17, 33, 5, 92, 7, 250, 64]
ASK = dict(stop_token=None, logprobs=3, prompt_logprobs=2)


def runner():
    from worker.models import llama

    return llama.from_hf(tiny_llama(), max_cache_len=128)


class HangingRunner:
    """A runner whose ``hang_at``-th step blocks until :attr:`release` is set
    (the worker heartbeats on, but makes no progress: hung)."""

    def __init__(self, inner, hang_at: int) -> None:
        self.inner, self.hang_at, self.steps = inner, hang_at, 0
        for name in ("vocab_size", "max_seq_len", "eos_token_ids", "tokenizer", "gives_logprobs", "prefill_budget"):
            setattr(self, name, getattr(inner, name))
        self.hanging, self.release = threading.Event(), threading.Event()

    def bind_slots(self, n):
        self.inner.bind_slots(n)

    def release_slot(self, slot):
        self.inner.release_slot(slot)

    def step(self, plan):
        self.steps += 1
        if self.steps == self.hang_at:
            self.hanging.set()
            self.release.wait()
        return self.inner.step(plan)


def same_entry(a, b) -> bool:
    return (a.logprob == pytest.approx(b.logprob, abs=1e-4) and [i for i, _ in a.top] == [i for i, _ in b.top]
            and [x for _, x in a.top] == pytest.approx([x for _, x in b.top], abs=1e-4))


def test_a_request_moved_off_a_hung_worker_keeps_one_entry_per_token_with_the_values_of_an_uninterrupted_run():
    hanging = HangingRunner(runner(), hang_at=8)  # the prefill, then 6 decode steps: 7 tokens before it hangs
    with ThreadCluster(heartbeat_interval_s=0.1, worker_hung_s=1.0) as cl, \
            Client(cl.frontend, model="tiny", heartbeat_interval_s=0.1) as c:
        a = cl.add_worker(hanging, model="tiny", num_slots=2, warmup=False, prefetch=0, name="hangs",
                          heartbeat_interval_s=0.1)
        wait_until(lambda: registered(c, "hangs"), 30, "the first worker to register")
        streamed = []
        h = c.submit_request(PROMPT, 24, on_token=lambda t: streamed.append((t, h.logprobs[-1])), **ASK)
        assert hanging.hanging.wait(30)
        wait_until(lambda: len(h.tokens) == 7, 10, "the tokens before the hang")
        before = c.status().counters
        cl.add_worker(runner(), model="tiny", num_slots=2, warmup=False, name="healthy", heartbeat_interval_s=0.1)
        h.result(timeout=60)  # the broker finds the first worker hung and moves the request to the second
        after = c.status().counters
        a.close()  # its stuck step ends; that output belongs to a request it lost: dropped
        ref = c.submit_request(PROMPT, 24, **ASK)
        ref.result(timeout=60)
    assert after["requeued"] >= before["requeued"] + 1 and after["workers_hung"] >= before["workers_hung"] + 1
    assert h.finish_reason is ref.finish_reason is FinishReason.LENGTH and h.error is None
    assert h.tokens == ref.tokens and len(h.tokens) == 24
    assert len(h.logprobs) == len(h.tokens) == len(ref.logprobs)
    assert all(same_entry(x, y) for x, y in zip(h.logprobs, ref.logprobs))
    assert all(len(e.top) == 3 and e.top[0][1] >= e.logprob for e in h.logprobs)
    assert streamed == list(zip(h.tokens, h.logprobs))  # one call per token, its entry already there
    assert h.prompt_logprobs[0] is None and len(h.prompt_logprobs) == len(PROMPT) == len(ref.prompt_logprobs)
    assert all(same_entry(x, y) for x, y in zip(h.prompt_logprobs[1:], ref.prompt_logprobs[1:]))


def test_async_stream_of_token_logprob_pairs_and_a_model_without_logits_refuses():
    async def main(frontend):
        async with await AsyncClient.connect(frontend, model="tiny") as ac:
            pairs = [p async for p in ac.stream_logprobs(PROMPT, 6, logprobs=2, stop_token=None)]
            h = await ac.generate(PROMPT, 6, logprobs=2, stop_token=None)
        return pairs, h

    with ThreadCluster(heartbeat_interval_s=0.1) as cl, Client(cl.frontend, model="tiny") as c, \
            Client(cl.frontend, model="sim") as s:
        cl.add_worker(runner(), model="tiny", num_slots=2, warmup=False, name="tiny")
        cl.add_worker(SimulatedLLM(), model="sim", num_slots=2, name="sim")
        wait_until(lambda: registered(c, "tiny") and registered(c, "sim"), 30, "both workers to register")
        pairs, h = asyncio.run(main(cl.frontend))
        sim = s.submit_request([1, 2], 3, logprobs=1)
        sim.result(timeout=30)
    assert [t for t, _ in pairs] == h.tokens and len(pairs) == 6
    assert all(same_entry(x, y) and len(x.top) == 2 for (_, x), y in zip(pairs, h.logprobs))
    assert sim.finish_reason is FinishReason.ERROR and sim.error.code is ErrorCode.BAD_REQUEST
    assert "logprobs" in str(sim.error) and sim.tokens == []


def test_every_async_stream_raises_the_error_that_ended_its_request_and_asyncclient_wants_a_client():
    """A stream over a request that ends ``finish_reason="error"`` raises its RemoteError (it used to
    end like a finished one: an empty loop for a model without logits); one that ends otherwise does not."""
    async def main(frontend):
        got = {}
        async with await AsyncClient.connect(frontend, model="sim") as ac:
            for name, stream in (("logprobs", ac.stream_logprobs([1, 2], 3, logprobs=1)),
                                 ("tokens", ac.stream([1, 2], 3, logprobs=1)),
                                 ("text", ac.stream_text([1, 2], 3, prompt_logprobs=0))):
                try:
                    got[name] = [x async for x in stream]
                except RemoteError as e:
                    got[name] = e
            got["plain"] = [t async for t in ac.stream([1, 2], 3)]
        return got

    with ThreadCluster(heartbeat_interval_s=0.1) as cl, Client(cl.frontend, model="sim") as c:
        cl.add_worker(SimulatedLLM(), model="sim", num_slots=2, name="sim")
        wait_until(lambda: registered(c, "sim"), 30, "the worker to register")
        got = asyncio.run(main(cl.frontend))
    for name in ("logprobs", "tokens", "text"):
        assert isinstance(got[name], RemoteError) and got[name].code is ErrorCode.BAD_REQUEST, (name, got[name])
        assert "logprobs" in str(got[name])
    assert len(got["plain"]) == 3
    with pytest.raises(TypeError, match="AsyncClient.connect"):
        AsyncClient("tcp://127.0.0.1:5555")


def test_the_worker_sends_each_tokens_entry_with_it_and_the_prompts_once_with_the_first(tiny_text_dir):
    from tests.support.messages import envelope
    from worker.models import load_model
    from worker.config import WorkerConfig
    from worker.process import WorkerProcess

    model = load_model(tiny_text_dir)
    wp = WorkerProcess(WorkerConfig(num_slots=4, warmup=False), model=model)
    assert wp.assign([envelope(1, "hello there", 4, stop_token=None, logprobs=1, prompt_logprobs=0),
                      envelope(2, [5, 6, 7], 3, stop_token=None, logprobs=0),
                      envelope(3, [5, 6, 7], 3, stop_token=None),
                      envelope(4, [5, 6, 7], 4, stop_token=None, prompt_logprobs=2, resume_tokens=(8, 9))]) == []
    its = iterations(wp)
    for it in its:  # each message: entries exactly for the tokens of the requests that ask for them
        for key in (1, 2):
            mine = [r for r in it.logprobs if r.request_id == key]
            assert sum(len(r.entries) for r in mine) == it.ids.count(key)
        assert not any(r.request_id in (3, 4) and r.entries for r in it.logprobs)
    prompts = [(r, it) for it in its for r in it.logprobs if r.prompt is not None]
    (text, it), = prompts  # once, for the fresh request that asked; not for the resumed one
    ids = model.tokenizer.encode("hello there")
    assert text.request_id == 1 and text.prompt_ids == tuple(ids) and len(text.prompt) == len(ids)
    assert text.prompt[0] is None and all(len(e.top) == 0 for e in text.prompt[1:])
    assert it is next(i for i in its if 1 in i.ids)  # with the request's first tokens
    assert sum(i.ids.count(1) for i in its) == 4 and sum(i.ids.count(4) for i in its) == 2
