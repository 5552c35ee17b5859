"""A tool message that answers no call, or a call answered already, is refused at every entry point
by one rule (:class:`protocol.chat.Answers`), as OpenAI refuses it ("Invalid parameter: Duplicate value
for 'tool_call_id' of 'c1', in messages[2] and messages[3]."; a tool message must answer a call of
an earlier message, and name it: ``tool_call_id`` is required): the gateway's chat route and
``/tokenize`` refused each (056dd9b), while the Python SDK (:class:`RequestParams`, what
``Client.submit_request`` builds), ``slotserve run``'s JSONL rows (:meth:`RequestParams.from_mapping`)
and a ZeroMQ client's submit took them and ran the chat (a call answered twice: until 92beb11; an id
no earlier call has, or none: until now). What OpenAI takes stays taken: one answer a call, a call
made again later by its id and answered again, a call sent without an id answered by any. In
process, no sockets; the gateway's words: tests/gateway/test_tool_answers_everywhere.py."""

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
SAYS = ("chat message {i} tool_call_id: Duplicate value for 'tool_call_id' of 'c1', in chat message 2 and chat "
        "message {i}: one tool message answers a call; leave the second out")


def _over_the_wire(messages: list[dict]) -> Rejected | Envelope:
    """A ZeroMQ client's submit of ``messages`` decoded as the broker decodes it (the chat set in a
    valid request's array, as a client in another language sends it)."""
    head = msgpack.unpackb(encode(Submit("m", [Envelope("a", RequestParams([1, 2], 3))])))
    head["requests"][0][1][0] = messages
    (request,) = decode(msgpack.packb(head)).requests
    return request


def _refused_everywhere(messages, says):
    """The Python SDK, a row and the wire refuse ``messages``, each in the words ``says``."""
    with pytest.raises(ValueError) as sdk:
        RequestParams(messages, 4)
    with pytest.raises(ValueError) as row:
        RequestParams.from_mapping({"messages": messages, "max_tokens": 4})
    wire = _over_the_wire(messages)
    assert isinstance(wire, Rejected), wire
    assert str(sdk.value) == str(row.value) == says, sdk.value
    assert says in wire.message, wire.message


@pytest.mark.parametrize("messages", [
    [ASK, CALLS, NOON, NOON],
    [ASK, {**CALLS, "tool_calls": [_call(), _call("c2")]}, NOON, {**NOON, "tool_call_id": "c2"}, NOON],
])
def test_every_entry_point_refuses_a_call_answered_twice(messages):
    says = SAYS.format(i=len(messages) - 1)
    _refused_everywhere(messages, says)


NO_CALL = ("chat message {i} tool_call_id: {id} is the id of no tool call in an earlier assistant message: give the "
           "id of the call this message answers (and the assistant message with that call before it)")
NO_ID = ("chat message {i} tool_call_id: a tool message needs the tool_call_id of the call it answers; give the id of "
         "that call (the assistant message's tool_calls[].id)")


@pytest.mark.parametrize("messages, says", [
    ([ASK, NOON], NO_CALL.format(i=1, id="'c1'")),                                           # no call at all
    ([ASK, {**CALLS, "tool_calls": [_call("c2")]}, NOON], NO_CALL.format(i=2, id="'c1'")),   # another call's id
    ([ASK, NOON, CALLS], NO_CALL.format(i=1, id="'c1'")),                                    # the call comes after
    ([ASK, {"role": "tool", "tool_call_id": "zz", "content": "x"}], NO_CALL.format(i=1, id="'zz'")),
    ([ASK, CALLS, {"role": "tool", "content": "noon"}], NO_ID.format(i=2)),                  # no id
    ([ASK, CALLS, {**NOON, "tool_call_id": ""}], NO_ID.format(i=2)),
    ([ASK, CALLS, {**NOON, "tool_call_id": None}], NO_ID.format(i=2)),
])
def test_every_entry_point_refuses_a_tool_message_that_answers_no_call(messages, says):
    _refused_everywhere(messages, says)


def test_a_chat_message_pair_off_the_wire_is_held_to_the_rule():
    # ([role, content] pairs, ChatMessages, a raw client's arrays: a tool message of two fields has no id)
    with pytest.raises(ValueError, match=r"^chat message 1 tool_call_id: a tool message needs"):
        RequestParams([("user", "hi"), ("tool", "noon")], 4)
    wire = _over_the_wire([["user", "hi"], ["assistant", "", [["c1", "get_time", "{}"]]], ["tool", "noon", [], "c9"]])
    assert isinstance(wire, Rejected) and NO_CALL.format(i=2, id="'c9'") in wire.message, wire


@pytest.mark.parametrize("messages", [
    [ASK, CALLS, NOON],
    [ASK, CALLS, NOON, {"role": "user", "content": "again?"}, CALLS, NOON],  # (a call made again, answered again)
    [ASK, {**CALLS, "tool_calls": [{**_call(), "id": ""}]}, NOON, {**NOON, "tool_call_id": "c2"}],  # (no id: any)
])
def test_every_entry_point_still_takes_one_answer_a_call(messages):
    sdk = RequestParams(messages, 4).prompt
    row = RequestParams.from_mapping({"messages": messages, "max_tokens": 4}).prompt
    wire = _over_the_wire(messages)
    assert isinstance(wire, Envelope), wire
    assert sdk == row == wire.params.prompt and [m.role for m in sdk] == [m["role"] for m in messages]
