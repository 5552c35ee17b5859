"""The client's handles get token logprobs (issue 20 item 3) from ``results``:
``handle.logprobs`` one entry per token, each appended before its token's
``on_token``; ``handle.prompt_logprobs`` set once, before the first token is
delivered (a resumed request's later prompt is ignored); kept across a broker
restart, whose resubmission continues them. Driven as ``Client`` drives the
core (tests/client/test_ledger.py's helpers)."""

from __future__ import annotations

from protocol.enums import FinishReason
from protocol.logprobs import TokenLogprob as T
from protocol.messages import Finished, Logprobs, Results
from protocol.request import RequestParams
from client.core import ClientCore
from tests.client.test_ledger import plain, stream, submit

ASKS = RequestParams([1, 2], 8, stop_token=None, logprobs=2, prompt_logprobs=1)
PROMPT = (None, T(-1.5, ((2, -1.5),)))


def e(x: float) -> T:
    return T(-x, ((4, -0.1), (5, -x)))


def test_a_request_without_callbacks_gets_its_entries_and_its_prompt_once():
    core = ClientCore()
    h = submit(core, "p", ASKS)
    other = submit(core, "q")  # asked for nothing: records naming it are dropped
    assert h.logprobs == [] and h.prompt_logprobs is None and other.logprobs is None
    rest, _ = plain(core, Results(("p", "q", "p"), (7, 1, 8), logprobs=(Logprobs("p", (e(1), e(2)), PROMPT),
                                                                       Logprobs("q", (e(9),), PROMPT))), 0.1)
    assert rest is None and h.tokens == [7, 8] and h.logprobs == [e(1), e(2)] and h.prompt_logprobs == list(PROMPT)
    assert other.logprobs is None and other.prompt_logprobs is None
    plain(core, Results(("p",), (9,), logprobs=(Logprobs("p", (e(3),), (None, T(-9.0))),),
                        finished=(Finished("p", FinishReason.LENGTH),)), 0.2)
    assert h.logprobs == [e(1), e(2), e(3)] and h.prompt_logprobs == list(PROMPT)  # the second prompt: ignored
    assert h.finish_reason is FinishReason.LENGTH and len(h.logprobs) == len(h.tokens)


def test_on_token_sees_its_tokens_entry_and_the_prompt_already():
    core = ClientCore()
    seen = []
    h = submit(core, "s", ASKS,
               on_token=lambda t: seen.append((t, h.logprobs[-1], len(h.logprobs), h.prompt_logprobs is not None)))
    quiet = submit(core, "quiet", ASKS)  # in the same message, applied on the I/O thread
    msg = Results(("s", "quiet", "s"), (7, 3, 8),
                  logprobs=(Logprobs("s", (e(1),), PROMPT), Logprobs("quiet", (e(5),), PROMPT), Logprobs("s", (e(2),))))
    rest, _ = plain(core, msg, 0.1)
    assert h.prompt_logprobs == list(PROMPT) and h.logprobs == []  # the prompt before any token is delivered
    assert quiet.logprobs == [e(5)] and [r.request_id for r in rest.logprobs] == ["s", "s"]
    stream(core, rest, 0.1)
    assert seen == [(7, e(1), 1, True), (8, e(2), 2, True)] and h.logprobs == [e(1), e(2)]


def test_a_request_asking_prompt_logprobs_alone_gets_no_token_entries():
    core = ClientCore()
    h = submit(core, "pl", RequestParams([1, 2], 2, stop_token=None, prompt_logprobs=0))
    plain(core, Results(("pl",), (4,), logprobs=(Logprobs("pl", (), (None, T(-2.0))),)), 0.1)
    assert h.logprobs is None and h.prompt_logprobs == [None, T(-2.0)] and h.tokens == [4]


def test_a_broker_restart_keeps_the_entries_and_the_resumed_request_continues_them():
    core = ClientCore()
    core.broker_seen("broker-A", 0.0)
    seen = []
    h = submit(core, "r", ASKS, on_token=lambda t: seen.append(h.logprobs[-1]))
    rest, _ = plain(core, Results(("r", "r"), (7, 8), logprobs=(Logprobs("r", (e(1), e(2)), PROMPT),)), 1.0)
    stream(core, rest, 1.0)
    out = core.broker_seen("broker-B", 2.0)
    (again,) = out.submit
    assert again.resume_tokens == (7, 8) and again.params.logprobs == 2 and again.params.prompt_logprobs == 1
    assert h.logprobs == [e(1), e(2)] and h.prompt_logprobs == list(PROMPT)
    # the new cluster's worker scores only the new tokens (and, were it to send a prompt again, it is ignored)
    rest, _ = plain(core, Results(("r",), (9,), logprobs=(Logprobs("r", (e(3),), (None, T(-7.0))),),
                                  finished=(Finished("r", FinishReason.LENGTH),)), 3.0)
    stream(core, rest, 3.0)
    assert h.tokens == [7, 8, 9] and h.logprobs == [e(1), e(2), e(3)] == seen
    assert h.prompt_logprobs == list(PROMPT) and h.finish_reason is FinishReason.LENGTH


def test_a_text_prompts_ids_arrive_with_its_prompt_logprobs():
    core = ClientCore()
    h = submit(core, "t", RequestParams("hi there", 3, stop_token=None, prompt_logprobs=0))
    plain_text = submit(core, "u", RequestParams("hi there", 3, stop_token=None))
    assert h.prompt is None and plain_text.prompt is None
    plain(core, Results(("t",), (5,), logprobs=(Logprobs("t", (), (None, T(-2.0)), (104, 105)),)), 0.1)
    assert h.prompt == [104, 105] and h.prompt_logprobs == [None, T(-2.0)] and h.tokens == [5]
    assert plain_text.prompt is None
