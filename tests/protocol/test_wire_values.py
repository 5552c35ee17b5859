"""Values the wire cannot carry are refused when a request is built, from every entry point.

Issue 10, kind 1 (the validation half): the submit-time check and the msgpack
encoder must agree about what is valid. msgpack carries integers in
``[-2**63, 2**64)`` and UTF-8 strings, so an int outside that range (``seed=2**64``)
or a str with a lone surrogate (``"tell me about \\ud83d"``) must be a
``ValueError`` at submit -- nothing queued, nothing sent, the caller's client
or engine working on as before -- never an exception in an I/O thread later.
The members of the kind: every int field and every str field of a request
(prompt text, chat role and content, stop tokens and sequences, request id,
resume tokens), and every entry point (``RequestParams``, the engine's
``submit_request``, ``Client.submit_request`` and its constructor, JSONL rows
of ``slotserve run``, chat messages). And the property that ties them: whatever
``RequestParams`` accepts, the codec encodes and decodes back unchanged.
"""

from __future__ import annotations

import io
import json
import math
import re

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from broker import BrokerConfig
from client import Client
from protocol.codec import decode, encode
from protocol.messages import Envelope, Submit
from protocol.request import DEFAULT, RequestParams
from protocol.validation import ROLE
from slotserve.job import run_job
from slotserve.launcher import ClusterConfig, LocalCluster
from worker import BatchInferenceEngine, SimulatedLLM
from worker.config import WorkerConfig

LONE = "tell me about \ud83d"
TOO_BIG, TOO_SMALL = 2**64, -(2**63) - 1
CHAT = [{"role": "user", "content": "hi"}]

# (args, options) of requests each carrying one value the wire cannot carry.
UNCARRIABLE = [
    pytest.param(([1, 2, 3], 4), {"seed": TOO_BIG}, id="seed"),
    pytest.param(([1, TOO_BIG], 4), {}, id="prompt-token"),
    pytest.param(([1], TOO_BIG), {}, id="max_tokens"),
    pytest.param(([1], 4), {"priority": TOO_BIG}, id="priority-high"),
    pytest.param(([1], 4), {"priority": TOO_SMALL}, id="priority-low"),
    pytest.param(([1], 4), {"top_k": TOO_BIG}, id="top_k"),
    pytest.param(([1], 4), {"stop_token": TOO_BIG}, id="stop_token"),
    pytest.param(([1], 4), {"stop_token": [5, TOO_BIG]}, id="stop_token-list"),
    pytest.param(([1], 4), {"stop_sequences": [[2, TOO_BIG]]}, id="stop_sequences"),
    pytest.param(([1], 4), {"timeout_s": 1e400}, id="timeout_s-inf"),
    pytest.param(([1], 4), {"temperature": math.nan}, id="temperature-nan"),
    pytest.param((LONE, 4), {}, id="prompt-text"),
    pytest.param(([{"role": "user", "content": LONE}], 4), {}, id="chat-content"),
    pytest.param(([{"role": "us\udfffer", "content": "hi"}], 4), {}, id="chat-role"),
]
BAD_IDS = [pytest.param(TOO_BIG, id="int"), pytest.param(TOO_SMALL, id="negative-int"),
           pytest.param("id-\ud83d", id="str")]


@pytest.mark.parametrize("args, options", UNCARRIABLE)
def test_request_params_refuse_it(args, options):
    with pytest.raises(ValueError):
        RequestParams(*args, **options)


@pytest.mark.parametrize("args, options", UNCARRIABLE)
def test_the_engine_refuses_it_and_queues_nothing(args, options):
    engine = BatchInferenceEngine(SimulatedLLM(stop_rate=0.0), 2)
    before = engine.submit_request([1, 2], 3)
    with pytest.raises(ValueError):
        engine.submit_request(*args, **options)
    assert engine.num_queued == 1
    engine.run()
    assert before.finish_reason == "length"


@pytest.mark.parametrize("request_id", BAD_IDS)
def test_the_engine_refuses_an_uncarriable_request_id(request_id):
    engine = BatchInferenceEngine(SimulatedLLM(), 2)
    with pytest.raises(ValueError, match="request_id"):
        engine.submit_request([1], 2, request_id=request_id)
    with pytest.raises(ValueError, match="resume_tokens"):
        engine.submit_request([1], 5, resume_tokens=[2, TOO_BIG])
    assert engine.num_queued == 0


@pytest.fixture(scope="module")
def cluster():
    any_port = "tcp://127.0.0.1:*"
    with LocalCluster(ClusterConfig(BrokerConfig(frontend=any_port, backend=any_port),
                                    (WorkerConfig(num_slots=4),), start_timeout_s=60.0)) as c:
        yield c


@pytest.fixture(scope="module")
def client(cluster):
    with Client(cluster.frontend) as c:
        c.wait_for_model(30)
        yield c


def _still_works(c: Client) -> None:
    assert c.num_in_flight == 0  # nothing was queued for the refused request
    h = c.submit_request([1, 2, 3], 4, stop_token=None, temperature=0.7, seed=2**64 - 1)
    c.run(timeout=20)
    assert h.finish_reason == "length" and len(h.tokens) == 4


@pytest.mark.parametrize("args, options", UNCARRIABLE)
def test_the_client_refuses_it_and_keeps_working(client, args, options):
    with pytest.raises(ValueError):
        client.submit_request(*args, **options)
    _still_works(client)


@pytest.mark.parametrize("request_id", BAD_IDS)
def test_the_client_refuses_an_uncarriable_request_id(client, request_id):
    with pytest.raises(ValueError, match="request_id"):
        client.submit_request([1], 2, request_id=request_id)
    _still_works(client)


@pytest.mark.parametrize("field", ["model", "name"])
def test_the_client_refuses_uncarriable_names(cluster, field):
    with pytest.raises(ValueError, match=field):
        Client(cluster.frontend, **{field: "x\ud800"})


def test_jsonl_rows_refuse_it_one_row_at_a_time(client):
    rows = [{"id": "big-seed", "prompt": [1, 2, 3], "max_tokens": 4, "seed": TOO_BIG},
            {"id": "ok-1", "prompt": [1, 2], "max_tokens": 3},
            {"id": "lone-text", "prompt": LONE, "max_tokens": 4},
            {"id": "lone-chat", "messages": [{"role": "user", "content": LONE}], "max_tokens": 4},
            {"id": "big-stop", "prompt": [1], "max_tokens": 4, "stop": [[TOO_BIG]]},
            {"id": "ok-2", "prompt": [3, 4], "max_tokens": 3, "temperature": 0.5, "seed": 2**64 - 1}]
    # json.dumps writes a lone surrogate as the escape "\ud83d", which json.loads reads back as one.
    out = io.StringIO()
    summary = run_job(client, io.StringIO("".join(json.dumps(r) + "\n" for r in rows)), out, progress=False,
                      timeout_s=30)
    got = {r["id"]: r for r in map(json.loads, out.getvalue().splitlines())}
    for rid in ("big-seed", "lone-text", "lone-chat", "big-stop"):
        assert got[rid]["finish_reason"] == "error" and got[rid]["error"]["code"] == "bad_request", got[rid]
    for rid in ("ok-1", "ok-2"):
        assert got[rid]["finish_reason"] == "length" and len(got[rid]["tokens"]) == 3
    assert summary.requests == 6 and summary.errors == 4
    _still_works(client)


# ---------------------------------------------------------------------- the property that ties them

anything = st.one_of(st.integers(), st.floats(), st.text(alphabet=st.characters(blacklist_categories=())),
                     st.none(), st.booleans(), st.lists(st.integers(), max_size=3))
option_names = [n for n in RequestParams._fields if n not in ("prompt", "max_tokens")]


any_text = st.text(alphabet=st.characters(blacklist_categories=()), max_size=6)
roles = st.one_of(st.from_regex(ROLE, fullmatch=True), any_text)  # (names, and text that is refused)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompt=st.one_of(st.lists(st.integers(), min_size=1, max_size=4),
                        st.text(alphabet=st.characters(blacklist_categories=()), min_size=1, max_size=6),
                        st.lists(st.fixed_dictionaries({"role": roles, "content": any_text}), min_size=1, max_size=2)),
       max_tokens=st.integers(), options=st.dictionaries(st.sampled_from(option_names), anything, max_size=4))
def test_whatever_is_accepted_travels_unchanged(prompt, max_tokens, options):
    try:
        params = RequestParams(prompt, max_tokens, **options)
    except ValueError:
        return
    msg = Submit("m", [Envelope(1, params)])
    assert decode(encode(msg)) == msg


def _look_alikes(default):
    """Values equal to an option's default: a fresh copy of it, and ones of another type."""
    if type(default) is float:
        return [float(repr(default)), -default, int(default), bool(default) if default in (0, 1) else default]
    if type(default) is int:
        return [float(default), bool(default) if default in (0, 1) else default]
    if type(default) is str:
        return ["".join(default)]
    return []


@pytest.mark.parametrize("stop_token", [DEFAULT, None, [9, 7]])
@pytest.mark.parametrize("name", option_names)
def test_a_decoded_request_with_default_looking_options_is_checked_as_given(name, stop_token):
    """Off the wire every field arrives (new float and str objects): one equal to its default and of
    its type is the default; one only equal to it (0 for 0.0, 0.0 for 0, False for 0) is checked,
    so it is normalised or refused exactly as a keyword option is -- whatever the request's
    stop_token (its own fast path: every other option at its default)."""
    if name == "stop_token" and stop_token != DEFAULT:
        return
    base = {} if name == "stop_token" else {"stop_token": stop_token}
    default = RequestParams._field_defaults[name]
    i = RequestParams._fields.index(name)
    for value in _look_alikes(default):
        full = list(RequestParams([1, 2], 3, **base))
        full[i] = value
        try:
            expected = RequestParams([1, 2], 3, **base, **{name: value})
        except ValueError:
            with pytest.raises(ValueError):
                RequestParams(*full)
            continue
        got = RequestParams(*full)
        assert got == expected and list(map(type, got)) == list(map(type, expected)), (name, value)
        wire = decode(encode(Submit("m", [Envelope(1, expected)]))).requests[0].params
        assert wire == expected and list(map(type, wire)) == list(map(type, expected)), (name, value)


@pytest.mark.parametrize("stop_token", [None, (), 7, [9, 7, 9], (3,), "default", -1, "eos", 2**64, [1, "x"], 1.5])
def test_a_decoded_stop_token_is_checked_as_a_keyword_one(stop_token):
    """A request with every other option at its default (off the wire: every field given) has its
    stop_token normalised or refused exactly as ``stop_token=`` is."""
    full = list(RequestParams([1, 2], 3))
    full[RequestParams._fields.index("stop_token")] = stop_token
    try:
        expected = RequestParams([1, 2], 3, stop_token=stop_token)
    except ValueError as e:
        with pytest.raises(ValueError, match=re.escape(str(e))):
            RequestParams(*full)
        return
    got = RequestParams(*full)
    assert got == expected and list(map(type, got)) == list(map(type, expected))


# ---------------------------------------------------------------------- JSON text inside a string

# Fields that hold JSON (tool definitions, a call's arguments, template variables, a schema): given as
# text, Python's parser reads the escape of half a surrogate pair ("\ud800" written in the text) as a
# lone surrogate; given as objects, their strings may hold one. RequestParams took both: the JSON text
# of tools, template variables and schemas then held the surrogate (the client's I/O thread or the
# broker failed to encode it: "UnicodeEncodeError: 'utf-8' codec can't encode character"), and a call's
# arguments travelled as text and failed the worker's chat template ("TextEncodeInput must be
# Union[...]", the tokenizer library's words). Each is a ValueError naming the field.
ESCAPE = "\\ud800"  # the six characters of the escape, as JSON text writes it
HISTORY = [{"role": "user", "content": "hi"}]


ANSWER = {"role": "tool", "tool_call_id": "c1", "content": "ok"}  # (a call is answered right after it: Answers)


def _called(arguments) -> list[dict]:
    return HISTORY + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": arguments}}]}, ANSWER]


def _tool(description: str) -> list[dict]:
    return [{"type": "function", "function": {"name": "f", "description": description}}]


TOOLS_TEXT = '[{"type": "function", "function": {"name": "f", "description": "' + ESCAPE + '"}}]'
IN_JSON = [  # (args, options, the words the ValueError starts with)
    pytest.param((_called('{"a": "' + ESCAPE + '"}'), 4), {},
                 "chat message 1 tool_calls[0] arguments is not valid JSON: it contains an unpaired surrogate escape "
                 "'\\ud800' at line 1 column 8", id="call-arguments-text"),
    pytest.param((_called({"a": LONE}), 4), {}, "chat message 1 tool_calls[0] arguments.a is not valid Unicode",
                 id="call-arguments-object"),
    pytest.param((_called({LONE: 1}), 4), {}, "a key of chat message 1 tool_calls[0] arguments is not valid Unicode",
                 id="call-arguments-key"),
    pytest.param((HISTORY, 4), {"tools": TOOLS_TEXT}, "tools is not valid JSON: it contains an unpaired surrogate "
                 f"escape '\\ud800' at line 1 column {TOOLS_TEXT.index(ESCAPE) + 1} (half of a UTF-16 surrogate pair, "
                 "which is no character); write the character itself, or both halves of its pair", id="tools-text"),
    pytest.param((HISTORY, 4), {"tools": _tool(LONE)}, "tools[0].function.description is not valid Unicode",
                 id="tools-object"),
    pytest.param((HISTORY, 4), {"chat_template_kwargs": '{"a": ["' + ESCAPE + '"]}'},
                 "chat_template_kwargs is not valid JSON: it contains an unpaired surrogate escape", id="kwargs-text"),
    pytest.param((HISTORY, 4), {"chat_template_kwargs": {"a": [LONE]}},
                 "chat_template_kwargs.a[0] is not valid Unicode", id="kwargs-object"),
    pytest.param((HISTORY, 4), {"structured": {"json_schema": '{"enum": ["' + ESCAPE + '"]}'}},
                 "structured json_schema is not valid JSON: it contains an unpaired surrogate escape",
                 id="schema-text"),
    pytest.param((HISTORY, 4), {"structured": {"json_schema": {"enum": [LONE]}}},
                 "structured json_schema.enum[0] is not valid Unicode", id="schema-object"),
    pytest.param((HISTORY, 4), {"structured": {"choice": '["' + ESCAPE + '"]'}},
                 "structured choice is not valid JSON: it contains an unpaired surrogate escape", id="choice-text"),
    pytest.param((HISTORY + [{"role": "tool", "content": "ok", "tool_call_id": "c\ud800"}], 4), {},
                 "chat message 1 tool_call_id is not valid Unicode", id="tool_call_id"),
    pytest.param(([{"role": "user", "content": "hi", "name": "n\udfff"}], 4), {},
                 "chat message 0 name is not valid Unicode", id="name"),
]


@pytest.mark.parametrize("args, options, words", IN_JSON)
def test_request_params_refuse_a_lone_surrogate_in_json_fields_naming_them(args, options, words):
    with pytest.raises(ValueError) as e:
        RequestParams(*args, **options)
    assert str(e.value).startswith(words), str(e.value)


@pytest.mark.parametrize("args, options, words", IN_JSON)
def test_the_client_refuses_a_lone_surrogate_in_json_fields_and_keeps_working(client, args, options, words):
    with pytest.raises(ValueError) as e:
        client.submit_request(*args, **options)
    assert str(e.value).startswith(words), str(e.value)
    _still_works(client)


def _forged(params: RequestParams, name: str, value) -> list:
    """``params`` as the wire carries them, with field ``name`` set to ``value`` unchecked (a peer's)."""
    wire = list(params)
    wire[RequestParams._fields.index(name)] = value
    return wire


@pytest.mark.parametrize("name, value, words", [
    ("prompt", [["user", "hi"], ["assistant", "", [["c1", "f", '{"a": "' + ESCAPE + '"}']]]],
     "chat message 1 tool_calls[0] arguments is not valid JSON"),
    ("tools", json.dumps(_tool("x")).replace('"x"', '"' + ESCAPE + '"'), "tools is not valid JSON"),
    ("chat_template_kwargs", '{"a": "' + ESCAPE + '"}', "chat_template_kwargs is not valid JSON"),
    ("structured", ["json_schema", '{"enum": ["' + ESCAPE + '"]}'], "structured json_schema is not valid JSON"),
])
def test_a_peers_request_with_such_text_is_rejected_alone_off_the_wire(name, value, words):
    """The broker and the worker decode a request with the codec: one whose JSON text holds the
    escape (ASCII: msgpack carries it) is a Rejected entry (the receiver ends it ``bad_request``
    with these words), its neighbour decoded. Was: decoded, then the broker failed to encode it for
    the worker ("the broker could not send this request's assign message: ... UnicodeEncodeError"),
    or the worker's tokenizer refused the rendered chat in its own words."""
    import msgpack

    from protocol.messages import PROTOCOL_VERSION, Rejected

    good = RequestParams(HISTORY, 4)
    frame = msgpack.packb({"v": PROTOCOL_VERSION, "op": "submit", "model": "m", "requests": [
        [1, _forged(good, name, value)], [2, list(good)]]}, use_bin_type=True)
    bad, fine = decode(frame).requests
    assert isinstance(bad, Rejected) and bad.request_id == 1 and bad.message.startswith(words), bad
    assert isinstance(fine, Envelope) and fine.params == good


@settings(max_examples=300, deadline=None)
@given(text=any_text, as_object=st.booleans())
def test_json_fields_accepted_are_carried_and_rendered(text, as_object):
    """Whatever text a call's arguments or a tool's description holds, as an object or as JSON text
    (``json.dumps`` writes a lone surrogate as its escape): refused, or it travels unchanged and the
    worker's chat template input (``template_dict``) and tools are UTF-8 text."""
    arguments = {"a": text} if as_object else json.dumps({"a": text})
    tools = _tool(text) if as_object else json.dumps(_tool(text))
    try:
        params = RequestParams(_called(arguments), 4, tools=tools, chat_template_kwargs={"k": text})
    except ValueError:
        assert any(0xD800 <= ord(c) <= 0xDFFF for c in text)
        return
    msg = Submit("m", [Envelope(1, params)])
    assert decode(encode(msg)) == msg
    json.dumps([m.template_dict() for m in params.prompt], ensure_ascii=False).encode("utf-8")
    params.tools.encode("utf-8")
