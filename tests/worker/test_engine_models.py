"""The model interface: slot-aware models (KV-cache hooks) and SimulatedLLM."""

from __future__ import annotations

import pytest

from protocol.request import GREEDY, SamplingParams
from tests.support.reference import spec_reference
from worker import BatchInferenceEngine, SimulatedLLM
from worker.models import load_model
from worker.models.base import BatchPlan, SlotInput, SlotModel, StepOutput


class CheckingSlotModel:
    """A SlotModel that asserts the engine keeps the call order of worker/models/base.py.

    Per slot it keeps the tokens it has "cached". A slot's first step after
    binding or release must be a prefill; every later step must carry exactly
    one new token, the one it returned last time. Next tokens come from a
    SimulatedLLM, so results can be compared with the stateless path.
    """

    def __init__(self, inner: SimulatedLLM) -> None:
        self.inner = inner
        self.vocab_size = inner.vocab_size
        self.cache: list[list[int] | None] = []
        self.bound = 0
        self.prefills = 0
        self.decodes = 0
        self.releases: list[int] = []
        self.samplings: list[SamplingParams] = []

    def bind_slots(self, num_slots: int) -> None:
        assert self.bound == 0, "bind_slots called twice"
        self.bound = num_slots
        self.cache = [None] * num_slots
        self.last = [None] * num_slots

    def step(self, plan) -> StepOutput:
        assert isinstance(plan, BatchPlan) and plan.batch and self.bound
        batch = plan.batch
        slots = [si.slot for si in batch]
        assert len(set(slots)) == len(slots), "a slot appears twice in one batch"
        out = []
        for si in batch:
            assert isinstance(si, SlotInput) and 0 <= si.slot < self.bound
            cached = self.cache[si.slot]
            if cached is None:
                self.prefills += 1
            else:
                assert len(si.tokens) == len(cached) + 1, "not exactly one new token"
                assert si.tokens[:-1] == cached, "slot reused without release_slot"
                assert si.tokens[-1] == self.last[si.slot], "new token is not the one returned"
                self.decodes += 1
            token = self.inner.next_token(si.tokens)
            self.cache[si.slot] = list(si.tokens)  # what this slot's "KV cache" now holds
            self.last[si.slot] = token
            self.samplings.append(si.sampling)
            out.append(token)
        return StepOutput(out)

    def release_slot(self, slot: int) -> None:
        assert self.cache[slot] is not None, "released a slot that holds nothing"
        self.cache[slot] = None
        self.releases.append(slot)


def test_checking_model_is_a_slot_model():
    assert isinstance(CheckingSlotModel(SimulatedLLM()), SlotModel)
    assert not isinstance(SimulatedLLM(), SlotModel)


def test_slot_aware_model_gets_bind_step_release_in_order_and_same_results():
    model = CheckingSlotModel(SimulatedLLM(vocab_size=100, stop_rate=0.1))
    engine = BatchInferenceEngine(model, batch_size=3, stop_token=0)
    assert model.bound == 3
    prompts = [[i, i + 1, i + 2] for i in range(1, 12)]
    handles = [engine.submit_request(p, 6) for p in prompts]
    cancelled = engine.submit_request([9, 9], 50, request_id="c",
                                      on_token=lambda t: engine.cancel("c"))
    engine.run()
    for p, h in zip(prompts, handles):
        assert h.result() == spec_reference(model.inner, p, 6, frozenset([0]))[0]
    assert cancelled.finish_reason == "cancelled" and len(cancelled.tokens) == 1
    assert model.prefills == len(prompts) + 1
    assert model.decodes == sum(len(h.tokens) for h in handles) - len(prompts)
    assert len(model.releases) == len(prompts) + 1  # every slot released before reuse
    assert all(c is None for c in model.cache)


def test_sampling_params_reach_slot_aware_models():
    model = CheckingSlotModel(SimulatedLLM(stop_rate=0.0))
    engine = BatchInferenceEngine(model, batch_size=2)
    engine.submit_request([1], 2, temperature=0.7, top_p=0.9, top_k=40, seed=3)
    engine.submit_request([2], 1)
    engine.run()
    assert SamplingParams(0.7, 0.9, 40, 3) in model.samplings
    assert GREEDY in model.samplings


def test_release_slot_after_model_failure():
    class Failing(CheckingSlotModel):
        def step(self, plan):
            super().step(plan)
            raise RuntimeError("device lost")

    model = Failing(SimulatedLLM())
    engine = BatchInferenceEngine(model, batch_size=2)
    hs = [engine.submit_request([i], 3) for i in (1, 2)]
    engine.run()
    assert all(h.finish_reason == "error" for h in hs)
    assert sorted(model.releases) == [0, 1]


def test_stateless_model_gets_the_engines_own_lists():
    seen = []

    class Recording:
        def next_tokens(self, seqs):
            seen.append([id(s) for s in seqs])
            return [1] * len(seqs)

    engine = BatchInferenceEngine(Recording(), batch_size=2)
    h = engine.submit_request([5], 3)
    engine.run()
    assert len(seen) == 3 and len({ids[0] for ids in seen}) == 1  # never rebuilt
    assert h.result() == [5, 1, 1, 1]


# ---- SimulatedLLM -------------------------------------------------------------


def test_simulated_llm_is_deterministic_and_content_dependent():
    a, b = SimulatedLLM(seed=1), SimulatedLLM(seed=1)
    seqs = [[1, 2, 3], [4, 5], [1, 2, 3]]
    assert a.next_tokens(seqs) == b.next_tokens(seqs)
    out = a.next_tokens(seqs)
    assert out[0] == out[2]
    tokens = {SimulatedLLM(seed=s).next_token([1, 2, 3]) for s in range(20)}
    assert len(tokens) > 10


def test_simulated_llm_vocab_and_stop_rate():
    model = SimulatedLLM(vocab_size=50, stop_rate=0.25)
    seqs = [[i, i * 7 % 13, i % 5] for i in range(20000)]
    out = model.next_tokens(seqs)
    assert all(0 <= t < 50 for t in out)
    assert 0.23 < out.count(0) / len(out) < 0.27
    assert SimulatedLLM(stop_rate=0.0).next_tokens(seqs).count(0) == 0
    assert set(SimulatedLLM(stop_rate=1.0).next_tokens(seqs[:100])) == {0}


def test_simulated_llm_cost_model_virtual_clock():
    model = SimulatedLLM(iteration_cost_s=0.01, sequence_cost_s=0.001, sleep=False)
    model.next_tokens([[1]] * 4)
    model.next_tokens([[1]] * 2)
    assert model.clock_s == pytest.approx(2 * 0.01 + 6 * 0.001)
    assert (model.calls, model.sequences) == (2, 6)


def test_simulated_llm_cost_model_really_sleeps():
    import time

    model = SimulatedLLM(iteration_cost_s=0.02)
    start = time.monotonic()
    model.next_tokens([[1]])
    assert time.monotonic() - start >= 0.02 and model.clock_s == 0.0


@pytest.mark.parametrize("kwargs", [
    {"vocab_size": 1}, {"stop_rate": 1.5}, {"max_seq_len": 1}, {"iteration_cost_s": -1},
])
def test_simulated_llm_bad_arguments(kwargs):
    with pytest.raises(ValueError):
        SimulatedLLM(**kwargs)


def test_load_model_simulated():
    model = load_model("simulated", vocab_size=64, seed=3)
    assert isinstance(model, SimulatedLLM) and model.vocab_size == 64 and model.seed == 3
