"""Bad input: rejected at submission with a clear ValueError, nothing queued, nothing disturbed."""

from __future__ import annotations

import math

import pytest

from protocol.request import DEFAULT, ModelLimits, RequestParams
from worker import BatchInferenceEngine, SimulatedLLM

np = pytest.importorskip("numpy")

VOCAB = 100

BAD_REQUESTS = [
    # (args, kwargs, message fragment)
    (([], 5), {}, "prompt must not be empty"),
    ((None, 5), {}, "prompt must be a list"),
    (("hello", 5), {}, "no tokenizer"),
    (({1: 2}, 5), {}, "prompt must be a list"),
    (({1, 2}, 5), {}, "prompt must be a list"),
    (([1, "2"], 5), {}, "must be an int"),
    (([1, 2.0], 5), {}, "must be an int"),
    (([1, True], 5), {}, "got true"),
    (([1, -1], 5), {}, "negative token id"),
    (([1, VOCAB], 5), {}, "outside the model's vocabulary"),
    (([1], 0), {}, "max_tokens must be >= 1"),
    (([1], -3), {}, "max_tokens must be >= 1"),
    (([1], 2.0), {}, "max_tokens must be an int"),
    (([1], "5"), {}, "max_tokens must be an int"),
    (([1], True), {}, "got true"),
    (([1], None), {}, "max_tokens must be an int"),
    (([1], 5), {"stop_sequences": [[]]}, "must not be empty"),
    (([1], 5), {"stop_sequences": [1, 2]}, "for one sequence pass"),
    (([1], 5), {"stop_sequences": "ab"}, "stop_sequences must be a list"),
    (([1], 5), {"stop_sequences": [[1, VOCAB]]}, "outside the model's vocabulary"),
    (([1], 5), {"stop_token": VOCAB}, "outside the model's vocabulary"),
    (([1], 5), {"stop_token": -1}, "stop_token must be >= 0"),
    (([1], 5), {"stop_token": 1.5}, "stop_token must be an int"),
    (([1], 5), {"stop_token": True}, "got true"),
    (([1], 5), {"priority": 1.5}, "priority must be an int"),
    (([1], 5), {"priority": "high"}, "priority must be an int"),
    (([1], 5), {"timeout_s": 0}, "timeout_s must be a finite number"),
    (([1], 5), {"timeout_s": -1.0}, "timeout_s must be a finite number"),
    (([1], 5), {"timeout_s": math.inf}, "timeout_s must be a finite number"),
    (([1], 5), {"timeout_s": "10"}, "timeout_s must be"),
    (([1], 5), {"timeout_s": True}, "timeout_s must be"),
    (([1], 5), {"temperature": -0.1}, "temperature must be >= 0"),
    (([1], 5), {"temperature": math.nan}, "temperature must be finite"),
    (([1], 5), {"top_p": 0.0}, "top_p must be in"),
    (([1], 5), {"top_p": 1.5}, "top_p must be in"),
    (([1], 5), {"top_k": -1}, "top_k must be >= 0"),
    (([1], 5), {"top_k": 2.5}, "top_k must be an int"),
    (([1], 5), {"seed": -1}, "seed must be >= 0"),
    (([1], 5), {"seed": "x"}, "seed must be an int"),
    (([1], 5), {"request_id": ""}, "request_id must be 1.."),
    (([1], 5), {"request_id": "x" * 257}, "request_id must be 1.."),
    (([1], 5), {"request_id": 1.5}, "request_id must be an int"),
    (([1], 5), {"resume_tokens": [1, 2, 3, 4, 5]}, "already complete"),
    (([1], 5), {"resume_tokens": [VOCAB]}, "outside the model's vocabulary"),
    (([1], 5), {"callback": 42}, "callback must be callable"),
    (([1], 5), {"on_token": "print"}, "on_token must be callable"),
    (([1] * 60, 41), {}, "exceeds the served context of 100 tokens"),
]


@pytest.mark.parametrize("args, kwargs, message", BAD_REQUESTS)
def test_bad_request_rejected_nothing_queued_later_requests_unaffected(args, kwargs, message):
    model = SimulatedLLM(vocab_size=VOCAB, max_seq_len=100, stop_rate=0.0)
    engine = BatchInferenceEngine(model, batch_size=2, stop_token=0)
    before = engine.submit_request([1, 2], 3)
    with pytest.raises(ValueError, match=message):
        engine.submit_request(*args, **kwargs)
    assert engine.num_queued == 1
    after = engine.submit_request([3, 4], 3)
    engine.run()
    assert model.calls == 3 and model.sequences == 6  # the bad request never reached the model
    assert before.finish_reason == after.finish_reason == "length"


def test_bad_request_inside_run_does_not_disturb_running_requests():
    engine = BatchInferenceEngine(SimulatedLLM(vocab_size=VOCAB, stop_rate=0.0), batch_size=2)
    errors = []

    def submit_bad(token):
        try:
            engine.submit_request([], 1)
        except ValueError as e:
            errors.append(e)

    h = engine.submit_request([1], 4, on_token=submit_bad)
    engine.run()
    assert len(errors) == 4 and h.finish_reason == "length" and h.error is None


def test_numpy_integers_accepted_everywhere_as_plain_ints():
    engine = BatchInferenceEngine(SimulatedLLM(vocab_size=VOCAB), 2, stop_token=np.int64(0))
    h = engine.submit_request(np.array([1, 2, 3]), np.int32(4), stop_sequences=[np.array([5, 6])],
                              priority=np.int8(1), top_k=np.int16(3), seed=np.uint8(2),
                              stop_token=[np.int64(7)], timeout_s=np.float32(30.0))
    engine.run()
    assert h.prompt == [1, 2, 3] and all(type(t) is int for t in h.prompt)
    assert h.finish_reason in ("stop", "length")


def test_numpy_bools_and_floats_rejected():
    with pytest.raises(ValueError, match="must be an int, got true"):
        RequestParams([np.True_], 1)
    with pytest.raises(ValueError, match="max_tokens must be an int"):
        RequestParams([1], np.float64(3.0))
    with pytest.raises(ValueError, match="max_tokens must be an int, got true"):
        RequestParams([1], np.bool_(True))


def test_request_params_normalise():
    p = RequestParams((1, 2), 3, stop_token=[4, 4, 5], stop_sequences=[(1, 2), [1, 2], [3]], priority=2,
                      timeout_s=1)
    assert p.prompt == (1, 2) and p.max_tokens == 3 and p.stop_token == (4, 5)
    assert p.stop_sequences == ((1, 2), (3,)) and p.timeout_s == 1.0 and type(p.timeout_s) is float
    assert p.priority == 2 and p.check_resume([7]) == (7,)
    assert RequestParams([1], 1).stop_token == DEFAULT
    assert RequestParams([1], 1, stop_token=None).stop_token == ()
    assert RequestParams([1], 1, stop_token=0).stop_token == (0,)
    assert RequestParams([1], 1, stop_token={3, 1}).stop_token == (1, 3)
    assert RequestParams([1], 1) == RequestParams(prompt=[1], max_tokens=1, stop_token=DEFAULT)
    with pytest.raises(ValueError, match="context of 4 tokens"):
        ModelLimits(vocab_size=10, max_seq_len=4).check(p)
    with pytest.raises(TypeError, match="unknown request option"):
        RequestParams([1], 1, stop_tokens=[1])


def test_prompt_plus_max_tokens_may_fill_the_context_exactly():
    model = SimulatedLLM(vocab_size=VOCAB, max_seq_len=10, stop_rate=0.0)
    engine = BatchInferenceEngine(model, 1)
    h = engine.submit_request([1] * 4, 6)
    engine.run()
    assert len(h.result()) == 10


@pytest.mark.parametrize("module", ["validation", "request"])
def test_validation_modules_import_only_stdlib(module):
    import ast
    import importlib
    import pathlib
    import sys

    tree = ast.parse(pathlib.Path(importlib.import_module(f"protocol.{module}").__file__).read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}
    names |= {n.module.split(".")[0] for n in ast.walk(tree)
              if isinstance(n, ast.ImportFrom) and n.module}
    assert names <= set(sys.stdlib_module_names) | {"__future__", "protocol"}


def test_bad_model_attributes_rejected():
    class M:
        vocab_size = 0

        def next_tokens(self, seqs):
            return [1] * len(seqs)

    with pytest.raises(ValueError, match="vocab_size"):
        BatchInferenceEngine(M(), 1)
    with pytest.raises(ValueError, match="eos_token_ids"):
        BatchInferenceEngine(ScriptlessModel(), 1, stop_token="model")


class ScriptlessModel:
    def next_tokens(self, seqs):
        return [1] * len(seqs)
