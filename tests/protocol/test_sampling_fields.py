"""The sampling controls' fields as a request takes them (protocol/request.py): ``logit_bias``
keys as ints or as the decimal strings JSON maps carry (a ``slotserve run`` row is parsed by
``RequestParams.from_mapping`` of its ``json.loads``), and the bounds of every field."""

from __future__ import annotations

import json

import pytest

from protocol.request import RequestParams


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
