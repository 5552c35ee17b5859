"""The CUDA decode step, replayed from CUDA graphs (as vLLM and SGLang do).

A decode step of a small model is a few hundred tiny kernels; launched one by
one from Python, the GPU waits on the CPU. Here the step is captured once per
(batch size, window) pair and replayed:

- batch sizes: :data:`BATCH_SIZES` up to the number of slots; a step with
  ``n`` decode rows runs the smallest captured size >= ``n`` (the extra rows
  are padding: token 0 written to the cache's scratch position, see
  :mod:`worker.models.llama.cache`);
- windows (keys each row looks at): powers of two from 256 up to the cache
  capacity, the smallest >= the longest row; shorter rows are masked.

Inputs live in one static ``[4, max_batch]`` tensor (tokens, positions,
write positions, lengths), filled by one host-to-device copy per step;
the cache is allocated whole (``capacity = max_len``) so the graphs can hold
it. Nothing in the step synchronises with the host: the only sync is the
sampler's ``tolist`` of the sampled tokens. The graphs return every row's
full logits, so every sampling option (bias, penalties, filters) applies to
them unchanged: no shortcut here assumes greedy. A graph is captured the first
time its pair is needed (a warm-up run, which is the real step, then the
capture; replaying it again is idempotent: same inputs, same cache writes).

CUDA-only: imported by :class:`~worker.models.llama.runner.LlamaRunner` only
on a CUDA device; the tests for it skip without a GPU. Its inputs come from
:func:`~worker.models.llama.plan.decode_inputs`, as the eager step's do.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from worker.models.llama.cache import SlotCache
from worker.models.llama.model import forward
from worker.models.llama.plan import StepPlan, decode_inputs
from worker.models.llama.weights import LlamaWeights
from worker.models.transfer import to_device

BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)
MIN_WINDOW = 256


class GraphStep(NamedTuple):
    """What one replayed decode step gives (:meth:`DecodeGraphs.run`)."""

    logits: torch.Tensor  # fp32 [n_out, vocab], the real rows'
    index: list[int]  # the batch index of each logits row
    failed: torch.Tensor  # bool [b]: which of the b replayed rows went non-finite
    rows: torch.Tensor  # [b]: the cache rows replayed (0..b-1)


class _Captured(NamedTuple):
    """One captured (batch size, window) pair: its graph and the static tensors it writes."""

    graph: torch.cuda.CUDAGraph
    logits: torch.Tensor
    failed: torch.Tensor


class DecodeGraphs:
    """Captured decode steps for one runner's weights and cache (see module docstring)."""

    def __init__(self, weights: LlamaWeights, cache: SlotCache) -> None:
        self.weights, self.cache = weights, cache
        rows = cache.rows
        self.batch_sizes = [b for b in BATCH_SIZES if b < rows] + [rows]
        windows, w = [], MIN_WINDOW
        while w < cache.capacity:
            windows.append(w)
            w *= 2
        self.windows = windows + [cache.capacity]
        device = cache.device
        self.inputs = torch.zeros(4, rows, dtype=torch.long, device=device)
        self.inputs[3] = 1
        self.arange = torch.arange(rows, device=device)
        self.pool = torch.cuda.graph_pool_handle()
        self.graphs: dict[tuple[int, int], _Captured] = {}

    def run(self, batch, decode: dict[int, int], cache: SlotCache) -> GraphStep:
        """One decode step for ``decode`` (cache row -> batch index): the real rows' logits,
        and which of the ``b`` replayed rows went non-finite."""
        d = decode_inputs(batch, decode, cache)
        n = len(d.ids)
        b = next(size for size in self.batch_sizes if size >= n)
        w = next(size for size in self.windows if size >= max(d.lengths))
        pad = b - n
        host = torch.tensor([d.ids + [0] * pad, d.positions + [0] * pad, d.write_pos + [cache.scratch] * pad,
                             d.lengths + [1] * pad], dtype=torch.long).pin_memory()
        self.inputs[:, :b].copy_(host, non_blocking=True)
        key = (b, w)
        if key not in self.graphs:
            self.graphs[key] = self._capture(b, w)
        captured = self.graphs[key]
        captured.graph.replay()
        rows = to_device(d.out_rows, torch.long, cache.device)
        return GraphStep(captured.logits.index_select(0, rows), d.out_index, captured.failed, self.arange[:b])

    def _plan(self, b: int, w: int) -> StepPlan:
        x = self.inputs
        return StepPlan(ids=x[0, :b], positions=x[1, :b], write_rows=self.arange[:b], write_pos=x[2, :b],
                        n_decode=b, lengths=x[3, :b], window=w, prefill=[], logits_at=self.arange[:b])

    def _capture(self, b: int, w: int) -> _Captured:
        plan = self._plan(b, w)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # warm-up (the real step): allocations settle before capture
            forward(self.weights, self.cache.kv, plan)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            logits, failed = forward(self.weights, self.cache.kv, plan)
        return _Captured(graph, logits, failed)
