"""bench/systems.py -- the systems slotserve is compared with on a model, in one place.

Each function runs one pass of a workload (``prompts`` as token ids, ``max_tokens[i]`` per
request, every request at t0, ``slots`` sequences at a time, greedy) and returns a :class:`Run`:

- :func:`slotserve`: the in-process :class:`worker.BatchInferenceEngine` over a loaded model,
  after a warm-up that fills every slot once;
- :func:`hf_static`: transformers' ``model.generate`` on left-padded batches of ``slots``
  requests in order, each batch running until its longest request is done (static batching:
  a request's extra tokens are wasted);
- :func:`hf_cb`: transformers' continuous batching manager (``init_continuous_batching``),
  per-request ``max_new_tokens``, ``slots`` requests per batch;
- llama.cpp's ``llama-server`` is :mod:`bench.llamacpp` (a process and an HTTP client).

``eos`` (a set of token ids) makes those ids end a request, and the useful output is the
tokens through the first of them (:func:`truncate`); ``eos=None`` turns stop tokens off, so
every request generates exactly its ``max_tokens`` and every system does the same work
(bench/gpu.py). bench/model.py (HE32 on a real model, CPU) and bench/gpu.py (random weights
on a device) run these same functions.
"""

from __future__ import annotations

import contextlib
import gc
import math
import os
import statistics
import time
from dataclasses import dataclass, field


@dataclass
class Run:
    """One system's pass over a workload: times in seconds from t0 (the first submit), outputs
    the useful generated tokens per request; ``first_s`` / ``last_s`` the first / last useful
    token's time per request (empty where the system was not timed per token)."""

    name: str
    wall_s: float = 0.0
    outputs: list[list[int]] = field(default_factory=list)
    first_s: list[float] = field(default_factory=list)
    last_s: list[float] = field(default_factory=list)
    rss_mb: float | None = None  # after the run
    peak_rss_mb: float | None = None  # highest sampled while the run was on (bench.common.RssPeak)
    load_avg: tuple[float, float] = (0.0, 0.0)  # 1-min load average before / after
    all_wall_s: list[float] = field(default_factory=list)  # every repeat; the fastest is reported
    note: str = ""
    threads: int | None = None  # CPU threads of the run reported (the best of those tried)
    ready_s: float | None = None  # a served system's start to ready (model loaded, serving), seconds

    def summary(self, reference: list[list[int]] | None) -> dict:
        """bench/model.py's row: rates, TTFT / TPOT (ms), how many outputs equal ``reference``'s."""
        useful = sum(len(o) for o in self.outputs)
        tpot = [(l - f) / (len(o) - 1) for o, f, l in zip(self.outputs, self.first_s, self.last_s) if len(o) > 1]
        return {
            "system": self.name,
            "wall_s": round(self.wall_s, 2),
            "useful_tokens": useful,
            "tokens_per_s": round(useful / self.wall_s, 2),
            "ttft_mean_ms": round(1000 * statistics.mean(self.first_s), 1),
            "ttft_p50_ms": round(1000 * statistics.median(self.first_s), 1),
            "tpot_mean_ms": round(1000 * statistics.mean(tpot), 1) if tpot else None,
            "identical_to_hf_greedy": None if reference is None else sum(
                a == b for a, b in zip(self.outputs, reference)),
            "rss_mb": None if self.rss_mb is None else round(self.rss_mb),
            "peak_rss_mb": None if self.peak_rss_mb is None else round(self.peak_rss_mb),
            "load_avg_before_after": [round(x, 2) for x in self.load_avg],
            "all_wall_s": self.all_wall_s,
            "threads": self.threads,
            "start_to_ready_s": None if self.ready_s is None else round(self.ready_s, 1),
            "note": self.note,
        }


class TokenTimes:
    """First and last token time per request, in seconds from construction (t0)."""

    def __init__(self, n: int) -> None:
        self.first: list[float | None] = [None] * n
        self.last = [0.0] * n
        self.t0 = time.monotonic()

    def recorder(self, i: int):
        """An ``on_token`` callback for request ``i``."""
        def record(_tok):
            now = time.monotonic() - self.t0
            if self.first[i] is None:
                self.first[i] = now
            self.last[i] = now
        return record


def truncate(tokens: list[int], limit: int, eos) -> list[int]:
    """The useful part of a generated row: up to ``limit`` tokens, through the first of ``eos``
    (None: no stop tokens)."""
    out = []
    for t in tokens[:limit]:
        out.append(t)
        if eos is not None and t in eos:
            break
    return out


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on a CPU."""
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def free(device: str) -> None:
    """Collect garbage and return cached device memory (CUDA), between systems."""
    gc.collect()
    import torch

    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- slotserve


def slotserve(model, prompts, max_tokens, slots: int, *, eos=None, device: str = "cpu",
              sample_rss: bool = False, name: str = "slotserve") -> Run:
    """The in-process engine over ``model`` with ``slots`` slots, ``eos`` its stop tokens (None:
    off), after a warm-up of ``slots`` 4-token requests; with ``sample_rss`` this process's peak RSS
    while the engine runs (:class:`bench.common.RssPeak`) and its RSS after.

    The prefix cache is off (``model.prefix_cache_mb = 0``, where the runner has one): the warm-up
    sends the first prompts, and with the cache on the measured run took their prefill from it
    (the Qwen2.5-Coder-0.5B's HE32: 736 of 2,955 prompt tokens, 9 % of the wall time), work that
    the systems it is compared with (transformers, llama.cpp with ``cache_prompt`` off) do again.
    """
    from bench.common import RssPeak
    from worker import BatchInferenceEngine

    if hasattr(model, "prefix_cache_mb"):
        model.prefix_cache_mb = 0  # read when the engine binds its slots
    engine = BatchInferenceEngine(model, batch_size=slots, stop_token=None if eos is None else tuple(sorted(eos)))
    for p in prompts[:slots]:  # warm-up: fills every slot once
        engine.submit_request(p, 4)
    engine.run()
    sync(device)
    run = Run(name)
    times = TokenTimes(len(prompts))
    handles = [engine.submit_request(p, m, on_token=times.recorder(i))
               for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    with RssPeak([os.getpid()]) if sample_rss else contextlib.nullcontext() as peak:
        engine.run()
        sync(device)
    run.wall_s = time.monotonic() - times.t0
    run.outputs = [list(h.result(timeout=0)[len(p):]) for h, p in zip(handles, prompts)]
    run.first_s, run.last_s = times.first, times.last
    if sample_rss:
        import psutil

        run.peak_rss_mb = peak.peak_mb[0]
        run.rss_mb = psutil.Process().memory_info().rss / 2**20
    run.note = f"in-process engine, {slots} slots" + ("" if eos is not None else ", stop tokens off")
    return run


# ---------------------------------------------------------------------------------------- transformers


class StepTimes:
    """A ``generate()`` streamer that records when each step's tokens arrive."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value):
        self.times.append(time.monotonic())

    def end(self):
        pass


def hf_static(hf, prompts, max_tokens, slots: int, *, eos=None, pad_id: int = 0, device: str = "cpu",
              warmup: bool = False, step_times: bool = True) -> Run:
    """``hf.generate`` (greedy) on left-padded batches of ``slots`` requests in prompt order, each
    batch to its longest ``max_tokens``; ``eos`` its stop tokens (None: off, every row generates
    its batch's maximum). ``warmup``: one batch of 4 tokens first. ``step_times``: each request's
    first / last useful token time from a streamer (a host sync per step on a GPU, so off there)."""
    import torch

    run = Run("hf-static")

    def batch(idx, limit=None, streamer=None):
        width = max(len(prompts[i]) for i in idx)
        ids = torch.tensor([[pad_id] * (width - len(prompts[i])) + prompts[i] for i in idx], device=device)
        mask = torch.tensor([[0] * (width - len(prompts[i])) + [1] * len(prompts[i]) for i in idx], device=device)
        n = limit or max(max_tokens[i] for i in idx)
        stops = {"eos_token_id": None, "min_new_tokens": n} if eos is None else {"eos_token_id": sorted(eos)}
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, do_sample=False,
                              pad_token_id=pad_id, streamer=streamer, **stops)
        return out[:, width:].tolist()

    if warmup:
        batch(list(range(min(slots, len(prompts)))), limit=4)
        sync(device)
    t0 = time.monotonic()
    for start in range(0, len(prompts), slots):
        idx = list(range(start, min(start + slots, len(prompts))))
        streamer = StepTimes() if step_times else None
        for i, row in zip(idx, batch(idx, streamer=streamer)):
            useful = truncate(row, max_tokens[i], eos)
            run.outputs.append(useful)
            if streamer is not None:
                steps = streamer.times[1:]  # the first put() is the prompt
                run.first_s.append(steps[0] - t0)
                run.last_s.append(steps[len(useful) - 1] - t0)
    sync(device)
    run.wall_s = time.monotonic() - t0
    run.note = f"generate, left-padded batches of {slots}, each runs to its longest request"
    return run


def cb_config(prompts, max_tokens, slots: int, device: str = "cpu"):
    """transformers' ``ContinuousBatchingConfig`` for this workload: on CUDA its paged cache sized by
    transformers from free memory; on a CPU 64-token pages, enough blocks for ``slots`` requests of
    the longest prompt + length, 512 batch tokens."""
    import torch
    from transformers import ContinuousBatchingConfig

    if torch.device(device).type == "cuda":
        return ContinuousBatchingConfig(max_batch_tokens=2048, max_requests_per_batch=slots)
    page = 64
    per_request = math.ceil((max(map(len, prompts)) + max(max_tokens)) / page)
    return ContinuousBatchingConfig(page_size=page, num_blocks=slots * per_request + 4, max_batch_tokens=512,
                                    max_requests_per_batch=slots, allow_block_sharing=False)


def hf_cb(hf, prompts, max_tokens, slots: int, *, config, eos=None, max_new_tokens: int | None = None,
          warm: str = "request", timestamps: bool = True, timeout_s: float = 300.0) -> Run:
    """transformers' continuous batching (``hf.init_continuous_batching``, ``config`` its
    ``ContinuousBatchingConfig``), greedy, each request its own ``max_new_tokens``; ``eos`` its stop
    tokens (None: off); ``max_new_tokens`` the generation config's (default the largest length).
    ``warm``: ``"request"`` (one 4-token request before t0) or ``"manager"`` (the manager's own
    ``warmup()``, as ``continuous_batching_context_manager`` does). ``timestamps``: each request's
    first / last useful token time (``record_timestamps``). Raises ``RuntimeError`` when no result
    comes within ``timeout_s``."""
    from transformers import GenerationConfig

    stops = {"eos_token_id": -1, "pad_token_id": 0} if eos is None else \
        {"eos_token_id": sorted(eos), "pad_token_id": min(eos)}
    gen = GenerationConfig(do_sample=False, max_new_tokens=max_new_tokens or max(max_tokens), **stops)
    manager = hf.init_continuous_batching(generation_config=gen, continuous_batching_config=config)
    run = Run("hf-cb")
    if warm == "manager":
        manager.warmup()
    manager.start()
    try:
        if warm == "request":
            manager.add_request(prompts[0][:8], request_id="warm-up", max_new_tokens=4)
            _collect(manager, {"warm-up"}, timeout_s)
        t0_perf, t0 = time.perf_counter(), time.monotonic()
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=m, record_timestamps=timestamps)
               for i, (p, m) in enumerate(zip(prompts, max_tokens))]
        done = _collect(manager, set(ids), timeout_s)
        run.wall_s = time.monotonic() - t0
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()
    for i, m in zip(ids, max_tokens):
        tokens = list(done[i].generated_tokens)
        useful = tokens if eos is None else truncate(tokens, m, eos)  # stops off: exactly m, or a visible bug
        run.outputs.append(useful)
        if timestamps:
            stamps = done[i].timestamps or [t0_perf + run.wall_s]
            run.first_s.append(stamps[0] - t0_perf)
            run.last_s.append(stamps[len(useful) - 1] - t0_perf)
    run.note = f"init_continuous_batching, {slots} requests per batch"
    return run


def _collect(manager, ids: set[str], timeout_s: float) -> dict:
    done: dict = {}
    while len(done) < len(ids):
        res = manager.get_result(timeout=timeout_s)
        if res is None:
            raise RuntimeError(f"transformers' continuous batching gave no result in {timeout_s:.0f} s")
        if res.is_finished() and res.request_id in ids:
            done[res.request_id] = res
    return done
