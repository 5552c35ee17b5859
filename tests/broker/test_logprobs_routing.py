"""The broker carries token logprobs (issue 20 item 3) as it carries tokens: a
worker's ``iteration`` records go, under the client's request ids, in that
client's ``results`` with the tokens they belong to; stale ones (a migrated
or ended request's) are dropped with those tokens; a migrated request
resumes from the tokens its client has, whose entries it keeps."""

from __future__ import annotations

from broker.outbox import Side
from protocol.codec import decode, encode
from protocol.enums import ErrorCode, FinishReason
from protocol.logprobs import TokenLogprob as T
from protocol.messages import Bye, Cancel, Finished, Iteration, Logprobs, Register, Results, Submit
from tests.support.cores import C1, C2, INFO, W1, W2, assigned, make_core, sent
from tests.support.messages import envelope


def register(core, w=W1, slots=2, now=0.0):
    return core.on_backend(w, Register("simulated", slots, slots, INFO, w.decode()), now)


def submit(core, client, ids, now=0.0, **kw):
    return core.on_frontend(client, Submit("simulated", [envelope(i, [1, 2], 6, stop_token=None, **kw)
                                                         for i in ids]), now)


def results(sends, client) -> list[Results]:
    return sent(sends, Side.FRONTEND, client, Results)


def entry(x: float) -> T:
    return T(-x, ((7, -0.5), (8, -x)))


def test_records_go_to_their_clients_under_their_ids_with_their_tokens():
    core = make_core()
    register(core, slots=4)
    ka, kb = [s.request_id for s in assigned(submit(core, C1, ["a", "b"], logprobs=2, prompt_logprobs=0))]
    (kc,) = [s.request_id for s in assigned(submit(core, C2, ["a"], logprobs=1))]
    prompt = (None, T(-3.0))
    it = Iteration(ids=(ka, kc, kb, ka), tokens=(5, 6, 7, 8),
                   logprobs=(Logprobs(ka, (entry(1), entry(2)), prompt), Logprobs(kc, (entry(3),)),
                             Logprobs(kb, (), prompt, (41, 42))))
    out = core.on_backend(W1, decode(encode(it)), 0.5)
    (r1,), (r2,) = results(out, C1), results(out, C2)
    assert (r1.ids, r1.tokens) == (("a", "b", "a"), (5, 7, 8))
    assert r1.logprobs == (Logprobs("a", (entry(1), entry(2)), prompt), Logprobs("b", (), prompt, (41, 42)))
    assert (r2.ids, r2.logprobs) == (("a",), (Logprobs("a", (entry(3),)),))
    assert decode(encode(r1)) == r1  # a valid message for the client (entries still match the tokens)


def test_a_request_ending_with_its_last_tokens_brings_their_entries_with_the_ending():
    core = make_core()
    register(core)
    (k,) = [s.request_id for s in assigned(submit(core, C1, ["x"], logprobs=0))]
    core.on_frontend(C1, Cancel(("x",)), 0.2)  # the broker asks; the worker's end comes with its last tokens
    out = core.on_backend(W1, Iteration(ids=(k,), tokens=(4,), logprobs=(Logprobs(k, (T(-0.25),)),),
                                        finished=(Finished(k, FinishReason.CANCELLED),)), 0.3)
    (r,) = results(out, C1)
    assert r.tokens == (4,) and r.logprobs == (Logprobs("x", (T(-0.25),)),)
    assert [f.finish_reason for f in r.finished] == [FinishReason.CANCELLED]
    # once ended (and detached), what still comes from the worker reaches nobody
    out = core.on_backend(W1, Iteration(ids=(k,), tokens=(5,), logprobs=(Logprobs(k, (T(-0.5),)),)), 0.4)
    assert not results(out, C1)


def test_a_migrated_request_resumes_from_the_tokens_the_client_has_and_stale_entries_are_dropped():
    core = make_core()
    register(core, W1, slots=1)
    (k,) = [s.request_id for s in assigned(submit(core, C1, ["m"], logprobs=1, prompt_logprobs=1))]
    prompt = (None, T(-2.0, ((2, -2.0),)))
    out = core.on_backend(W1, Iteration(ids=(k, k), tokens=(10, 11),
                                        logprobs=(Logprobs(k, (entry(1), entry(2)), prompt),)), 0.1)
    got = list(results(out, C1))
    core.on_backend(W1, Bye("stopping"), 0.2)  # its requests are requeued at once, with their tokens
    (resumed,) = assigned(register(core, W2, slots=1, now=0.3), W2)
    assert resumed.request_id == k and resumed.resume_tokens == (10, 11)
    assert resumed.params.logprobs == 1 and resumed.params.prompt_logprobs == 1
    # the old worker's late output is stale: its tokens and their entries are dropped together
    assert not results(core.on_backend(W1, Iteration(ids=(k,), tokens=(99,),
                                                     logprobs=(Logprobs(k, (entry(9),)),)), 0.35), C1)
    out = core.on_backend(W2, Iteration(ids=(k,), tokens=(12,), logprobs=(Logprobs(k, (entry(3),)),),
                                        finished=(Finished(k, FinishReason.LENGTH),)), 0.4)
    got += results(out, C1)
    tokens = [t for r in got for t in r.tokens]
    entries = [e for r in got for rec in r.logprobs for e in rec.entries]
    prompts = [rec.prompt for r in got for rec in r.logprobs if rec.prompt is not None]
    assert tokens == [10, 11, 12] and entries == [entry(1), entry(2), entry(3)] and prompts == [prompt]


def test_a_broker_side_ending_after_a_migration_leaves_the_entries_sent():
    core = make_core(max_attempts=1, heartbeat_interval_s=0.1, worker_liveness_s=1.0)
    register(core, W1, slots=1)
    (k,) = [s.request_id for s in assigned(submit(core, C1, ["z"], logprobs=0))]
    first = results(core.on_backend(W1, Iteration(ids=(k,), tokens=(3,), logprobs=(Logprobs(k, (T(-1.0),)),)),
                                    0.1), C1)
    out = core.tick(1.6)  # W1 fell silent, dead: no attempt left, the broker ends the request
    (r,) = results(out, C1)
    assert [(f.request_id, f.code) for f in r.finished] == [("z", ErrorCode.WORKER_FAILED)]
    assert r.logprobs == () and first[0].logprobs == (Logprobs("z", (T(-1.0),)),)
