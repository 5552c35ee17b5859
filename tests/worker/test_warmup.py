"""Ready means warm (issue 22, item 2): a worker warms its model up -- a prefill
and decode steps at the batch sizes of worker.warmup.batch_sizes, up to its slots
or MAX_BATCH, so its cost is bounded whatever --slots -- before it registers, so
the broker lists the model as loading until then (``wait_for_model`` waits, a
request waits in the queue); the warm-up leaves no trace in the engine, the
model or the broker; ``warmup=False`` and stateless models skip it."""

from __future__ import annotations

import threading

import pytest

from client import Client
from protocol.enums import FinishReason
from tests.support.cluster import ThreadCluster
from tests.support.reference import simulated_reference
from tests.support.waits import wait_until
from worker import BatchInferenceEngine, SimulatedLLM
from worker.config import WorkerConfig
from worker.models.base import StepOutput
from worker.process import WorkerProcess
from worker.warmup import BATCH_SIZES, DECODE_TOKENS, MAX_BATCH, batch_sizes, needs_warmup, warm_up


class SlotSim:
    """A slot-aware SimulatedLLM (its tokens are SimulatedLLM's) that records every
    step: ``steps`` holds ``(rows, prefill rows)`` -- a row prefills when its slot
    has not been seen since it was bound or released -- and ``released`` the
    slots given back."""

    def __init__(self) -> None:
        self.sim = SimulatedLLM()
        self.vocab_size = self.sim.vocab_size
        self.eos_token_ids = (0,)
        self.bound: list[int] = []
        self.steps: list[tuple[int, int]] = []
        self.released: list[int] = []
        self.held: set[int] = set()

    def bind_slots(self, num_slots: int) -> None:
        self.bound.append(num_slots)

    def step(self, plan):
        batch = plan.batch
        new = {x.slot for x in batch} - self.held
        self.held |= new
        self.steps.append((len(batch), len(new)))
        return StepOutput(self.sim.next_tokens([x.tokens for x in batch]))

    def release_slot(self, slot: int) -> None:
        self.released.append(slot)
        self.held.discard(slot)


class GatedSlotSim(SlotSim):
    """A :class:`SlotSim` whose steps wait for ``release`` (set by the test, or by
    the harness when the worker closes): ``entered`` is set once one waits."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.entered = threading.Event()

    def step(self, plan):
        if not self.release.is_set():
            self.entered.set()
            assert self.release.wait(30), "the test never released the model"
        return super().step(plan)


# ---------------------------------------------------------------------- the warm-up itself


def test_warm_up_decodes_at_its_batch_sizes_and_leaves_the_engine_as_it_was():
    model = SlotSim()
    engine = BatchInferenceEngine(model, 5, stop_token=None)
    report = warm_up(engine)
    decode_sizes = sorted({rows for rows, prefill in model.steps if prefill == 0})
    assert decode_sizes == batch_sizes(5) == [1, 2, 4, 5]  # the CUDA graphs' sizes below the slots, and the slots
    assert (1, 1) in model.steps and (5, 5) in model.steps  # a prefill alone, and all slots' at once
    assert report.iterations == len(model.steps) and report.max_batch == 5
    assert not report.stopped and report.failed == 0 and report.seconds > 0
    # No trace: every slot it used was given back, nothing queued or running, one bind_slots (the engine's).
    assert len(model.released) == 1 + 5 and not model.held and model.bound == [5]
    assert (engine.num_free_slots, engine.num_queued, engine.num_running) == (5, 0, 0)
    # Its requests had ids of their own: the engine's first picked id is still its first.
    h = engine.submit_request([4, 5, 6], 6)
    engine.run()
    assert h.request_id == "req-0"
    assert (h.tokens, h.finish_reason.value) == simulated_reference([4, 5, 6], 6, stop_token=None)


def test_the_warm_up_of_many_slots_is_bounded():
    """--slots 100000 never became ready: the warm-up decoded at every batch size from 100000 down
    to 1, one slot freed per step (quadratic: 256 slots of SmolLM2-135M took 236 s, 100000 never
    ended). Now at most MAX_BATCH requests and one step per size of batch_sizes."""
    model = SlotSim()
    engine = BatchInferenceEngine(model, 100_000, stop_token=None)
    report = warm_up(engine)
    assert batch_sizes(100_000)[-1] == MAX_BATCH == report.max_batch
    assert max(rows for rows, _ in model.steps) == MAX_BATCH
    assert report.iterations == len(model.steps) <= DECODE_TOKENS + 2 * len(batch_sizes(100_000)) + 2
    assert sorted({rows for rows, prefill in model.steps if prefill == 0}) == batch_sizes(100_000)
    assert (engine.num_free_slots, engine.num_queued, engine.num_running) == (100_000, 0, 0)


def test_the_warm_up_steps_through_the_cuda_graphs_own_sizes():
    """warmup.BATCH_SIZES is a copy of the CUDA graphs' ladder (worker.warmup may not import torch): on CUDA
    the warm-up is what captures those graphs, so the two may never drift apart."""
    cuda_graphs = pytest.importorskip("worker.models.llama.cuda_graphs")
    assert BATCH_SIZES == cuda_graphs.BATCH_SIZES and MAX_BATCH == max(cuda_graphs.BATCH_SIZES)


def test_a_stop_during_the_warm_up_ends_it_at_once_with_every_slot_free():
    model = SlotSim()
    engine = BatchInferenceEngine(model, 4, stop_token=None)
    stop = threading.Event()
    stop.set()
    report = warm_up(engine, stop)
    assert report.stopped and report.iterations == 1 and model.steps == []
    assert (engine.num_free_slots, engine.num_queued, engine.num_running) == (4, 0, 0)


def test_only_slot_aware_models_need_a_warm_up():
    assert needs_warmup(SlotSim()) and not needs_warmup(SimulatedLLM())
    # A worker of a stateless model is ready at once; one of a slot-aware model after its warm-up
    # (or at once, with warmup off).
    assert WorkerProcess(WorkerConfig(num_slots=2), SimulatedLLM()).ready
    assert not WorkerProcess(WorkerConfig(num_slots=2), SlotSim()).ready
    assert WorkerProcess(WorkerConfig(num_slots=2, warmup=False), SlotSim()).ready
    with pytest.raises(ValueError, match="warmup"):
        WorkerConfig(warmup="no")


def test_a_warmed_up_model_answers_as_a_fresh_one_greedy_and_seeded(tmp_path):
    pytest.importorskip("transformers")
    from tests.support.slot_models import TINY_LLAMA_VOCAB, save_tiny_llama
    from worker.models import load_model

    save_tiny_llama(tmp_path)
    requests = [([5, 17, 42, 99], 12, {}), ([7] * 30, 10, {"temperature": 0.9, "seed": 3}),
                ([200, 3, 3, 8], 9, {"temperature": 1.2, "top_k": 20, "seed": 11})]

    def outputs(warm: bool):
        engine = BatchInferenceEngine(load_model(str(tmp_path)), 3, stop_token=None)
        if warm:
            assert warm_up(engine).failed == 0
        hs = [engine.submit_request(p, n, **kw) for p, n, kw in requests]
        engine.run()
        assert engine.num_free_slots == 3
        return [h.tokens for h in hs]

    fresh = outputs(warm=False)
    assert all(0 <= t < TINY_LLAMA_VOCAB for toks in fresh for t in toks)
    assert outputs(warm=True) == fresh


def test_the_prefix_cache_counts_served_requests_only_its_warm_up_blocks_stay(tmp_path):
    """The warm-up's lookups are not in the hit rate a worker reports (a newcomer's idle workers
    showed 160/824 tokens hit before any request), and the blocks it stored still serve."""
    pytest.importorskip("transformers")
    from tests.support.slot_models import save_tiny_llama
    from worker.models import load_model

    save_tiny_llama(tmp_path)
    engine = BatchInferenceEngine(load_model(str(tmp_path)), 3, stop_token=None)
    cache = engine.model.prefix_cache
    assert cache is not None
    warm_up(engine)
    assert (cache.stats.queries, cache.stats.hits) == (0, 0) and cache.used_blocks > 0
    from worker.warmup import _prompt

    h = engine.submit_request(_prompt(engine)[0], 2)  # the warm-up's own prompt: its blocks are there
    engine.run()
    assert h.cached_tokens > 0 and cache.stats.queries > 0 and cache.stats.hits == h.cached_tokens


# ---------------------------------------------------------------------- through a broker


def test_the_model_is_served_only_once_warm_and_its_requests_wait_for_it():
    model = GatedSlotSim()
    with ThreadCluster(heartbeat_interval_s=0.1) as cl, Client(cl.frontend, model="gated") as c:
        cl.add_worker(model, model="gated", num_slots=3)
        assert model.entered.wait(10)  # the warm-up's first step is held
        wait_until(lambda: "gated" in c.loading, 10, "the broker to say the model is loading")
        st = c.status()
        assert (st.models["gated"].loading, st.models["gated"].workers) == (1, 0) and "gated" not in c.models
        h = c.submit_request([1, 2, 3], 5, stop_token=None)  # waits in the broker's queue
        with pytest.raises(TimeoutError, match="still loading"):  # before: returned, the model was registered
            c.wait_for_model(0.5)
        assert not h.done()
        model.release.set()
        assert c.wait_for_model(10).vocab_size == 1000
        assert h.result(timeout=10) and h.finish_reason is FinishReason.LENGTH
        assert h.tokens == simulated_reference([1, 2, 3], 5, stop_token=None)[0]
        st = c.status()
        # The warm-up's tokens never left the worker; its steps came before any request's.
        assert st.counters["tokens_out"] == 5 and st.models["gated"].workers == 1
        warm_steps = len(model.steps) - 5
        assert warm_steps > 5 and model.steps[warm_steps] == (1, 1)


def test_without_warmup_the_model_is_served_at_once():
    model = GatedSlotSim()
    with ThreadCluster(heartbeat_interval_s=0.1) as cl, Client(cl.frontend, model="gated") as c:
        cl.add_worker(model, model="gated", num_slots=3, warmup=False)
        assert c.wait_for_model(10).vocab_size == 1000  # the gate was never reached
        assert not model.entered.is_set() and model.steps == []


def test_health_says_unavailable_while_the_model_warms_up_and_ok_once_warm():
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient

    from gateway import GatewayConfig
    from gateway.app import create_app

    model = GatedSlotSim()
    with ThreadCluster(heartbeat_interval_s=0.1) as cl:
        with TestClient(create_app(GatewayConfig(broker=cl.frontend, status_interval_s=0.1))) as http:
            cl.add_worker(model, model="gated", num_slots=2)
            assert model.entered.wait(10)
            # The gateway reaches the broker, which lists the model as loading: not ready.
            r = wait_until(lambda: (r := http.get("/health")).status_code == 503
                           and "no worker serves" in r.json()["reason"] and r, 20, "the broker's answer")
            assert r.json()["status"] == "unavailable"
            # /v1/models lists it as loading (as the 404 of an unknown name does), not yet as served
            assert [(m["id"], m.get("status")) for m in http.get("/v1/models").json()["data"]] == \
                [("gated", {"value": "loading"})]
            model.release.set()
            r = wait_until(lambda: (r := http.get("/health")).status_code == 200 and r, 20, "/health 200")
            assert r.json() == {"status": "ok", "models": {"gated": 1}}
            assert [(m["id"], m.get("status")) for m in http.get("/v1/models").json()["data"]] == [("gated", None)]
