"""Engine slots -> KV-cache rows, lowest free row first (shared by both runners).

The engine may hand out any free slot; a runner maps each occupied slot to
the lowest free row of its cache, so the rows in use stay packed near row 0
and a decode step can read rows ``0..n-1`` as one view (the slotserve
runner) or slice instead of gather (the HF runner).
"""

from __future__ import annotations

import heapq


class SlotRows:
    """``slot -> row`` for ``num_rows`` cache rows.

    - ``of``: the current mapping (read it directly in hot loops).
    - :meth:`row`: the slot's row, taking the lowest free one for a new slot.
    - :meth:`release`: give the slot's row back; returns it (None if it had none).
    - :attr:`idle`: no slot holds a row.

    Raises ValueError when a new slot finds no free row (``release`` was not called).
    """

    __slots__ = ("of", "_free")

    def __init__(self, num_rows: int = 0) -> None:
        self.of: dict[int, int] = {}
        self._free = list(range(num_rows))  # a heap (sorted is one)

    def row(self, slot: int) -> int:
        row = self.of.get(slot)
        if row is None:
            if not self._free:
                raise ValueError(f"slot {slot} has no free cache row; was release_slot() called?")
            row = self.of[slot] = heapq.heappop(self._free)
        return row

    @property
    def idle(self) -> bool:
        """True when no slot holds a row."""
        return not self.of

    def release(self, slot: int) -> int | None:
        row = self.of.pop(slot, None)
        if row is not None:
            heapq.heappush(self._free, row)
        return row
