"""Numbers JSON cannot hold (NaN, infinities, and ``1e400``, which reads as infinity) in the JSON a
request carries: template variables, tool definitions, a schema, a call's arguments, each given as
Python values (the SDK) or JSON text (the wire, ``slotserve run`` rows). They were refused in
``json.dumps``'s words, naming no place ("tools must be JSON: Out of range float values are not JSON
compliant"), and a call's arguments text holding ``1e400`` was taken (the worker's template writes
``Infinity`` into the prompt). Now a ValueError names the place (``tools[0].function.parameters.
properties.a.default is NaN ...``), on the wire a :class:`Rejected` entry says it, and a ``slotserve
run`` row whose ``id`` holds one gets an error row (its result row echoed ``"id": NaN``, no JSON).
"""

from __future__ import annotations

import io
import json
import math

import msgpack
import pytest

from broker import BrokerConfig
from client import Client
from protocol.codec import decode, encode
from protocol.json_numbers import check_finite, first_nonfinite, loads, nonfinite_words, path_text
from protocol.messages import Envelope, Rejected, Submit
from protocol.request import RequestParams
from slotserve.job import run_job
from slotserve.launcher import ClusterConfig, LocalCluster
from worker.config import WorkerConfig

CHAT = [{"role": "user", "content": "hi"}]
NAN_WORDS = "which is no JSON number (JSON has no NaN or Infinity, RFC 8259)"
RANGE_WORDS = "past a double's range (about 1.8e308: it reads as infinity)"


def _tool(parameters) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "parameters": parameters}}]


ANSWER = {"role": "tool", "tool_call_id": "c1", "content": "ok"}  # (a call is answered right after it: Answers)


def _called(arguments) -> list[dict]:
    return CHAT + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}, ANSWER]


# ---------------------------------------------------------------------- the reading

def test_loads_keeps_what_was_written_and_says_whether_there_was_one():
    value, found = loads('{"a": [1, 2.5, {"b c": NaN}], "x": 1e400, "y": -Infinity, "z": -1e400}')
    assert found and math.isnan(value["a"][2]["b c"]) and value["x"] == math.inf and value["y"] == -math.inf
    assert [value["a"][2]["b c"].text, value["x"].text, value["y"].text, value["z"].text] == \
        ["NaN", "1e400", "-Infinity", "-1e400"]
    assert loads('{"a": 1.7e308, "b": 1e-400, "c": "NaN"}') == ({"a": 1.7e308, "b": 0.0, "c": "NaN"}, False)
    with pytest.raises(ValueError):
        loads("{")


def test_the_first_one_in_order_and_its_place():
    value, _ = loads('{"a": [1, {"b c": NaN}], "x": 1e400}')
    path, number = first_nonfinite(value)
    assert path == ("a", 1, "b c")
    assert path_text("f", path) == 'f.a[1]["b c"]' and path_text("", path, dotted=True) == "a.1.b c"
    assert first_nonfinite({"a": [1.0, (2, {"k": math.inf})]})[0] == ("a", 1, 1, "k")
    assert first_nonfinite({"a": [1.0, "inf", None, True]}) is None
    deep = [math.nan]
    for _ in range(5000):  # (deeper than Python's recursion limit: the walk is iterative)
        deep = [deep]
    assert first_nonfinite(deep)[0] == (0,) * 5001


def test_the_words_say_what_was_written():
    assert nonfinite_words("p", loads("1e400")[0]) == (
        "p is 1e400, past a double's range (about 1.8e308: it reads as infinity); send a number within range, "
        "or the value as a string")
    assert nonfinite_words("p", math.nan) == (f"p is NaN, {NAN_WORDS}; send a finite number, or the value as a "
                                              "string")
    assert nonfinite_words("p", -math.inf).startswith("p is -Infinity, which is no JSON number")
    with pytest.raises(ValueError, match=r"^tools\.t\[1\]\.k is Infinity"):
        check_finite({"t": [1.0, {"k": math.inf}]}, "tools")


# ---------------------------------------------------------------------- the SDK's request

SDK_MEMBERS = [  # (options, the words the ValueError starts with)
    pytest.param({"chat_template_kwargs": {"x": math.nan}}, f"chat_template_kwargs.x is NaN, {NAN_WORDS}",
                 id="template-kwargs"),
    pytest.param({"chat_template_kwargs": '{"x": [1, 1e400]}'}, f"chat_template_kwargs.x[1] is 1e400, {RANGE_WORDS}",
                 id="template-kwargs-text"),
    pytest.param({"tools": _tool({"type": "object", "properties": {"a": {"default": math.inf}}})},
                 f"tools[0].function.parameters.properties.a.default is Infinity, {NAN_WORDS}", id="tools"),
    pytest.param({"tools": json.dumps(_tool({"type": "object", "properties": {"a": {"enum": [math.nan]}}}))},
                 f"tools[0].function.parameters.properties.a.enum[0] is NaN, {NAN_WORDS}", id="tools-text"),
    pytest.param({"structured": {"json_schema": {"maximum": -math.inf}}},
                 f"structured json_schema.maximum is -Infinity, {NAN_WORDS}", id="schema"),
    pytest.param({"structured": {"json_schema": '{"maximum": 1E+400}'}},
                 f"structured json_schema.maximum is 1E+400, {RANGE_WORDS}", id="schema-text"),
]
CALL_MEMBERS = [  # a call's arguments -> the place in them
    pytest.param({"a": math.nan}, f"a is NaN, {NAN_WORDS}", id="object-nan"),
    pytest.param({"a": [math.inf]}, f"a[0] is Infinity, {NAN_WORDS}", id="object-inf"),
    pytest.param('{"a": 1e400}', f"a is 1e400, {RANGE_WORDS}", id="text-1e400"),  # (was taken)
    pytest.param('{"a": {"b": -1e999}}', f"a.b is -1e999, {RANGE_WORDS}", id="text-minus-1e999"),  # (was taken)
    pytest.param('{"a": Infinity}', f"a is Infinity, {NAN_WORDS}", id="text-infinity"),
]


@pytest.mark.parametrize("options, message", SDK_MEMBERS)
def test_request_params_name_the_place(options, message):
    with pytest.raises(ValueError) as ei:
        RequestParams(CHAT, 3, **options)
    assert str(ei.value).startswith(message), str(ei.value)


@pytest.mark.parametrize("arguments, inner", CALL_MEMBERS)
def test_a_calls_arguments_name_the_place_in_them(arguments, inner):
    with pytest.raises(ValueError) as ei:
        RequestParams(_called(arguments), 3)
    assert str(ei.value).startswith("chat message 1 tool_calls[0] arguments must be the JSON text of an object, with "
                                    f"JSON numbers only: {inner}"), str(ei.value)
    as_array = CHAT + [{"role": "assistant", "content": "", "tool_calls": [["c1", "f", json.dumps(arguments)
                                                                            if isinstance(arguments, dict)
                                                                            else arguments]]}]
    with pytest.raises(ValueError, match="JSON numbers only"):  # (the wire's form of a call)
        RequestParams(as_array, 3)


def test_finite_numbers_are_taken():
    p = RequestParams(_called('{"a": 1.5e300, "b": 1e-400}'), 3, chat_template_kwargs={"x": 1.7e308},
                      tools=_tool({"type": "object", "properties": {"a": {"maximum": -1.7e308}}}),
                      structured={"json_schema": '{"maximum": 1e308}'})
    assert p.prompt[1].tool_calls[0].arguments == '{"a": 1.5e300, "b": 1e-400}'
    assert json.loads(p.chat_template_kwargs) == {"x": 1.7e308}


# ---------------------------------------------------------------------- off the wire


@pytest.mark.parametrize("field, written, message", [
    ("chat_template_kwargs", '{"x":NaN}', f"chat_template_kwargs.x is NaN, {NAN_WORDS}"),
    ("tools", '[{"type":"function","function":{"name":"f","parameters":{"type":"object","default":1e400}}}]',
     f"tools[0].function.parameters.default is 1e400, {RANGE_WORDS}"),
])
def test_a_submit_whose_json_text_holds_one_rejects_that_request_alone(field, written, message):
    params = RequestParams(CHAT, 3, chat_template_kwargs={"x": 1.5}, tools=_tool({"type": "object"}))
    frame = msgpack.unpackb(encode(Submit("m", [Envelope(1, params), Envelope(2, params)])), raw=False)
    fields = frame["requests"][0][1]
    fields[fields.index(getattr(params, field))] = written
    first, second = decode(msgpack.packb(frame, use_bin_type=True)).requests
    assert type(first) is Rejected and first.request_id == 1 and message in first.message, first
    assert type(second) is Envelope and second.params == params


# ---------------------------------------------------------------------- the Client and slotserve run


@pytest.fixture(scope="module")
def client():
    any_port = "tcp://127.0.0.1:*"
    with LocalCluster(ClusterConfig(BrokerConfig(frontend=any_port, backend=any_port),
                                    (WorkerConfig(num_slots=4),), start_timeout_s=60.0)) as c:
        with Client(c.frontend) as sdk:
            sdk.wait_for_model(30)
            yield sdk


@pytest.mark.parametrize("options, message", SDK_MEMBERS)
def test_the_client_refuses_it_and_sends_nothing(client, options, message):
    with pytest.raises(ValueError) as ei:
        client.submit_request(CHAT, 3, **options)
    assert str(ei.value).startswith(message), str(ei.value)
    assert client.num_in_flight == 0


def _strict(line: str) -> dict:
    def refuse(constant):
        raise ValueError(f"{constant} in an output row")
    value, found = loads(line)
    assert not found, line
    return json.loads(line, parse_constant=refuse)


def test_a_row_whose_id_holds_one_gets_an_error_row_and_every_row_is_json(client):
    """The id is echoed in the row's result: ``"id": NaN`` was written, a line no JSON reader takes."""
    lines = ['{"id": NaN, "prompt": [1, 2], "max_tokens": 2}',
             '{"id": [1, 1e400], "prompt": [1, 2], "max_tokens": 2}',
             '{"id": {"k": -Infinity}, "prompt": [1, 2], "max_tokens": 2}',
             '{"id": "ok", "prompt": [1, 2], "max_tokens": 2, "temperature": 1e-400}',
             '{"id": "t", "prompt": [1, 2], "max_tokens": 2, "temperature": NaN}']
    out = io.StringIO()
    summary = run_job(client, io.StringIO("\n".join(lines) + "\n"), out, progress=False, timeout_s=30)
    rows = {json.dumps(r["id"]): r for r in map(_strict, out.getvalue().splitlines())}
    assert set(rows) == {"1", "2", "3", '"ok"', '"t"'} and summary.requests == 5 and summary.errors == 4
    for n, message in [(1, f"line 1: id is NaN, {NAN_WORDS}"), (2, f"line 2: id[1] is 1e400, {RANGE_WORDS}"),
                       (3, f"line 3: id.k is -Infinity, {NAN_WORDS}")]:
        row = rows[str(n)]
        assert row["finish_reason"] == "error" and row["error"]["code"] == "bad_request", row
        assert row["error"]["message"].startswith(message), row
    assert rows['"ok"']["finish_reason"] == "length"
    assert rows['"t"']["error"]["message"] == "line 5: temperature must be finite, got nan"  # (its own check, as before)
