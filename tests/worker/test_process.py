"""The worker process's engine side without a broker: assigned requests go into
the engine, each iteration becomes one message, refusals carry codes, text
prompts use the model's tokenizer, and stale work never leaks out."""

from __future__ import annotations

import msgpack

from protocol.codec import decode
from protocol.enums import ErrorCode, FinishReason
from protocol.messages import PROTOCOL_VERSION
from tests.support.messages import envelope
from worker import BatchInferenceEngine, SimulatedLLM
from worker.config import WorkerConfig
from worker.process import WorkerProcess


class ByteCodec:
    """A toy TextCodec: one token per byte (+1, so 0 stays the stop token)."""

    def encode(self, text):
        return [b + 1 for b in text.encode()]

    def apply_chat_template(self, messages):
        return self.encode("".join(f"<{m['role']}>{m['content']}" for m in messages))

    def decode(self, ids):
        return "".join(chr(32 + i % 95) for i in ids)  # printable, one char per token

    def decoder(self, prompt_ids):
        codec = self

        class D:
            def step(self, token_id):
                return codec.decode([token_id])

        return D()


class TextSim(SimulatedLLM):
    def __init__(self):
        super().__init__(vocab_size=256)
        self.tokenizer = ByteCodec()


def drain(wp: WorkerProcess):
    """Run the engine until idle; return the iterations it produced, in order."""
    its = []
    while wp.engine.wait_for_work(0):
        wp.engine.step()
        out = wp._collect()
        if out is not None:
            its.append(out)
    return its


def merged(its):
    ids, toks, texts, fin = [], [], [], {}
    for _, it in its:
        ids += it.ids
        toks += it.tokens
        texts += it.texts
        fin.update({f.request_id: f for f in it.finished})
    per = {}
    for i, t in zip(ids, toks):
        per.setdefault(i, []).append(t)
    return per, texts, fin


def test_iterations_carry_every_slot_and_match_the_engine():
    wp = WorkerProcess(WorkerConfig(num_slots=3), model=SimulatedLLM())
    assert wp.info.eos_token_ids == (0,) and wp.info.vocab_size == 1000 and not wp.info.has_tokenizer
    specs = [envelope(k, [k + 1, 2], 6 + k) for k in range(5)]
    assert wp.assign(specs) == []
    its = drain(wp)
    # One message per iteration, each holding at most one token per slot.
    assert all(len(it.ids) <= 3 and len(set(it.ids)) == len(it.ids) for _, it in its)
    per, _, fin = merged(its)
    ref = BatchInferenceEngine(SimulatedLLM(), 2, stop_token=0)
    hs = [ref.submit_request([k + 1, 2], 6 + k) for k in range(5)]
    ref.run()
    for k, h in enumerate(hs):
        assert per[k] == h.tokens and fin[k].finish_reason is h.finish_reason and fin[k].prompt_tokens == 2


def test_refusals_carry_codes_and_cost_no_slot():
    wp = WorkerProcess(WorkerConfig(num_slots=2), model=SimulatedLLM())
    # Key 2's parameters are invalid: the decoder hands it over as a Rejected entry.
    (bad,) = decode(msgpack.packb({"v": PROTOCOL_VERSION, "op": "assign", "requests": [[2, [[1], 0]]]})).requests
    refused = wp.assign([envelope(1, [1, 5000], 3), bad, envelope(3, "text", 3),
                         envelope(4, [1, 2], 3, resume_tokens=[7, 8, 9]), envelope(5, [3], 2)])
    codes = {f.request_id: f.code for f in refused}
    assert codes == {1: ErrorCode.BAD_REQUEST, 2: ErrorCode.BAD_REQUEST, 3: ErrorCode.UNSUPPORTED,
                     4: ErrorCode.BAD_REQUEST}
    assert all(f.finish_reason is FinishReason.ERROR and f.message for f in refused)
    _, _, fin = merged(drain(wp))
    assert set(fin) == {5}


def test_resume_tokens_continue_without_repeating():
    wp = WorkerProcess(WorkerConfig(num_slots=2), model=SimulatedLLM())
    ref = BatchInferenceEngine(SimulatedLLM(), 1, stop_token=None)
    full = ref.submit_request([4, 4], 12)
    ref.run()
    wp.assign([envelope(9, [4, 4], 12, stop_token=None, resume_tokens=full.tokens[:5])])
    per, _, fin = merged(drain(wp))
    assert per[9] == full.tokens[5:] and fin[9].finish_reason is FinishReason.LENGTH


def test_text_prompts_and_chat_use_the_tokenizer():
    wp = WorkerProcess(WorkerConfig(num_slots=2), model=TextSim())
    assert wp.info.has_tokenizer
    wp.assign([envelope(1, "hi", 5, stop_token=None),
               envelope(2, [{"role": "user", "content": "yo"}], 4, stop_token=None)])
    per, texts, fin = merged(drain(wp))
    assert fin[1].prompt_tokens == 2 and fin[2].prompt_tokens == len(ByteCodec().apply_chat_template(
        [{"role": "user", "content": "yo"}]))
    text = {}
    for rid, piece in texts:
        text[rid] = text.get(rid, "") + piece
    assert text[1] == ByteCodec().decode(per[1])


def test_dropped_work_never_leaks_and_keys_can_be_reused():
    wp = WorkerProcess(WorkerConfig(num_slots=2), model=SimulatedLLM())
    wp.assign([envelope(1, [1, 2], 50, stop_token=None)])
    wp.engine.step()
    wp.drop_all()                         # the broker went away: a new registration epoch
    wp.assign([envelope(1, [3, 4], 3, stop_token=None)])   # the new broker reuses key 1
    its = drain(wp)
    assert {e for e, _ in its} <= {1}
    per, _, fin = merged([x for x in its if x[0] == wp._epoch])
    assert len(per[1]) == 3 and fin[1].finish_reason is FinishReason.LENGTH
    assert not wp._live


class _Coded(ValueError):
    code = "E42"  # a library's own code: no ErrorCode


class _Numbered(RuntimeError):
    code = 404  # an HTTP status, as urllib.error.HTTPError carries


def test_a_foreign_error_s_code_is_mapped_to_an_error_code_the_wire_carries():
    # WorkerProcess.assign passed e.code on as it was: a Finished with code 'E42' or 404, which the broker could
    # not read ("field 'code': unknown value 'E42'", "expected NoneType or str, got int"), malformed
    from types import SimpleNamespace

    from protocol.codec import encode
    from protocol.messages import Iteration
    from worker.process import _finished

    for err, code in ((_Coded("bad thing"), ErrorCode.BAD_REQUEST), (_Numbered("boom"), ErrorCode.INTERNAL)):
        wp = WorkerProcess(WorkerConfig(num_slots=2), model=SimulatedLLM())

        def submit(*args, **kwargs):
            raise err

        wp.engine.submit = submit
        (refused,) = wp.assign([envelope(1, [1, 2], 3)])
        assert refused.code is code and refused.finish_reason is FinishReason.ERROR, refused
        assert decode(encode(Iteration(finished=(refused,)))).finished == (refused,)
        ended = _finished(7, SimpleNamespace(finish_reason=FinishReason.ERROR, error=err, prompt_tokens=2,
                                             stop_reason=None, cached_tokens=None))
        assert ended.code is ErrorCode.INTERNAL and decode(encode(Iteration(finished=(ended,)))).finished == (ended,)
