"""The engine's side of logprobs (issue 20 item 3): entries go to the handle in step with its
tokens, dropped with the tokens dropped after a request ends; the prompt's once, before the first
token; refused at submission for models without logits."""

from __future__ import annotations

import pytest

from protocol.logprobs import TokenLogprob
from protocol.request import RequestParams
from worker import BatchInferenceEngine, FinishReason, SimulatedLLM
from worker.models.base import StepOutput


def entry(position: int, token: int) -> TokenLogprob:
    """What the fake model scores the token at ``position``: a function of both, to be checked."""
    return TokenLogprob(-position / 100, ((token, -position / 100),))


class ScoringModel:
    """A slot-aware model with logprobs: after ``seq`` its next tokens are ``burst`` tokens
    ``(len(seq) + k) % 40 + 10`` (several when ``burst > 1``, as speculative decoding returns), each
    scored by :func:`entry`; it scores a prompt that asks as ``entry(q, prompt[q])``."""

    gives_logprobs = True
    vocab_size = 64

    def __init__(self, burst: int = 1) -> None:
        self.burst = burst
        self.asked_prompt: list[tuple[int, int | None]] = []  # (slot, prompt_logprobs) per prefill

    def bind_slots(self, n):
        self.seen = {}

    def release_slot(self, slot):
        self.seen.pop(slot, None)

    def step(self, plan):
        out = StepOutput([None] * len(plan.batch), more={}, logprobs={}, prompt_logprobs={})
        for i, si in enumerate(plan.batch):
            first = slot_first = si.slot not in self.seen
            self.seen[si.slot] = True
            if first:
                self.asked_prompt.append((si.slot, si.prompt_logprobs))
            n = len(si.tokens)
            burst = 1 if slot_first else self.burst
            toks = [(n + k) % 40 + 10 for k in range(burst)]
            out.tokens[i] = toks[0]
            if burst > 1:
                out.more[i] = toks[1:]
            if si.logprobs is not None:
                out.logprobs[i] = [entry(n + k, t) for k, t in enumerate(toks)]
            if si.prompt_logprobs is not None:
                prompt = si.tokens[:si.prompt_len]
                out.prompt_logprobs[i] = [None] + [entry(q, prompt[q]) for q in range(1, len(prompt))]
        return out


def expected(prompt_len: int, tokens: list[int], resumed: int = 0) -> list[TokenLogprob]:
    return [entry(prompt_len + resumed + k, t) for k, t in enumerate(tokens[resumed:])]


@pytest.mark.parametrize("burst", [1, 3])
def test_entries_follow_the_tokens_and_come_before_on_token(burst):
    engine = BatchInferenceEngine(ScoringModel(burst), batch_size=2)
    seen = []
    handles = []

    def on_token(token, i):
        h = handles[i]
        seen.append((len(h.logprobs), len(h.tokens), h.prompt_logprobs is not None))

    prompts = [[1, 2, 3], [4, 5], [6]]
    for i, p in enumerate(prompts):
        handles.append(engine.submit_request(p, 7, logprobs=1, prompt_logprobs=0,
                                             on_token=lambda t, i=i: on_token(t, i)))
    plain = engine.submit_request([7, 8], 7)
    engine.run()
    assert all(a == b and prompt for a, b, prompt in seen) and len(seen) == 21
    for p, h in zip(prompts, handles):
        assert len(h.tokens) == 7 and h.logprobs == expected(len(p), h.tokens)
        assert h.prompt_logprobs == [None] + [entry(q, p[q]) for q in range(1, len(p))]
    assert plain.logprobs is None and plain.prompt_logprobs is None


@pytest.mark.parametrize("burst", [1, 4])
def test_tokens_dropped_after_a_stop_or_max_tokens_drop_their_entries(burst):
    """A burst of speculative tokens past a stop token or past max_tokens: the tokens after the end
    are dropped, and so are their entries: exactly one entry per token."""
    engine = BatchInferenceEngine(ScoringModel(burst), batch_size=3)
    stop = 14  # (len(seq) + k) % 40 + 10 == 14 at sequence length 4: inside the second burst
    a = engine.submit_request([1, 2], 9, logprobs=0, stop_token=stop)
    b = engine.submit_request([1, 2], 6, logprobs=2)
    c = engine.submit_request([1, 2, 3, 4, 5, 6], 2, logprobs=3)
    engine.run()
    assert a.finish_reason == FinishReason.STOP and a.tokens[-1] == stop and len(a.tokens) == 3
    assert b.finish_reason == c.finish_reason == FinishReason.LENGTH and len(b.tokens) == 6
    for h, n in ((a, 2), (b, 2), (c, 6)):
        assert h.logprobs == expected(n, h.tokens)


def test_a_resumed_request_scores_its_new_tokens_only_and_never_its_prompt():
    model = ScoringModel()
    engine = BatchInferenceEngine(model, batch_size=2)
    fresh = engine.submit_request([1, 2, 3], 6, logprobs=1, prompt_logprobs=2)
    resumed = engine.submit_request([1, 2, 3], 6, logprobs=1, prompt_logprobs=2, resume_tokens=[13, 14])
    engine.run()
    assert resumed.tokens[:2] == [13, 14] and len(resumed.tokens) == 6
    assert resumed.logprobs == expected(3, resumed.tokens, resumed=2)
    assert resumed.prompt_logprobs is None and fresh.prompt_logprobs == [None, entry(1, 2), entry(2, 3)]
    assert sorted(model.asked_prompt, key=lambda x: x[0]) == [(0, 2), (1, None)]  # the resumed one: not asked


def test_slots_reused_after_a_scoring_request_ask_nothing():
    model = ScoringModel()
    engine = BatchInferenceEngine(model, batch_size=1)
    first = engine.submit_request([1, 2], 3, logprobs=2, prompt_logprobs=1)
    second = engine.submit_request([3, 4], 3)
    engine.run()
    assert len(first.logprobs) == 3 and second.logprobs is None and second.prompt_logprobs is None
    assert model.asked_prompt == [(0, 1), (0, None)]


class NoLogprobsSlotModel(ScoringModel):
    gives_logprobs = False


class Stateless:
    def next_tokens(self, sequences):
        return [len(s) % 7 for s in sequences]


@pytest.mark.parametrize("model", [SimulatedLLM(), Stateless(), NoLogprobsSlotModel()],
                         ids=["simulated", "stateless", "slot-model"])
@pytest.mark.parametrize("field", ["logprobs", "prompt_logprobs"])
def test_a_model_without_logits_refuses_logprobs_at_submit_naming_the_field(model, field):
    engine = BatchInferenceEngine(model, batch_size=1)
    with pytest.raises(ValueError, match=f"^{field}: this model gives no logprobs"):
        engine.submit_request([1, 2], 3, **{field: 0})
    with pytest.raises(ValueError, match=f"^{field}:"):
        engine.submit(RequestParams(prompt=(1, 2), max_tokens=3, **{field: 2}))
    assert engine.num_queued == 0
    h = engine.submit_request([1, 2], 3)
    engine.run()
    assert len(h.tokens) == 3 and h.logprobs is None
