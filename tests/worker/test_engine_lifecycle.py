"""Request lifecycle: cancellation, deadlines, failing callbacks and models, threads.

No test sleeps to synchronise: threads meet on events (GatedModel) or on
conditions waited for with a deadline.
"""

from __future__ import annotations

import threading

import pytest

from tests.support.engine import FakeClock, GatedModel, ScriptedModel
from tests.support.reference import spec_reference
from tests.support.waits import wait_until
from worker import BatchInferenceEngine, ModelError, SimulatedLLM


def _sim(**kw):
    return SimulatedLLM(vocab_size=100, stop_rate=0.0, **kw)


# ---- cancellation ---------------------------------------------------------------


def test_cancel_queued_request_never_reaches_the_model():
    engine = BatchInferenceEngine(_sim(), batch_size=1)
    results = []
    engine.submit_request([1], 3)
    h = engine.submit_request([2, 2], 3, request_id="q", callback=results.append)
    assert engine.num_queued == 2
    assert engine.cancel("q") is True
    assert engine.num_queued == 1
    assert engine.cancel("q") is False  # already ending
    engine.run()
    assert h.finish_reason == "cancelled" and results == [[2, 2]] and h.tokens == []
    assert engine.model.sequences == 3


def test_cancel_running_request_from_on_token_keeps_tokens_so_far():
    engine = BatchInferenceEngine(_sim(), batch_size=2)
    results = []
    streamed = []

    def on_token(t):
        streamed.append(t)
        if len(streamed) == 3:
            assert engine.cancel("r") is True

    h = engine.submit_request([1], 10, request_id="r", on_token=on_token, callback=results.append)
    other = engine.submit_request([2], 6)
    engine.run()
    assert h.finish_reason == "cancelled" and len(h.tokens) == 3
    assert streamed == h.tokens and results == [[1] + streamed]
    assert other.finish_reason == "length" and len(other.tokens) == 6
    assert engine.num_free_slots == 2


def test_cancel_frees_the_slot_for_the_next_iteration():
    engine = BatchInferenceEngine(_sim(), batch_size=1)
    engine.submit_request([1], 100, request_id="long")
    waiting = engine.submit_request([2], 2)
    engine.step()
    engine.cancel("long")
    engine.step()  # ends "long", admits the waiting request in the same iteration
    assert engine.num_running == 1 and len(waiting.tokens) == 1


def test_cancel_of_unknown_or_finished_request_is_false():
    engine = BatchInferenceEngine(_sim(), batch_size=1)
    h = engine.submit_request([1], 2, request_id="a")
    engine.run()
    assert engine.cancel("a") is False and engine.cancel("nope") is False
    assert h.finish_reason == "length"


def test_cancel_arriving_in_the_finishing_iteration_changes_nothing():
    engine = BatchInferenceEngine(_sim(), batch_size=2)
    answers = []
    # Both finish in iteration 2; a's callback runs first and cancels b, which has
    # already finished in that iteration.
    a = engine.submit_request([1], 2, callback=lambda seq: answers.append(engine.cancel("b")))
    b = engine.submit_request([2], 2, request_id="b")
    engine.run()
    assert answers == [False] and b.finish_reason == "length" and len(b.tokens) == 2
    assert a.finish_reason == "length"


def test_cancel_from_another_thread_while_the_model_runs():
    gated = GatedModel(_sim())
    engine = BatchInferenceEngine(gated, batch_size=1)
    streamed = []
    h = engine.submit_request([1], 2, request_id="x", on_token=streamed.append)
    runner = threading.Thread(target=engine.run)
    runner.start()
    try:
        assert gated.entered.wait(10)
        # The model is computing x's 1st token; this cancel wins over the ending
        # x would otherwise reach at its 2nd token: it ends as cancelled with the
        # token in flight, which is also streamed.
        assert engine.cancel("x") is True
    finally:
        gated.release()
        runner.join(10)
    assert not runner.is_alive()
    assert h.finish_reason == "cancelled" and h.tokens == streamed and len(streamed) == 1


def test_cancel_racing_the_final_token_ends_cancelled_when_cancel_said_true():
    gated = GatedModel(_sim())
    engine = BatchInferenceEngine(gated, batch_size=1)
    h = engine.submit_request([1], 1, request_id="x")
    runner = threading.Thread(target=engine.run)
    runner.start()
    try:
        assert gated.entered.wait(10)
        assert engine.cancel("x") is True  # the model is producing x's last token
    finally:
        gated.release()
        runner.join(10)
    assert h.finish_reason == "cancelled" and len(h.tokens) == 1


# ---- deadlines ------------------------------------------------------------------


def test_deadline_of_a_queued_request_model_never_sees_it():
    clock = FakeClock()
    model = ScriptedModel({1: [5], 2: [6]})
    engine = BatchInferenceEngine(model, batch_size=1, clock=clock)
    engine.submit_request([1], 3)
    results = []
    h = engine.submit_request([2], 3, timeout_s=0.5, callback=results.append)
    engine.step()
    clock.advance(0.6)
    engine.run()
    assert h.finish_reason == "deadline" and results == [[2]] and h.tokens == []
    assert all(seq[0] == 1 for call in model.calls for seq in call)


def test_deadline_of_a_running_request_keeps_tokens_so_far():
    clock = FakeClock()
    engine = BatchInferenceEngine(_sim(), batch_size=2, clock=clock)

    def on_token(t):
        if len(h.tokens) == 4:
            clock.advance(2.0)

    h = engine.submit_request([1], 50, timeout_s=1.5, on_token=on_token)
    unbounded = engine.submit_request([2], 8)
    engine.run()
    assert h.finish_reason == "deadline" and len(h.tokens) == 4
    assert unbounded.finish_reason == "length" and len(unbounded.tokens) == 8


def test_request_finishing_before_its_deadline_is_unaffected():
    clock = FakeClock()
    engine = BatchInferenceEngine(_sim(), batch_size=1, clock=clock)
    h = engine.submit_request([1], 3, timeout_s=1.0)
    engine.run()
    clock.advance(5)
    engine.run()
    assert h.finish_reason == "length"


def test_real_clock_deadline():
    engine = BatchInferenceEngine(_sim(), batch_size=1)
    engine.submit_request([1], 1)
    h = engine.submit_request([2], 1, timeout_s=1e-6)
    wait_until(lambda: engine._clock() > h.submitted_s + 1e-6, what="the deadline to pass")
    engine.run()
    assert h.finish_reason == "deadline"


# ---- failing callbacks and models ------------------------------------------------


def test_raising_completion_callback_is_isolated():
    engine = BatchInferenceEngine(_sim(), batch_size=2)
    boom = RuntimeError("boom")
    results = []

    def bad(seq):
        raise boom

    a = engine.submit_request([1], 3, callback=bad)
    b = engine.submit_request([2], 5, callback=results.append)
    c = engine.submit_request([3], 2, callback=results.append)
    engine.run()
    assert a.error is boom and a.finish_reason == "length" and a.done()
    assert b.error is None and c.error is None and len(results) == 2
    assert b.result() == spec_reference(engine.model, [2], 5)[0]


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_ctrl_c_in_a_completion_callback_stops_run_and_leaves_the_engine_whole(stop):
    """Ctrl-C while a completion callback runs, or sys.exit() in one: run() raises it, once every
    request ending in that iteration has ended and had its callback; their slots are free, and the
    next run() serves what is left (a break-it pass: the slots stayed taken and the next run() spun
    forever)."""
    engine = BatchInferenceEngine(_sim(), batch_size=3)
    results = []

    def bad(_):
        raise stop()

    a = engine.submit_request([1], 3, callback=bad)
    b = engine.submit_request([2], 3, callback=results.append)  # ends in the same iteration, after a
    c = engine.submit_request([3], 6, callback=results.append)
    d = engine.submit_request([4], 2, callback=results.append)  # queued: a slot frees after a and b
    with pytest.raises(stop):
        engine.run()
    assert a.done() and a.finish_reason == "length" and isinstance(a.error, stop)
    assert b.done() and b.error is None and b.result() == spec_reference(engine.model, [2], 3)[0]
    assert engine.num_running == 1  # c, still running: a's and b's slots were freed
    engine.run()  # returns: c and d finish
    assert c.result() == spec_reference(engine.model, [3], 6)[0] and d.done() and d.error is None
    assert engine.num_running == engine.num_queued == 0 and len(results) == 3


@pytest.mark.parametrize("stop", [KeyboardInterrupt, SystemExit])
def test_ctrl_c_in_a_streaming_on_token_stops_run_and_the_next_run_finishes_every_request(stop):
    """The same from ``on_token`` mid-stream: run() raises it at once, and the next run() serves
    every request to its end with the tokens a run without it gives."""
    engine = BatchInferenceEngine(_sim(), batch_size=2)
    calls, ended = [], []

    def bad(t):
        calls.append(t)
        if len(calls) == 2:
            raise stop()

    a = engine.submit_request([5, 6], 6, on_token=bad, callback=ended.append)
    b = engine.submit_request([7, 8], 6, callback=ended.append)
    c = engine.submit_request([9], 4, callback=ended.append)
    with pytest.raises(stop):
        engine.run()
    assert not a.done() and engine.num_running == 2
    engine.run()
    for h, prompt, n in ((a, [5, 6], 6), (b, [7, 8], 6), (c, [9], 4)):
        assert h.done() and h.error is None and h.result() == spec_reference(engine.model, prompt, n)[0]
    assert len(ended) == 3 and engine.num_running == engine.num_queued == 0


def test_ctrl_c_in_a_last_on_text_stops_run_and_leaves_the_engine_whole(tmp_path):
    """The same for a request's last ``on_text`` (its text's end, handed over as it finishes)."""
    pytest.importorskip("transformers")
    from tests.support.tiny_text import ScriptedTextModel, make_tiny_text_model

    engine = BatchInferenceEngine(ScriptedTextModel(make_tiny_text_model(tmp_path), "a😀b", 12), batch_size=2)
    ended = []

    def bad(piece):
        if a.finish_reason is not None:  # its last piece (it ended: complete() hands over the rest)
            raise KeyboardInterrupt

    # (2 tokens: part of a character, held back until the end, when the last on_text gets it)
    a = engine.submit_request([5, 6], 2, on_text=bad, callback=ended.append)
    b = engine.submit_request([7, 8], 2, callback=ended.append)
    c = engine.submit_request([9], 3, callback=ended.append)
    with pytest.raises(KeyboardInterrupt):
        engine.run()
    assert a.done() and isinstance(a.error, KeyboardInterrupt) and b.done() and b.error is None
    assert len(ended) == 2 and engine.num_running == 0  # a's callback ran too
    engine.run()
    assert c.done() and c.error is None and len(ended) == 3


def test_raising_on_token_ends_only_that_request_with_error():
    engine = BatchInferenceEngine(_sim(), batch_size=2)
    results = []

    def bad(token):
        if len(a.tokens) == 2:
            raise KeyError("stream broke")

    a = engine.submit_request([1], 10, on_token=bad, callback=results.append)
    b = engine.submit_request([2], 10, callback=results.append)
    engine.run()
    assert a.finish_reason == "error" and isinstance(a.error, KeyError)
    assert len(a.tokens) == 2 and results[0] == a.result()
    assert b.finish_reason == "length" and b.error is None and len(results) == 2


def test_raising_on_token_on_the_final_token():
    engine = BatchInferenceEngine(_sim(), batch_size=1)

    def bad(token):
        raise ValueError("x")

    h = engine.submit_request([1], 1, on_token=bad)
    engine.run()
    assert h.finish_reason == "error" and isinstance(h.error, ValueError) and len(h.tokens) == 1


class FlakyModel:
    """Fails on the given call numbers (1-based), else behaves like SimulatedLLM."""

    vocab_size = 100

    def __init__(self, fail_on, wrong_count=False):
        self.inner = _sim()
        self.fail_on = set(fail_on)
        self.wrong_count = wrong_count
        self.calls = 0

    def next_tokens(self, seqs):
        self.calls += 1
        if self.calls in self.fail_on:
            if self.wrong_count:
                return [1] * (len(seqs) + 1)
            raise MemoryError("out of memory")
        return self.inner.next_tokens(seqs)


@pytest.mark.parametrize("wrong_count", [False, True])
def test_model_failure_ends_the_batch_with_error_and_the_engine_goes_on(wrong_count):
    engine = BatchInferenceEngine(FlakyModel([2], wrong_count), batch_size=2)
    results = []
    first = [engine.submit_request([i], 5, callback=results.append) for i in (1, 2)]
    queued = engine.submit_request([3], 5, callback=results.append)
    engine.run()
    for h in first:
        assert h.finish_reason == "error" and isinstance(h.error, ModelError)
        assert h.error.code == "model_error" and len(h.tokens) == 1
    if not wrong_count:
        assert isinstance(first[0].error.__cause__, MemoryError)
    assert queued.finish_reason == "length" and len(results) == 3


# ---- threads and re-entrancy -----------------------------------------------------


def test_submit_from_callbacks_runs_before_run_returns():
    engine = BatchInferenceEngine(_sim(), batch_size=2)
    chain = []

    def follow_up(seq):
        chain.append(seq)
        if len(chain) < 5:
            engine.submit_request(seq[-2:], 2, callback=follow_up)

    engine.submit_request([1, 2], 2, callback=follow_up)
    engine.run()
    assert len(chain) == 5 and engine.num_queued == 0 and engine.num_running == 0


def test_submit_from_another_thread_while_run_executes():
    gated = GatedModel(_sim())
    engine = BatchInferenceEngine(gated, batch_size=2)
    first = engine.submit_request([1], 20)
    runner = threading.Thread(target=engine.run)
    runner.start()
    try:
        assert gated.entered.wait(10)
        second = engine.submit_request([2], 3)  # while the model is running
    finally:
        gated.release()
        runner.join(10)
    assert not runner.is_alive()
    assert first.finish_reason == second.finish_reason == "length"
    assert second.result(timeout=0) == spec_reference(gated.inner, [2], 3)[0]


def test_many_threads_submit_concurrently():
    engine = BatchInferenceEngine(SimulatedLLM(vocab_size=100), batch_size=8, stop_token=0)
    handles = []
    lock = threading.Lock()
    stop = threading.Event()

    def loop():
        while not stop.is_set():
            if engine.wait_for_work(0.05):
                engine.step()

    def submitter(k):
        for i in range(50):
            h = engine.submit_request([k, i % 100], 1 + i % 7)
            with lock:
                handles.append(h)

    runner = threading.Thread(target=loop)
    runner.start()
    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    try:
        for h in handles:
            h.result(timeout=10)
    finally:
        stop.set()
        runner.join(10)
    assert len(handles) == 200 and len({h.request_id for h in handles}) == 200
    for h in handles:
        assert h.result() == spec_reference(engine.model, h.prompt, 1 + h.prompt[1] % 7,
                                       frozenset([0]))[0]


def test_run_reentered_from_a_callback_raises_and_is_recorded():
    engine = BatchInferenceEngine(_sim(), batch_size=1)
    h = engine.submit_request([1], 2, callback=lambda seq: engine.run())
    g = engine.submit_request([2], 2, on_token=lambda t: engine.step())
    engine.run()
    assert isinstance(h.error, RuntimeError) and "already running" in str(h.error)
    assert isinstance(g.error, RuntimeError) and g.finish_reason == "error"


def test_run_from_a_second_thread_while_running_raises():
    gated = GatedModel(_sim())
    engine = BatchInferenceEngine(gated, batch_size=1)
    engine.submit_request([1], 2)
    runner = threading.Thread(target=engine.run)
    runner.start()
    try:
        assert gated.entered.wait(10)
        with pytest.raises(RuntimeError, match="already running"):
            engine.run()
        with pytest.raises(RuntimeError, match="already running"):
            engine.step()
    finally:
        gated.release()
        runner.join(10)
    engine.run()  # usable again afterwards


def test_wait_for_work_blocks_until_a_submit_and_times_out_when_idle():
    engine = BatchInferenceEngine(_sim(), batch_size=1)
    assert engine.wait_for_work(0.01) is False
    woke = []
    waiter = threading.Thread(target=lambda: woke.append(engine.wait_for_work(30)))
    waiter.start()
    wait_until(lambda: engine._waiting == 1, what="a thread in wait_for_work")
    engine.submit_request([1], 1)
    waiter.join(10)
    assert woke == [True]
    assert engine.wait_for_work(0) is True  # work is there: returns at once
    engine.run()
    assert engine.wait_for_work(0) is False


def test_result_blocks_until_done_from_another_thread():
    engine = BatchInferenceEngine(_sim(), batch_size=1)
    h = engine.submit_request([1], 3)
    got = []
    reader = threading.Thread(target=lambda: got.append(h.result(timeout=30)))
    reader.start()
    wait_until(lambda: engine._completion.waiters == 1, what="a thread in result()")
    engine.run()
    reader.join(10)
    assert got == [h.result()] and len(got[0]) == 4


def test_result_inside_own_callback_returns_at_once():
    engine = BatchInferenceEngine(_sim(), batch_size=1)
    seen = []
    h = engine.submit_request([1], 2, callback=lambda seq: seen.append(h.result() == seq))
    engine.run()
    assert seen == [True] and h.error is None
