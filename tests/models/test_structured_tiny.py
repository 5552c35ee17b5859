"""Structured outputs on the tiny text model (fast): the masks the engine prefetches while the
forward runs are the masks the sampler would fill itself, in mixed batches with prefill chunks,
slot reuse and cancellation; the rows stay valid."""

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


def test_prefetched_masks_are_the_sampler_s_own(tiny, monkeypatch):
    g = tiny.grammars
    before = g.prefetched
    with_prefetch = run(tiny)
    assert g.prefetched > before  # the forward overlapped some masks
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


def test_a_slow_prefetch_is_waited_for_before_its_matchers_are_touched(tiny, monkeypatch):
    """The fill thread borrows the matchers: the sampler's mask waits for it before it touches them
    (a fill still running when the sampler came failed the batch: 'Already mutably borrowed').
    Slowed here so that every mask waits; the outputs stay those of the fast path."""
    import time

    g = tiny.grammars
    fill = g._fill

    def slow(matchers):
        time.sleep(0.05)
        return fill(matchers)

    monkeypatch.setattr(g, "_fill", slow)
    before = g.prefetched
    handles = run(tiny)
    assert g.prefetched > before
    assert all(h.finish_reason != FinishReason.ERROR for h in handles)
