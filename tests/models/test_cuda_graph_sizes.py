"""The batch sizes the CUDA decode graphs are captured at (worker.models.llama.cuda_graphs.batch_sizes):
pure arithmetic, so tested without a GPU. Past 256 rows the sizes stopped, and the next size was every
slot: a step of 300 rows on 2,048 slots replayed all 2,048."""

from __future__ import annotations

import pytest

from worker.models.llama.cuda_graphs import BATCH_SIZES, batch_sizes


@pytest.mark.parametrize("rows", [1, 2, 3, 7, 24, 100, 256, 257, 300, 384, 385, 2048, 3000, 100_000])
def test_the_sizes_rise_to_the_slots_and_pad_a_step_by_at_most_a_third_past_256(rows):
    sizes = batch_sizes(rows)
    assert sizes == sorted(set(sizes)) and sizes[-1] == rows and sizes[0] == 1
    assert [s for s in sizes if s < min(rows, 257)] == [s for s in BATCH_SIZES if s < rows]
    for n in range(1, rows + 1, max(1, rows // 997)):  # every step's rows (a sample of them for the largest)
        b = next(s for s in sizes if s >= n)
        assert b == n or b <= max(256, n * 3 // 2), (rows, n, b)  # past 256: at most a third of b is padding


def test_past_256_each_size_is_half_again_the_one_before():
    assert batch_sizes(5000)[len(BATCH_SIZES):] == [384, 512, 768, 1024, 1536, 2048, 3072, 4096, 5000]


def test_no_rows_is_refused():
    with pytest.raises(ValueError, match="rows must be >= 1"):
        batch_sizes(0)
