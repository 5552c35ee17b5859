"""glibc's heap while serving (worker.models.heap): after a model loads, a large temporary (a prefill
chunk's activations) comes from the heap, whose freed pages later temporaries reuse, not from a fresh
mapping that page-faults every page and is unmapped at its free."""

from __future__ import annotations

import ctypes
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.models import heap, load_model

BIG = (512, 17920)
"""Qwen2.5-Coder-1.5B's gate/up product for a 512-token prefill chunk (fp32, 35 MiB: past glibc's
largest automatic mmap threshold, 32 MiB)."""


class MallInfo2(ctypes.Structure):
    """glibc's ``struct mallinfo2`` (glibc >= 2.33)."""
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                      "fsmblks", "uordblks", "fordblks", "keepcost")]


def mapped_bytes() -> int:
    """Bytes glibc holds in blocks mapped one each (``mallinfo2().hblkhd``)."""
    libc = ctypes.CDLL("libc.so.6")
    if not hasattr(libc, "mallinfo2"):
        pytest.skip("needs glibc >= 2.33 (mallinfo2)")
    libc.mallinfo2.restype = MallInfo2
    return libc.mallinfo2().hblkhd


CHECK = """
import torch
from worker.models import heap
from tests.models.test_heap import BIG, mapped_bytes
if {reuse}:
    heap.reuse_freed_memory()
before = mapped_bytes()
t = torch.empty(BIG)
past = torch.empty(heap.REUSED_BYTES // 4 + 1024)
print(mapped_bytes() - before - past.nbytes)
"""


@pytest.mark.process  # (a process of its own: the setting is process-wide, and a pytest worker's other
def test_after_reuse_a_big_temporary_comes_from_the_heap():  # threads' blocks would move the count)
    mapped_bytes()  # (skips without mallinfo2)

    def grown(reuse: bool) -> int:
        out = subprocess.run([sys.executable, "-c", CHECK.format(reuse=reuse)], capture_output=True, text=True,
                             timeout=120, cwd=Path(__file__).parents[2])
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    # beyond the block past the threshold (mapped either way, its size rounded up to pages), BIG added a
    # mapped block by default only
    assert grown(False) >= BIG[0] * BIG[1] * 4 and grown(True) < 1 << 16


def test_load_model_turns_the_reuse_on(model_dir, monkeypatch):
    import worker.models

    calls = []
    monkeypatch.setattr(worker.models, "reuse_freed_memory", lambda: calls.append(1))
    load_model(model_dir)
    assert calls == [1]
