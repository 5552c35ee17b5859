"""A slot-aware model whose :class:`~worker.models.base.StepOutput` breaks the contract for one slot.

What the model said about one batch entry -- further tokens that are not
token ids, an error next to a token, logprobs entries that do not match its
tokens, prompt logprobs of the wrong length -- ends that request alone with
``finish_reason="error"`` (a ModelError saying what was wrong); the other
requests' results are those of a clean run, every request gets exactly one
callback and every slot is released. A reply that cannot be pinned on one
entry (a batch index out of range) fails the batch, as a model that raised.
"""

from __future__ import annotations

import pytest

from protocol.logprobs import TokenLogprob
from worker import BatchInferenceEngine, FinishReason
from worker.errors import ModelError
from worker.models.base import StepOutput


def entry(position: int, token: int) -> TokenLogprob:
    return TokenLogprob(-position / 100, ((token, -position / 100),))


class Bursting:
    """After ``seq`` its next tokens are ``(len(seq) + k) % 40 + 10``, two per step after the
    first (as speculative decoding returns), each scored by :func:`entry`. ``spoil(out, plan)``
    breaks the output of step 3 (a decode step of every slot)."""

    gives_logprobs = True
    vocab_size = 64

    def __init__(self, spoil=None) -> None:
        self.spoil, self.steps, self.released = spoil, 0, []

    def bind_slots(self, n):
        self.seen = set()

    def release_slot(self, slot):
        self.released.append(slot)
        self.seen.discard(slot)

    def step(self, plan):
        self.steps += 1
        out = StepOutput([None] * len(plan.batch), more={}, logprobs={}, prompt_logprobs={}, errors={})
        for i, si in enumerate(plan.batch):
            n, burst = len(si.tokens), 1 if si.slot not in self.seen else 2
            self.seen.add(si.slot)
            toks = [(n + k) % 40 + 10 for k in range(burst)]
            out.tokens[i] = toks[0]
            if burst > 1:
                out.more[i] = toks[1:]
            if si.logprobs is not None:
                out.logprobs[i] = [entry(n + k, t) for k, t in enumerate(toks)]
            if si.prompt_logprobs is not None:
                out.prompt_logprobs[i] = [None] + [entry(q, si.tokens[q]) for q in range(1, si.prompt_len)]
        if self.steps == 3 and self.spoil is not None:
            self.spoil(out, plan)
        return out


def _run(spoil, **options):
    model = Bursting(spoil)
    engine = BatchInferenceEngine(model, batch_size=4)
    calls = {i: 0 for i in range(3)}

    def callback(tokens, i):
        calls[i] += 1

    handles = [engine.submit_request([5 + i, 6, 7], 9, lambda t, i=i: callback(t, i), **options)
               for i in range(3)]
    engine.run()
    assert calls == {0: 1, 1: 1, 2: 1}  # one terminal callback each
    assert sorted(model.released) == [0, 1, 2]
    return handles


def _set(field, index, value):
    def spoil(out, plan):
        getattr(out, field)[index] = value
    return spoil


SPOILED_ENTRY = {  # what breaks batch entry 1's output, and the words of its error
    "a None among the further tokens": (_set("more", 1, [None, 12]), {}, "further tokens"),
    "a float among the further tokens": (_set("more", 1, [12.0]), {}, "further tokens"),
    "a further token past the vocabulary": (_set("more", 1, [64]), {}, "further tokens"),
    "a negative further token": (_set("more", 1, [-3]), {}, "further tokens"),
    "further tokens in a tuple": (_set("more", 1, (12,)), {}, "further tokens"),
    "an error next to a token": (_set("errors", 1, FloatingPointError("NaN")), {}, "NaN"),
    "an error that is no exception": (lambda out, plan: (out.tokens.__setitem__(1, None),
                                                         out.errors.__setitem__(1, "NaN in row 1")), {}, "NaN"),
    "logprobs entries in a tuple": (lambda out, plan: out.logprobs.__setitem__(1, tuple(out.logprobs[1])),
                                    {"logprobs": 1}, "logprobs"),
    "no logprobs entries": (lambda out, plan: out.logprobs.pop(1), {"logprobs": 1}, "logprobs"),
    "empty logprobs entries": (_set("logprobs", 1, []), {"logprobs": 1}, "logprobs"),
    "fewer logprobs entries than tokens": (lambda out, plan: out.logprobs[1].pop(), {"logprobs": 1}, "logprobs"),
    "more logprobs entries than tokens": (lambda out, plan: out.logprobs[1].append(entry(0, 1)),
                                          {"logprobs": 1}, "logprobs"),
}


@pytest.mark.parametrize("case", SPOILED_ENTRY)
def test_a_malformed_entry_ends_that_request_alone(case):
    spoil, options, words = SPOILED_ENTRY[case]
    clean = _run(None, **options)
    got = _run(spoil, **options)
    assert got[1].finish_reason == FinishReason.ERROR
    assert isinstance(got[1].error, ModelError) and words in str(got[1].error) + str(got[1].error.__cause__)
    assert got[1].tokens == clean[1].tokens[:len(got[1].tokens)]  # nothing of the bad step appended
    assert len(got[1].tokens) == 3  # its tokens of steps 1 and 2
    for i in (0, 2):
        assert got[i].finish_reason == FinishReason.LENGTH
        assert got[i].tokens == clean[i].tokens
        assert got[i].logprobs == clean[i].logprobs


def test_prompt_logprobs_of_the_wrong_length_end_that_request_alone():
    class Short(Bursting):
        def step(self, plan):
            out = super().step(plan)
            if self.steps == 1:
                out.prompt_logprobs[1].pop()
            return out

    model = Short()
    engine = BatchInferenceEngine(model, batch_size=4)
    handles = [engine.submit_request([5 + i, 6, 7], 4, prompt_logprobs=0) for i in range(3)]
    engine.run()
    assert handles[1].finish_reason == FinishReason.ERROR and "prompt_logprobs" in str(handles[1].error)
    assert handles[1].tokens == [] and handles[1].prompt_logprobs is None
    for i in (0, 2):
        assert handles[i].finish_reason == FinishReason.LENGTH and len(handles[i].prompt_logprobs) == 3


@pytest.mark.parametrize("field", ["more", "errors"])
@pytest.mark.parametrize("index", [-1, 3, "1"])
def test_a_batch_index_out_of_range_fails_the_batch(field, index):
    value = [12] if field == "more" else FloatingPointError("NaN")
    handles = _run(_set(field, index, value))
    for h in handles:
        assert h.finish_reason == FinishReason.ERROR
        assert isinstance(h.error, ModelError) and f"StepOutput.{field}" in str(h.error)
        assert len(h.tokens) == 3


class Chunked:
    """Prefills in the engine's chunks (``prefill_budget`` 2), one token per step after; ``spoil(out,
    plan)`` runs on every step's output."""

    prefill_budget = 2
    vocab_size = 64

    def __init__(self, spoil) -> None:
        self.spoil = spoil

    def bind_slots(self, n):
        self.seen = [0] * n

    def release_slot(self, slot):
        self.seen[slot] = 0

    def step(self, plan):
        out = StepOutput([None] * len(plan.batch), more={})
        for i, si in enumerate(plan.batch):
            self.seen[si.slot] += plan.chunks.get(i, 1)
            if self.seen[si.slot] >= len(si.tokens):
                out.tokens[i] = len(si.tokens) % 40 + 10
        self.spoil(out, plan)
        return out


def test_further_tokens_without_a_first_token_end_that_request_alone():
    def spoil(out, plan):
        for i, si in enumerate(plan.batch):
            if si.tokens[0] == 6 and out.tokens[i] is None:  # a prompt chunk that did not finish it
                out.more[i] = [12]

    engine = BatchInferenceEngine(Chunked(spoil), batch_size=3)
    handles = [engine.submit_request([5 + i] + [7] * 5, 4) for i in range(3)]
    engine.run()
    assert handles[1].finish_reason == FinishReason.ERROR and "no first token" in str(handles[1].error)
    assert handles[1].tokens == []
    for i in (0, 2):
        assert handles[i].finish_reason == FinishReason.LENGTH and handles[i].tokens == [16, 17, 18, 19]



class Nested:
    """A stateless model that returns its first ``bad`` steps' tokens as one-element lists
    (``tensor.tolist()`` of shape ``[n, 1]``), then plain ones."""

    vocab_size = 64

    def __init__(self, bad: int) -> None:
        self.bad = bad

    def next_tokens(self, seqs):
        self.bad -= 1
        return [[9] if self.bad >= 0 else 9 for _ in seqs]


class NestedSlots(Nested):
    """:class:`Nested` as a slot-aware model."""

    def bind_slots(self, n):
        pass

    def release_slot(self, slot):
        pass

    def step(self, plan):
        return StepOutput(self.next_tokens(plan.batch))


@pytest.mark.parametrize("model_type", [Nested, NestedSlots])
def test_tokens_that_break_the_checks_fail_the_batch_and_the_engine_goes_on(model_type):
    engine = BatchInferenceEngine(model_type(bad=1), batch_size=2, stop_token=[0, 1])  # two stops: a set
    calls = []
    failed = [engine.submit_request([5, 6], 3, calls.append) for _ in range(2)]
    engine.run()
    assert [h.finish_reason for h in failed] == [FinishReason.ERROR] * 2 and len(calls) == 2
    assert isinstance(failed[0].error, ModelError) and "unhashable" in str(failed[0].error)
    after = engine.submit_request([5, 6], 3)
    engine.run()
    assert after.finish_reason == FinishReason.LENGTH and after.tokens == [9, 9, 9]


def test_prompt_logprobs_a_request_did_not_ask_for_are_not_taken():
    class Eager(Bursting):  # scores every prompt at every step, asked or not
        def step(self, plan):
            out = super().step(plan)
            for i, si in enumerate(plan.batch):
                out.prompt_logprobs[i] = [None] + [entry(0, 1)] * (si.prompt_len - 1)
            return out

    engine = BatchInferenceEngine(Eager(), batch_size=2)
    only_logprobs = engine.submit_request([5, 6, 7], 4, logprobs=1)
    both = engine.submit_request([5, 6, 7], 4, logprobs=1, prompt_logprobs=1)
    engine.run()
    assert only_logprobs.finish_reason == both.finish_reason == FinishReason.LENGTH
    assert only_logprobs.prompt_logprobs is None
    assert both.prompt_logprobs == [None, entry(0, 1), entry(0, 1)]
