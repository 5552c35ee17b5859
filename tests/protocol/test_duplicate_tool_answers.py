"""A call answered twice is refused at every entry point, as OpenAI refuses it ("Invalid parameter:
Duplicate value for 'tool_call_id' of 'c1', in messages[2] and messages[3]."): the gateway's chat
route and ``/tokenize`` refused it (056dd9b), while the Python SDK (:class:`RequestParams`, what
``Client.submit_request`` builds), ``slotserve run``'s JSONL rows (:meth:`RequestParams.from_mapping`)
and a ZeroMQ client's submit took it and ran the chat. What OpenAI takes stays taken: one answer a
call, a call made again later by its id and answered again. In process, no sockets."""

from __future__ import annotations

import msgpack
import pytest

from protocol.codec import decode, encode
from protocol.messages import Envelope, Rejected, Submit
from protocol.request import RequestParams


def _call(cid: str = "c1") -> dict:
    return {"id": cid, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}


ASK = {"role": "user", "content": "time?"}
CALLS = {"role": "assistant", "content": None, "tool_calls": [_call()]}
NOON = {"role": "tool", "tool_call_id": "c1", "content": "noon"}
SAYS = ("chat message {i} tool_call_id: Duplicate value for 'tool_call_id' of 'c1', in chat messages 2 and {i}: one "
        "tool message answers a call; leave the second out")


def _over_the_wire(messages: list[dict]) -> Rejected | Envelope:
    """A ZeroMQ client's submit of ``messages`` decoded as the broker decodes it (the chat set in a
    valid request's array, as a client in another language sends it)."""
    head = msgpack.unpackb(encode(Submit("m", [Envelope("a", RequestParams([1, 2], 3))])))
    head["requests"][0][1][0] = messages
    (request,) = decode(msgpack.packb(head)).requests
    return request


@pytest.mark.parametrize("messages", [
    [ASK, CALLS, NOON, NOON],
    [ASK, {**CALLS, "tool_calls": [_call(), _call("c2")]}, NOON, {**NOON, "tool_call_id": "c2"}, NOON],
])
def test_every_entry_point_refuses_a_call_answered_twice(messages):
    says = SAYS.format(i=len(messages) - 1)
    with pytest.raises(ValueError) as sdk:
        RequestParams(messages, 4)
    with pytest.raises(ValueError) as row:
        RequestParams.from_mapping({"messages": messages, "max_tokens": 4})
    wire = _over_the_wire(messages)
    assert isinstance(wire, Rejected), wire
    assert str(sdk.value) == str(row.value) == says, sdk.value
    assert says in wire.message, wire.message


@pytest.mark.parametrize("messages", [
    [ASK, CALLS, NOON],
    [ASK, CALLS, NOON, {"role": "user", "content": "again?"}, CALLS, NOON],  # (a call made again, answered again)
    [ASK, {"role": "tool", "tool_call_id": "zz", "content": "x"}, {"role": "tool", "tool_call_id": "zz",
                                                                    "content": "y"}],  # (no call has that id)
])
def test_every_entry_point_still_takes_one_answer_a_call(messages):
    sdk = RequestParams(messages, 4).prompt
    row = RequestParams.from_mapping({"messages": messages, "max_tokens": 4}).prompt
    wire = _over_the_wire(messages)
    assert isinstance(wire, Envelope), wire
    assert sdk == row == wire.params.prompt and [m.role for m in sdk] == [m["role"] for m in messages]
