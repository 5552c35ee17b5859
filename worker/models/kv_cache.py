"""A per-slot KV cache that slotserve manages, plugged into Hugging Face models.

Layout
------
One key buffer and one value buffer per decoder layer, each a float tensor::

    [num_slots, num_kv_heads, capacity, head_dim]

Row ``r`` holds the keys/values of the request that occupies cache row ``r``
(the backend maps engine slots to rows); position ``p`` along the third axis
is the token at sequence position ``p`` (0-based: the first prompt token is
position 0). ``lengths[r]`` says how many positions of row ``r`` are valid;
everything at or past it is stale data from an earlier occupant or padding,
never visible because the attention mask hides it (and always finite: :meth:`SlotKVCache.update`
stores NaN/inf as 0, so a failed request never poisons a neighbour). Units: positions are
tokens; memory is ``2 * num_layers * num_slots * num_kv_heads * capacity *
head_dim * itemsize`` bytes (SmolLM2-135M, fp32, 8 slots, capacity 512:
30 * 2 * 8 * 3 * 512 * 64 * 4 B = 189 MiB).

``capacity`` starts small and grows in steps of ``capacity_step`` positions
up to ``max_len`` when a row needs more (one reallocation that copies the
buffers; amortised over ``capacity_step`` tokens), so memory follows the
longest live sequence, not the model's context limit.

How a forward pass uses it
--------------------------
The Hugging Face model is called with explicit ``position_ids``, a
ready-made 4-D boolean attention mask and this object as its cache; each
attention layer calls :meth:`SlotKVCache.update` with the new keys/values of
the step, which writes them at their own rows and positions and returns the
keys/values the layer attends over. Two kinds of pass (set with
:meth:`begin_rows` / :meth:`begin_packed`):

- **rows** (decode, and prefill of a prefix-extended row): batch row ``b``
  is cache row ``rows[b]`` with ``q_len`` new tokens starting at
  ``starts[b]``. The layer attends over the window ``[:, :, :W]`` of the
  batch's rows, ``W = max(starts[b] + num_new[b])``: a view, not a copy,
  when the rows are consecutive (the backend hands out the lowest free row
  first to keep them so), a gather otherwise. Mask ``[B, 1, q_len, W]``:
  query ``i`` of row ``b`` sees key ``j`` iff ``j <= starts[b] + i`` and
  ``j < starts[b] + num_new[b]``.
- **packed** (prefill of freshly admitted requests, several at once without
  padding): all prompts are concatenated into one sequence of ``T`` tokens;
  keys/values are scattered into their rows at positions ``0..len-1`` and
  the layer attends over the packed keys themselves with a block-diagonal
  causal mask ``[1, 1, T, T]``.

This mirrors the static cache of gpt-fast (a preallocated buffer written in
place at the token's position) with one row per slot; a freed row is reused
by overwriting it, without touching the other rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class SlotKVCache:
    """Per-slot static KV cache (see module docstring for the layout).

    Implements the part of the transformers ``Cache`` interface that
    decoder layers call (``update``); position ids and masks are built here
    and passed to the model explicitly, so no other cache method is needed.
    """

    def __init__(
        self,
        *,
        num_layers: int,
        num_slots: int,
        num_kv_heads: int,
        head_dim: int,
        max_len: int,
        dtype: torch.dtype = torch.float32,
        capacity_step: int = 256,
    ) -> None:
        if min(num_layers, num_slots, num_kv_heads, head_dim, max_len, capacity_step) < 1:
            raise ValueError("SlotKVCache sizes must all be >= 1")
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.max_len = max_len
        self.dtype = dtype
        self.capacity_step = capacity_step
        self.capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths = [0] * num_slots
        self._pass: _RowsPass | _PackedPass | None = None
        from worker.models.llama.cache import check_fits  # (the runner's cache's rule, for this one's first buffers)

        first = min(capacity_step, max_len)
        check_fits(num_slots, 2 * num_layers * num_kv_heads * first * head_dim * dtype.itemsize, "cpu",
                   "its first buffers (allocated at once)")
        self._ensure_capacity(first)

    # -- bookkeeping -------------------------------------------------------

    def reset_row(self, row: int) -> None:
        """Forget row ``row`` (its data stays, hidden, until overwritten)."""
        self.lengths[row] = 0

    def nbytes(self) -> int:
        """Bytes held by the key and value buffers."""
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)

    def _ensure_capacity(self, needed: int) -> None:
        if needed > self.max_len:
            raise ValueError(
                f"sequence of {needed} tokens exceeds the KV cache limit of {self.max_len} "
                "tokens; shorten the prompt or max_tokens"
            )
        if needed <= self.capacity:
            return
        step = self.capacity_step
        new_cap = min(self.max_len, -(-needed // step) * step)
        shape = (self.num_slots, self.num_kv_heads, new_cap, self.head_dim)
        old_k, old_v, old_cap = self.keys, self.values, self.capacity
        # zeros, not empty: masked positions are still multiplied by zero
        # attention weights, and uninitialised memory may hold NaN/inf.
        self.keys = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        self.values = [torch.zeros(shape, dtype=self.dtype) for _ in range(self.num_layers)]
        for new, old in zip(self.keys + self.values, old_k + old_v):
            new[:, :, :old_cap].copy_(old)
        self.capacity = new_cap

    # -- passes ------------------------------------------------------------

    def begin_rows(
        self, rows: Sequence[int], starts: Sequence[int], num_new: Sequence[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a rows pass; return ``(position_ids [B, q], mask [B, 1, q, W])``.

        ``rows[b]`` is the cache row of batch row ``b``, ``starts[b]`` its
        first new position (== ``lengths[rows[b]]``) and ``num_new[b] >= 1``
        its number of new tokens; ``q = max(num_new)`` (shorter rows are
        right-padded by the caller). Raises ``ValueError`` past ``max_len``.
        """
        q_len = max(num_new)
        self._ensure_capacity(max(s + q_len for s in starts))
        window = max(s + n for s, n in zip(starts, num_new))
        starts_t = torch.tensor(starts, dtype=torch.long)
        offsets = torch.arange(q_len)
        positions = starts_t[:, None] + offsets[None, :]  # [B, q]
        key_pos = torch.arange(window)
        ends = starts_t + torch.tensor(num_new, dtype=torch.long)
        mask = (key_pos[None, None, :] <= positions[:, :, None]) & (
            key_pos[None, None, :] < ends[:, None, None]
        )
        first = rows[0]
        consecutive = list(rows) == list(range(first, first + len(rows)))
        self._pass = _RowsPass(
            rows=torch.tensor(rows, dtype=torch.long),
            row_slice=slice(first, first + len(rows)) if consecutive else None,
            positions=positions,
            window=window,
        )
        for r, e in zip(rows, ends.tolist()):
            self.lengths[r] = e
        return positions, mask[:, None]

    def begin_packed(self, rows: Sequence[int], num_new: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prepare a packed prefill of fresh rows; return ``(position_ids [1, T], mask [1, 1, T, T])``.

        Row ``rows[k]`` receives ``num_new[k]`` tokens at positions
        ``0..num_new[k]-1``; ``T = sum(num_new)``. Raises ``ValueError``
        past ``max_len``.
        """
        self._ensure_capacity(max(num_new))
        lengths = torch.tensor(num_new, dtype=torch.long)
        seq_id = torch.repeat_interleave(torch.arange(len(rows)), lengths)  # [T]
        first = torch.cumsum(lengths, 0) - lengths
        positions = torch.arange(int(lengths.sum())) - torch.repeat_interleave(first, lengths)
        row_of = torch.tensor(rows, dtype=torch.long)[seq_id]
        same = seq_id[:, None] == seq_id[None, :]
        causal = torch.arange(len(seq_id))[None, :] <= torch.arange(len(seq_id))[:, None]
        self._pass = _PackedPass(rows=row_of, positions=positions)
        for r, n in zip(rows, num_new):
            self.lengths[r] = n
        return positions[None, :], (same & causal)[None, None]

    def end(self) -> None:
        """Close the current pass (drops its index tensors)."""
        self._pass = None

    # -- transformers Cache protocol --------------------------------------

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the step's keys/values ``[B, H_kv, q, D]``; return what layer ``layer_idx`` attends over."""
        p = self._pass
        k_buf, v_buf = self.keys[layer_idx], self.values[layer_idx]
        # A non-finite key/value of one sequence must not reach another one: masked
        # positions still take part as 0 * value (NaN), and a freed row's stale data stays.
        key_states = key_states.nan_to_num(0.0, 0.0, 0.0)
        value_states = value_states.nan_to_num(0.0, 0.0, 0.0)
        if isinstance(p, _PackedPass):
            # [1, H, T, D] -> [T, H, D] scattered to (row, position) pairs
            k_buf[p.rows, :, p.positions] = key_states[0].transpose(0, 1)
            v_buf[p.rows, :, p.positions] = value_states[0].transpose(0, 1)
            return key_states, value_states
        assert p is not None, "update() outside a pass"
        if key_states.shape[2] == 1:
            k_buf[p.rows, :, p.positions[:, 0]] = key_states[:, :, 0]
            v_buf[p.rows, :, p.positions[:, 0]] = value_states[:, :, 0]
        else:
            rows = p.rows[:, None]
            k_buf[rows, :, p.positions] = key_states.transpose(1, 2)
            v_buf[rows, :, p.positions] = value_states.transpose(1, 2)
        if p.row_slice is not None:
            return k_buf[p.row_slice, :, : p.window], v_buf[p.row_slice, :, : p.window]
        return k_buf[p.rows, :, : p.window], v_buf[p.rows, :, : p.window]


class _RowsPass:
    __slots__ = ("rows", "row_slice", "positions", "window")

    def __init__(self, rows: torch.Tensor, row_slice: slice | None, positions: torch.Tensor, window: int):
        self.rows = rows
        self.row_slice = row_slice
        self.positions = positions
        self.window = window


class _PackedPass:
    __slots__ = ("rows", "positions")

    def __init__(self, rows: torch.Tensor, positions: torch.Tensor):
        self.rows = rows
        self.positions = positions
