"""Handing freed heap memory back to the OS (glibc's ``malloc_trim``), keeping a serving
loop's large temporaries on the heap (``mallopt``), and bounding oneDNN's per-shape caches.

glibc keeps freed blocks on its heaps: after a large free it raises its mmap
threshold, so later temporaries of that size (a prefill's activations) come
from the heap, and the pages they leave free stay in the process's RSS.
``malloc_trim(0)`` returns every whole free page (glibc >= 2.8 also releases
pages in the middle of a heap). Measured on SmolLM2-135M at 8 slots (fp32,
HE32): the first 512-token prefill left ~54 MiB of such pages, and a trim
took 4 ms.
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os

@functools.cache
def _glibc(function: str):
    """glibc's ``function`` (through ctypes), or None without glibc (another libc, another OS)."""
    try:
        return getattr(ctypes.CDLL("libc.so.6"), function)
    except (OSError, AttributeError):
        return None


def trim_heap() -> None:
    """``malloc_trim(0)``: return whole free heap pages to the OS; a no-op without glibc."""
    trim = _glibc("malloc_trim")
    if trim is not None:
        trim(0)


REUSED_BYTES = 1 << 28
"""glibc's mmap and trim thresholds while serving (256 MiB; :func:`reuse_freed_memory`)."""


def reuse_freed_memory() -> None:
    """Serve temporaries of up to :data:`REUSED_BYTES` from the heap and keep what they free there
    (glibc's ``M_MMAP_THRESHOLD`` and ``M_TRIM_THRESHOLD``); a no-op without glibc.

    glibc maps a block above its mmap threshold afresh at each allocation and unmaps it at its
    free; the threshold rises with the blocks freed, but to 32 MiB at most. So a temporary past
    it (Qwen2.5-Coder-1.5B's gate/up product for a 512-token prefill chunk: 512 x 17920 fp32,
    35 MiB) page-faulted all its pages at every layer. With both thresholds at 256 MiB such
    temporaries come from the heap, and the pages they free stay there for the next ones (not
    always: ``posix_memalign`` asks a little more than the block it freed, so a freed block is
    reused once its neighbours are free too); the runner hands free pages back when it goes idle
    (:func:`trim_heap`). Measured, the 1.5B at int8, 2 threads, one process each, two rounds: a
    512-token prefill took 1,160-1,330 ms against 1,480-1,950 without; over 12 prefills of
    97-512 tokens, 9 % less time, the RSS the same after each (1,402 -> 1,954 MiB both, the KV
    cache filling). Called after a model loads (``load_model``), so the load's own large blocks
    are mapped as before and unmapped when freed.
    """
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return
    mallopt(-3, REUSED_BYTES)  # M_MMAP_THRESHOLD
    mallopt(-1, REUSED_BYTES)  # M_TRIM_THRESHOLD


def return_freed_memory() -> None:
    """Collect garbage, then :func:`trim_heap` (after a load: the HF module's freed tensors)."""
    gc.collect()
    trim_heap()


ONEDNN_CACHE_ENTRIES = 32
"""Entries kept by each of oneDNN's per-shape caches (see :func:`bound_onednn_caches`)."""

ONEDNN_CACHE_VARIABLES = ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")
"""oneDNN's primitive cache, and ideep's cache of torch's oneDNN linears (both 1,024 by default)."""


def bound_onednn_caches() -> None:
    """Cap oneDNN's caches at :data:`ONEDNN_CACHE_ENTRIES` each, unless the variables are already set.

    oneDNN (torch's packed and bf16 CPU linears) caches a primitive, with its
    buffers, per input shape, and ideep (torch's oneDNN layer) keeps its own
    per-shape cache, 1,024 entries each by default. A serving loop gives the
    linears a new row count at almost every prefill iteration, so those
    caches grow the worker for hours: measured on an AMD EPYC, 4 linears of
    SmolLM2-135M's shapes at every row count from 1 to 520 took +492 MiB
    (bf16 ``F.linear`` at 1-300 rows: +654 MiB), and +16 MiB with 32 entries
    each. A miss costs ~0.7 ms per linear shape (measured: ~3 ms per prefill
    iteration of 4 layer shapes); the decode row count stays cached, except
    with speculative decoding, whose rows vary with the drafts found. The
    libraries read the variables once, at their first use in the process:
    this must run before any oneDNN product (``load_model`` calls it first).
    """
    for name in ONEDNN_CACHE_VARIABLES:
        os.environ.setdefault(name, str(ONEDNN_CACHE_ENTRIES))
