"""GGUF block formats unpacked (:func:`worker.models.gguf_blocks.unpack`) against the ``gguf`` package.

For every format slotserve reads quantised, ``QuantizedWeight(*unpack(raw))``
must give back ``gguf.dequantize(raw)`` bit for bit (compared as int32, so
signed zeros count), for all rows and for a subset, on random blocks (random
bytes, the fp16 fields set to finite values: normal, subnormal, zero, negative)
and on ``gguf.quantize``'s own output where gguf can quantise to the format;
and its product must match ``F.linear`` on the dequantised weight.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

import torch.nn.functional as F  # noqa: E402

from tests.support.tiny_gguf import random_blocks  # noqa: E402
from worker.models import gguf_blocks  # noqa: E402
from worker.models.gguf_blocks import FORMATS, unpack  # noqa: E402
from worker.models.llama.quantized import QuantizedWeight  # noqa: E402

QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")  # what gguf.quantize writes


def _assert_bits(got: torch.Tensor, want: np.ndarray) -> None:
    want = torch.from_numpy(np.ascontiguousarray(want, dtype=np.float32))
    assert got.dtype == torch.float32 and got.shape == want.shape
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


def _check(fmt: str, raw: np.ndarray) -> QuantizedWeight:
    qtype = gguf.GGMLQuantizationType[fmt]
    codes, scales, offsets, group = unpack(raw, qtype)
    lo, hi = gguf_blocks.CODE_RANGE[fmt]
    assert lo <= int(codes.min()) and int(codes.max()) <= hi
    w = QuantizedWeight(codes, scales, offsets, group, fmt)
    want = gguf.dequantize(raw, qtype)
    _assert_bits(w.dequantize(), want)
    rows = torch.tensor([len(raw) - 1, 0, 2, 2])
    _assert_bits(w.dequantize(rows), want[rows.numpy()])
    assert torch.equal(w.codes(), codes)
    return w


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_blocks_dequantize_as_gguf_bit_for_bit(fmt):
    _check(fmt, random_blocks(fmt, 12, 512))


@pytest.mark.parametrize("fmt", FORMATS)
def test_rows_are_unpacked_in_chunks_alike(fmt, monkeypatch):
    """A chunk smaller than the tensor (several rows, then one row at a time) changes nothing."""
    raw = random_blocks(fmt, 9, 768, seed=3)
    whole = unpack(raw, fmt)
    for chunk in (3 * 768, 1):
        monkeypatch.setattr(gguf_blocks, "CHUNK_CODES", chunk)
        for got, want in zip(unpack(raw, fmt)[:3], whole[:3]):
            assert (got is None and want is None) or torch.equal(got, want)


@pytest.mark.parametrize("fmt", QUANTIZABLE)
def test_gguf_quantize_output_dequantizes_as_gguf(fmt):
    values = np.random.default_rng(1).standard_normal((16, 256)).astype(np.float32) * 0.05
    values[3] = 0.0  # an all-zero row: d = 0
    _check(fmt, gguf.quantize(values, gguf.GGMLQuantizationType[fmt]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_product_matches_f_linear_on_the_dequantized_weight(fmt):
    w = _check(fmt, random_blocks(fmt, 24, 512, seed=2))
    x = torch.randn(5, 512, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(w(x), F.linear(x, w.dequantize()), rtol=1e-5, atol=1e-5)
    assert w(x[:0]).shape == (0, 24)
    bias = torch.randn(24)
    torch.testing.assert_close(w.with_bias(bias)(x), F.linear(x, w.dequantize(), bias), rtol=1e-5, atol=1e-5)


def test_cat_stacks_rows_and_repacks_only_where_packings_differ():
    """q/k/v of one format fuse into one weight that dequantises as the parts stacked; parts whose
    codes span different nibble ranges, or that are not nibbles, still fuse exactly."""
    parts = [QuantizedWeight(*unpack(random_blocks("Q4_K", n, 256, seed=n), "Q4_K"), "Q4_K") for n in (8, 4, 4)]
    parts[1] = parts[1].with_bias(torch.arange(4.0))
    fused = QuantizedWeight.cat(parts)
    assert fused.out_features == 16 and fused.bias.tolist() == [0.0] * 8 + [0, 1, 2, 3] + [0.0] * 4
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    narrow = QuantizedWeight(torch.full((2, 256), 3, dtype=torch.int8), torch.ones(2, 8), torch.zeros(2, 8), 32, "Q4_K")
    mixed = QuantizedWeight.cat([parts[0], narrow])
    assert torch.equal(mixed.dequantize(), torch.cat([parts[0].dequantize(), narrow.dequantize()]))
    wide = [QuantizedWeight(*unpack(random_blocks("Q5_0", 4, 256, seed=s), "Q5_0"), "Q5_0") for s in (1, 2)]
    assert torch.equal(QuantizedWeight.cat(wide).dequantize(), torch.cat([p.dequantize() for p in wide]))
    with pytest.raises(ValueError, match="one format"):
        QuantizedWeight.cat([parts[0], wide[0]])


def test_an_unread_format_is_refused():
    with pytest.raises(ValueError, match="Q2_K"):
        unpack(np.zeros((1, 84), dtype=np.uint8), gguf.GGMLQuantizationType.Q2_K)
