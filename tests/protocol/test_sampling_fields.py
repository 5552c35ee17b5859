"""The sampling controls' fields as a request takes them (protocol/request.py): ``logit_bias``
keys as ints or as the decimal strings JSON maps carry (a ``slotserve run`` row is parsed by
``RequestParams.from_mapping`` of its ``json.loads``), the bounds of every field, and each
field reaching the same-named field of the request's ``SamplingParams``."""

from __future__ import annotations

import json

import pytest

from protocol.request import GREEDY, RequestParams, SamplingParams
from protocol.structured import Constraint


def row(**fields):
    return RequestParams.from_mapping(json.loads(json.dumps({"prompt": [1, 2], "max_tokens": 3, **fields})))


def test_a_json_row_gives_logit_bias_in_openais_shape():
    # JSON maps have string keys only: {"5": 2} was refused ("key must be an int, got str '5'").
    assert row(logit_bias={"5": 2, "17": -100, "3": 0}).logit_bias == ((5, 2.0), (17, -100.0))
    assert row(logit_bias=[[5, 2]]).logit_bias == ((5, 2.0),)
    assert RequestParams([1], 2, logit_bias={5: 2, "6": 1}).logit_bias == ((5, 2.0), (6, 1.0))


@pytest.mark.parametrize("key", ["-1", "1.5", " 3", "3 ", "0x10", "+3", "1_000", "\u0663", "", "9" * 5000])
def test_a_key_that_is_not_a_plain_decimal_id_is_refused(key):
    with pytest.raises(ValueError, match="logit_bias keys must be token ids"):
        row(logit_bias={key: 1})


@pytest.mark.parametrize("fields, says", [
    ({"logit_bias": {"7": 1, "07": 2}}, "twice"),
    ({"logit_bias": {"18446744073709551616": 1}}, "token ids"),
    ({"logit_bias": {"1": True}}, "number"),
    ({"logit_bias": {"1": None}}, "number"),
    ({"logit_bias": {"1": 100.0000001}}, r"\[-100, 100\]"),
    ({"logit_bias": {str(i): 1 for i in range(301)}}, "at most 300"),
    ({"presence_penalty": 2.0000001}, r"\[-2, 2\]"),
    ({"frequency_penalty": -2.0000001}, r"\[-2, 2\]"),
    ({"repetition_penalty": 0}, "> 0"),
    ({"repetition_penalty": -1.0}, "> 0"),
])
def test_out_of_bounds_values_are_refused_naming_the_field(fields, says):
    with pytest.raises(ValueError, match=says):
        row(**fields)


# A distinct, non-default value for every SamplingParams field a request sets (each a RequestParams
# field of the same name; min_tokens too, but the slot table sets that one: worker/slots.py).
DISTINCT = {"temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 3, "min_p": 0.05, "logit_bias": ((5, 2.0),),
            "repetition_penalty": 1.1, "presence_penalty": 0.5, "frequency_penalty": -0.25,
            "structured": Constraint("regex", "a+")}
DRAW = ("temperature", "top_p", "top_k", "seed", "min_p")  # left at GREEDY's for a greedy request


def test_every_sampling_field_of_a_request_is_named_here():
    """A field added to both tuples must be added to DISTINCT (and so to the checks below)."""
    shared = set(SamplingParams._fields) & set(RequestParams._fields) - {"min_tokens"}
    assert shared == set(DISTINCT)
    assert len(set(map(repr, DISTINCT.values()))) == len(DISTINCT)
    assert all(getattr(GREEDY, name) != value for name, value in DISTINCT.items())


def test_each_sampling_field_reaches_its_own_name():
    """Built positionally, a field inserted in the middle of SamplingParams would shift the later
    ones into their neighbours' places; by name, each value lands where it belongs."""
    sampling = RequestParams([1, 2], 3, stop_token=[9, 4], **DISTINCT).sampling
    assert {name: getattr(sampling, name) for name in DISTINCT} == DISTINCT
    assert sampling.structured_stops == (4, 9)
    assert sampling._replace(**{name: getattr(GREEDY, name) for name in DISTINCT}, structured_stops=()) == GREEDY


@pytest.mark.parametrize("structured", [False, True])
def test_a_greedy_request_keeps_its_processors_and_drops_the_draws_options(structured):
    fields = {k: v for k, v in DISTINCT.items() if k not in DRAW and (structured or k != "structured")}
    sampling = RequestParams([1, 2], 3, temperature=1e-6, top_p=0.9, top_k=40, seed=3, min_p=0.05,
                             **fields).sampling
    assert {name: getattr(sampling, name) for name in fields} == fields
    assert {name: getattr(sampling, name) for name in DRAW} == {name: getattr(GREEDY, name) for name in DRAW}
    assert RequestParams([1, 2], 3, temperature=0.0, top_k=40, seed=3).sampling is GREEDY
