"""A structured spec the grammar engine refuses is refused in words about what the client wrote
(worker.models.grammar._said): never a position in the Lark text llguidance wrote from a regex,
a JSON schema or a GBNF grammar, never serde_json's line and column of the JSON text llguidance
read (the schema inside its own wrapping), never the bare name of llguidance's internal error
variant (``NoExtensionBias``). A client's own Lark grammar keeps its positions (its lines). The
refusal is the worker's, at submit, so every entry point says the same (the engine's ValueError,
the wire's ``bad_request``, each HTTP field's 400, which names the field instead of
"structured <kind>"). Grammars over a byte-level vocabulary (no model), and on the real
Qwen2.5-Coder tokenizer where an install left it on disk."""

from __future__ import annotations

import json
import re

import pytest

pytest.importorskip("llguidance")
pytest.importorskip("tokenizers")
pytest.importorskip("torch")

from protocol.structured import Constraint  # noqa: E402
from tests.support.vocab import EOS, NO_QWEN, byte_level, qwen_tokenizer  # noqa: E402
from worker.models.grammar import GrammarError, Grammars  # noqa: E402

NO_OUTPUT = ("admits no output the grammar engine can produce (a schema with no finite instance, such as one "
             "that only refers to itself, or too large a lexer)")
TOO_DEEP = ("does not compile: nested too deeply: the grammar engine reads JSON at most 128 levels of objects and "
            "arrays deep, its own wrapping of the schema included")
LOOK_AROUND = ('regex parse error: (?=a) ^^^ error: look-around, including look-ahead and look-behind, is not '
               'supported')


def nested(levels: int) -> str:
    schema: dict = {}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return json.dumps(schema)


# (kind, spec, think) -> the whole refusal. Was: NO_OUTPUT + ": NoExtensionBias"; "at 1(8): " (a regex's
# place in llguidance's 'start: /(?=a)/'), "at 3(8): " (in the Lark written from the GBNF);
# "recursion limit exceeded at line 1 column 3026" (a column of llguidance's wrapping, ~ the 125th level).
MEMBERS = [
    ("json_schema", '{"$ref": "#"}', "", f"structured json_schema {NO_OUTPUT}"),
    ("json_schema", '{"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}}', "",
     f"structured json_schema {NO_OUTPUT}"),
    ("grammar", "start: start", "", f"structured grammar {NO_OUTPUT}"),
    ("grammar", 'start: x\nx: x "a"', "", f"structured grammar {NO_OUTPUT}"),
    ("gbnf", "root ::= root", "", f"structured gbnf {NO_OUTPUT}"),
    # after a thinking format (the first mask is the thinking's): was compiled and queued, then thought
    # and could never answer (its answer allowed no token) up to max_tokens
    ("json_schema", '{"$ref": "#"}', "qwen3", f"structured json_schema {NO_OUTPUT}"),
    ("grammar", "start: start", "deepseek_r1", f"structured grammar {NO_OUTPUT}"),
    ("gbnf", "root ::= root", "openai_gptoss", f"structured gbnf {NO_OUTPUT}"),
    ("regex", "(?=a)", "", f'structured regex does not compile: invalid regex "(?=a)" (in regex): {LOOK_AROUND}'),
    ("regex", "(?=a)", "qwen3", f'structured regex does not compile: invalid regex "(?=a)" (in regex): {LOOK_AROUND}'),
    ("gbnf", "root ::= x\nx ::= [b-a]", "",
     'structured gbnf does not compile: invalid regex "[b-a]" (in regex): regex parse error: [b-a] ^^^ error: '
     'invalid character class range, the start must be <= the end'),
    ("grammar", "root ::= [b-a]", "",  # (GBNF given as a grammar: converted too)
     'structured grammar does not compile: invalid regex "[b-a]" (in regex): regex parse error: [b-a] ^^^ error: '
     'invalid character class range, the start must be <= the end'),
    ("json_schema", '{"type": "string", "pattern": "(?=a)"}', "", f"structured json_schema does not compile: {LOOK_AROUND}"),
    ("json_schema", nested(125), "", f"structured json_schema {TOO_DEEP}"),
    ("json_schema", nested(300), "deepseek_r1", f"structured json_schema {TOO_DEEP}"),
    ("json_schema", json.dumps({"const": json.loads(nested(200))}), "", f"structured json_schema {TOO_DEEP}"),
    # a client's own Lark keeps the line(column) of its own text
    ("grammar", "start: x\n\nx: /(?=a)/", "", f'structured grammar does not compile: at 3(4): invalid regex "(?=a)" '
                                              f'(in regex): {LOOK_AROUND}'),
    ("grammar", "start: x\n\nx: /(?=a)/", "qwen3", f'structured grammar does not compile: at 3(4): invalid regex '
                                                   f'"(?=a)" (in regex): {LOOK_AROUND}'),
]


@pytest.fixture(scope="module", params=["bytes", "qwen2.5"])
def grammars(request) -> Grammars:
    tok = byte_level(False) if request.param == "bytes" else qwen_tokenizer()
    if tok is None:
        pytest.skip(NO_QWEN)
    eos = tok.token_to_id(EOS) if tok.token_to_id(EOS) is not None else tok.token_to_id("<|im_end|>")
    return Grammars(tok.to_str, tok.get_vocab_size(), (eos,))


@pytest.mark.parametrize("kind, spec, think, words", MEMBERS, ids=[f"{m[0]}-{i}" for i, m in enumerate(MEMBERS)])
def test_a_refused_spec_is_said_in_the_clients_terms(grammars, kind, spec, think, words):
    with pytest.raises(GrammarError) as caught:
        grammars.compile(Constraint(kind, spec, think))
    said = str(caught.value)
    assert said == words
    assert not re.search(r"NoExtensionBias|line \d+ column \d+", said)


def test_what_still_compiles_beside_them(grammars):
    """The depth the words speak of is llguidance's: a schema a level shallower compiles."""
    grammars.compile(Constraint("json_schema", nested(120)))
    grammars.compile(Constraint("grammar", 'start: "a" x\nx: "b"'))


def test_the_engine_refuses_it_at_submit_with_the_same_words(tiny_text_dir):
    """The in-process engine (and so the SDK's and the wire's ``bad_request``) raises the worker's
    words, before anything is queued."""
    pytest.importorskip("transformers")
    from worker import BatchInferenceEngine
    from worker.models import load_model

    engine = BatchInferenceEngine(load_model(tiny_text_dir), batch_size=2, stop_token="model")
    with pytest.raises(ValueError) as caught:
        engine.submit_request("hello", 4, structured={"json_schema": {"$ref": "#"}})
    assert str(caught.value) == f"structured json_schema {NO_OUTPUT}"
    with pytest.raises(ValueError) as caught:
        engine.submit_request("hello", 4, structured={"regex": "(?=a)"})
    assert str(caught.value).startswith('structured regex does not compile: invalid regex "(?=a)"')
    assert engine.num_queued == 0 and engine.num_running == 0
