"""A tool's or a call's name with a newline after it, in the SDK's request and off the wire: the
``$``-anchored ``re.match`` took ``"get_time\\n"`` (Python's ``$`` matches before a final newline) in
``tools`` and in an assistant message's calls (both forms: OpenAI's object and the wire's array).
One rule now, :func:`protocol.tools.is_tool_name`, a whole match (the gateway's too:
tests/gateway/test_tool_names.py)."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from protocol.codec import decode, encode
from protocol.messages import Envelope, Rejected, Submit
from protocol.request import RequestParams
from protocol.tools import is_tool_name

CHAT = [{"role": "user", "content": "hi"}]
NEWLINE_NAMES = ["get_time\n", "f\n", "a" * 64 + "\n"]


def _tools(name: str) -> list[dict]:
    return [{"type": "function", "function": {"name": name}}]


def _called(call) -> list[dict]:  # (the call answered right after it, as every chat's must be: Answers)
    return CHAT + [{"role": "assistant", "content": "", "tool_calls": [call]},
                   {"role": "tool", "tool_call_id": "c1", "content": "noon"}]


@pytest.mark.parametrize("name", NEWLINE_NAMES)
def test_a_name_with_a_newline_after_it_is_no_tool_name(name):
    assert not is_tool_name(name) and is_tool_name(name[:-1])


@given(st.text(alphabet="ab_-9\n\r \t.", max_size=70))
def test_the_rule_is_a_whole_match(name):
    assert is_tool_name(name) == (1 <= len(name) <= 64 and all(c in "ab_-9" for c in name))


@pytest.mark.parametrize("name", NEWLINE_NAMES)
def test_request_params_refuse_it_in_tools(name):
    with pytest.raises(ValueError, match=r"^tools\[0\]\.function\.name must be 1-64 letters"):
        RequestParams(CHAT, 3, tools=_tools(name))
    RequestParams(CHAT, 3, tools=_tools(name[:-1]))


@pytest.mark.parametrize("call", [
    pytest.param({"id": "c1", "type": "function", "function": {"name": "get_time\n", "arguments": "{}"}}, id="object"),
    pytest.param(["c1", "get_time\n", "{}"], id="wire-array"),
])
def test_request_params_refuse_it_in_a_call(call):
    with pytest.raises(ValueError, match=r"^chat message 1 tool_calls\[0\] needs a function name of 1-64"):
        RequestParams(_called(call), 3)


@pytest.mark.parametrize("field", ["tools", "call"])
def test_off_the_wire_that_request_alone_is_rejected(field):
    params = RequestParams(_called(["c1", "get_time", "{}"]), 3, tools=_tools("get_time"))
    frame = msgpack.unpackb(encode(Submit("m", [Envelope(1, params), Envelope(2, params)])), raw=False)
    fields = frame["requests"][0][1]
    if field == "tools":
        fields[fields.index(params.tools)] = params.tools.replace("get_time", "get_time\\n")
    else:
        fields[0][1][2][0][1] = "get_time\n"  # (prompt -> message 1 -> its calls -> call 0 -> name)
    first, second = decode(msgpack.packb(frame, use_bin_type=True)).requests
    assert type(first) is Rejected and first.request_id == 1 and "1-64 letters" in first.message, first
    assert type(second) is Envelope and second.params == params
