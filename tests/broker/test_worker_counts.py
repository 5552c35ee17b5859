"""A worker's token counts and prefix-cache numbers that cannot be true (negative, or a part
larger than its whole) never reach clients or status: they become unknown, the worker is
logged once, and its requests are served as before. Socket-free broker core."""

from __future__ import annotations

import logging

import msgpack
import pytest

from broker.outbox import Side
from protocol.codec import decode, encode
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import ProtocolError
from protocol.logprobs import TokenLogprob
from protocol.messages import (
    MAX_SLOTS, PROTOCOL_VERSION, WORKER_TO_BROKER, Bye, Cancel, Finished, Heartbeat, Iteration, Logprobs,
    PrefixCacheUsage, Register, Results, Started, Submit,
)
from tests.support.cores import C1, INFO, W1, W2, assigned, make_core, sent
from tests.support.messages import envelope


def serving(slots=2, prompt="hello there"):
    """A core with W1 serving ``slots`` requests of ``prompt`` (text: its length only the worker
    knows) and one more queued; (core, the keys assigned)."""
    core = make_core()
    core.on_backend(W1, Register("simulated", slots, slots, INFO, W1.decode()), 0.0)
    out = core.on_frontend(C1, Submit("simulated", [envelope(i, prompt, 4) for i in range(slots + 1)]), 0.0)
    return core, [s.request_id for s in assigned(out)]


def relayed(out) -> tuple[dict, dict, list]:
    """(client id -> Finished, client id -> Started, tokens) the client got."""
    rs = sent(out, Side.FRONTEND, C1, Results)
    return ({f.request_id: f for r in rs for f in r.finished}, {s.request_id: s for r in rs for s in r.started},
            [t for r in rs for t in r.tokens])


# (prompt_tokens, cached_tokens) a worker sent -> what the client gets
CASES = [((10, 4), (10, 4)), ((10, 0), (10, 0)), ((10, 10), (10, 10)), ((None, None), (None, None)),
         ((10, -1), (10, None)), ((10, 11), (10, None)), ((-3, 2), (None, None)), ((-3, None), (None, None)),
         ((None, -5), (None, None))]


@pytest.mark.parametrize(("sent_counts", "got"), CASES)
def test_finished_counts_that_cannot_be_true_become_unknown_and_the_request_still_ends(sent_counts, got):
    core, (k, _) = serving()
    prompt_tokens, cached = sent_counts
    out = core.on_backend(W1, Iteration(ids=[k, k], tokens=[5, 6], finished=[
        Finished(k, FinishReason.LENGTH, prompt_tokens=prompt_tokens, cached_tokens=cached)]), 1.0)
    fin, _, tokens = relayed(out)
    assert (fin[0].prompt_tokens, fin[0].cached_tokens) == got
    assert fin[0].finish_reason is FinishReason.LENGTH and tokens == [5, 6]
    assert [s.request_id for s in assigned(out)] == [2]  # the credit came back: the queued request runs


@pytest.mark.parametrize(("sent_counts", "got"), [(c, g) for c, g in CASES if c[0] is not None])
def test_started_counts_that_cannot_be_true_become_unknown_and_the_tokens_still_arrive(sent_counts, got):
    core, (k, _) = serving()
    out = core.on_backend(W1, Iteration(ids=[k], tokens=[5], started=[Started(k, *sent_counts)]), 1.0)
    _, started, tokens = relayed(out)
    assert tokens == [5]
    if got[0] is None:
        assert started == {}  # no length to tell: the ending may tell it
    else:
        assert (started[0].prompt_tokens, started[0].cached_tokens) == got


def test_impossible_prefix_cache_numbers_keep_the_last_sound_report():
    core, _ = serving()
    good = PrefixCacheUsage(100, 40, 2**20, 2**24)
    core.on_backend(W1, Heartbeat(progress=1, prefix_cache=good), 1.0)
    for bad in (PrefixCacheUsage(100, 140, 2**20, 2**24), PrefixCacheUsage(-1, 0, 0, 2**24),
                PrefixCacheUsage(100, 40, -2**20, 2**24), PrefixCacheUsage(100, 40, 0, -1)):
        core.on_backend(W1, Heartbeat(progress=2, prefix_cache=bad), 2.0)
        assert core.workers.get(W1).prefix_cache == good
    later = PrefixCacheUsage(200, 90, 2**21, 2**24)
    core.on_backend(W1, Heartbeat(progress=3, prefix_cache=later), 3.0)
    assert core.workers.get(W1).prefix_cache == later


def test_each_kind_of_fault_is_logged_once_per_worker(caplog):
    core, (k1, k2) = serving()
    core.on_backend(W2, Register("simulated", 1, 1, INFO, W2.decode()), 0.0)
    with caplog.at_level(logging.WARNING, logger="broker.workers"):
        core.on_backend(W1, Iteration(ids=[k1], tokens=[5], started=[Started(k1, 10, 11)]), 1.0)
        core.on_backend(W1, Iteration(ids=[k1], tokens=[6], finished=[
            Finished(k1, FinishReason.LENGTH, prompt_tokens=10, cached_tokens=-1)]), 1.1)
        for t in (2.0, 3.0):
            core.on_backend(W1, Heartbeat(progress=int(t), prefix_cache=PrefixCacheUsage(1, 2, 0, 0)), t)
        core.on_backend(W1, Iteration(ids=[k2], tokens=[7], finished=[
            Finished(k2, FinishReason.LENGTH, prompt_tokens=10, cached_tokens=3)]), 4.0)  # sound: no warning
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "token counts" in lines[0] and "prefix-cache numbers" in lines[1]
    assert all(W1.decode() in line for line in lines)


# a token-id prompt of 2 tokens: the broker knows its length, so a count the worker sends is checked
# against it (the client takes the worker's prompt_tokens over the length it knew)
TOKEN_CASES = [((2, 1), (2, 1)), ((2, 2), (2, 2)), ((None, 2), (None, 2)), ((None, None), (None, None)),
               ((None, 3), (None, None)), ((10, 4), (None, None)), ((1, 0), (None, None)), ((2, 3), (2, None))]


@pytest.mark.parametrize(("sent_counts", "got"), TOKEN_CASES)
def test_token_prompt_counts_that_contradict_its_known_length_become_unknown(sent_counts, got):
    core, (k, _) = serving(prompt=[1, 2])
    out = core.on_backend(W1, Iteration(ids=[k], tokens=[5], finished=[
        Finished(k, FinishReason.LENGTH, prompt_tokens=sent_counts[0], cached_tokens=sent_counts[1])]), 1.0)
    fin, _, tokens = relayed(out)
    assert (fin[0].prompt_tokens, fin[0].cached_tokens) == got and tokens == [5]
    out = core.on_backend(W1, Iteration(ids=[k + 1], tokens=[6], started=[Started(k + 1, 3, 1)]), 2.0)
    assert relayed(out)[1] == {}  # a started record with another length is dropped too


def _register_frame(num_slots, max_inflight, info=(1000, None, (0,), False)):
    """A worker's ``register`` frame as raw msgpack (the message class would refuse some of these)."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": "register", "model": "simulated", "num_slots": num_slots,
                          "max_inflight": max_inflight, "info": list(info), "worker_name": "w"}, use_bin_type=True)


@pytest.mark.parametrize(("num_slots", "max_inflight", "info"), [
    (2**63, 2**63, INFO), (4, 2**64 - 1, INFO),  # two such workers: status's slots_total would not encode
    (4, 5, (0, None, (0,), False)), (4, 5, (-5, None, (), False)),  # every client would refuse every prompt
    (4, 5, (1000, 0, (0,), False)), (4, 5, (1000, -1, (0,), False)),  # ... and every request
    (4, 5, (1000, None, (-1,), False)), (4, 5, (1000, None, (0, 1000), False)),  # the gateway's stop_token_ids
])
def test_a_register_that_cannot_be_true_is_refused_when_decoded(num_slots, max_inflight, info):
    with pytest.raises(ProtocolError) as e:
        decode(_register_frame(num_slots, max_inflight, info), WORKER_TO_BROKER)
    assert e.value.code is ErrorCode.MALFORMED


def test_status_encodes_with_workers_of_the_most_slots_a_register_may_claim():
    core = make_core()
    for w in (W1, W2):
        core.on_backend(w, decode(_register_frame(MAX_SLOTS, MAX_SLOTS), WORKER_TO_BROKER), 0.0)
    status = core.status(1.0)
    assert status.models["simulated"].slots_total == 2 * MAX_SLOTS
    assert decode(encode(status)) == status


@pytest.mark.parametrize("bad", [-1, INFO.vocab_size, 2**63])
def test_a_token_outside_the_vocabulary_ends_its_request_alone(bad):
    """A token id no model of that vocabulary can produce is never relayed (a client would
    render it, and a migration would resume with it, failing ``bad_request`` on the next worker):
    its request ends ``model_error`` now and is cancelled on the worker; the others' tokens
    in the same iteration arrive."""
    core, (k1, k2) = serving()
    out = core.on_backend(W1, Iteration(ids=[k1, k2, k1], tokens=[5, bad, 6], texts=[(k2, "x")]), 1.0)
    fin, _, tokens = relayed(out)
    assert tokens == [5, 6] and list(fin) == [1]
    assert fin[1].finish_reason is FinishReason.ERROR and fin[1].code is ErrorCode.MODEL_ERROR
    assert str(bad) in fin[1].message
    assert [c.request_ids for c in sent(out, Side.BACKEND, W1, Cancel)] == [(k2,)]
    assert [s.request_id for s in assigned(out)] == [2]  # its credit came back
    later = core.on_backend(W1, Iteration(ids=[k2, k1], tokens=[7, 8], finished=[
        Finished(k2, FinishReason.CANCELLED)]), 2.0)
    fin, _, tokens = relayed(later)
    assert tokens == [8] and fin == {}  # (the cancelled request ended already)


def test_cached_tokens_without_the_prompt_length_of_a_text_prompt_become_unknown():
    """A worker that took tokens from its cache has tokenised the prompt, so it knows its length:
    a text prompt's cached_tokens without prompt_tokens cannot be checked, nor be true (the client
    may hold a shorter length from the request's started record)."""
    core, (k, _) = serving()
    core.on_backend(W1, Iteration(ids=[k], tokens=[5], started=[Started(k, 3, 1)]), 1.0)
    out = core.on_backend(W1, Iteration(ids=[k], tokens=[6], finished=[
        Finished(k, FinishReason.LENGTH, prompt_tokens=None, cached_tokens=5)]), 2.0)
    fin, _, tokens = relayed(out)
    assert (fin[0].prompt_tokens, fin[0].cached_tokens) == (None, None) and tokens == [6]


@pytest.mark.parametrize("bad", [
    PrefixCacheUsage(100, 40, 2**24 + 1, 2**24),  # more held than the budget (the cache never passes it)
    PrefixCacheUsage(99, 40, 2**20, 2**24), PrefixCacheUsage(100, 39, 2**20, 2**24),  # cumulative counts fell
])
def test_prefix_cache_numbers_over_the_budget_or_going_back_keep_the_last_sound_report(bad):
    core, _ = serving()
    good = PrefixCacheUsage(100, 40, 2**20, 2**24)
    core.on_backend(W1, Heartbeat(progress=1, prefix_cache=good), 1.0)
    core.on_backend(W1, Heartbeat(progress=2, prefix_cache=bad), 2.0)
    assert core.workers.get(W1).prefix_cache == good
    core.on_backend(W1, Heartbeat(progress=3, prefix_cache=good._replace(used_bytes=0)), 3.0)  # evicted: sound
    assert core.workers.get(W1).prefix_cache.used_bytes == 0


@pytest.mark.parametrize("where", ["top", "prompt", "prompt_ids"])
def test_a_logprobs_token_id_outside_the_vocabulary_ends_its_request_alone(where):
    """The ids a logprobs record names (alternatives, a text prompt's ids) are rendered by the
    gateway's tokenizer (a negative one raised there): one outside the vocabulary ends its request
    as a generated one does; the other request's logprobs arrive."""
    core, (k1, k2) = serving()
    good = TokenLogprob(-0.5, ((5, -0.5),))
    bad = {"top": Logprobs(k2, (TokenLogprob(-0.5, ((-3, -1.0),)),)),
           "prompt": Logprobs(k2, (good,), (None, TokenLogprob(-1.0, ((INFO.vocab_size, -2.0),)))),
           "prompt_ids": Logprobs(k2, (good,), (None, good), (7, -3))}[where]
    out = core.on_backend(W1, Iteration(ids=[k1, k2], tokens=[5, 5], logprobs=[Logprobs(k1, (good,)), bad]), 1.0)
    fin, _, tokens = relayed(out)
    assert tokens == [5] and list(fin) == [1] and fin[1].code is ErrorCode.MODEL_ERROR
    assert [r.request_id for r in sent(out, Side.FRONTEND, C1, Results)[0].logprobs] == [0]
    assert [c.request_ids for c in sent(out, Side.BACKEND, W1, Cancel)] == [(k2,)]


@pytest.mark.parametrize(("sent_end", "got"), [
    ((FinishReason.ERROR, ErrorCode.MODEL_ERROR, "boom"), (FinishReason.ERROR, ErrorCode.MODEL_ERROR, "boom")),
    ((FinishReason.LENGTH, None, None), (FinishReason.LENGTH, None, None)),
    ((FinishReason.ERROR, None, "boom"), (FinishReason.ERROR, ErrorCode.INTERNAL, "boom")),  # an error has a code
    ((FinishReason.ERROR, None, None), (FinishReason.ERROR, ErrorCode.INTERNAL, None)),
    ((FinishReason.STOP, ErrorCode.MODEL_ERROR, "x"), (FinishReason.STOP, None, None)),  # only an error has one
])
def test_an_ending_whose_code_contradicts_its_reason_is_made_consistent(sent_end, got):
    """Finished's rule: ``code`` is an ErrorCode when ``finish_reason`` is ``error``, else None; the
    client turns a code into the handle's error (so a stop with one would carry an error, and an
    error without one none)."""
    core, (k, _) = serving()
    out = core.on_backend(W1, Iteration(ids=[k], tokens=[5], finished=[Finished(k, *sent_end)]), 1.0)
    fin = relayed(out)[0][0]
    assert fin.finish_reason is got[0] and fin.code is got[1]
    if got[2] is None:
        assert fin.message is None or (got[1] is ErrorCode.INTERNAL and W1.decode() in fin.message)
    else:
        assert got[2] in fin.message



def test_a_worker_sending_past_max_tokens_never_gets_them_relayed():
    """The broker is the trust boundary: no request's client gets more than ``max_tokens``
    tokens, whatever a worker sends. A token past it is withheld, the request ends ``model_error``
    at once (the worker's own ending, in the same iteration or later, is ignored) and is cancelled
    on the worker, its credit back; the other request's tokens and ending arrive. Was: all six
    relayed, then the error."""
    core, (k1, k2) = serving()  # max_tokens 4
    out = core.on_backend(W1, Iteration(ids=[k1, k2, k2, k2, k2, k2, k2], tokens=[9, 1, 2, 3, 4, 5, 6], texts=[
        (k2, "text of six")], finished=[Finished(k2, FinishReason.LENGTH), Finished(k1, FinishReason.STOP)]), 1.0)
    fin, _, tokens = relayed(out)
    assert tokens == [9, 1, 2, 3, 4]  # k2's first four, never its fifth and sixth
    assert fin[1].finish_reason is FinishReason.ERROR and fin[1].code is ErrorCode.MODEL_ERROR
    assert "sent 6 tokens for a request of max_tokens 4; those past it were not relayed" in fin[1].message
    assert fin[0].finish_reason is FinishReason.STOP
    assert not [t for r in sent(out, Side.FRONTEND, C1, Results) for t in r.texts]  # (nor its text)
    assert [c.request_ids for c in sent(out, Side.BACKEND, W1, Cancel)] == [(k2,)]
    assert [s.request_id for s in assigned(out)] == [2]  # the credit came back: the queued request runs


def test_tokens_past_max_tokens_are_withheld_across_iterations():
    """Counted per request over its iterations: three, then three more of which one fits."""
    core, (k1, k2) = serving()  # max_tokens 4
    fin, _, tokens = relayed(core.on_backend(W1, Iteration(ids=[k2, k2, k2], tokens=[1, 2, 3]), 1.0))
    assert tokens == [1, 2, 3] and fin == {}
    out = core.on_backend(W1, Iteration(ids=[k1, k2, k2, k2], tokens=[9, 4, 5, 6]), 2.0)
    fin, _, tokens = relayed(out)
    assert tokens == [9, 4] and list(fin) == [1] and fin[1].code is ErrorCode.MODEL_ERROR
    assert "sent 6 tokens" in fin[1].message
    later = core.on_backend(W1, Iteration(ids=[k2, k1], tokens=[7, 8], finished=[
        Finished(k2, FinishReason.LENGTH)]), 3.0)
    fin, _, tokens = relayed(later)
    assert tokens == [8] and fin == {}  # (the worker goes on: still nothing of k2's)


def test_a_request_lost_with_all_its_tokens_ends_instead_of_migrating():
    """A request holding its ``max_tokens`` tokens when its worker is lost is complete: it ends
    ``length`` (a resume with them is refused as complete, ``bad_request``, on the next worker);
    one sent more ended ``model_error`` as they came (none holds more); one with room left migrates."""
    core, (k1, k2, k3) = serving(slots=3)
    core.on_backend(W2, Register("simulated", 3, 3, INFO, W2.decode()), 0.0)
    out = core.on_backend(W1, Iteration(ids=[k1] + [k2] * 4 + [k3] * 5, tokens=[9] + [1] * 4 + [2] * 5), 1.0)
    fin = relayed(out)[0]
    assert list(fin) == [2] and fin[2].finish_reason is FinishReason.ERROR and fin[2].code is ErrorCode.MODEL_ERROR
    out = core.on_backend(W1, Bye(), 2.0)
    fin = relayed(out)[0]
    assert list(fin) == [1] and fin[1].finish_reason is FinishReason.LENGTH and fin[1].code is None
    assert [(e.request_id, e.resume_tokens) for e in assigned(out, W2)] == [(k1, (9,))]


@pytest.mark.parametrize("kind, send, says", [
    ("tokens past max_tokens", lambda k: Iteration(ids=[k] * 5, tokens=[1, 2, 3, 4, 5]),  # (max_tokens 4)
     "the tokens past it were withheld and each request that overran ended model_error (cancelled on the worker); "
     "its other requests are served as before"),
    ("token counts", lambda k: Iteration(ids=[k], tokens=[5], started=[Started(k, 10, 11)]),
     "the counts were dropped (unknown to the client); its requests are served as before"),
    ("error codes", lambda k: Iteration(ids=[k], tokens=[5], finished=[Finished(k, FinishReason.ERROR)]),
     "each ending's code was made to agree with its finish_reason (an error with none: internal); its requests "
     "are served as before"),
    ("prefix-cache numbers", lambda k: Heartbeat(progress=1, prefix_cache=PrefixCacheUsage(1, 2, 0, 0)),
     "they were dropped (its last sound report stays); its requests are served as before"),
])
def test_each_faults_log_line_says_what_was_done(caplog, kind, send, says):
    """Was: every kind said "dropped or made consistent, and its requests are served as before", untrue
    of a request ended for overrunning its max_tokens."""
    core, (k, _) = serving()
    with caplog.at_level(logging.WARNING, logger="broker.workers"):
        out = core.on_backend(W1, send(k), 1.0)
    (line,) = [r.getMessage() for r in caplog.records]
    assert f"worker {W1.decode()} reported impossible {kind} (" in line and f"): {says}; is it a slotserve" in line
    if kind == "tokens past max_tokens":  # (what the line says is what happened)
        assert relayed(out)[0][0].code is ErrorCode.MODEL_ERROR
