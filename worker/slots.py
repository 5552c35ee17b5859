"""The running batch: which request occupies which slot, and when each one must stop.

A slot is one row of the model's batch (and, for slot-aware models, one
per-slot KV cache). :class:`SlotTable` keeps the occupied slots as parallel
lists in *batch order* -- ``reqs[i]`` owns ``seqs[i]`` -- so one model call
reads them as they are and one ``map`` appends a token to every sequence. A
freed entry is swap-removed (the last entry moves into its place), so
admitting and freeing cost O(1) and nothing is rebuilt per iteration.

Termination is checked per batch, not per token, wherever it can be:

- stop tokens: one ``isdisjoint`` of the new tokens against the multiset of
  stop tokens in use; only on a hit are the slots visited;
- ``max_tokens``: requests are bucketed by the iteration in which they
  reach it, so an iteration looks at its own bucket only;
- stop sequences: only requests that have them are visited (one
  :class:`~worker.request.StopMatcher` step each).
"""

from __future__ import annotations

from collections import deque

from protocol.enums import FinishReason
from worker.models.base import GREEDY, SlotInput
from worker.request import Request, RequestState

_NO_TOKENS: list[int] = []  # what a free slot's SlotInput points at (drops the old sequence)
_exhaust = deque(maxlen=0).extend  # runs an iterator at C speed, keeps nothing
_RUNNING = RequestState.RUNNING
_STOP, _LENGTH = FinishReason.STOP, FinishReason.LENGTH


class SlotTable:
    """``num_slots`` slots, each free or owned by one running request.

    - ``reqs``: running requests, batch order.
    - ``seqs``: their token lists (``reqs[i].seq``), the batch of a stateless model.
    - ``batch``: what the model is called with -- ``seqs``, or for slot-aware
      models one :class:`SlotInput` per entry (owned by its slot and reused,
      so an iteration allocates nothing).
    - ``free``: free slot indices, a stack (slot 0 first, then the latest freed).
    - ``streaming``: running requests with an ``on_token`` callback.
    - ``iteration``: number of token-appending iterations so far.

    Invariants: ``len(reqs) + len(free) == num_slots``; ``reqs[i].pos == i``;
    ``stop_counts[t]`` = number of running requests with stop token ``t``.
    """

    __slots__ = ("num_slots", "reqs", "seqs", "free", "batch", "streaming", "iteration",
                 "_inputs", "_slot_inputs", "_due", "_stop_counts", "_matching")

    def __init__(self, num_slots: int, slot_aware: bool) -> None:
        self.num_slots = num_slots
        self.reqs: list[Request] = []
        self.seqs: list[list[int]] = []
        self.free = list(range(num_slots - 1, -1, -1))
        self._slot_inputs = [SlotInput(slot=i, tokens=_NO_TOKENS) for i in range(num_slots)]
        self._inputs: list[SlotInput] | None = [] if slot_aware else None
        self.batch: list = self.seqs if self._inputs is None else self._inputs
        self.streaming: list[Request] = []
        self.iteration = 0
        self._due: dict[int, list[Request]] = {}  # iteration -> requests reaching max_tokens
        self._stop_counts: dict[int, int] = {}
        self._matching: list[Request] = []  # running requests with stop sequences

    def occupy(self, req: Request) -> int:
        """Give ``req`` a free slot (the caller checked there is one); return the slot."""
        slot = self.free.pop()
        req.slot, req.pos = slot, len(self.reqs)
        self.reqs.append(req)
        self.seqs.append(req.seq)
        if self._inputs is not None:
            si = self._slot_inputs[slot]
            si.tokens, si.sampling = req.seq, req.sampling
            self._inputs.append(si)
        # Its k-th new token is appended in iteration (now + k - 1).
        due = self.iteration + req.limit - len(req.seq) - 1
        bucket = self._due.get(due)
        if bucket is None:
            self._due[due] = [req]
        else:
            bucket.append(req)
        for t in req.stop_tokens:
            self._stop_counts[t] = self._stop_counts.get(t, 0) + 1
        if req.matcher is not None:
            self._matching.append(req)
        if req.on_token is not None:
            self.streaming.append(req)
        return slot

    def vacate(self, req: Request) -> int:
        """Free ``req``'s slot (swap-remove from the batch lists); return the slot."""
        pos, slot = req.pos, req.slot
        assert pos is not None and slot is not None and self.reqs[pos] is req
        last = len(self.reqs) - 1
        if pos != last:
            moved = self.reqs[last]
            self.reqs[pos] = moved
            self.seqs[pos] = self.seqs[last]
            if self._inputs is not None:
                self._inputs[pos] = self._inputs[last]
            moved.pos = pos
        self.reqs.pop()
        self.seqs.pop()
        if self._inputs is not None:
            self._inputs.pop()
            si = self._slot_inputs[slot]
            si.tokens, si.sampling = _NO_TOKENS, GREEDY
        req.pos = req.slot = None
        self.free.append(slot)
        for t in req.stop_tokens:
            n = self._stop_counts[t] - 1
            if n:
                self._stop_counts[t] = n
            else:
                del self._stop_counts[t]
        if req.matcher is not None:
            self._matching.remove(req)
            req.matcher = None
        if req.on_token is not None:
            self.streaming.remove(req)
            req.on_token = None
        return slot

    def append(self, tokens: list[int]) -> list[Request]:
        """Append ``tokens[i]`` to ``seqs[i]``; return the requests this finishes.

        Checks in the order stop token, stop sequences, ``max_tokens``; the
        first that fires sets ``req.reason``. Only RUNNING requests with no
        reason yet can finish; states are left for the engine to commit.
        """
        reqs = self.reqs
        _exhaust(map(list.append, self.seqs, tokens))
        it = self.iteration
        self.iteration = it + 1
        finished: list[Request] = []
        stop = self._stop_counts
        # One C-level scan of the new tokens; `in` on a list beats isdisjoint for one token.
        if stop and (next(iter(stop)) in tokens if len(stop) == 1
                     else not stop.keys().isdisjoint(tokens)):
            for i in [i for i, t in enumerate(tokens) if t in stop]:
                req = reqs[i]
                if tokens[i] in req.stop_tokens and req.state is _RUNNING:
                    req.reason, req.stop_reason = _STOP, tokens[i]
                    finished.append(req)
        for req in self._matching:
            matched = req.matcher.feed(req.seq[-1])
            if matched is not None and req.reason is None and req.state is _RUNNING:
                req.reason, req.stop_reason = _STOP, matched
                finished.append(req)
        for req in self._due.pop(it, ()):
            if req.pos is not None and req.reason is None and req.state is _RUNNING:
                req.reason = _LENGTH
                finished.append(req)
        return finished
