"""Slot-aware models that return several tokens for a slot in one step (speculative decoding).

The engine appends them one iteration at a time, with every check of a
single-token iteration: stop tokens, stop sequences, stop strings,
``min_tokens``, ``max_tokens``, streaming, cancellation. So a request's
result, ``finish_reason`` and streamed tokens are those of the same request
on a model that returns one token per step, and no token past its end is
ever appended or streamed.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker import BatchInferenceEngine, FinishReason, SimulatedLLM
from worker.models.base import StepOutput


class Speculating:
    """A slot-aware wrapper of a stateless model: each step returns, per slot, the next
    1..``most`` tokens the inner model would give one by one, as a runner whose drafts were
    accepted would. ``empty_when(tokens)``: no tokens instead (for a decoding slot: a failure)."""

    def __init__(self, inner, most: int = 4, seed: int = 0, empty_when=None) -> None:
        self.inner = inner
        for name in ("vocab_size", "eos_token_ids", "tokenizer", "max_seq_len"):
            if getattr(inner, name, None) is not None:
                setattr(self, name, getattr(inner, name))
        self.most = most
        self.rng = random.Random(seed)
        self.empty_when = empty_when
        self.returned = 0  # tokens handed to the engine

    def bind_slots(self, num_slots: int) -> None:
        pass

    def step(self, plan):
        out = StepOutput([None] * len(plan.batch), more={})
        for i, si in enumerate(plan.batch):
            if self.empty_when is not None and self.empty_when(si.tokens):
                continue
            seq = list(si.tokens)
            for _ in range(self.rng.randint(1, self.most)):
                seq.append(self.inner.next_tokens([seq])[0])
            new = seq[len(si.tokens):]
            self.returned += len(new)
            out.tokens[i] = new[0]
            if len(new) > 1:
                out.more[i] = new[1:]
        return out

    def release_slot(self, slot: int) -> None:
        pass


VOCAB = 8
request = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=5),
    "max_tokens": st.integers(1, 14),
    "min_tokens": st.integers(0, 4),
    "stop": st.one_of(st.just("default"), st.none(), st.sets(st.integers(0, VOCAB - 1), max_size=2)),
    "stop_sequences": st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=3), max_size=2),
    "cancel_after": st.one_of(st.none(), st.integers(1, 10)),
})


def _run(model, batch_size, requests):
    engine = BatchInferenceEngine(model, batch_size, stop_token=0)
    streamed, finals, handles = {}, {}, {}
    for i, r in enumerate(requests):
        kw = {} if r["stop"] == "default" else {"stop_token": sorted(r["stop"] or ())}
        streamed[i], finals[i] = [], []

        def on_token(t, i=i, r=r):
            streamed[i].append(t)
            if r["cancel_after"] == len(streamed[i]):
                engine.cancel(i)

        handles[i] = engine.submit_request(
            r["prompt"], max(r["max_tokens"], r["min_tokens"]), finals[i].append, request_id=i,
            stop_sequences=r["stop_sequences"], min_tokens=r["min_tokens"], on_token=on_token, **kw)
    engine.run()
    assert engine.num_running == engine.num_queued == 0
    return {i: (h.result(timeout=0), h.finish_reason, streamed[i], finals[i]) for i, h in handles.items()}


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request, min_size=1, max_size=12), st.integers(1, 4), st.integers(2, 5), st.integers(0, 99))
def test_several_tokens_per_step_give_the_one_token_results(requests, batch_size, most, seed):
    plain = _run(SimulatedLLM(vocab_size=VOCAB, stop_rate=0.15, seed=3), batch_size, requests)
    fast = _run(Speculating(SimulatedLLM(vocab_size=VOCAB, stop_rate=0.15, seed=3), most, seed),
                batch_size, requests)
    for i in plain:
        seq, reason, streamed, finals = fast[i]
        assert (seq, reason) == plain[i][:2], f"request {i}"
        assert streamed == seq[len(requests[i]["prompt"]):]  # every token streamed once, none past the end
        assert finals == [seq]  # exactly one terminal callback


def test_tokens_past_max_tokens_or_a_stop_are_dropped():
    inner = SimulatedLLM(vocab_size=500, stop_rate=0.0, seed=5)
    model = Speculating(inner, most=6, seed=1)
    engine = BatchInferenceEngine(model, batch_size=2)
    a = engine.submit_request([5, 6], 3)
    plain = SimulatedLLM(vocab_size=500, stop_rate=0.0, seed=5)
    first = plain.next_tokens([[5, 6, 7]])[0]
    b = engine.submit_request([5, 6, 7], 10, stop_token=first)  # stops on its first token
    engine.run()
    assert len(a.tokens) == 3 and a.finish_reason == FinishReason.LENGTH
    assert b.tokens == [first] and b.finish_reason == FinishReason.STOP
    assert model.returned > 4  # the model did hand over more than was kept


def test_step_returns_the_number_of_tokens_appended():
    model = Speculating(SimulatedLLM(vocab_size=500, stop_rate=0.0, seed=2), most=5, seed=3)
    engine = BatchInferenceEngine(model, batch_size=3)
    handles = [engine.submit_request([1, 2, i], 9) for i in range(3)]
    total = 0
    while engine.num_running or engine.num_queued:
        total += engine.step()
    assert total == sum(len(h.tokens) for h in handles) == 27


@pytest.mark.parametrize("after", [0, 3])
def test_no_tokens_for_a_decoding_slot_fails_that_request_only(after):
    """No tokens from the first step on (the prompt's chunk, then a decode that gives none), or
    after some tokens: that request ends with a ModelError, the other goes on."""
    inner = SimulatedLLM(vocab_size=500, stop_rate=0.0, seed=2)
    model = Speculating(inner, most=3, seed=4, empty_when=lambda tokens: tokens[0] == 99 and len(tokens) > 2 + after)
    engine = BatchInferenceEngine(model, batch_size=2)
    bad = engine.submit_request([99, 1], 5)
    good = engine.submit_request([1, 2], 5)
    engine.run()
    assert bad.finish_reason == FinishReason.ERROR and "no token" in str(bad.error)
    assert len(bad.tokens) >= after and bad.tokens == inner_tokens(inner, [99, 1], len(bad.tokens))
    assert good.finish_reason == FinishReason.LENGTH and len(good.tokens) == 5


def inner_tokens(inner, prompt: list[int], n: int) -> list[int]:
    """The first ``n`` tokens ``inner`` gives after ``prompt``, one by one."""
    seq = list(prompt)
    for _ in range(n):
        seq.append(inner.next_tokens([seq])[0])
    return seq[len(prompt):]


def test_text_stop_strings_and_streamed_text_match_one_token_steps(tmp_path):
    from tests.support.tiny_text import ScriptedTextModel, make_tiny_text_model

    model_dir = make_tiny_text_model(tmp_path / "m")
    text = "def add(a, b):\n    return a + b\n" * 3
    results = []
    for model in (ScriptedTextModel(model_dir, text, 4), Speculating(ScriptedTextModel(model_dir, text, 4), 5, 7)):
        engine = BatchInferenceEngine(model, batch_size=2)
        pieces = {0: [], 1: []}
        hs = [engine.submit_request([1, 2, 3, 4], 40, stop=["return a"], on_text=pieces[0].append),
              engine.submit_request([1, 2, 3, 5], 25, on_text=pieces[1].append)]
        engine.run()
        results.append([(h.text, h.finish_reason, "".join(pieces[i])) for i, h in enumerate(hs)])
    assert results[0] == results[1]
    assert results[0][0][1] == FinishReason.STOP and results[0][0][0] == "def add(a, b):\n    "
    assert results[0][1][0] == results[0][1][2]  # the streamed pieces add up to the text


@pytest.mark.parametrize("cancel_after", [1, 2, 4])
def test_cancel_from_on_token_stops_the_rest_of_a_step(cancel_after):
    model = Speculating(SimulatedLLM(vocab_size=500, stop_rate=0.0, seed=8), most=6, seed=0)
    engine = BatchInferenceEngine(model, batch_size=1)
    seen = []

    def on_token(t):
        seen.append(t)
        if len(seen) == cancel_after:
            engine.cancel(h.request_id)

    h = engine.submit_request([3, 4], 20, on_token=on_token)
    engine.run()
    assert h.finish_reason == FinishReason.CANCELLED
    assert h.tokens == seen and len(seen) == cancel_after
