"""Structured outputs and tool grammars apply to the answer, not the thinking (issue 33 item 2): a
constraint with ``think`` (protocol.structured) compiles to a grammar that lets the model think first,
in its reasoning parser's format, then holds the answer to the constraint -- every constraint kind,
both formats, on the real Qwen2.5-Coder tokenizer (``<think>`` and ``</think>`` are text there, and
``>\\n\\n`` one token spanning the end tag and the blanks) and on the tiny byte-level one."""

from __future__ import annotations

import json
import os

import pytest

llguidance = pytest.importorskip("llguidance")
tokenizers = pytest.importorskip("tokenizers")

from protocol.structured import Constraint, check_structured  # noqa: E402
from tests.support.vocab import QWEN, kept_folder  # noqa: E402
from worker.models.grammar import Grammars, after_thinking  # noqa: E402

CONSTRAINTS = {  # kind -> (spec, an answer it takes, one it refuses)
    "json_schema": ('{"type":"object","properties":{"a":{"type":"integer"}},"required":["a"]}', '{"a": 1}',
                    '{"b": 1}'),  # (the worker's JSON separators are ", " and ": ", as OpenAI's)
    "json_object": ("", '{"x": [1, 2]}', "[1]"),
    "regex": ("[0-9]+", "42", "4a"),
    "choice": ('["yes","no"]', "yes", "maybe"),
    "grammar": ('start: "a" B\nB: /b+/', "abbb", "ba"),
    "gbnf": ('root ::= "x" [0-9]', "x7", "y7"),
}
THOUGHT = "<think>\nFirst </ think> then more.\n</think>\n\n"


def tokenizer_jsons():
    out, qwen = [("tiny", None)], kept_folder(QWEN)
    if qwen:
        out.append(("qwen", os.path.join(qwen, "tokenizer.json")))
    return out


@pytest.fixture(scope="module", params=tokenizer_jsons(), ids=lambda p: p[0])
def grammars(request, tiny_text_dir):
    path = request.param[1] or os.path.join(tiny_text_dir, "tokenizer.json")
    with open(path) as f:
        text = f.read()
    tok = tokenizers.Tokenizer.from_str(text)
    g = Grammars(lambda: text, tok.get_vocab_size(with_added_tokens=True), (0,))
    return g, tok


def accepts(grammars, text: str, constraint: Constraint) -> bool:
    g, tok = grammars
    m = g.compile(constraint).deep_copy()
    return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False).ids) and m.is_accepting()


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_qwen3_may_think_first_then_the_answer_is_held_to_the_constraint(grammars, kind):
    spec, good, bad = CONSTRAINTS[kind]
    c = check_structured([kind, spec, "qwen3"])
    assert c.think == "qwen3"
    assert accepts(grammars, THOUGHT + good, c) and accepts(grammars, good, c)  # thinking is optional
    assert not accepts(grammars, THOUGHT + bad, c) and not accepts(grammars, "<think>x</think> y</think>" + good, c)
    assert not accepts(grammars, THOUGHT + good, Constraint(kind, c.spec))  # without think: as before


@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_deepseek_r1_thinks_until_its_end_tag_then_the_answer_is_held(grammars, kind):
    spec, good, bad = CONSTRAINTS[kind]
    c = check_structured([kind, spec, "deepseek_r1"])
    assert accepts(grammars, "Some thought.\n</think>\n\n" + good, c)
    assert accepts(grammars, THOUGHT + good, c)  # (a <think> written again at the start)
    assert not accepts(grammars, good, c)  # the template opened the thinking: it must end first
    assert not accepts(grammars, "Some thought.\n</think>" + bad, c)


def test_a_bad_think_is_a_value_error():
    assert check_structured(["regex", "a"]) == Constraint("regex", "a", "")  # an older peer's [kind, spec]
    with pytest.raises(ValueError, match="think must be one of"):
        check_structured(["regex", "a", "gpt-oss"])
    with pytest.raises(ValueError, match="think must be one of"):
        after_thinking('start: "a"', "none")
    assert json.loads(after_thinking('start: "a"', "qwen3"))["grammars"][1] == {"lark_grammar": 'start: "a"',
                                                                               "name": "answer"}
