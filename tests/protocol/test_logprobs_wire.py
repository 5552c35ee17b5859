"""Token logprobs on the wire (issue 20 item 3): :class:`~protocol.messages.Logprobs`
records in ``iteration`` / ``results``, their codec (``-inf`` carried, NaN and
``+inf`` refused), the rule tying entries to tokens, and framing that splits
a message without separating an entry from its token."""

from __future__ import annotations

import math

import msgpack
import pytest

from protocol.codec import decode, encode, peek_request_ids
from protocol.enums import ErrorCode
from protocol.errors import ProtocolError
from protocol.framing import fit, request_ids, split
from protocol.logprobs import TokenLogprob as T
from protocol.messages import PROTOCOL_VERSION, Iteration, Logprobs, Results, Started, Text

NEG_INF = float("-inf")


def frame(**fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, **fields}, use_bin_type=True)


def test_minus_infinity_and_none_round_trip_exactly():
    msg = Results(ids=(1, "a", 1), tokens=(5, 6, 7),
                  logprobs=(Logprobs(1, (T(NEG_INF, ((3, -0.1), (5, NEG_INF))), T(-0.0)), (None, T(-2.5, ()))),
                            Logprobs("a", (T(-1e-300, ((6, -1e-300),)),))))
    back = decode(encode(msg))
    assert back == msg
    first = back.logprobs[0]
    assert first.entries[0].logprob == NEG_INF and first.entries[0].top[1] == (5, NEG_INF)
    assert type(first.entries[0]) is T and first.prompt[0] is None and math.copysign(1, first.entries[1].logprob) < 0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "x", None, [1.0]])
def test_a_logprob_that_is_nan_plus_inf_or_no_number_is_malformed(bad):
    for entry in ([bad], [-1.0, [[3, bad]]]):
        data = frame(op="iteration", ids=[1], tokens=[3], logprobs=[[1, [entry]]])
        with pytest.raises(ProtocolError) as e:
            decode(data)
        assert e.value.code is ErrorCode.MALFORMED


@pytest.mark.parametrize("top", [[[3]], [[3, -1.0, 2]], [["3", -1.0]], [[3.0, -1.0]], 7, [7]])
def test_an_alternative_that_is_no_id_logprob_pair_is_malformed(top):
    with pytest.raises(ProtocolError) as e:
        decode(frame(op="iteration", ids=[1], tokens=[3], logprobs=[[1, [[-1.0, top]]]]))
    assert e.value.code is ErrorCode.MALFORMED


def test_int_logprobs_from_a_peer_decode_as_floats():
    msg = decode(frame(op="results", ids=[1], tokens=[3], logprobs=[[1, [[0, [[3, 0], [4, -2]]]]]]))
    (entry,) = msg.logprobs[0].entries
    assert entry == T(0.0, ((3, 0.0), (4, -2.0))) and type(entry.logprob) is float
    assert all(type(x) is float for _, x in entry.top)


def test_each_token_of_a_request_with_entries_has_exactly_one():
    with pytest.raises(ValueError, match="2 tokens and 1 logprobs entries"):
        Iteration(ids=(1, 1), tokens=(3, 4), logprobs=(Logprobs(1, (T(-1.0),)),))
    with pytest.raises(ValueError, match="0 tokens and 1 logprobs entries"):
        Results(logprobs=(Logprobs(9, (T(-1.0),)),))
    with pytest.raises(ProtocolError, match="logprobs entries") as e:  # the same rule off the wire
        decode(frame(op="iteration", ids=[1, 1], tokens=[3, 4], logprobs=[[1, [[-1.0]]]]))
    assert e.value.code is ErrorCode.MALFORMED
    # several records of one request add up (an I/O thread merges iterations); a prompt-only
    # record (prompt_logprobs alone) covers no token
    ok = Iteration(ids=(1, 2, 1), tokens=(3, 4, 5),
                   logprobs=(Logprobs(1, (T(-1.0),), (None,)), Logprobs(2, (), (None, T(-3.0))), Logprobs(1, (T(-2.0),))))
    assert decode(encode(ok)) == ok


def test_peek_and_request_ids_name_the_requests_of_logprob_records():
    msg = Iteration(ids=(1,), tokens=(3,), logprobs=(Logprobs(1, (T(-1.0),)), Logprobs(7, (), (None,))))
    assert request_ids(msg) == [1, 7]
    data = frame(op="iteration", ids=[], tokens=[], logprobs=[[1, [], [None, [float("nan")]]], [7, [], [None]]])
    with pytest.raises(ProtocolError):  # a NaN: the frame fails to decode; its requests are still named
        decode(data)
    assert peek_request_ids(data) == [1, 7]


def entries_of(parts, rid) -> list:
    return [e for p in parts for r in p.logprobs if r.request_id == rid for e in r.entries]


def tokens_of(parts, rid) -> list:
    return [t for p in parts for i, t in zip(p.ids, p.tokens) if i == rid]


def test_a_split_keeps_each_requests_entries_with_its_tokens_and_the_prompt_first():
    es = [T(-float(i), ((i, -float(i)),)) for i in range(6)]
    prompt = (None, T(-4.0), T(-5.0))
    many = Results(ids=(1, 2, 1, 2, 1), tokens=(10, 20, 11, 21, 12),
                   logprobs=(Logprobs(1, (es[0], es[1], es[2]), prompt), Logprobs(2, (es[3], es[4]))))
    a, b = split(many)
    assert set(request_ids(a)).isdisjoint(request_ids(b))
    for rid in (1, 2):
        assert entries_of((a, b), rid) == list(many.logprobs[rid - 1].entries)
    one = Results(ids=(1,) * 5, tokens=tuple(range(5)), texts=(Text(1, "abcdef"),), started=(Started(1, 3),),
                  logprobs=(Logprobs(1, tuple(es[:2]), prompt), Logprobs(1, tuple(es[2:5]))))
    first, rest = split(one)
    assert first.logprobs[0].prompt == prompt and all(r.prompt is None for r in rest.logprobs)
    assert len(entries_of([first], 1)) == len(first.ids) and len(entries_of([rest], 1)) == len(rest.ids)
    assert entries_of((first, rest), 1) == es[:5]
    # fitted into small frames, one token each at worst: entries still follow their tokens in order
    smallest = Results(ids=(1,), tokens=(0,), started=(Started(1, 3),), logprobs=(Logprobs(1, (es[0],), prompt),))
    framed = fit(one, len(encode(smallest)))  # (the largest part that cannot be split)
    parts = [p for _, p in framed.frames]
    assert not framed.refused and len(parts) >= 3
    assert tokens_of(parts, 1) == list(range(5)) and entries_of(parts, 1) == es[:5]
    assert [r.prompt for p in parts for r in p.logprobs if r.prompt is not None] == [prompt]
    assert parts[0].logprobs[0].prompt == prompt  # before any later token


def test_a_prompt_only_record_stays_with_the_first_part():
    msg = Iteration(ids=(4, 4), tokens=(1, 2), texts=(Text(4, "xy"),),
                    logprobs=(Logprobs(4, (), (None, T(-1.0)), (30, 31)),))
    first, rest = split(msg)
    assert first.logprobs == (Logprobs(4, (), (None, T(-1.0)), (30, 31)),) and rest.logprobs == ()
    assert decode(encode(msg)) == msg
    assert first.ids == (4,) and rest.ids == (4,)
