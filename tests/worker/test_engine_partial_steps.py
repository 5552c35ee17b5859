"""Slot-aware models that give no token for some slots in an iteration.

Two kinds, both in :mod:`worker.models.base`'s contract:

- no tokens: the slot's prompt chunk did not finish its prompt (chunked
  prefill, as the engine planned it). The request gets nothing this
  iteration, is not checked for termination, streams nothing, and its
  ``max_tokens`` still counts generated tokens exactly.
- an error: that slot's computation failed. Only that request ends with
  ``finish_reason="error"``; the others go on.

Text (stop strings, streamed text) and time to first token follow real tokens only.
"""

from __future__ import annotations

import pytest

from worker import BatchInferenceEngine, FinishReason, SimulatedLLM
from worker.errors import ModelError
from worker.models.base import StepOutput


class ChunkingModel:
    """Prefills prompts in the chunks the engine plans (``prefill_budget = chunk`` tokens per
    iteration) and gives no token until a slot's prompt is done; tokens come from a
    SimulatedLLM, so results must equal the stateless path. ``fail_when(tokens)`` True: that
    slot gets an error instead of a token."""

    def __init__(self, chunk: int, stop_rate: float = 0.0, fail_when=None, inner=None) -> None:
        self.inner = inner or SimulatedLLM(vocab_size=500, stop_rate=stop_rate, seed=4)
        self.vocab_size = self.inner.vocab_size
        self.eos_token_ids = self.inner.eos_token_ids
        if hasattr(self.inner, "tokenizer"):
            self.tokenizer = self.inner.tokenizer
        self.prefill_budget = chunk
        self.fail_when = fail_when
        self.log: list[dict[int, int | None]] = []  # per iteration: slot -> token (None = no token)

    def bind_slots(self, num_slots: int) -> None:
        self.seen = [0] * num_slots  # tokens of the slot's sequence "in the cache"

    def step(self, plan):
        out = StepOutput([None] * len(plan.batch), errors={})
        for i, si in enumerate(plan.batch):
            if i in plan.chunks:
                assert plan.chunks[i] <= self.prefill_budget
                self.seen[si.slot] += plan.chunks[i]
            else:  # decodes: one token it has not seen
                assert len(si.tokens) - self.seen[si.slot] == 1
                self.seen[si.slot] += 1
            if self.seen[si.slot] < len(si.tokens):
                continue  # no token yet
            if self.fail_when is not None and self.fail_when(si.tokens):
                out.errors[i] = FloatingPointError("NaN in this row")
            else:
                out.tokens[i] = self.inner.next_tokens([si.tokens])[0]
        assert sum(plan.chunks.values()) <= self.prefill_budget
        self.log.append({si.slot: tok for si, tok in zip(plan.batch, out.tokens)})
        return out

    def release_slot(self, slot: int) -> None:
        self.seen[slot] = 0


def _prompts():
    return [[7] * 3, [8] * 40, [9] * 5, [10] * 90, [11] * 2, [12] * 33]


def test_none_means_no_token_and_results_match_the_stateless_path():
    prompts, max_tokens = _prompts(), [5, 3, 1, 7, 4, 2]
    plain = BatchInferenceEngine(SimulatedLLM(vocab_size=500, stop_rate=0.0, seed=4), batch_size=3)
    want = [plain.submit_request(p, n) for p, n in zip(prompts, max_tokens)]
    plain.run()
    model = ChunkingModel(chunk=8)
    engine = BatchInferenceEngine(model, batch_size=3)
    streamed = {i: [] for i in range(len(prompts))}
    got = [engine.submit_request(p, n, on_token=streamed[i].append)
           for i, (p, n) in enumerate(zip(prompts, max_tokens))]
    engine.run()
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.result(timeout=0) == w.result(timeout=0)
        assert g.finish_reason == FinishReason.LENGTH
        assert len(g.tokens) == max_tokens[i]  # max_tokens counts real tokens only
        assert streamed[i] == g.tokens  # nothing streamed for the None iterations
    assert any(None in it.values() for it in model.log)


def test_other_slots_keep_decoding_while_a_long_prompt_prefills():
    model = ChunkingModel(chunk=16)
    engine = BatchInferenceEngine(model, batch_size=2)
    short = engine.submit_request([5, 6], 30)
    engine.step()  # the short request is decoding now
    long = engine.submit_request([3] * 160, 4)  # 10 iterations of prefill
    while not long.tokens:
        before = len(short.tokens)
        engine.step()
        assert len(short.tokens) == before + 1  # never waits for the long prompt
    engine.run()
    assert long.finish_reason == FinishReason.LENGTH and len(long.tokens) == 4
    waits = [it for it in model.log if it.get(1, 0) is None]
    assert len(waits) == 9


def test_stop_token_and_stop_sequences_skip_the_slots_without_a_token():
    model = ChunkingModel(chunk=4, stop_rate=0.3)
    engine = BatchInferenceEngine(model, batch_size=4, stop_token="model")
    plain = BatchInferenceEngine(SimulatedLLM(vocab_size=500, stop_rate=0.3, seed=4), batch_size=4,
                                 stop_token="model")
    prompts = [[i] * (1 + 7 * i) for i in range(1, 9)]
    stop = [[0, 0]]
    got = [engine.submit_request(p, 12, stop_sequences=stop) for p in prompts]
    want = [plain.submit_request(p, 12, stop_sequences=stop) for p in prompts]
    engine.run()
    plain.run()
    assert [g.result(timeout=0) for g in got] == [w.result(timeout=0) for w in want]
    assert [g.finish_reason for g in got] == [w.finish_reason for w in want]


def test_an_exception_for_one_slot_ends_only_that_request():
    model = ChunkingModel(chunk=100, fail_when=lambda tokens: tokens[0] == 13 and len(tokens) > 4)
    engine = BatchInferenceEngine(model, batch_size=3)
    plain = BatchInferenceEngine(SimulatedLLM(vocab_size=500, stop_rate=0.0, seed=4), batch_size=3)
    prompts = [[12, 1], [13, 1], [14, 1]]
    got = [engine.submit_request(p, 8) for p in prompts]
    want = [plain.submit_request(p, 8) for p in prompts]
    engine.run()
    plain.run()
    bad = got[1]
    assert bad.finish_reason == FinishReason.ERROR
    assert isinstance(bad.error, ModelError) and isinstance(bad.error.__cause__, FloatingPointError)
    assert bad.result(timeout=0) == want[1].result(timeout=0)[:5]  # the tokens before the failure
    for i in (0, 2):
        assert got[i].finish_reason == FinishReason.LENGTH
        assert got[i].result(timeout=0) == want[i].result(timeout=0)
    # its slot was freed and is reused
    again = engine.submit_request([15, 1], 3)
    engine.run()
    assert again.finish_reason == FinishReason.LENGTH


def test_none_after_tokens_is_a_model_error_for_that_slot_alone():
    class Flaky(ChunkingModel):
        def step(self, plan):
            out = super().step(plan)
            for i, si in enumerate(plan.batch):
                if si.tokens[0] == 21 and len(si.tokens) == 4:
                    out.tokens[i] = None
            return out

    engine = BatchInferenceEngine(Flaky(chunk=100), batch_size=2)
    bad, good = engine.submit_request([21, 1], 6), engine.submit_request([22, 1], 6)
    engine.run()
    assert bad.finish_reason == FinishReason.ERROR and "no token" in str(bad.error)
    assert good.finish_reason == FinishReason.LENGTH and len(good.tokens) == 6


def test_text_stops_streamed_text_and_ttft_follow_real_tokens_only(tmp_path):
    pytest.importorskip("transformers")
    from tests.support.tiny_text import ScriptedTextModel, make_tiny_text_model

    prompt = list(range(5, 17))  # 12 tokens: 3 chunks of 4
    scripted = ScriptedTextModel(make_tiny_text_model(tmp_path), "Hello world, the quick brown fox 😀 jumps", 12)
    model = ChunkingModel(chunk=4, inner=scripted)
    engine = BatchInferenceEngine(model, batch_size=3, clock=lambda: len(model.log))  # time = iterations
    plain = BatchInferenceEngine(scripted, batch_size=3)
    options = [{"stop": ["quick bro"]}, {"stop": ["fox 😀 j"]}, {}, {"stop": ["never"]}]
    pieces = [[] for _ in options]
    got = [engine.submit_request(prompt, 40, on_text=pieces[i].append, **o) for i, o in enumerate(options)]
    want = [plain.submit_request(prompt, 40, **o) for o in options]
    engine.run()
    plain.run()
    for g, w, p in zip(got, want, pieces):
        assert (g.tokens, g.text, g.finish_reason, g.stop_reason) == (w.tokens, w.text, w.finish_reason,
                                                                      w.stop_reason)
        assert "".join(p) == g.text
    assert got[0].stop_reason == "quick bro" and got[1].text == "Hello world, the quick brown "
    # admitted at 0; one budget of 4 prompt tokens per iteration: 3 chunks each, one prompt after another
    assert [g.ttft_s for g in got[:3]] == [3, 6, 9]
    assert got[3].ttft_s == got[0].finished_s + 3 - got[3].submitted_s  # admitted when the first one ended
