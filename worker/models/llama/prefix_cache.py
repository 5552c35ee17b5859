"""Automatic prefix caching for the Llama runner: KV of earlier requests kept in token blocks and reused.

Scheme: vLLM's automatic prefix caching (``vllm/v1/core/kv_cache_utils.py``):
a sequence is cut into full blocks of :data:`BLOCK_TOKENS` tokens, and block
``i`` is identified by its parent's identity and its own tokens, so a block
stands for the whole prefix up to its end. Here the identity is exact, not
a digest: the key is ``(parent serial, tokens)`` in a dict (Python hashes
the tuple and compares it on a hit, so a collision can never hand one
prefix another's keys), and every stored block gets a fresh serial, so a
child of an evicted parent is unreachable (it ages out) rather than
attached to a reused slot. Blocks beat a radix tree here because the
runner's KV cache is a static per-row array, not paged: a hit is copied
into the row, and a block-granular pool is one tensor indexed by block,
copied in and out with one ``index_select`` / ``index_copy_`` per request.

Memory: one pool ``[blocks, layers, 2, kv_heads, BLOCK_TOKENS, head_dim]``
in the runner's KV dtype, ``blocks = budget // bytes per block``; on CPU
an anonymous mapping whose pages are backed only when a block is first
written (:func:`worker.models.llama.cache._anonymous_zeros`), so resident
memory follows the blocks used and never passes the budget.

Eviction: least recently used first (an ``OrderedDict``). Since a hit is
copied into the slot's row, no slot ever holds a pool block: every block is
evictable. A chain is touched from its last block to its first, so a
prefix's tail is evicted before its head (vLLM frees blocks in reverse for
the same reason): what is left is still a usable prefix.

What is stored: a row's full blocks, of prompt and output tokens, up to
what the row's cache holds (``SlotCache.lengths``), after each prefill chunk
(so a request can hit a prompt still running) and when the slot is
released (finished, cancelled, or any other ending). A row whose tokens
went non-finite is never stored. What is looked up: the request's tokens
but the last (at least one token is computed, for its logits), in whole
blocks. Exactness: a key at position ``p`` depends only on the tokens up to
``p``, and the runner is batch- and chunk-invariant, so a hit gives the keys
a cold prefill computes (tested bitwise: same greedy tokens).

Precision: the pool belongs to one runner, whose weights have one
precision and whose KV cache one dtype (``--kv-cache-dtype``: the pool
takes the cache's, so a bf16 cache's blocks take half the bytes and a hit
copies the very values a cold prefill stores); the root of every chain is
also keyed by ``precision`` and that dtype, so a block cached in one is
never reused by another.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from worker import host_memory

BLOCK_TOKENS = 16
"""Tokens per cached block (vLLM's default block size)."""

DEFAULT_FRACTION = 0.10
"""Share of the machine's memory the default budget takes (RAM on CPU, free GPU memory on CUDA)."""

DEFAULT_CAP_MB = 4096
"""Most MiB the default budget takes."""


def default_budget_mb(device: str) -> int:
    """The ``--prefix-cache-mb`` default: :data:`DEFAULT_FRACTION` of the machine's memory
    (on CPU the host's memory, a cgroup's limit if smaller: :func:`worker.host_memory.total_bytes`;
    free memory of the current GPU on CUDA), at most :data:`DEFAULT_CAP_MB` (that where unknown)."""
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info()
        total = free
    else:
        total = host_memory.total_bytes()
        if total is None:
            return DEFAULT_CAP_MB
    return int(min(DEFAULT_CAP_MB, total * DEFAULT_FRACTION / 2**20))


def skips_cache(item) -> bool:
    """True for a slot input (:class:`~worker.models.base.SlotInput`) that must not reuse cached
    KV: one asking ``prompt_logprobs``, whose prompt positions all need logits (vLLM skips the
    cache for them too). Its own blocks are still stored."""
    return getattr(item, "prompt_logprobs", None) is not None


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters (vLLM's names): ``queries`` prompt tokens looked up, ``hits`` of them found,
    both in tokens; ``stored`` blocks written, ``evicted`` blocks evicted."""

    queries: int = 0
    hits: int = 0
    stored: int = 0
    evicted: int = 0


class PrefixCache:
    """A pool of KV blocks for one :class:`~worker.models.llama.cache.SlotCache` (see module docstring).

    ``budget_mb``: MiB the pool may take (>= one block). ``precision``: the
    runner's (part of every chain's root). ValueError for a budget under one block.
    """

    def __init__(self, kv_cache, budget_mb: float, precision: str) -> None:
        layers, _, _, kv_heads, _, head_dim = kv_cache.kv.shape
        self.block_bytes = layers * 2 * kv_heads * BLOCK_TOKENS * head_dim * kv_cache.kv.element_size()
        self.num_blocks = int(budget_mb * 2**20) // self.block_bytes
        if self.num_blocks < 1:
            raise ValueError(f"a prefix cache of {budget_mb} MiB holds no block of {BLOCK_TOKENS} tokens "
                             f"({self.block_bytes} bytes); give at least {self.block_bytes / 2**20:.2f} MiB, or 0 for off")
        self.kv = kv_cache
        shape = (self.num_blocks, layers, 2, kv_heads, BLOCK_TOKENS, head_dim)
        if torch.device(kv_cache.device).type == "cpu":
            from worker.models.llama.cache import _anonymous_zeros

            self.pool = _anonymous_zeros(shape, kv_cache.dtype)
        else:
            self.pool = torch.zeros(shape, dtype=kv_cache.dtype, device=kv_cache.device)
        self.root = ("root", precision, kv_cache.dtype)
        self._blocks: OrderedDict[tuple, tuple[int, int]] = OrderedDict()  # key -> (serial, pool index), LRU first
        self._free = list(range(self.num_blocks - 1, -1, -1))
        self._serial = 0
        self._chains: dict[int, list[int]] = {}  # row -> serials of its stored blocks, in order
        self.stats = PrefixCacheStats()

    def reset_stats(self) -> None:
        """Zero the counters (the blocks stay): what a warm-up looked up is not served traffic."""
        self.stats = PrefixCacheStats()

    @property
    def nbytes(self) -> int:
        """Bytes of the pool (on CPU only the blocks written take memory)."""
        return self.num_blocks * self.block_bytes

    @property
    def used_blocks(self) -> int:
        return len(self._blocks)

    def _parent(self, chain: list[int]):
        return chain[-1] if chain else self.root

    def load(self, row: int, tokens: Sequence[int]) -> int:
        """Copy the longest cached prefix of ``tokens`` (whole blocks, never the last token) into
        ``row`` of the KV cache and set its length; returns the tokens reused (0: a miss).
        The row must be empty (a new occupant)."""
        want = (len(tokens) - 1) // BLOCK_TOKENS
        chain, where, blocks = [], [], self._blocks
        parent = self.root
        for b in range(want):
            hit = blocks.get((parent, tuple(tokens[b * BLOCK_TOKENS:(b + 1) * BLOCK_TOKENS])))
            if hit is None:
                break
            chain.append(hit[0])
            where.append(hit[1])
            parent = hit[0]
        self.stats.queries += len(tokens)
        self._chains[row] = chain
        if not chain:
            return 0
        n = len(chain) * BLOCK_TOKENS
        self.stats.hits += n
        self._touch(tokens, chain)
        got = self.pool.index_select(0, torch.tensor(where, device=self.pool.device))
        # [n_blocks, layers, 2, kv_heads, B, head_dim] -> [layers, 2, kv_heads, n_blocks * B, head_dim]
        layers, _, kvh, _, hd = got.shape[1:]
        self.kv.kv[:, :, row, :, :n].copy_(got.permute(1, 2, 3, 0, 4, 5).reshape(layers, 2, kvh, n, hd))
        self.kv.lengths[row] = n
        return n

    def store(self, row: int, tokens: Sequence[int]) -> None:
        """Add ``row``'s full blocks not yet stored (up to its cache length; ``tokens`` its
        sequence, whose first ``lengths[row]`` positions the row holds)."""
        chain = self._chains.setdefault(row, [])
        # at most the pool's size: then taking a block never evicts one of this chain (all newer)
        full = min(self.kv.lengths[row], len(tokens)) // BLOCK_TOKENS
        full = min(full, self.num_blocks)
        if full <= len(chain):
            return
        self._touch(tokens, chain)
        blocks, new_at, new_index = self._blocks, [], []
        for b in range(len(chain), full):
            key = (self._parent(chain), tuple(tokens[b * BLOCK_TOKENS:(b + 1) * BLOCK_TOKENS]))
            hit = blocks.get(key)
            if hit is not None:
                blocks.move_to_end(key)
            else:
                index = self._take()
                if index is None:
                    break
                self._serial += 1
                hit = blocks[key] = (self._serial, index)
                new_at.append(b)
                new_index.append(index)
                self.stats.stored += 1
            chain.append(hit[0])
        if new_index:
            # runs of consecutive new blocks: [layers, 2, kvh, n*B, hd] -> [n, layers, 2, kvh, B, hd]
            kv = self.kv.kv[:, :, row]
            src = torch.stack([kv[:, :, :, b * BLOCK_TOKENS:(b + 1) * BLOCK_TOKENS] for b in new_at])
            self.pool.index_copy_(0, torch.tensor(new_index, device=self.pool.device), src)
        self._touch(tokens, chain)

    def release(self, row: int) -> None:
        """The row's request ended: forget its chain (its blocks stay cached)."""
        self._chains.pop(row, None)

    def _take(self) -> int | None:
        """A free pool index, evicting the least recently used block if needed (None: pool empty)."""
        if self._free:
            return self._free.pop()
        if not self._blocks:
            return None
        _, (_, index) = self._blocks.popitem(last=False)
        self.stats.evicted += 1
        return index

    def _touch(self, tokens: Sequence[int], chain: list[int]) -> None:
        """Mark the chain's blocks most recently used, its first block last (evicted after its tail)."""
        blocks, keys, parent = self._blocks, [], self.root
        for b, serial in enumerate(chain):
            keys.append((parent, tuple(tokens[b * BLOCK_TOKENS:(b + 1) * BLOCK_TOKENS])))
            parent = serial
        for key in reversed(keys):
            if key in blocks:
                blocks.move_to_end(key)
