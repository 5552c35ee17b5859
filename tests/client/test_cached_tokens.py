"""``ClientHandle.cached_tokens`` (issue 23 step 3) from the broker's results, without sockets:
a text prompt's count comes with its first tokens (``started``), every request's with its end
(``finished``), and a later worker's count replaces an earlier one's (migration)."""

from __future__ import annotations

from client.core import ClientCore
from protocol.enums import FinishReason
from protocol.messages import Finished, Results, Started
from protocol.request import RequestParams


def apply(core: ClientCore, msg: Results) -> None:
    rest, endings = core.apply_plain(msg, 1.0)
    core.end_plain(endings, 1.0)


def test_a_text_prompts_count_comes_with_its_first_tokens_and_the_last_workers_with_its_end():
    core = ClientCore()
    h = core.submit(RequestParams("a system prompt and a question", 4), request_id="t", now=0.0)[0]
    assert h.cached_tokens is None and h.prompt_tokens is None
    apply(core, Results(ids=("t",), tokens=(5,), started=(Started("t", 40, 32),)))
    assert (h.prompt_tokens, h.cached_tokens) == (40, 32)
    # migrated: the next worker prefilled it again and hit 16 tokens there; its end says so
    apply(core, Results(ids=("t",), tokens=(6,), started=(Started("t", 40, 16),)))
    assert h.cached_tokens == 16
    apply(core, Results(finished=(Finished("t", FinishReason.LENGTH, prompt_tokens=40, cached_tokens=16),)))
    assert h.done() and h.cached_tokens == 16


def test_a_token_prompts_count_comes_with_its_end_and_none_keeps_what_was_known():
    core = ClientCore()
    a = core.submit(RequestParams([1, 2, 3], 2), request_id="a", now=0.0)[0]
    b = core.submit(RequestParams("text", 2), request_id="b", now=0.0)[0]
    apply(core, Results(ids=("a", "b"), tokens=(7, 7), started=(Started("b", 3),)))  # (a v6-shaped record)
    assert a.cached_tokens is None and b.cached_tokens is None and b.prompt_tokens == 3
    apply(core, Results(ids=("b",), tokens=(8,), started=(Started("b", 3, 0),)))
    apply(core, Results(finished=(Finished("a", FinishReason.STOP, prompt_tokens=3, cached_tokens=0),
                                  Finished("b", FinishReason.CANCELLED))))  # (ended before its next worker's prefill)
    assert (a.cached_tokens, b.cached_tokens) == (0, 0)
