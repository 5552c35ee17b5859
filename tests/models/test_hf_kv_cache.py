"""SlotKVCache bookkeeping: masks, positions, writes in place, growth, limits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from worker.models.kv_cache import SlotKVCache  # noqa: E402

pytestmark = pytest.mark.hf


def make(max_len=64, step=8, slots=4):
    return SlotKVCache(num_layers=2, num_slots=slots, num_kv_heads=2, head_dim=4, max_len=max_len,
                       capacity_step=step)


def test_packed_prefill_writes_rows_and_masks_block_diagonal():
    cache = make()
    positions, mask = cache.begin_packed([2, 0], [3, 2])
    assert positions.tolist() == [[0, 1, 2, 0, 1]]
    want = torch.tensor([
        [1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 0, 0],
        [0, 0, 0, 1, 0],
        [0, 0, 0, 1, 1],
    ], dtype=torch.bool)
    assert torch.equal(mask[0, 0], want)
    k = torch.arange(5, dtype=torch.float32).view(1, 1, 5, 1).expand(1, 2, 5, 4).contiguous()
    out_k, _ = cache.update(k, k + 100, 1)
    assert torch.equal(out_k, k)  # attention runs over the packed keys themselves
    cache.end()
    assert cache.keys[1][2, 0, :3, 0].tolist() == [0, 1, 2]
    assert cache.keys[1][0, 1, :2, 0].tolist() == [3, 4]
    assert cache.values[1][0, 0, :2, 0].tolist() == [103, 104]
    assert cache.lengths == [2, 0, 3, 0]


def test_decode_rows_attend_to_their_own_lengths():
    cache = make()
    cache.begin_packed([0, 1, 2], [3, 1, 5])
    cache.end()
    positions, mask = cache.begin_rows([0, 1, 2], [3, 1, 5], [1, 1, 1])
    assert positions.tolist() == [[3], [1], [5]]
    assert mask.shape == (3, 1, 1, 6)
    assert mask[:, 0, 0].sum(-1).tolist() == [4, 2, 6]
    k = torch.full((3, 2, 1, 4), 7.0)
    out_k, out_v = cache.update(k, k, 0)
    assert out_k.shape == (3, 2, 6, 4)
    assert out_k.data_ptr() == cache.keys[0].data_ptr()  # consecutive rows: a view, no copy
    assert cache.keys[0][1, 0, 1, 0] == 7.0 and cache.keys[0][2, 1, 5, 3] == 7.0
    cache.end()
    assert cache.lengths[:3] == [4, 2, 6]


def test_scattered_rows_are_gathered():
    cache = make()
    cache.begin_packed([0, 3], [2, 2])
    cache.end()
    cache.begin_rows([0, 3], [2, 2], [1, 1])
    out_k, _ = cache.update(torch.ones(2, 2, 1, 4), torch.ones(2, 2, 1, 4), 0)
    cache.end()
    assert out_k.shape == (2, 2, 3, 4)
    assert out_k.data_ptr() != cache.keys[0].data_ptr()


def test_growth_keeps_contents_and_limit_raises():
    cache = make(max_len=20, step=8)
    assert cache.capacity == 8
    cache.begin_packed([1], [6])
    k = torch.arange(6, dtype=torch.float32).view(1, 1, 6, 1).expand(1, 2, 6, 4).contiguous()
    cache.update(k, k, 0)
    cache.end()
    cache.begin_rows([1], [6], [5])  # needs 11 positions
    assert cache.capacity == 16
    assert cache.keys[0][1, 0, :6, 0].tolist() == [0, 1, 2, 3, 4, 5]
    cache.end()
    with pytest.raises(ValueError):
        cache.begin_packed([0], [21])
    with pytest.raises(ValueError):
        make(max_len=0)


def test_non_finite_keys_and_values_are_stored_and_attended_as_zero():
    """One sequence's NaN/inf never reaches another: not through the packed attention
    (0 x NaN is NaN) and not as stale data in a reused row."""
    cache = make()
    cache.begin_packed([0, 1], [2, 1])
    k = torch.tensor([1.0, float("nan"), float("inf")]).view(1, 1, 3, 1).expand(1, 2, 3, 4).contiguous()
    out_k, out_v = cache.update(k, -k, 0)
    cache.end()
    assert out_k[0, 0, :, 0].tolist() == [1, 0, 0] and out_v[0, 0, :, 0].tolist() == [-1, 0, 0]
    assert bool(torch.isfinite(cache.keys[0]).all() and torch.isfinite(cache.values[0]).all())
