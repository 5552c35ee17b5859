"""Core semantics of the in-process engine: the spec's examples, termination, streaming."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from protocol.enums import FinishReason
from tests.support.engine import ScriptedModel
from tests.support.reference import spec_reference
from worker import BatchInferenceEngine, SimulatedLLM
from worker.request import StopMatcher

# ---- the spec's examples, verbatim API ---------------------------------------


def test_spec_example_single_request():
    results = []
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=4, stop_token=0)
    engine.submit_request([1, 2, 3], max_tokens=5, callback=lambda seq: results.append(seq))
    engine.run()

    assert len(results) == 1
    seq = results[0]
    assert seq[:3] == [1, 2, 3]
    expected, _ = spec_reference(SimulatedLLM(), [1, 2, 3], 5, frozenset([0]))
    assert seq == expected
    generated = seq[3:]
    assert 1 <= len(generated) <= 5
    assert 0 not in generated[:-1]  # only the last token may be the stop token
    assert engine.num_queued == 0 and engine.num_running == 0 and engine.num_free_slots == 4


def test_spec_example_more_requests_than_slots():
    results = {}
    model = SimulatedLLM(vocab_size=100)
    engine = BatchInferenceEngine(model, batch_size=2, stop_token=0)
    prompts = [[1, 2, 3], [4, 5], [6], [7, 8, 9, 10], [11, 12]]
    for i, p in enumerate(prompts):
        engine.submit_request(p, max_tokens=8, callback=lambda seq, i=i: results.setdefault(i, seq))
    engine.run()

    assert sorted(results) == list(range(len(prompts)))
    for i, p in enumerate(prompts):
        assert results[i] == spec_reference(model, p, 8, frozenset([0]))[0]
        assert all(0 <= t < 100 for t in results[i])


def test_spec_example_stop_token_is_included_and_ends_early():
    model = ScriptedModel({1: [5, 6, 0, 7, 8]})
    engine = BatchInferenceEngine(model, batch_size=4, stop_token=0)
    results = []
    handle = engine.submit_request([1], max_tokens=10, callback=results.append)
    engine.run()
    assert results == [[1, 5, 6, 0]]
    assert handle.finish_reason == FinishReason.STOP == "stop"
    assert handle.stop_reason is None  # the engine's own stop token (its EOS): vLLM's None
    assert handle.tokens == [5, 6, 0]
    assert handle.result(timeout=0) == [1, 5, 6, 0]


# ---- stop tokens, max_tokens, termination order -------------------------------


def test_max_tokens_counts_generated_tokens_only():
    engine = BatchInferenceEngine(SimulatedLLM(stop_rate=0.0), batch_size=2)
    h = engine.submit_request([1, 2, 3, 4], max_tokens=3)
    engine.run()
    assert len(h.tokens) == 3 and len(h.result()) == 7
    assert h.finish_reason == "length" and h.stop_reason is None


def test_stop_token_zero_is_a_real_token_and_none_means_no_stop():
    model = ScriptedModel({1: [0, 0, 0, 0]})
    engine = BatchInferenceEngine(model, batch_size=2, stop_token=0)
    a = engine.submit_request([1], max_tokens=4)
    b = engine.submit_request([1], max_tokens=4, stop_token=None)  # override: no stop token
    engine.run()
    assert a.tokens == [0] and a.finish_reason == "stop"
    assert b.tokens == [0, 0, 0, 0] and b.finish_reason == "length"


def test_stop_token_as_a_set_and_per_request_override():
    model = ScriptedModel({1: [5, 6, 7, 8], 2: [5, 6, 7, 8]})
    engine = BatchInferenceEngine(model, batch_size=2, stop_token=[7, 99])
    a = engine.submit_request([1], max_tokens=10)
    b = engine.submit_request([2], max_tokens=10, stop_token={6})
    engine.run()
    assert a.tokens == [5, 6, 7] and a.stop_reason is None  # the engine's default stop tokens (its EOS): vLLM's None
    assert b.tokens == [5, 6] and b.stop_reason == 6


def test_stop_token_model_uses_eos_token_ids():
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=1, stop_token="model")
    assert engine.stop_tokens == frozenset([0])


def test_termination_order_stop_token_before_stop_sequence_before_length():
    # The 3rd token is the stop token, completes a stop sequence, and reaches max_tokens.
    model = ScriptedModel({1: [4, 5, 9], 2: [4, 5, 9], 3: [4, 5, 9]})
    engine = BatchInferenceEngine(model, batch_size=3)
    all_three = engine.submit_request([1], 3, stop_token=9, stop_sequences=[[5, 9]])
    seq_and_length = engine.submit_request([2], 3, stop_token=None, stop_sequences=[[5, 9]])
    length_only = engine.submit_request([3], 3, stop_token=None)
    engine.run()
    assert (all_three.finish_reason, all_three.stop_reason) == ("stop", 9)
    assert (seq_and_length.finish_reason, seq_and_length.stop_reason) == ("stop", (5, 9))
    assert (length_only.finish_reason, length_only.stop_reason) == ("length", None)
    assert all_three.tokens == seq_and_length.tokens == length_only.tokens == [4, 5, 9]


# ---- stop sequences -----------------------------------------------------------


def test_stop_sequence_spans_iterations():
    model = ScriptedModel({1: [3, 4, 5, 6, 7, 8]})
    engine = BatchInferenceEngine(model, batch_size=1)
    h = engine.submit_request([1], 10, stop_sequences=[[5, 6, 7]])
    engine.run()
    assert h.tokens == [3, 4, 5, 6, 7] and h.stop_reason == (5, 6, 7)


@pytest.mark.parametrize("script, pattern, expected_len", [
    ([1, 1, 1, 2, 9], [1, 1, 2], 4),        # naive "reset on mismatch" misses this
    ([1, 2, 1, 2, 1, 3, 9], [1, 2, 1, 3], 6),
    ([7, 7, 7, 7, 9], [7, 7, 7], 3),
    ([1, 2, 1, 1, 2, 1, 2, 9], [1, 2, 1, 2], 7),
])
def test_self_overlapping_stop_sequences(script, pattern, expected_len):
    model = ScriptedModel({50: script})
    engine = BatchInferenceEngine(model, batch_size=1)
    h = engine.submit_request([50], 20, stop_sequences=[pattern])
    engine.run()
    assert h.tokens == script[:expected_len]
    assert h.finish_reason == "stop" and h.stop_reason == tuple(pattern)


def test_stop_sequence_never_matches_the_prompt():
    model = ScriptedModel({5: [6, 1, 2, 3]}, prompt_len=3)
    engine = BatchInferenceEngine(model, batch_size=1)
    # The prompt ends with 5 and the first generated token is 6: [5, 6] then ends
    # the sequence, but spans prompt and output, so it must not match.
    h = engine.submit_request([5, 8, 5], 4, stop_sequences=[[5, 6], [2, 3]])
    engine.run()
    assert h.tokens == [6, 1, 2, 3] and h.stop_reason == (2, 3)


def test_first_of_several_stop_sequences_wins_and_max_tokens_still_applies():
    model = ScriptedModel({1: [1, 2, 3, 4]})
    engine = BatchInferenceEngine(model, batch_size=1)
    h = engine.submit_request([1], 4, stop_sequences=[[3, 4, 5], [2, 3]])
    engine.run()
    assert h.tokens == [1, 2, 3] and h.stop_reason == (2, 3)
    h2 = engine.submit_request([1], 2, stop_sequences=[[2, 3]])
    engine.run()
    assert h2.tokens == [1, 2] and h2.finish_reason == "length"


# ---- streaming ----------------------------------------------------------------


def test_streaming_equals_final_result_and_precedes_callback():
    model = SimulatedLLM(vocab_size=100, stop_rate=0.05)
    engine = BatchInferenceEngine(model, batch_size=3, stop_token=0)
    events = {}
    handles = []
    for i in range(8):
        events[i] = []
        handles.append(engine.submit_request(
            [i + 1, 7], max_tokens=5 + 3 * i,
            on_token=lambda t, i=i: events[i].append(("tok", t)),
            callback=lambda seq, i=i: events[i].append(("done", seq))))
    engine.run()
    for i, h in enumerate(handles):
        streamed = [t for kind, t in events[i] if kind == "tok"]
        assert [kind for kind, _ in events[i]] == ["tok"] * len(streamed) + ["done"]
        assert streamed == h.tokens
        assert events[i][-1][1] == [i + 1, 7] + streamed == h.result()


def test_callback_gets_its_own_copy_of_the_sequence():
    engine = BatchInferenceEngine(SimulatedLLM(stop_rate=0.0), batch_size=1)
    h = engine.submit_request([1, 2], 3, callback=lambda seq: seq.clear())
    engine.run()
    assert len(h.result()) == 5


def test_handle_state_and_repr():
    engine = BatchInferenceEngine(SimulatedLLM(stop_rate=0.0), batch_size=1)
    h = engine.submit_request([1, 2], 3, request_id="mine")
    assert h.request_id == "mine" and h.prompt == [1, 2] and h.tokens == []
    assert h.finish_reason is None and not h.done() and h.error is None
    with pytest.raises(TimeoutError):
        h.result(timeout=0.01)
    engine.run()
    assert h.done() and "mine" in repr(h) and "length" in repr(h)


def test_step_returns_tokens_generated_and_zero_when_idle():
    engine = BatchInferenceEngine(SimulatedLLM(stop_rate=0.0), batch_size=2)
    assert engine.step() == 0
    engine.submit_request([1], 2)
    engine.submit_request([2], 1)
    engine.submit_request([3], 1)
    assert engine.step() == 2
    assert (engine.num_running, engine.num_queued) == (1, 1)
    assert engine.step() == 2
    assert engine.step() == 0 and engine.num_running == 0


def test_resume_tokens_continue_where_a_previous_run_stopped():
    model = SimulatedLLM(vocab_size=100, stop_rate=0.0)
    full = spec_reference(model, [3, 4], 10)[0]
    done_before = full[2:6]  # 4 tokens generated "elsewhere"
    engine = BatchInferenceEngine(model, batch_size=2)
    streamed = []
    h = engine.submit_request([3, 4], 10, resume_tokens=done_before, on_token=streamed.append)
    engine.run()
    assert h.result() == full and h.finish_reason == "length"
    assert streamed == full[6:] and h.tokens == full[2:]


def test_resume_tokens_take_part_in_stop_sequence_matching():
    model = ScriptedModel({1: [9, 9, 9, 5, 6, 7]})  # indexes count resumed tokens too
    engine = BatchInferenceEngine(model, batch_size=1)
    h = engine.submit_request([1], 10, resume_tokens=[9, 9, 9, 5], stop_sequences=[[5, 6]])
    engine.run()
    assert h.tokens == [9, 9, 9, 5, 6] and h.stop_reason == (5, 6)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=4).map(tuple), min_size=1,
                max_size=3, unique=True),
       st.lists(st.integers(0, 2), max_size=40))
def test_stop_matcher_equals_a_suffix_check_after_every_token(patterns, stream):
    matcher = StopMatcher(patterns)
    seen = []
    for token in stream:
        seen.append(token)
        suffixes = [p for p in patterns if tuple(seen[-len(p):]) == p and len(seen) >= len(p)]
        assert matcher.feed(token) == (suffixes[0] if suffixes else None)

