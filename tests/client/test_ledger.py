"""The client's ledger and decisions without sockets (client.core.ClientCore):
request ids, results applied in order, exactly one ending per request
whatever reports it, errors for the requests they name, the connection's
end, resubmission after a broker restart, cancels pending.

The core is driven as the shell drives it: :func:`plain`, :func:`stream`
and :func:`deliver` do what ``Client`` does on its I/O thread and its
callback thread (apply, call the streaming callbacks, run each completion
callback, settle).
"""

from __future__ import annotations

import pytest

from client.core import ClientCore, Outcome
from protocol.enums import ErrorCode, FinishReason
from protocol.messages import Envelope, Error, Finished, Results, Text
from protocol.request import RequestParams

PARAMS = RequestParams([1, 2], 8, stop_token=None)


def plain(core: ClientCore, msg: Results, now: float) -> tuple[Results | None, int]:
    """Apply ``msg`` on the I/O thread's path (tokens and text, then the endings
    of requests without callbacks); return the rest and how many settled."""
    rest, endings = core.apply_plain(msg, now)
    return rest, core.end_plain(endings, now)


def deliver(core: ClientCore, out: Outcome) -> Outcome:
    """Run the completion callbacks of ``out`` and settle each, as the shell does."""
    for h in out.deliver:
        error = None
        try:
            h.callback((h.prompt or []) + h.tokens)  # (h.result() waits through the shell)
        except Exception as e:  # noqa: BLE001 -- recorded on the handle
            error = e
        core.settle(h, error)
    return out


def stream(core: ClientCore, msg: Results, now: float) -> tuple[list, list]:
    """Apply ``msg`` on the callback thread's path (streaming calls, then
    endings); return the ids whose completion callback ran, and those to cancel."""
    delivered, cancels = [], []
    for h, fn, value in core.stream(msg, now):
        if fn is None:
            if core.finish(h, value, now):
                deliver(core, Outcome(deliver=[h]))
                delivered.append(h.request_id)
            continue
        try:
            fn(value)
        except Exception as e:  # noqa: BLE001 -- the request ends with it
            cancels += core.stream_failed(h, e).cancel
    return delivered, cancels


def submit(core: ClientCore, rid=None, params=PARAMS, now=0.0, **callbacks):
    return core.submit(params, request_id=rid, now=now, **callbacks)[0]


def nothing(out: Outcome) -> bool:
    """True when ``out`` asks the shell to do nothing at all."""
    return not (out.hello or out.submit or out.cancel or out.deliver or out.settled)


def ended(out: Outcome) -> list:
    return [h.request_id for h in out.deliver]


# ---------------------------------------------------------------------- ids


def test_ids_are_picked_past_the_callers_own_and_a_duplicate_is_refused():
    core = ClientCore()
    mine = submit(core, 1)
    picked = [submit(core).request_id for _ in range(3)]
    assert picked == [0, 2, 3]  # 1 is in flight: skipped
    with pytest.raises(ValueError, match="already in flight"):
        core.submit(PARAMS, request_id=1, now=0.0)
    submit(core, "x")
    with pytest.raises(ValueError, match="already in flight"):
        core.submit(PARAMS, request_id="x", now=0.0)
    assert core.in_flight == 5 and core.ledger.handles[1] is mine  # the refused ones left no trace
    h, entry = core.submit(PARAMS, request_id="y", now=2.5)
    assert entry == Envelope("y", PARAMS) and entry.params is PARAMS and h.submitted_s == 2.5


def test_an_id_is_free_again_once_its_request_ended():
    core = ClientCore()
    first = submit(core, "a")
    plain(core, Results(finished=(Finished("a", FinishReason.LENGTH),)), 1.0)
    again = submit(core, "a")
    assert again is not first and core.ledger.handles["a"] is again and first.done()



def test_an_id_ended_here_waits_for_the_brokers_word_before_it_is_taken_again():
    # A request the client ends itself (its deadline passed while the broker was silent; a message about
    # it it could not handle) is cancelled at the broker, which may still hold it: the same id sent again
    # was taken there for that request (a resubmission, run once) and the new handle got its tokens and
    # ending (reproduced: broker SIGSTOPped, "x" expired, submitted again as [7, 8, 9]: the old request's
    # [201, 742, 0], "stop"). The id is refused until the broker's ending, or refusal, of it comes.
    core = ClientCore()
    timed = RequestParams([1, 2], 8, timeout_s=1.0)
    x = submit(core, "x", timed)
    f = submit(core, "f")
    out = core.expire(core.overdue(5.0, 0.0, 1.0), 5.0)
    assert list(out.cancel) == ["x"] and x.finish_reason is FinishReason.DEADLINE
    core.failed(Results(("f",), (3,)), KeyError("a bug"), 5.0)
    for rid in ("x", "f"):
        with pytest.raises(ValueError, match="has not yet said it ended there"):
            core.submit(PARAMS, request_id=rid, now=6.0)
    assert [submit(core).request_id for _ in range(2)] == [0, 1]  # (picked ids skip no int here)
    plain(core, Results(("x",), (9,), finished=(Finished("x", FinishReason.CANCELLED),)), 7.0)  # the broker's word
    again = submit(core, "x")
    assert again is not x and again.tokens == [] and x.tokens == []  # the late token went to nobody
    core.io_refused(Error(ErrorCode.INTERNAL, "gone", ("f",)))  # a refusal ends it at the broker too
    assert submit(core, "f").request_id == "f"


def test_a_message_ending_a_request_it_failed_on_leaves_its_id_free():
    core = ClientCore()
    submit(core, "a")
    core.failed(Results(("a",), (5,), finished=(Finished("a", FinishReason.STOP),)), KeyError("a bug"), 1.0)
    assert submit(core, "a").request_id == "a"  # the broker ended it already: no word to wait for


def test_picked_ids_skip_the_retiring_ones_and_a_new_broker_frees_them():
    core = ClientCore()
    core.broker_seen("b1", 0.0)
    timed = RequestParams([1, 2], 8, timeout_s=1.0)
    picked = submit(core, None, timed)
    core.expire(core.overdue(5.0, 0.0, 1.0), 5.0)
    assert picked.request_id == 0 and submit(core).request_id == 1  # 0 is retiring: skipped
    with pytest.raises(ValueError, match="has not yet said"):
        core.submit(PARAMS, request_id=0, now=6.0)
    core.broker_seen("b2", 7.0)  # a restarted broker holds nothing of the old one's
    assert submit(core, 0).request_id == 0

def test_a_closed_or_broken_client_takes_no_new_requests():
    core = ClientCore()
    assert core.close() and not core.close()
    with pytest.raises(RuntimeError, match="closed"):
        submit(core)
    core = ClientCore()
    core.broken(OSError("socket gone"), 0.0)
    with pytest.raises(RuntimeError, match="connection failed.*socket gone"):
        submit(core)
    assert core.in_flight == 0


# ---------------------------------------------------------------------- results


def test_results_without_callbacks_are_applied_in_order_and_end_once():
    core = ClientCore()
    h = submit(core, "a")
    other = submit(core, "b")
    rest, settled = plain(core, Results(("a", "b", "a"), (5, 6, 7), (Text("a", "hi"),)), 1.0)
    assert rest is None and settled == 0 and h.first_token_s == 1.0
    last = Results(("a",), (8,), finished=(Finished("a", FinishReason.STOP, prompt_tokens=2, stop_reason=8),))
    rest, endings = core.apply_plain(last, 2.0)
    assert rest is None and endings == [(h, last.finished[0])] and h.finish_reason is None  # ended under the lock
    assert core.end_plain(endings, 2.0) == 1 and core.in_flight == 1
    assert h.tokens == [5, 7, 8] and h.text == "hi" and other.tokens == [6]
    assert (h.finish_reason, h.stop_reason, h.prompt_tokens, h.finished_s) == (FinishReason.STOP, 8, 2, 2.0)
    assert h.done() and h.result() == [1, 2, 5, 7, 8]
    # Anything later for it is dropped: it ended once.
    rest, settled = plain(core, Results(("a",), (9,), finished=(Finished("a", FinishReason.LENGTH),)), 3.0)
    assert rest is None and settled == 0 and h.tokens == [5, 7, 8] and h.finish_reason is FinishReason.STOP
    assert ended(core.error(Error(ErrorCode.QUEUE_FULL, "late", ("a",)), 3.0)) == [] and h.error is None


def test_results_with_callbacks_go_to_the_callback_thread_in_order():
    core = ClientCore()
    calls = []
    h = submit(core, "cb", callback=lambda seq: calls.append(("done", seq, h.done())),
               on_token=lambda t: calls.append(("token", t, len(h.tokens))),
               on_text=lambda s: calls.append(("text", s)))
    no_callbacks = submit(core, "plain")
    msg = Results(("cb", "plain", "cb"), (5, 6, 7), (Text("cb", "x"),),
                  (Finished("plain", FinishReason.LENGTH), Finished("cb", FinishReason.STOP)))
    rest, settled = plain(core, msg, 1.0)
    assert settled == 1 and no_callbacks.done() and no_callbacks.tokens == [6]
    assert rest == Results(("cb", "cb"), (5, 7), (Text("cb", "x"),), (Finished("cb", FinishReason.STOP),))
    assert h.tokens == [] and not calls  # nothing of it applied on the I/O thread
    assert stream(core, rest, 2.0) == (["cb"], [])
    # Each token is applied just before its call; text after the tokens; the ending last, once.
    assert calls == [("token", 5, 1), ("token", 7, 2), ("text", "x"), ("done", [1, 2, 5, 7], False)]
    assert h.done() and core.in_flight == 0 and h.first_token_s == 2.0
    assert stream(core, Results(finished=(Finished("cb", FinishReason.LENGTH),)), 3.0) == ([], [])
    assert h.finish_reason is FinishReason.STOP and len(calls) == 4


def test_a_streaming_callback_that_raises_ends_its_request_with_that_error():
    core = ClientCore()
    seen, boom = [], ValueError("bad token")

    def on_token(t):
        seen.append(t)
        if t == 6:
            raise boom

    h = submit(core, "a", on_token=on_token)
    other = submit(core, "b", on_token=seen.append)
    delivered, cancels = stream(core, Results(("a", "a", "b", "a"), (5, 6, 9, 7),
                                              finished=(Finished("a", FinishReason.LENGTH),)), 1.0)
    assert cancels == ["a"] and delivered == []  # stopped at the broker; it has no completion callback
    assert seen == [5, 6, 9] and h.tokens == [5, 6, 7]  # no call after the raise; the tokens still kept
    assert h.finish_reason is FinishReason.ERROR and h.error is boom and h.done()
    assert other.finish_reason is None


def test_a_completion_callback_that_raises_is_recorded_and_the_request_still_settles():
    core = ClientCore()
    boom = RuntimeError("callback bug")
    h = submit(core, "a", callback=lambda seq: (_ for _ in ()).throw(boom))
    stream(core, Results(finished=(Finished("a", FinishReason.STOP),)), 1.0)
    assert h.done() and h.finish_reason is FinishReason.STOP and h.error is boom and core.in_flight == 0


# ---------------------------------------------------------------------- errors and failures


def test_an_error_ends_only_the_requests_it_names():
    core = ClientCore()
    done = []
    a = submit(core, "a", callback=done.append)
    b = submit(core, "b")
    c = submit(core, "c")
    out = deliver(core, core.error(Error(ErrorCode.QUEUE_FULL, "queue full", ("a", "c", "ghost")), 1.0))
    assert ended(out) == ["a"] and out.settled == 1 and list(out.cancel) == []
    for h in (a, c):
        assert h.finish_reason is FinishReason.ERROR and h.error.code is ErrorCode.QUEUE_FULL and h.done()
    assert done == [[1, 2]] and b.finish_reason is None and core.in_flight == 1
    # An error naming no request is the client's, not a request's: it ends nothing.
    assert nothing(core.error(Error(ErrorCode.INTERNAL, "something"), 2.0)) and b.finish_reason is None


def test_a_message_the_client_failed_on_ends_the_requests_it_names_and_cancels_them():
    core = ClientCore()
    a, b = submit(core, "a"), submit(core, "b")
    bad = Results(("a",), (5,))
    core.io_failed(bad, KeyError("a bug"))
    # A later frame, applied on the I/O thread before the callback thread ends "a", must not end it normally.
    plain(core, Results(("a", "b"), (6, 7), finished=(Finished("a", FinishReason.LENGTH),)), 1.0)
    assert a.finish_reason is FinishReason.ERROR and a.error.code is ErrorCode.INTERNAL and "KeyError" in str(a.error)
    out = core.failed(bad, KeyError("a bug"), 2.0)  # the callback thread's turn: "a" ended already
    assert list(out.cancel) == [] and out.settled == 0 and b.finish_reason is None
    out = core.failed(Results(("b",), (8,)), RuntimeError("another"), 2.0)
    assert list(out.cancel) == ["b"] and out.settled == 1 and b.error.code is ErrorCode.INTERNAL
    assert nothing(core.failed("not a message", RuntimeError("x"), 3.0))


def test_a_refusal_seen_on_the_io_thread_wins_over_a_later_ending():
    core = ClientCore()
    a = submit(core, "a")
    refusal = Error(ErrorCode.TOO_LARGE, "too large", ("a",))
    core.io_refused(refusal)
    plain(core, Results(finished=(Finished("a", FinishReason.STOP),)), 1.0)
    assert a.finish_reason is FinishReason.ERROR and a.error.code is ErrorCode.TOO_LARGE
    assert nothing(core.error(refusal, 2.0))  # ended once already


def test_a_broken_connection_ends_every_request():
    core = ClientCore()
    done = []
    hs = [submit(core, i, callback=done.append) for i in range(2)] + [submit(core, "plain")]
    out = deliver(core, core.broken(ConnectionResetError("gone"), 1.0))
    assert sorted(map(str, ended(out))) == ["0", "1"] and out.settled == 1 and core.in_flight == 0
    for h in hs:
        assert h.done() and h.finish_reason is FinishReason.ERROR and h.error.code is ErrorCode.BROKER_UNAVAILABLE
        assert "ConnectionResetError: gone" in h.error.message
    assert len(done) == 2


def test_close_abandons_what_is_open_as_cancelled():
    core = ClientCore()
    a, b = submit(core, "a"), submit(core, "b")
    plain(core, Results(("a",), (5,), finished=(Finished("b", FinishReason.STOP),)), 1.0)
    assert core.close()
    out = core.abandon(2.0)
    assert out.settled == 1 and a.finish_reason is FinishReason.CANCELLED and a.tokens == [5]
    assert b.finish_reason is FinishReason.STOP and core.in_flight == 0


# ---------------------------------------------------------------------- broker restart


def test_a_broker_restart_resubmits_with_the_tokens_held_and_the_time_left():
    core = ClientCore()
    assert nothing(core.broker_seen("broker-A", 0.0))  # the first broker: nothing to do
    timed = RequestParams([1], 10, stop_token=None, timeout_s=5.0)
    mid = submit(core, "mid", timed, now=1.0)
    fresh = submit(core, "fresh")
    plain(core, Results(("mid", "mid"), (7, 8)), 2.0)
    assert nothing(core.broker_seen("broker-A", 3.0))  # the same broker again
    out = core.broker_seen("broker-B", 3.5)
    assert out.hello and list(out.cancel) == [] and ended(out) == [] and out.settled == 0
    assert out.submit == [Envelope("mid", timed, (7, 8), pytest.approx(2.5)), Envelope("fresh", PARAMS, (), None)]
    assert core.resubmitted == 2 and core.broker_id == "broker-B" and core.in_flight == 2
    assert mid.finish_reason is None and fresh.finish_reason is None  # still waiting on the new broker
    plain(core, Results(("mid",), (9,), finished=(Finished("mid", FinishReason.STOP),)), 4.0)
    assert mid.tokens == [7, 8, 9] and mid.finish_reason is FinishReason.STOP


def test_a_broker_restart_ends_what_cannot_continue():
    core = ClientCore()
    core.broker_seen("A", 0.0)
    done = []
    late = submit(core, "late", RequestParams([1], 10, timeout_s=1.0), now=0.0, callback=done.append)
    full = submit(core, "full", RequestParams([1], 2))
    plain(core, Results(("full", "full"), (5, 6)), 0.5)
    stream(core, Results(("late",), (4,)), 0.5)  # it has a callback: the callback thread's path
    out = deliver(core, core.broker_seen("B", 1.5))
    assert out.submit == [] and out.hello
    assert late.finish_reason is FinishReason.DEADLINE and late.error is None and done == [[1, 4]]
    assert full.finish_reason is FinishReason.LENGTH and full.tokens == [5, 6] and full.done()
    assert ended(out) == ["late"] and out.settled == 1 and core.in_flight == 0 and core.resubmitted == 0


# ---------------------------------------------------------------------- cancels


def test_a_cancel_before_any_result_ends_the_request_when_the_broker_confirms():
    core = ClientCore()
    h = submit(core, "a")
    assert core.cancel("a")
    assert not core.cancel("a")  # already being cancelled: nothing more to send (the engine's answer too)
    assert h.finish_reason is None  # the broker decides: it may have finished meanwhile
    plain(core, Results(finished=(Finished("a", FinishReason.CANCELLED),)), 1.0)
    assert h.finish_reason is FinishReason.CANCELLED and h.tokens == [] and h.done()


def test_a_cancel_after_tokens_arrived_keeps_them_and_a_crossing_ending_wins():
    core = ClientCore()
    a, b = submit(core, "a"), submit(core, "b")
    plain(core, Results(("a", "b"), (5, 6)), 1.0)
    assert core.cancel("a") and core.cancel("b")
    plain(core, Results(("a",), (7,), finished=(Finished("a", FinishReason.CANCELLED),
                                                     Finished("b", FinishReason.STOP, stop_reason=6))), 2.0)
    assert a.finish_reason is FinishReason.CANCELLED and a.tokens == [5, 7]
    assert b.finish_reason is FinishReason.STOP and b.stop_reason == 6  # it finished anyway: unchanged


def test_a_cancel_pending_at_a_broker_restart_is_sent_again_after_the_request():
    core = ClientCore()
    core.broker_seen("A", 0.0)
    submit(core, "a")
    submit(core, "b")
    assert core.cancel("a")
    out = core.broker_seen("B", 1.0)
    assert [e.request_id for e in out.submit] == ["a", "b"] and list(out.cancel) == ["a"]
    # A cancel after the resubmission went out is an ordinary one, and stays pending for the next restart.
    assert core.cancel("b")
    out = core.broker_seen("C", 2.0)
    assert [e.request_id for e in out.submit] == ["a", "b"] and list(out.cancel) == ["a", "b"]


def test_a_cancel_for_a_request_that_ended_does_nothing():
    core = ClientCore()
    core.broker_seen("A", 0.0)
    h = submit(core, "a")
    submit(core, "b")
    plain(core, Results(("a",), (5,), finished=(Finished("a", FinishReason.LENGTH),)), 1.0)
    assert not core.cancel("a") and not core.cancel("never-submitted")
    assert h.finish_reason is FinishReason.LENGTH and h.tokens == [5]
    out = core.broker_seen("B", 2.0)
    assert [e.request_id for e in out.submit] == ["b"] and list(out.cancel) == []


def test_an_ending_drops_its_pending_cancel():
    core = ClientCore()
    core.broker_seen("A", 0.0)
    submit(core, "a")
    assert core.cancel("a")
    plain(core, Results(finished=(Finished("a", FinishReason.CANCELLED),)), 1.0)
    submit(core, "a")  # the id is used again
    out = core.broker_seen("B", 2.0)
    assert [e.request_id for e in out.submit] == ["a"] and list(out.cancel) == []  # the old cancel is not the new one's


# ---------------------------------------------------------------------- deadlines with a silent broker


def test_a_deadline_passed_while_the_broker_is_silent_ends_the_request_with_its_tokens():
    """A broker ends a request at its deadline; one that is gone never does: the client then ends
    it ``deadline`` itself (with the tokens received) and cancels it there, once the broker has
    been silent for the grace. Before: such a request waited for a broker that never came back
    (over HTTP, a stream with ``timeout_s: 8`` hung until the HTTP client gave up)."""
    core = ClientCore()
    core.broker_seen("A", 0.0)
    done = []
    timed = RequestParams([1], 10, stop_token=None, timeout_s=1.0)
    a = submit(core, "a", timed)
    b = submit(core, 7, timed, callback=done.append)  # (ids of both kinds share the heap)
    c = submit(core, "c")  # no deadline: it waits for the broker as before
    d = submit(core, "d", RequestParams([1], 10, timeout_s=5.0))
    plain(core, Results(("a",), (4,)), 0.5)
    assert core.overdue(0.9, 0.0, 0.5) == []  # no deadline passed yet
    assert core.overdue(2.0, 1.8, 0.5) == []  # the broker was heard 0.2 s ago: it decides
    due = core.overdue(2.0, 1.0, 0.5)
    assert due == [a, b]
    out = deliver(core, core.expire(due, 2.0))
    assert a.finish_reason is FinishReason.DEADLINE and a.tokens == [4] and a.error is None and a.done()
    assert b.finish_reason is FinishReason.DEADLINE and done == [[1]] and ended(out) == [7] and out.settled == 1
    assert list(out.cancel) == ["a", 7] and core.in_flight == 2
    assert core.overdue(3.0, 1.0, 0.5) == []  # each is handed out once
    plain(core, Results(("a",), (5,), finished=(Finished("a", FinishReason.LENGTH),)), 3.0)  # the broker, late
    assert a.tokens == [4] and a.finish_reason is FinishReason.DEADLINE
    assert c.finish_reason is None and d.finish_reason is None
    assert core.overdue(6.0, 1.0, 0.5) == [d]


def test_an_overdue_request_that_ended_meanwhile_keeps_its_ending():
    core = ClientCore()
    core.broker_seen("A", 0.0)
    a = submit(core, "a", RequestParams([1], 10, timeout_s=1.0))
    due = core.overdue(2.0, 0.0, 0.5)
    plain(core, Results(("a",), (4,), finished=(Finished("a", FinishReason.STOP),)), 2.0)  # it came first
    out = core.expire(due, 2.0)
    assert nothing(out) and a.finish_reason is FinishReason.STOP and a.tokens == [4]


def test_an_id_used_again_has_its_own_deadline():
    core = ClientCore()
    core.broker_seen("A", 0.0)
    submit(core, "a", RequestParams([1], 10, timeout_s=1.0))
    plain(core, Results(finished=(Finished("a", FinishReason.LENGTH),)), 0.5)
    again = submit(core, "a", RequestParams([1], 10, timeout_s=10.0), now=0.6)
    untimed = submit(core, "b", RequestParams([1], 10, timeout_s=1.0))
    plain(core, Results(finished=(Finished("b", FinishReason.LENGTH),)), 0.5)
    submit(core, "b", now=0.7)  # used again without a deadline: never overdue
    assert core.overdue(5.0, 0.0, 0.5) == [] and untimed.finish_reason is FinishReason.LENGTH
    assert core.overdue(11.0, 0.0, 0.5) == [again]


def test_the_deadline_heap_keeps_only_open_requests_when_it_outgrows_them():
    core = ClientCore()
    for i in range(500):
        submit(core, i, RequestParams([1], 10, timeout_s=100.0), now=float(i))
        plain(core, Results(finished=(Finished(i, FinishReason.LENGTH),)), float(i))
    assert len(core.ledger._deadlines) <= 2 * len(core.ledger.handles) + 65
    last = submit(core, "last", RequestParams([1], 10, timeout_s=1.0), now=600.0)
    assert core.overdue(1000.0, 0.0, 0.5) == [last]
