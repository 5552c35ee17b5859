"""The slow part of taking a request runs off the worker's I/O thread (worker.admission).

Tokenising a text or chat prompt and compiling a structured constraint take time that grows with
what a client sent (a 109,588-character GBNF grammar: 8-9.7 s; 4 MB of text: 3.7 s with Qwen2.5's
tokenizer, on the loaded 2-core machine). On the I/O thread that time sent no heartbeat, so past
the broker's worker liveness (5 s) the worker was declared lost and its requests requeued (the
kind of a941b61's tokenizer build). Each test holds that work on a gate and checks that the I/O
thread still serves meanwhile: a token-id request assigned after it runs to its end, the held one
ends once released, and the work ran on the admission thread. Before, the token-id request waited
behind the gate (the I/O thread never read its assignment)."""

from __future__ import annotations

import contextlib
import threading

import pytest

pytest.importorskip("transformers")

from client import Client  # noqa: E402
from protocol.enums import FinishReason  # noqa: E402
from tests.support.cluster import ThreadCluster  # noqa: E402
from tests.support.scripted_text import TEXT, ScriptedText  # noqa: E402
from tests.support.vocab import SMOLLM2, kept_tokenizer  # noqa: E402
from tests.support.waits import wait_until  # noqa: E402

ADMISSION = "slotserve-worker-admission"


class Gate:
    """Holds each call of the wrapped callable until :attr:`open` is set (up to 30 s), noting the
    calling threads' names in :attr:`threads` and setting :attr:`entered` on the first call."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.open, self.entered = threading.Event(), threading.Event()
        self.threads: list[str] = []

    def __call__(self, *args, **kwargs):
        self.threads.append(threading.current_thread().name)
        self.entered.set()
        self.open.wait(30)
        return self.fn(*args, **kwargs)


class GatedCodec:
    """A text codec whose ``encode`` and ``apply_chat_template`` pass through a :class:`Gate`."""

    def __init__(self, codec, gate_of) -> None:
        self._codec = codec
        self.encode = gate_of(codec.encode)
        self.apply_chat_template = gate_of(codec.apply_chat_template)

    def __getattr__(self, name):
        return getattr(self._codec, name)


class GatedGrammars:
    """Stands in for a model's :class:`worker.models.grammar.Grammars`: ``compile`` through a gate
    (the scripted model picks its tokens itself: nothing is masked)."""

    def __init__(self, eos: int, gate_of) -> None:
        self.eos_token_ids = (eos,)
        self.compile = gate_of(lambda constraint: None)


@contextlib.contextmanager
def opened(gates: list[Gate]):
    """Opens every gate on leaving (a failed test must not leave the worker held on one)."""
    try:
        yield
    finally:
        for g in gates:
            g.open.set()


@pytest.fixture
def model():
    tok = kept_tokenizer(SMOLLM2)
    if tok is None:
        pytest.skip("SmolLM2's tokenizer is not installed")
    return ScriptedText(tok)


@pytest.mark.parametrize("work", ["text prompt", "chat prompt", "structured"])
def test_slow_request_work_leaves_the_io_thread_serving(model, work):
    gates: list[Gate] = []

    def gate_of(fn):
        gates.append(Gate(fn))
        return gates[-1]

    if work == "structured":
        model.grammars = GatedGrammars(model.script[-1], gate_of)
        slow_args = ([7, 8], 40), {"structured": {"json_schema": {"type": "object"}}}
    else:
        model.tokenizer = GatedCodec(model.tokenizer, gate_of)
        slow_args = ("hi" if work == "text prompt" else [{"role": "user", "content": "hi"}], 40), {}
    with ThreadCluster() as cluster, opened(gates):
        cluster.add_worker(model, model="m")
        with Client(cluster.frontend, model="m") as c:
            c.wait_for_model(30)
            slow = c.submit_request(*slow_args[0], **slow_args[1])
            wait_until(lambda: any(g.entered.is_set() for g in gates), 30, "the slow work to start")
            fast = c.submit_request([7, 8], 40)
            assert fast.result(timeout=30) == [7, 8, *model.script]  # served while the slow work is held
            assert slow.finish_reason is None
            for g in gates:
                g.open.set()
            slow.result(timeout=30)
    assert slow.finish_reason is FinishReason.STOP and slow.tokens == model.script
    if work != "structured":
        assert slow.text == TEXT
    assert {t for g in gates for t in g.threads} == {ADMISSION if work != "structured" else f"{ADMISSION}-structured"}


def held_text(model) -> list[Gate]:
    """Gates ``model``'s text codec (:class:`GatedCodec`): its gates, ``encode``'s first."""
    gates: list[Gate] = []
    model.tokenizer = GatedCodec(model.tokenizer, lambda fn: gates.append(Gate(fn)) or gates[-1])
    return gates


@pytest.mark.parametrize("end", ["cancel", "deadline"])
@pytest.mark.parametrize("where", ["being prepared", "queued behind another"])
def test_a_request_the_admission_thread_holds_ends_at_its_cancel_or_deadline(model, end, where):
    """It ends at once (cancelled, or at its deadline: ``deadline``), while the admission thread is
    still held: before, a cancel took effect, and a deadline was looked at, only once that thread
    reached the request (after the slow work ahead of it, a 9 s grammar), and a request whose
    deadline had passed meanwhile was then tokenised and run with its whole timeout_s again (it
    ended ``stop`` with its tokens). One queued behind is never tokenised."""
    gates = held_text(model)
    with ThreadCluster() as cluster, opened(gates):
        cluster.add_worker(model, model="m")
        wp = cluster.workers[0].wp
        with Client(cluster.frontend, model="m") as c:
            c.wait_for_model(30)
            timed = {"timeout_s": 0.2} if end == "deadline" else {}
            first = c.submit_request("hi", 40, **(timed if where == "being prepared" else {}))
            wait_until(lambda: gates[0].entered.is_set(), 30, "the tokenisation to start")
            held = first if where == "being prepared" else c.submit_request("hello", 40, **timed)
            wait_until(lambda: len(wp._admitting) == (1 if where == "being prepared" else 2), 30,
                       "the worker to hold the request")
            if end == "cancel":
                assert c.cancel(held.request_id)
            held.result(timeout=30)  # (the gate is still closed)
            assert held.finish_reason is (FinishReason.CANCELLED if end == "cancel" else FinishReason.DEADLINE)
            assert held.tokens == []
            for g in gates:
                g.open.set()
            if held is not first:
                assert first.result(timeout=30) == model.script and first.finish_reason is FinishReason.STOP
            after = c.submit_request([7, 8], 40)  # the worker goes on serving
            assert after.result(timeout=30) == [7, 8, *model.script]
            wait_until(lambda: not wp._admitting, 30, "the admission thread to drop the ended request")
    assert len(gates[0].threads) == 1  # the request held behind was never tokenised


def test_a_slow_grammar_holds_no_text_request_behind_it(model):
    """A structured request's compile (held on a gate, as a 9 s grammar) and a text prompt assigned
    after it: the text request runs to its end meanwhile (it waited behind the grammar when one
    admission thread took both, in order), then the structured one."""
    gates: list[Gate] = []
    model.grammars = GatedGrammars(model.script[-1], lambda fn: gates.append(Gate(fn)) or gates[-1])
    with ThreadCluster() as cluster, opened(gates):
        cluster.add_worker(model, model="m")
        with Client(cluster.frontend, model="m") as c:
            c.wait_for_model(30)
            slow = c.submit_request([7, 8], 40, structured={"json_schema": {"type": "object"}})
            wait_until(lambda: gates[0].entered.is_set(), 30, "the grammar's compile to start")
            text = c.submit_request("hi", 40)
            assert text.result(timeout=30) == model.script and text.text == TEXT
            assert slow.finish_reason is None  # (still held)
            gates[0].open.set()
            assert slow.result(timeout=30) == [7, 8, *model.script]
    assert set(gates[0].threads) == {f"{ADMISSION}-structured"}
