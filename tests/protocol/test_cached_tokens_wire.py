"""Protocol v7 (issue 23 step 3): ``cached_tokens`` at the end of the ``finished`` and ``started``
records, a worker's :class:`PrefixCacheUsage` in ``heartbeat`` and ``status``. Records of the v6
shape (without the trailing fields) still decode, their new fields None; a v6 frame is refused."""

from __future__ import annotations

import msgpack
import pytest

from protocol.codec import decode, encode
from protocol.enums import ErrorCode, FinishReason
from protocol.errors import ProtocolError
from protocol.messages import (
    BROKER_TO_CLIENT, PROTOCOL_VERSION, WORKER_TO_BROKER, Finished, Heartbeat, Iteration, ModelStatus, PrefixCacheUsage,
    Results, Started, Status, WorkerStatus,
)

USAGE = PrefixCacheUsage(queries=1200, hits=960, used_bytes=3 << 20, budget_bytes=64 << 20)


def frame(op: str, **fields) -> bytes:
    return msgpack.packb({"v": PROTOCOL_VERSION, "op": op, **fields}, use_bin_type=True)


@pytest.mark.parametrize("msg", [
    Iteration(ids=[1], tokens=[5], finished=[Finished(1, FinishReason.LENGTH, None, None, 40, None, 32),
                                             Finished(2, FinishReason.CANCELLED)],
              started=[Started(1, 40, 32), Started(3, 9, 0)]),
    Results(ids=["a"], tokens=[5], finished=[Finished("a", FinishReason.STOP, prompt_tokens=3, stop_reason=5,
                                                      cached_tokens=0)]),
    Heartbeat(progress=7, prefix_cache=USAGE),
    Status("b", 1.0, {"m": ModelStatus(0, 1, 2, 1, 8)},
           (WorkerStatus("w1", "m", 4, 1, 10, False, USAGE), WorkerStatus("w2", "m", 4, 0, 3, False)), 1, {}),
], ids=lambda m: type(m).__name__)
def test_the_new_fields_round_trip(msg):
    back = decode(encode(msg))
    assert back == msg and type(back) is type(msg)


def test_the_current_version_is_spoken_and_an_older_frame_is_refused():
    assert PROTOCOL_VERSION >= 8
    old = msgpack.packb({"v": PROTOCOL_VERSION - 1, "op": "heartbeat", "progress": 1}, use_bin_type=True)
    with pytest.raises(ProtocolError) as e:
        decode(old)
    assert e.value.code is ErrorCode.UNSUPPORTED_VERSION


def test_records_of_the_older_shape_decode_with_the_new_fields_none():
    it = decode(frame("iteration", ids=[1], tokens=[4], finished=[[1, "length", None, None, 40, None]],
                      started=[[1, 40]]), WORKER_TO_BROKER)
    assert it.finished == (Finished(1, FinishReason.LENGTH, prompt_tokens=40),)
    assert it.finished[0].cached_tokens is None and it.started == (Started(1, 40, None),)
    hb = decode(frame("heartbeat", progress=3), WORKER_TO_BROKER)
    assert hb == Heartbeat(progress=3) and hb.prefix_cache is None
    st = decode(frame("status", broker_id="b", uptime_s=1.0, models={}, workers=[["w", "m", 2, 0, 0, False]],
                      clients=0, counters={}), BROKER_TO_CLIENT)
    assert st.workers[0].prefix_cache is None and st.workers[0].name == "w"


@pytest.mark.parametrize("data", [
    frame("iteration", finished=[[1, "stop", None, None, 4, None, "32"]]),          # cached_tokens not an int
    frame("iteration", finished=[[1, "stop", None, None, 4, None, 32, "extra"]]),  # a newer peer's longer record
    frame("iteration", ids=[1], tokens=[4], started=[[1, 4, 2.5]]),
    frame("heartbeat", prefix_cache=[1, 2, 3]),                                     # a usage record lacks a field
    frame("heartbeat", prefix_cache=[1, 2, 3, "4"]),
])
def test_bad_values_are_malformed(data):
    with pytest.raises(ProtocolError) as e:
        decode(data, WORKER_TO_BROKER)
    assert e.value.code is ErrorCode.MALFORMED


def test_model_info_says_what_runs_and_an_older_record_decodes_without_it():
    from protocol.messages import ModelInfo, Register

    reg = Register("m", 2, 2, ModelInfo(100, 64, (1,), True, "gguf: Q4_K x 3 (compiled kernel, AMX-BF16)"))
    assert decode(encode(reg)) == reg
    old = decode(frame("register", model="m", num_slots=2, max_inflight=2, info=[100, 64, [1], True]),
                 WORKER_TO_BROKER)
    assert old.info.runs == "" and old.info.max_seq_len == 64


def test_model_info_says_how_the_model_thinks_and_an_older_record_decodes_without_it():
    from protocol.messages import ModelInfo, Register

    reg = Register("m", 2, 2, ModelInfo(100, 64, (1,), True, "bf16", reasoning="qwen3"))
    assert decode(encode(reg)) == reg
    old = decode(frame("register", model="m", num_slots=2, max_inflight=2, info=[100, 64, [1], True, "bf16"]),
                 WORKER_TO_BROKER)
    assert old.info.reasoning == "" and old.info.runs == "bf16"
