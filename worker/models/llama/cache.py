"""The runner's static per-slot KV cache.

One tensor ``kv``, ``[layers, 2, rows, kv_heads, capacity, head_dim]``
(keys at index 0 of the second axis, values at 1, so a layer's new keys and
values are stored with one indexed write); ``keys`` and ``values`` are its
two ``[layers, rows, kv_heads, capacity, head_dim]`` views. Row ``r`` belongs
to one slot's request, position ``p`` along the capacity axis is its token
at sequence position ``p``. ``lengths[r]`` is
how many positions of row ``r`` hold its keys; everything at or past it is
stale (an earlier occupant's, or padding) and is never attended to.
Non-finite values never enter (the forward replaces them with 0 before the
write), so stale data is always finite and a masked position contributes
exactly 0.

Scratch position: the last position, ``capacity - 1``, never holds a real
key. Padding queries of a decode step (rows in ``0..n_decode-1`` that are
not decoding) write there. This holds because :meth:`SlotCache.reserve`
keeps ``capacity`` above every row's length (one spare position), and at
the final capacity ``max_len`` a real key at ``max_len - 1`` would belong to
the token that completes a ``max_len``-token sequence, which the model never
reads.

Memory. With ``capacity_step=None`` (the runner's default) the cache has
its whole ``max_len`` capacity from the start, so it never grows or copies:
on CUDA allocated whole (captured graphs hold the tensors); on CPU as an
anonymous memory mapping whose pages the kernel backs only when first
written. A row's block for one layer and head holds its positions
contiguously, so the resident memory follows the positions rows have
actually reached (rounded up to a 4 KiB page per row, layer and head),
plus one page per block for the scratch position; reading a masked
position no row has written reads the kernel's shared zero page and takes
no memory. Measured for SmolLM2-135M at 8 slots (45 KiB per position and
slot; 8,192 positions, 2.8 GiB mapped): after HE32, whose longest sequence
has 282 positions, ~92 MiB resident (the whole-capacity cache of the growth
mode had 320 positions, 112.5 MiB, and 180 MiB with the 256-position steps
before). Pages a row has been written to stay resident for its next
occupants (nothing is handed back).

With a ``capacity_step``, ``capacity`` starts at that many positions and
grows, when a row needs more, to the larger of what it needs and
:data:`GROWTH` times the old capacity, rounded up to a multiple of
``capacity_step``, at most ``max_len`` (one copy per growth, with old and
new cache held at once while it copies). This is also the fallback where the
whole mapping is refused (strict overcommit). Bytes mapped:
``2 * layers * rows * kv_heads * capacity * head_dim * itemsize``.

Rows that memory cannot hold are refused when the cache is made (:func:`least_bytes`): on CPU a
row holding one token has written a page of each of its ``2 * layers * kv_heads`` blocks, so
``rows`` of them busy at once take at least that many pages each (SmolLM2-135M: 720 KiB a row);
on CUDA the cache is allocated whole. Past the memory available, a worker could never serve its
slots (``--slots 100000`` of SmolLM2-135M: 69 GiB at the least): a ValueError saying how many fit.
"""

from __future__ import annotations

import math
import mmap
import sys

import torch

from worker import host_memory

GROWTH = 1.125
"""Least factor by which the capacity grows (see the module docstring)."""

FALLBACK_STEP = 64
"""``capacity_step`` when the whole cache cannot be mapped at once."""

_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform.startswith("linux") else 0)
"""Linux's MAP_NORESERVE (Python < 3.13 does not name it): no swap is reserved for the mapping, so
the kernel's heuristic overcommit accepts a cache larger than RAM of which only written pages count."""


class SlotCache:
    """Per-row KV cache (see module docstring)."""

    def __init__(self, *, layers: int, rows: int, kv_heads: int, head_dim: int, max_len: int,
                 dtype: torch.dtype, device: str, capacity_step: int | None = 64) -> None:
        if min(layers, rows, kv_heads, head_dim) < 1 or max_len < 2:
            raise ValueError("SlotCache sizes must be >= 1 (max_len >= 2)")
        cpu = torch.device(device).type == "cpu"
        check_fits(rows, least_bytes(layers, kv_heads, head_dim, max_len, dtype, device), device,
                   "a token" if cpu else "its whole context (allocated at once)")
        self.layers, self.rows, self.kv_heads, self.head_dim = layers, rows, kv_heads, head_dim
        self.max_len, self.dtype, self.device, self.capacity_step = max_len, dtype, device, capacity_step
        self.lengths = [0] * rows
        self.capacity = 0
        self.kv = torch.empty(0)
        if capacity_step is None:
            try:
                self._grow(max_len)
                return
            except OSError:  # the whole mapping refused: grow as needed instead
                self.capacity_step = capacity_step = FALLBACK_STEP
        self._grow(min(capacity_step, max_len))

    @property
    def keys(self) -> torch.Tensor:
        """``[layers, rows, kv_heads, capacity, head_dim]``, a view of :attr:`kv`."""
        return self.kv[:, 0]

    @property
    def values(self) -> torch.Tensor:
        """``[layers, rows, kv_heads, capacity, head_dim]``, a view of :attr:`kv`."""
        return self.kv[:, 1]

    @property
    def scratch(self) -> int:
        """The position padding writes go to (``capacity - 1``)."""
        return self.capacity - 1

    def reserve(self, longest: int) -> None:
        """Make room for rows of up to ``longest`` positions plus the scratch position.

        Raises ValueError past ``max_len - 1`` positions.
        """
        if longest > self.max_len - 1:
            raise ValueError(f"a sequence of {longest + 1} tokens exceeds the model's limit of "
                             f"{self.max_len} tokens; shorten the prompt or max_tokens")
        if longest + 1 > self.capacity:
            step = self.capacity_step or self.max_len
            want = max(longest + 1, int(self.capacity * GROWTH))
            self._grow(min(self.max_len, -(-want // step) * step))

    def clear(self, row: int) -> None:
        """Forget row ``row`` (its data stays, never read, until overwritten)."""
        self.lengths[row] = 0

    @property
    def nbytes(self) -> int:
        """Bytes mapped (on CPU only the written pages of them take memory)."""
        return self.kv.numel() * self.kv.element_size()

    def _grow(self, capacity: int) -> None:
        shape = (self.layers, 2, self.rows, self.kv_heads, capacity, self.head_dim)
        # zeros, not empty: masked positions are still multiplied by 0 weights, and 0 * NaN is NaN
        if torch.device(self.device).type == "cpu":
            kv = _anonymous_zeros(shape, self.dtype)
        else:
            kv = torch.zeros(shape, dtype=self.dtype, device=self.device)
        if self.capacity:
            kv[..., : self.capacity, :].copy_(self.kv)
        self.kv, self.capacity = kv, capacity


PAGE_BYTES = mmap.PAGESIZE
"""The kernel's page: the least memory a written position of a block takes (CPU)."""


def least_bytes(layers: int, kv_heads: int, head_dim: int, max_len: int, dtype: torch.dtype, device: str) -> int:
    """The least memory one row takes once it holds a token (bytes): on CPU one page of each of its
    ``2 * layers * kv_heads`` blocks (a block smaller than a page: itself); elsewhere its whole
    ``max_len`` positions (the cache is allocated whole)."""
    block = max_len * head_dim * dtype.itemsize
    if torch.device(device).type == "cpu":
        block = min(block, PAGE_BYTES)
    return 2 * layers * kv_heads * block


def available_bytes(device: str) -> int | None:
    """Memory the cache may take (bytes): CUDA's free device memory, else the host memory this
    process may still take (:func:`worker.host_memory.available_bytes`: MemAvailable, less under a
    cgroup limit); None where unknown (no check then)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return torch.cuda.mem_get_info(dev)[0]
    if dev.type != "cpu":
        return None
    return host_memory.available_bytes()


def check_fits(rows: int, per_row: int, device: str, where: str) -> None:
    """ValueError when ``rows`` rows of ``per_row`` bytes at the least (once a row holds ``where``)
    exceed the memory available (:func:`available_bytes`)."""
    available = available_bytes(device)
    if available is None or rows * per_row <= available:
        return
    raise ValueError(f"{rows} slots do not fit: each slot's KV cache takes at least {per_row / 2**20:.2f} MiB once "
                     f"it holds {where}, {rows * per_row / 2**30:.1f} GiB for {rows}, beyond the "
                     f"{available / 2**30:.1f} GiB of {device} memory available; at most {available // per_row} "
                     "slots fit here (fewer leave room for longer sequences)")


def _anonymous_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero CPU tensor on an anonymous memory mapping of its own (``mmap``), not on malloc's heap.

    - The kernel's pages start zero and take memory only once written.
    - Freeing it unmaps it: glibc never sees it, so it does not raise glibc's
      mmap threshold (freeing a malloc'ed block under 32 MiB does, after which
      every activation up to that size stays on the heap when freed: measured
      on HE32, ~90 MiB more RSS after a 22.5 MiB cache grew).

    Raises OSError when the kernel refuses the mapping.
    """
    count = math.prod(shape)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(count * itemsize, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE)
    return torch.frombuffer(buffer, dtype=dtype, count=count).view(shape)
