"""A caller's wait on the engine, cut short by a signal's exception (Ctrl-C's KeyboardInterrupt, a test
runner's timeout, a worker's LoadInterrupted on SIGTERM) while another thread holds the lock it waits
to take back, leaves that thread its lock (tests/support/interrupted_wait.py says how and why).

Before, the engine's condition variables were on plain locks (``wait_for_work``'s, a handle's
``result()``'s, the embedding engine's) and an embedding handle's ``result()`` waited on a
``threading.Event``: the interrupted waiter released the lock of the thread that had woken it, whose next
wait raised "RuntimeError: cannot wait on un-acquired lock" (so once two fast-lane tests failed, under
load, with that error from a thread another test left running), its ``with`` exit "release unlocked
lock", and ``submit_request``, which the design lets any thread call while ``run()`` executes, ran
unguarded meanwhile. Now each is on an RLock, which a waiter takes back whole."""

from __future__ import annotations

import signal

import pytest

from tests.support.interrupted_wait import interrupt_a_wait
from worker import BatchInferenceEngine, SimulatedLLM
from worker.embeddings import EmbeddingEngine

pytestmark = pytest.mark.skipif(not hasattr(signal, "pthread_kill"), reason="signals to one thread: POSIX")


class StandIn:
    """An embedding model without weights: a prompt's vector is its length, three times."""

    embedding_size = 3
    vocab_size = 100

    def embed(self, prompts):
        from protocol.embedding import pack

        return [pack([float(len(p))] * 3) for p in prompts]


def test_an_interrupted_wait_for_work_leaves_the_lock_of_the_thread_that_woke_it():
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=2)
    interrupt_a_wait(engine._work, lambda: engine.wait_for_work(None))
    h = engine.submit_request([1, 2, 3], max_tokens=3)  # (the engine still works)
    engine.run()
    assert h.done() and len(h.tokens) == 3


def test_an_interrupted_result_leaves_the_lock_of_the_thread_that_woke_it():
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=2)
    h = engine.submit_request([1, 2, 3], max_tokens=3)
    interrupt_a_wait(h._completion.cond, lambda: h.result())
    engine.run()
    assert h.result(10)[:3] == [1, 2, 3]


def test_an_interrupted_wait_of_the_embedding_engine_leaves_the_lock_of_the_thread_that_woke_it():
    engine = EmbeddingEngine(StandIn(), 2)
    interrupt_a_wait(engine._work, lambda: engine.wait_for_work(None))
    h = engine.submit_request([4, 5])
    interrupt_a_wait(h._event._cond, lambda: h.result())
    engine.step()
    assert h.embedding == [2.0, 2.0, 2.0]
