"""A request's validation messages name what a client sent in the words of the values it can send
(JSON's: an array, an object, a string, an integer, a number, null, true / false), never Python's
type names: they reach ZeroMQ clients (msgpack: an array decodes to a tuple) and JSONL rows alike,
where "got tuple", "got dict" or "got NoneType None" named nothing the client wrote. Was:
``stop[0] must be a str, got tuple``; ``request_id ... got NoneType None``; a malformed frame field
``expected str, got tuple``. A Python caller's own types (a set) are still named as before."""

from __future__ import annotations

import re

import msgpack
import pytest

from protocol.codec import decode, encode
from protocol.errors import ProtocolError
from protocol.messages import PROTOCOL_VERSION, Envelope, Rejected, Submit
from protocol.request import RequestParams, check_request_id

PYTHON_WORDS = re.compile(r"\bgot (?:a |an )?(?:list|tuple|dict|str|int|float|bool|NoneType|bytes)\b")

_FIELDS = RequestParams._fields


def _sent(**fields) -> str:
    """The message a ZeroMQ client gets for a request whose fields are ``fields`` (msgpack values, the
    others a valid token-id request's): the frame decoded as the broker decodes it."""
    head = msgpack.unpackb(encode(Submit("m", [Envelope("a", RequestParams([1, 2], 3))])))
    array = list(RequestParams([1, 2], 3))
    for name, value in fields.items():
        array[_FIELDS.index(name)] = value
    head["requests"][0][1] = array
    (rejected,) = decode(msgpack.packb(head)).requests
    assert isinstance(rejected, Rejected), rejected
    return rejected.message


@pytest.mark.parametrize("fields, says", [
    ({"prompt": {"a": 1}}, "prompt must be a list of token ids, a str or a list of chat messages, got an object"),
    ({"max_tokens": [3]}, "max_tokens must be an int, got an array [3]"),
    ({"max_tokens": "3"}, "max_tokens must be an int, got a string '3'"),
    ({"max_tokens": None}, "max_tokens must be an int, got null"),
    ({"stop_sequences": "ab"}, "stop_sequences must be a list of token lists, got a string"),
    ({"stop_sequences": [1]}, "stop_sequences[0] must be a list of int token ids, got an integer"),
    ({"stop": {"a": 1}}, "stop must be a str or a list of str, got an object"),
    ({"stop": [["x"]]}, "stop[0] must be a str, got an array"),
    ({"include_stop_str_in_output": 1}, "include_stop_str_in_output must be true or false, got an integer 1"),
    ({"temperature": [1]}, "temperature must be a number, got an array"),
    ({"temperature": "hot"}, "temperature must be a number, got a string 'hot'"),
    ({"logit_bias": "x"}, "logit_bias must be a map of token id -> bias, got a string"),
    ({"structured": [1, 2, 3, 4]}, "got an array [1, 2, 3, 4]"),
    ({"structured": [["x"], "a"]}, "structured kind must be a str, one of"),
    ({"structured": ["regex", 5]}, "structured regex must be a str, got an integer"),
    ({"structured": ["json_schema", [1]]}, "structured json_schema must be a JSON schema, a JSON object; got an array [1]"),
    ({"structured": ["choice", 5]}, "structured choice must be a non-empty list of strings, got an integer"),
    ({"chat_template_kwargs": [1]}, "chat_template_kwargs must be an object of chat template variables, e.g. "),
    ({"input_extra": {"a": 1}}, "input_extra must be a list of {\"filename\": str, \"text\": str}, got an object"),
])
def test_a_wrong_value_off_the_wire_is_named_in_json_s_words(fields, says):
    message = _sent(**fields)
    assert says in message and not PYTHON_WORDS.search(message), message


@pytest.mark.parametrize("value, says", [((1,), "got an array [1]"), (None, "got null"), (True, "got true"),
                                         ({"a": (1,)}, 'got an object {"a": [1]}')])
def test_a_request_id_off_the_wire_is_named_in_json_s_words(value, says):
    with pytest.raises(ValueError) as e:
        check_request_id(value)
    assert str(e.value).endswith(says) and not PYTHON_WORDS.search(str(e.value)), e.value


@pytest.mark.parametrize("message, says", [
    ({"op": "cancel", "request_ids": [5, [1]]},
     "field 'request_ids[1]': expected a request id (an integer, or a string of 1..256 characters), got an array"),
    ({"op": "cancel", "request_ids": "x"}, "field 'request_ids': expected an array of request ids, got a string"),
    ({"op": "error", "code": "bad_request", "message": ["x"]}, "field 'message': expected a string, got an array"),
])
def test_a_malformed_frame_field_is_named_in_msgpack_s_words(message, says):
    with pytest.raises(ProtocolError) as e:
        decode(msgpack.packb({"v": PROTOCOL_VERSION, **message}))
    assert says in str(e.value) and not PYTHON_WORDS.search(str(e.value)), e.value


def test_a_python_caller_s_own_types_are_named_as_before():
    """Only a caller in process sends a set: its type's name is as precise as it was."""
    with pytest.raises(ValueError, match=r"stop must be a str or a list of str, got set$"):
        RequestParams([1], 2, stop={"a"})
    with pytest.raises(ValueError, match=r"max_tokens must be an int, got set \{3\}$"):
        RequestParams([1], {3})
