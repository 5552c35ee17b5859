"""Property tests over random workloads (hypothesis).

For every workload: each accepted request gets exactly one terminal callback;
each result equals the request run alone (batch invariance, checked against
an independent plain re-statement of the spec, :func:`~tests.support.reference.spec_reference`); under the
continuous policy no slot is free while a request waits, and under the
static policy a batch is only ever admitted into an empty engine.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.reference import spec_reference
from worker import BatchInferenceEngine, SimulatedLLM

VOCAB = 8  # small, so stop tokens and stop sequences fire often

tokens = st.integers(0, VOCAB - 1)
request = st.fixed_dictionaries({
    "prompt": st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=5),
    "max_tokens": st.integers(1, 12),
    "stop": st.one_of(st.just("default"), st.none(), st.sets(tokens, max_size=2)),
    "stop_sequences": st.lists(st.lists(tokens, min_size=1, max_size=3), max_size=2),
    "priority": st.integers(0, 2),
    "cancel_after": st.one_of(st.none(), st.integers(1, 12)),
    "from_callback": st.booleans(),
})
workload = st.fixed_dictionaries({
    "batch_size": st.integers(1, 6),
    "policy": st.sampled_from(["continuous", "static"]),
    "requests": st.lists(request, min_size=1, max_size=25),
})


class Observed:
    """Wraps SimulatedLLM; records the batch size and queue length at every call."""

    def __init__(self) -> None:
        self.inner = SimulatedLLM(vocab_size=VOCAB, stop_rate=0.15, seed=11)
        self.vocab_size = VOCAB
        self.engine: BatchInferenceEngine | None = None
        self.calls: list[tuple[int, int, frozenset]] = []  # (batch size, queued, request ids)

    def next_tokens(self, seqs):
        ids = frozenset(r.request_id for r in self.engine._slots.reqs)
        self.calls.append((len(seqs), self.engine.num_queued, ids))
        return self.inner.next_tokens(seqs)


def _run(w):
    model = Observed()
    engine = BatchInferenceEngine(model, w["batch_size"], stop_token=0, policy=w["policy"])
    model.engine = engine
    terminal: dict[int, list[list[int]]] = {}
    streamed: dict[int, list[int]] = {}
    handles = {}
    cancel_answers: dict[int, bool] = {}
    deferred = []  # requests submitted from the callback of the one before

    def submit(i, r):
        kw = {} if r["stop"] == "default" else {"stop_token": r["stop"]}
        terminal[i], streamed[i] = [], []

        def on_token(t, i=i, r=r):
            streamed[i].append(t)
            if r["cancel_after"] == len(streamed[i]):
                cancel_answers[i] = engine.cancel(i)

        def done(seq, i=i):
            terminal[i].append(seq)
            if deferred:
                j, rj = deferred.pop(0)
                submit(j, rj)

        handles[i] = engine.submit_request(
            r["prompt"], r["max_tokens"], done, stop_sequences=r["stop_sequences"],
            on_token=on_token, priority=r["priority"], request_id=i, **kw)

    for i, r in enumerate(w["requests"]):
        if r["from_callback"] and i > 0:
            deferred.append((i, r))
        else:
            submit(i, r)
    engine.run()
    while deferred:  # only if every callback already ran before these were deferred
        j, rj = deferred.pop(0)
        submit(j, rj)
        engine.run()
    return model, engine, terminal, streamed, handles, cancel_answers


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workload)
def test_random_workloads(w):
    model, engine, terminal, streamed, handles, cancel_answers = _run(w)
    assert engine.num_queued == engine.num_running == 0
    assert engine.num_free_slots == w["batch_size"]
    for i, r in enumerate(w["requests"]):
        h = handles[i]
        # Exactly one terminal callback, carrying the handle's final sequence.
        assert len(terminal[i]) == 1 and terminal[i][0] == h.result(timeout=0)
        # Streaming equals the final result.
        assert streamed[i] == h.tokens
        stops = frozenset([0]) if r["stop"] == "default" else frozenset(r["stop"] or ())
        alone, reason = spec_reference(model.inner, r["prompt"], r["max_tokens"], stops,
                                  r["stop_sequences"])
        if cancel_answers.get(i):
            # Cancelled from its own on_token after k tokens: the first k tokens
            # of the request run alone, nothing after.
            k = r["cancel_after"]
            assert h.finish_reason == "cancelled" and h.result() == alone[: len(r["prompt"]) + k]
        else:
            # Batch invariance: the same tokens and ending as the request run alone.
            assert (h.result(), h.finish_reason) == (alone, reason)
    if w["policy"] == "continuous":
        # No slot is free while a request waits.
        for batch, queued, _ in model.calls:
            assert batch == w["batch_size"] or queued == 0
    else:
        # Static: new requests join only an empty engine -- a call that shows a new
        # request shares no request with the call before it.
        for (_, _, prev), (_, _, cur) in zip(model.calls, model.calls[1:]):
            assert cur <= prev or not (cur & prev)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(1, 30), min_size=1, max_size=40), st.integers(1, 8))
def test_results_do_not_depend_on_batch_size_or_policy(lengths, batch_size):
    outs = []
    for bs, policy in ((1, "continuous"), (batch_size, "continuous"), (batch_size, "static")):
        engine = BatchInferenceEngine(SimulatedLLM(vocab_size=50), bs, stop_token=0, policy=policy)
        hs = [engine.submit_request([i % 49 + 1, n % 49 + 1], n) for i, n in enumerate(lengths)]
        engine.run()
        outs.append([(h.result(), h.finish_reason) for h in hs])
    assert outs[0] == outs[1] == outs[2]
