"""Structured outputs through the engine on SmolLM2-135M (worker/models/grammar.py, llguidance):
every constraint kind holds, free rows beside constrained ones are untouched, a spec that does not
compile queues nothing, speculative decoding and a migration keep the output, ``length`` endings."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from protocol.errors import UnsupportedError  # noqa: E402
from worker import BatchInferenceEngine, FinishReason, SimulatedLLM  # noqa: E402
from worker.models import load_model  # noqa: E402
from worker.models.grammar import GrammarError  # noqa: E402

pytestmark = pytest.mark.hf

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 12},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
ASK = [{"role": "user", "content": "Describe a person called Ann, aged 31, as JSON."}]
LARK = 'start: "The answer is " DIGIT "."\nDIGIT: /[0-9]/'
GBNF = 'root ::= "colour: " ("red" | "green" | "blue")'


@pytest.fixture(scope="module")
def smol():
    return load_model("smollm2-135m", precision="fp32")  # the outputs these tests pin were fp32's


def run(model, requests, batch_size=4):
    engine = BatchInferenceEngine(model, batch_size=batch_size, stop_token="model")
    handles = [engine.submit_request(prompt, n, **options) for prompt, n, options in requests]
    engine.run()
    return handles


def check_kind(kind, spec, text):
    if kind == "json_schema":
        jsonschema.validate(json.loads(text), spec)
    elif kind == "json_object":
        assert isinstance(json.loads(text), dict)
    elif kind == "regex":
        assert re.fullmatch(spec, text), text
    elif kind == "choice":
        assert text in spec
    elif kind == "grammar":
        assert re.fullmatch(r"The answer is [0-9]\.", text), text
    else:
        assert re.fullmatch(r"colour: (red|green|blue)", text), text


KINDS = [("json_schema", PERSON), ("json_object", True), ("regex", r"[A-Z][a-z]{2,8}"),
         ("choice", ["positive", "negative", "neutral"]), ("grammar", LARK), ("gbnf", GBNF)]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_every_kind_holds_in_one_batch_and_ends_stop(smol, temperature):
    kinds = KINDS if temperature == 0 else KINDS[2:]
    requests = [(ASK, 32, {"structured": {kind: spec}, "temperature": temperature, "seed": i})
                for i, (kind, spec) in enumerate(kinds)]
    for (kind, spec), h in zip(kinds, run(smol, requests, batch_size=6)):
        if kind == "json_object" and h.finish_reason == FinishReason.LENGTH:  # any object: it may ramble on
            assert h.text.startswith("{")
            continue
        assert h.finish_reason == FinishReason.STOP, (kind, h.text)
        assert h.tokens[-1] in smol.eos_token_ids  # the grammar's end allows EOS, and it is taken
        check_kind(kind, spec, h.text)


def test_free_rows_beside_constrained_ones_are_untouched(smol):
    free = [(ASK, 8, {}), ("def add(a, b):", 8, {"temperature": 0.7, "seed": 5})]
    alone = run(smol, free)
    mixed = run(smol, [free[0], (ASK, 12, {"structured": {"json_schema": PERSON}}), free[1],
                       (ASK, 10, {"structured": {"choice": ["a", "b"]}})])
    assert [h.tokens for h in alone] == [mixed[0].tokens, mixed[2].tokens]
    assert smol.grammars.masks > 0


def test_a_spec_that_does_not_compile_queues_nothing_and_the_batch_goes_on(smol):
    engine = BatchInferenceEngine(smol, batch_size=2, stop_token="model")
    good = engine.submit_request(ASK, 30, structured={"choice": ["yes", "no"]})
    for bad in [{"regex": "a(b"}, {"grammar": "start: undefined_rule"}, {"gbnf": "root ::= ("},
                {"json_schema": {"type": "no-such-type"}}]:
        with pytest.raises(GrammarError, match="does not compile") as ei:
            engine.submit_request(ASK, 10, structured=bad)
        assert ei.value.code == "bad_request"
    assert engine.num_queued == 1
    engine.run()
    assert good.finish_reason == FinishReason.STOP and good.text in ("yes", "no")


@pytest.mark.parametrize("schema", [
    {"$ref": "#"},  # only itself: no finite instance
    {"$ref": "#/definitions/a", "definitions": {"a": {"$ref": "#/definitions/a"}}},
])
def test_a_schema_with_no_output_the_engine_can_produce_is_a_bad_request(smol, schema):
    """Kind "compiles, then fails at its first token" (a break-it pass sent these: HTTP 500 with the
    engine's own text): refused at submit, as a spec that does not compile is, the batch untouched."""
    engine = BatchInferenceEngine(smol, batch_size=2, stop_token="model")
    good = engine.submit_request(ASK, 30, structured={"choice": ["yes", "no"]})
    with pytest.raises(GrammarError, match="admits no output") as ei:
        engine.submit_request(ASK, 10, structured={"json_schema": schema})
    assert ei.value.code == "bad_request" and "<state>" not in str(ei.value)
    engine.run()
    assert good.finish_reason == FinishReason.STOP and good.text in ("yes", "no")


def test_an_error_reply_keeps_the_detail_after_the_first_line():
    from worker.models.grammar import _first_lines

    error = "regex parse error:\n    ([\n     ^\nerror: unclosed character class\n<state>\nrows: 3\n</state>"
    assert _first_lines(error) == "regex parse error: ([ ^ error: unclosed character class"


def test_a_second_request_with_the_same_schema_compiles_nothing(smol):
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 7}}, "required": ["n"],
              "additionalProperties": False}
    g = smol.grammars
    compiles = g.compiles
    first, second = run(smol, [(ASK, 20, {"structured": {"json_schema": schema}})] * 2)
    assert g.compiles == compiles + 1 and first.tokens == second.tokens
    assert json.loads(first.text)["n"] >= 7


def test_a_cut_by_max_tokens_is_length_and_a_prefix(smol):
    (full,) = run(smol, [(ASK, 40, {"structured": {"json_schema": PERSON}})])
    (cut,) = run(smol, [(ASK, 5, {"structured": {"json_schema": PERSON}})])
    assert full.finish_reason == FinishReason.STOP
    assert cut.finish_reason == FinishReason.LENGTH and cut.tokens == full.tokens[:5]
    with pytest.raises(ValueError):
        json.loads(cut.text)


def test_speculative_decoding_on_keeps_the_constrained_and_free_outputs(smol):
    requests = [(ASK, 32, {"structured": {"json_schema": PERSON}}), ("1, 2, 3, 4, 1, 2, 3, 4, 1, 2,", 12, {}),
                (ASK, 12, {"structured": {"regex": r"[a-z]+( [a-z]+){0,4}"}})]
    off = run(smol, requests)
    smol.speculative_tokens, costs, smol.draft_costs = 4, smol.draft_costs, None  # every draft found
    try:
        on = run(smol, requests)
    finally:
        smol.speculative_tokens, smol.draft_costs = 0, costs
    assert [h.tokens for h in on] == [h.tokens for h in off]
    jsonschema.validate(json.loads(on[0].text), PERSON)


@pytest.mark.parametrize("at", [1, 6])
def test_a_migration_mid_json_rebuilds_the_matcher_from_the_resumed_tokens(smol, at):
    (whole,) = run(smol, [(ASK, 32, {"structured": {"json_schema": PERSON}})])
    engine = BatchInferenceEngine(smol, batch_size=2, stop_token="model")
    h = engine.submit_request(ASK, 32, structured={"json_schema": PERSON}, resume_tokens=whole.tokens[:at])
    engine.run()
    assert whole.finish_reason == FinishReason.STOP and at < len(whole.tokens) - 1
    assert h.tokens == whole.tokens and h.finish_reason == FinishReason.STOP


def test_resumed_tokens_the_grammar_refuses_fail_that_request_alone(smol):
    engine = BatchInferenceEngine(smol, batch_size=2, stop_token="model")
    wrong = smol.tokenizer.encode("hello")  # a JSON object cannot start so
    bad = engine.submit_request(ASK, 20, structured={"json_object": True}, resume_tokens=wrong)
    fine = engine.submit_request(ASK, 8)
    engine.run()
    assert bad.finish_reason == FinishReason.ERROR and "structured constraint" in str(bad.error)
    assert "<state>" not in str(bad.error) and "\n" not in str(bad.error)  # not llguidance's parser state
    assert fine.finish_reason == FinishReason.LENGTH


def test_explicit_stop_tokens_end_a_finished_grammar(smol):
    stop = smol.tokenizer.encode("\n")[-1]
    (h,) = run(smol, [(ASK, 20, {"structured": {"choice": ["yes", "no"]}, "stop_token": [stop]})])
    assert h.finish_reason == FinishReason.STOP and h.tokens[-1] == stop and h.text.strip() in ("yes", "no")


def test_cancelled_constrained_request_leaves_its_slot_clean(smol):
    engine = BatchInferenceEngine(smol, batch_size=1, stop_token="model")
    a = engine.submit_request(ASK, 60, structured={"json_schema": PERSON}, request_id="a")
    engine.step()
    engine.step()
    engine.cancel("a")
    b = engine.submit_request(ASK, 10, structured={"choice": ["yes", "no"]})
    engine.run()
    assert a.finish_reason == FinishReason.CANCELLED and b.text in ("yes", "no")


def test_models_without_grammar_support_refuse_it():
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=1)
    with pytest.raises(UnsupportedError):
        engine.submit_request([1, 2], 3, structured={"regex": "a"})


@pytest.fixture(scope="module")
def smol_hf(smollm2_hf):
    return smollm2_hf


def test_the_transformers_runner_gives_the_same_constrained_output(smol, smol_hf):
    requests = [(ASK, 32, {"structured": {"json_schema": PERSON}}), (ASK, 8, {}),
                (ASK, 12, {"structured": {"gbnf": GBNF}})]
    ours, theirs = run(smol, requests), run(smol_hf, requests)
    assert [h.text for h in ours] == [h.text for h in theirs]
    jsonschema.validate(json.loads(theirs[0].text), PERSON)
