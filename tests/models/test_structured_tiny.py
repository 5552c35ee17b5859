"""Structured outputs on the tiny text model (fast): the masks the engine prefetches while the
forward runs are the masks the sampler would fill itself, in mixed batches with prefill chunks,
slot reuse and cancellation; the rows stay valid. The prefetch's race with the sampler (9bad2ff)
is made deterministic by :class:`LateFill`: every fill holds its matchers until it is waited for."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from worker import BatchInferenceEngine, FinishReason  # noqa: E402
from worker.models import load_model  # noqa: E402

pytestmark = pytest.mark.hf

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["a", "b"],
          "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"enum": ["x", "yy"]}}}
REQUESTS = [("hello world", 30, {"structured": {"json_schema": SCHEMA}}),
            ("def add(a, b):", 10, {}),
            ("the quick brown fox " * 12, 20, {"structured": {"regex": "[a-e]{2,6}"}, "temperature": 0.9, "seed": 4}),
            ("slotserve", 12, {"temperature": 0.8, "seed": 2}),
            ("hello", 16, {"structured": {"choice": ["one", "two", "three"]}}),
            ("over the lazy dog", 30, {"structured": {"json_schema": SCHEMA}, "temperature": 1.0, "seed": 9})]


@pytest.fixture(scope="module")
def tiny(tiny_text_dir):
    return load_model(tiny_text_dir, max_prefill_tokens=16)  # long prompts prefill over several steps


def run(model, batch_size=3):
    engine = BatchInferenceEngine(model, batch_size=batch_size, stop_token="model")
    handles = [engine.submit_request(p, n, **o) for p, n, o in REQUESTS]
    engine.run()
    return handles


@pytest.fixture(scope="module")
def reference(tiny):
    """:func:`run` with real matchers on the real prefetch thread: its handles, and how many
    iterations' masks the prefetch filled."""
    before = tiny.grammars.prefetched
    handles = run(tiny)
    return handles, tiny.grammars.prefetched - before


def test_prefetched_masks_are_the_sampler_s_own(tiny, reference, monkeypatch):
    g = tiny.grammars
    with_prefetch, prefetched = reference
    assert prefetched > 0  # the forward overlapped some masks
    monkeypatch.setattr(g, "prefetch", lambda batch: None)
    without = run(tiny)
    assert [h.tokens for h in with_prefetch] == [h.tokens for h in without]
    for (_, _, options), h in zip(REQUESTS, with_prefetch):
        spec = options.get("structured")
        if spec is None or h.finish_reason != FinishReason.STOP:
            continue
        if "json_schema" in spec:
            jsonschema.validate(json.loads(h.text), SCHEMA)
        elif "regex" in spec:
            assert re.fullmatch(spec["regex"], h.text)
        else:
            assert h.text in spec["choice"]
    assert sum(h.finish_reason == FinishReason.STOP for h in with_prefetch if h.params.structured) >= 3


def test_a_cancel_between_prefetch_and_pick_leaves_nothing_stale(tiny):
    engine = BatchInferenceEngine(tiny, batch_size=1, stop_token="model")
    a = engine.submit_request("hello", 30, structured={"json_schema": SCHEMA}, request_id="a")
    for _ in range(3):
        engine.step()
    engine.cancel("a")
    b = engine.submit_request("hello", 16, structured={"choice": ["one", "two"]})
    engine.run()
    assert a.finish_reason == FinishReason.CANCELLED and b.text in ("one", "two")


class Lent:
    """An llguidance matcher as the prefetch thread's fill holds it: like the real one (a pyo3
    object borrowed mutably by ``LLExecutor.unsafe_compute_mask_ptr``), every call on it while
    ``lent`` raises ``RuntimeError('Already mutably borrowed')`` (llguidance 1.9.1, a fill looping on
    a thread: ``is_error`` and ``deep_copy`` raise that, ``is_accepting`` 'Already borrowed').
    ``inner`` is the real matcher."""

    def __init__(self, inner) -> None:
        self.inner, self.lent = inner, False

    def __getattr__(self, name):  # (only for names not set in __init__)
        if self.lent:
            raise RuntimeError("Already mutably borrowed")
        attr = getattr(self.inner, name)
        return (lambda: Lent(attr())) if name == "deep_copy" else attr


class LateFill:
    """The prefetch pool at its slowest, deterministically: a fill holds its matchers from the
    moment it is submitted until someone asks for its result, and runs then (on the asking thread).
    So any touch of a prefetched row's matcher before the prefetch is waited for raises, as the real
    overlap did when the forward finished before the fill (9bad2ff)."""

    def __init__(self) -> None:
        self.submitted = 0
        self.outstanding: list[LateFill.Future] = []
        self.failing = False  # fills submitted while set raise (after giving their matchers back)

    class Future:
        """A submitted fill: runs at the first ``result()``, then gives its matchers back."""

        def __init__(self, pool, fill, matchers) -> None:
            self.pool, self.fill, self.matchers, self.bits = pool, fill, matchers, None
            self.fails = pool.failing

        def result(self):
            if self.bits is None:
                self.bits = self.fill(self.matchers)
                for m in self.matchers:
                    m.lent = False
                self.pool.outstanding.remove(self)
            if self.fails:
                raise RuntimeError("the fill failed")
            return self.bits

    def submit(self, fill, matchers):
        for m in matchers:
            m.lent = True
        self.submitted += 1
        future = LateFill.Future(self, fill, matchers)
        self.outstanding.append(future)
        return future


@pytest.fixture
def late(tiny, monkeypatch):
    """``tiny``'s grammars with every row's matcher a :class:`Lent` and prefetches on a :class:`LateFill`."""
    g = tiny.grammars
    compile_, fill = g.compile, g._fill
    monkeypatch.setattr(g, "compile", lambda constraint: Lent(compile_(constraint)))
    monkeypatch.setattr(g, "_fill", lambda matchers: fill([m.inner for m in matchers]))
    pool = LateFill()
    monkeypatch.setattr(g, "_pool", pool)
    return pool


def test_no_matcher_is_touched_while_its_prefetched_fill_holds_it(tiny, reference, late):
    """The race of 9bad2ff made deterministic: each prefetch's fill holds its rows' matchers until
    it is waited for, so the sampler's mask (and a release, a new prefetch) must wait for it before
    it syncs, checks or copies a matcher; before 9bad2ff mask checked ``is_error`` first and the
    batch failed (every request in it ``error``). The outputs are those of the fast path."""
    g = tiny.grammars
    before = g.prefetched
    handles = run(tiny)
    assert [h.error for h in handles if h.finish_reason == FinishReason.ERROR] == []
    assert late.submitted > 0 and g.prefetched > before and not late.outstanding
    assert [h.tokens for h in handles] == [h.tokens for h in reference[0]]


def test_a_slot_released_while_its_fill_holds_the_matcher_waits_for_it(tiny, late):
    """A constrained row still prefilling is prefetched but not sampled: its fill is still out when
    the request is cancelled. The release drops the row without touching its matcher (it waits for
    the fill), and the slot's next constrained occupant gets a fresh matcher."""
    engine = BatchInferenceEngine(tiny, batch_size=1, stop_token="model")
    a = engine.submit_request("the quick brown fox " * 12, 30, structured={"json_schema": SCHEMA}, request_id="a")
    engine.step()  # the first 16 of the prompt's tokens: prefetched, not sampled
    assert len(late.outstanding) == 1 and a.tokens == []
    engine.cancel("a")
    b = engine.submit_request("hello", 16, structured={"choice": ["one", "two"]})
    engine.run()
    assert a.finish_reason == FinishReason.CANCELLED and not late.outstanding
    assert b.finish_reason == FinishReason.STOP and b.text in ("one", "two")


def test_a_resumed_request_s_matcher_is_rebuilt_under_late_fills(tiny, reference, late):
    """A migrated request (its tokens so far as ``resume_tokens``) beside fresh ones: its matcher is
    rebuilt from the resumed tokens inside prefetch and mask, with every fill held until waited for;
    it ends with the tokens of the uninterrupted run."""
    whole = reference[0][0].tokens  # REQUESTS[0]: a JSON schema, greedy
    engine = BatchInferenceEngine(tiny, batch_size=3, stop_token="model")
    prompt, n, options = REQUESTS[0]
    moved = engine.submit_request(prompt, n, resume_tokens=whole[:5], **options)
    others = [engine.submit_request(p, m, **o) for p, m, o in REQUESTS[1:3]]
    engine.run()
    assert 5 < len(whole) and moved.tokens == whole and moved.finish_reason == FinishReason.STOP
    jsonschema.validate(json.loads(moved.text), SCHEMA)
    assert [h.tokens for h in others] == [h.tokens for h in reference[0][1:3]] and late.submitted > 0


def test_a_fill_that_failed_is_refilled_when_sampled_and_never_fails_a_release(tiny, reference, late, caplog):
    """A prefetched fill that raised is dropped: the sampler fills those rows itself (the outputs
    are the fast path's), and a release that discards it completes (before, it raised out of
    ``release_slot`` and left the slot's cache row to its next occupant)."""
    late.failing = True
    handles = run(tiny)
    assert [h.error for h in handles if h.finish_reason == FinishReason.ERROR] == []
    assert [h.tokens for h in handles] == [h.tokens for h in reference[0]]
    engine = BatchInferenceEngine(tiny, batch_size=1, stop_token="model")
    engine.submit_request("the quick brown fox " * 12, 30, structured={"json_schema": SCHEMA}, request_id="a")
    engine.step()  # prefetched (a fill that will fail), not sampled
    assert len(late.outstanding) == 1
    engine.cancel("a")
    late.failing = False
    b = engine.submit_request("hello", 16, structured={"choice": ["one", "two"]})
    engine.run()
    assert b.finish_reason == FinishReason.STOP and b.text in ("one", "two")
    assert not [r for r in caplog.records if "release_slot" in r.getMessage()]
    assert not tiny._rows.of  # every slot's cache row given back


@pytest.mark.parametrize("structured", [{"choice": ["one", "two", "three"]}, {"json_schema": SCHEMA},
                                        {"regex": "[a-e]{2,6}"}], ids=["choice", "json_schema", "regex"])
@pytest.mark.parametrize("stop_token", [None, "other"], ids=["no stop tokens", "only another stop token"])
def test_a_finished_grammar_ends_the_request_when_its_stop_tokens_leave_eos_out(tiny, structured, stop_token):
    """Kind "a field that pairs with a constraint" (issue 33): ``ignore_eos`` (the gateway sends the
    request's stop tokens without EOS) and ``stop_token=None`` fed the EOS the finished grammar
    allowed back to it, and the request failed with the grammar engine's state in its message (a
    500). The grammar's end ends it: ``stop``, on the model's EOS, the output complete."""
    eos = tiny.eos_token_ids
    stops = None if stop_token is None else [next(t for t in range(5, 50) if t not in eos)]
    engine = BatchInferenceEngine(tiny, batch_size=2, stop_token=None)
    h = engine.submit_request("hello", 40, structured=structured, stop_token=stops)
    free = engine.submit_request("hello", 6, stop_token=stops)
    engine.run()
    ends = set(eos) | set(stops or ())  # (the request's own stop tokens end a finished grammar too)
    assert h.finish_reason is FinishReason.STOP and h.tokens[-1] in ends, (h.finish_reason, h.error)
    text = tiny.tokenizer.decode(h.tokens[:-1])
    if "choice" in structured:
        assert text in structured["choice"]
    elif "regex" in structured:
        assert re.fullmatch(structured["regex"], text), text
    else:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert free.finish_reason is FinishReason.LENGTH  # (its EOS, were it drawn, would not stop it)


def test_the_warm_up_builds_the_grammar_tokenizer_so_no_request_does(tiny_text_dir, monkeypatch):
    """The llguidance tokenizer holds the GIL while it is built (Qwen2.5's: up to 4.2 s in one call
    on a loaded machine); built by the first constrained request, on the worker's I/O thread where
    requests are submitted, it silenced the worker's heartbeats past the broker's liveness and the
    worker was declared lost. The warm-up builds it, before the model is served; a request builds none."""
    import llguidance

    from worker.warmup import warm_up

    built = []
    real = llguidance.LLTokenizer
    monkeypatch.setattr(llguidance, "LLTokenizer", lambda *a, **k: built.append(1) or real(*a, **k))
    engine = BatchInferenceEngine(load_model(tiny_text_dir), batch_size=2, stop_token="model")  # its own: unbuilt
    assert not warm_up(engine).failed
    assert len(built) == 1
    assert engine.model.grammars.prepare() == 0.0  # built already
    h = engine.submit_request("hello", 30, structured={"json_schema": SCHEMA})
    engine.run()
    assert len(built) == 1
    if h.finish_reason is FinishReason.STOP:
        jsonschema.validate(json.loads(h.text), SCHEMA)


def test_a_grammar_tokenizer_the_warm_up_cannot_build_is_logged_and_the_model_served(tiny_text_dir, monkeypatch,
                                                                                      caplog):
    import llguidance

    from worker.warmup import warm_up

    def refuse(*args, **kwargs):
        raise ValueError("no such tokenizer")

    monkeypatch.setattr(llguidance, "LLTokenizer", refuse)
    engine = BatchInferenceEngine(load_model(tiny_text_dir), batch_size=2, stop_token="model")
    with caplog.at_level("WARNING", logger="worker.warmup"):
        report = warm_up(engine)
    assert not report.failed and not report.stopped
    assert any("could not be built (ValueError: no such tokenizer)" in r.getMessage() for r in caplog.records)
    h = engine.submit_request("hello", 4)  # unconstrained requests are served
    engine.run()
    assert h.finish_reason is FinishReason.LENGTH and len(h.tokens) == 4


def test_a_grammar_being_built_holds_no_other_constrained_request(tiny, monkeypatch):
    """A build runs outside the grammar cache's lock: a request whose constraint is compiled runs
    to its end while another constraint is being built (held here; a 109,588-character GBNF grammar
    takes 8-9.7 s, on the worker's admission thread). Before, the engine loop waited for that build
    when the request took its slot (its cached matcher is looked up under that lock), every slot
    with it: the run below ended only after the build."""
    import threading

    g = tiny.grammars
    engine = BatchInferenceEngine(tiny, batch_size=2, stop_token="model")
    ready = engine.submit_request("hello", 8, structured={"regex": "[a-e]{2,6}"})  # compiled at submit
    entered, release = threading.Event(), threading.Event()
    build = g._build

    def held_build(constraint):
        if constraint[0] == "regex" and constraint[1] == "[0-9]{3,5}":
            entered.set()
            release.wait(30)
        return build(constraint)

    monkeypatch.setattr(g, "_build", held_build)
    slow: list = []
    builder = threading.Thread(
        target=lambda: slow.append(engine.submit_request("x", 6, structured={"regex": "[0-9]{3,5}"})))
    builder.start()
    try:
        assert entered.wait(30)
        engine.run()  # the compiled request alone
        assert builder.is_alive()  # (the build is still held)
        assert ready.finish_reason is not None and re.fullmatch("[a-e]{2,6}", ready.text), ready.text
    finally:
        release.set()
        builder.join(30)
    engine.run()
    assert re.fullmatch("[0-9]{3,5}", slow[0].text), slow[0].text


@pytest.mark.parametrize("options", [{"temperature": 1e308, "seed": 3},
                                     {"temperature": 1.0, "top_p": 1e-300, "seed": 3}])
def test_a_sampling_value_past_fp32s_range_keeps_the_grammar(tiny, options):
    # temperature 1e308 (inf in fp32: the grammar's -inf masks became NaN) and top_p 1e-300 (0 in fp32:
    # every token dropped) drew the vocabulary's last id: GrammarMismatch, finish_reason error.
    engine = BatchInferenceEngine(tiny, batch_size=2, stop_token="model")
    h = engine.submit_request("hello world", 30, structured={"json_schema": SCHEMA}, **options)
    held = engine.submit_request("hello world", 6, min_tokens=6, **options)
    engine.run()
    assert h.error is None and h.finish_reason in (FinishReason.STOP, FinishReason.LENGTH), h.error
    if h.finish_reason is FinishReason.STOP:
        jsonschema.validate(json.loads(h.text), SCHEMA)
    assert held.error is None and held.finish_reason is FinishReason.LENGTH
    assert not set(held.tokens) & set(tiny.eos_token_ids)  # min_tokens' mask held
