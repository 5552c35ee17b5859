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
