"""GGUF block formats unpacked (:func:`worker.models.gguf_blocks.unpack`) against the ``gguf`` package.

For every format slotserve reads quantised, ``QuantizedWeight(*unpack(raw))``
must give back ``gguf.dequantize(raw)`` bit for bit (compared as int32, so
signed zeros count), for all rows and for a subset, on random blocks (random
bytes, the fp16 fields set to finite values: normal, subnormal, zero, negative)
and on ``gguf.quantize``'s own output where gguf can quantise to the format;
and its product must match ``F.linear`` on the dequantised weight. Where the compiled kernel runs,
:func:`~worker.models.gguf_blocks.stored_weight` reads the blocks straight into its layout (C++):
it must hold exactly what numpy's read then ``prepare()`` hold, for every format, and for codes
spanning less than their format's range (held in fewer bits: read again).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
np = pytest.importorskip("numpy")

import torch.nn.functional as F  # noqa: E402

from tests.support.kernels import built_or_skip  # noqa: E402
from tests.support.tiny_gguf import random_blocks  # noqa: E402
from worker.models import gguf_blocks  # noqa: E402
from worker.models.gguf_blocks import FORMATS, unpack  # noqa: E402
from worker.models.llama import qkernel  # noqa: E402
from worker.models.llama.quantized import GroupScales, QuantizedWeight  # noqa: E402

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

    def tensors(parts):
        codes, scales, offsets, _ = parts
        return [codes, scales.d, scales.q] + ([None, None] if offsets is None else [offsets.d, offsets.q])

    for chunk in (3 * 768, 1):
        monkeypatch.setattr(gguf_blocks, "CHUNK_CODES", chunk)
        for got, want in zip(tensors(unpack(raw, fmt)), tensors(whole)):
            assert (got is None and want is None) or torch.equal(got, want)


# format -> (scale d per row of 768 columns, its q's dtype or None, offset d per row or None, offset q's dtype)
HELD = {"Q4_0": (24, None, None, None), "Q4_1": (24, None, 24, None), "Q5_0": (24, None, None, None),
        "Q5_1": (24, None, 24, None), "Q8_0": (24, None, None, None), "Q4_K": (3, torch.uint8, 3, torch.uint8),
        "Q5_K": (3, torch.uint8, 3, torch.uint8), "Q6_K": (3, torch.int8, None, None)}


@pytest.mark.parametrize("fmt", FORMATS)
def test_scales_are_held_as_the_file_holds_them(fmt):
    """fp16 d (and m, -dmin) per block or super-block, a byte per sub-block scale or min: the held
    bytes of scales are the file's (give or take the 6-bit packing), and held_bytes says so."""
    codes, scales, offsets, group = unpack(random_blocks(fmt, 5, 768, seed=4), fmt)
    d, q, od, oq = HELD[fmt]
    assert scales.d.dtype == torch.float16 and scales.d.shape == (5, d)
    assert (scales.q is None) == (q is None) and (q is None or scales.q.dtype == q and scales.q.shape == (5, 768 // group))
    assert (offsets is None) == (od is None)
    if offsets is not None:
        assert offsets.d.dtype == torch.float16 and offsets.d.shape == (5, od)
        assert (offsets.q is None) == (oq is None) and (oq is None or offsets.q.dtype == oq)
    w = QuantizedWeight(codes, scales, offsets, group, fmt)
    assert w.nbytes <= gguf_blocks.held_bytes(fmt, 5, 768)
    if fmt.startswith("Q4"):  # codes two a byte: the estimate is exact
        assert w.nbytes == gguf_blocks.held_bytes(fmt, 5, 768)


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
    ones = GroupScales(torch.ones(2, 1).half(), torch.ones(2, 8, dtype=torch.uint8), 8)
    zeros = GroupScales(torch.zeros(2, 1).half(), torch.zeros(2, 8, dtype=torch.uint8), 8)
    narrow = QuantizedWeight(torch.full((2, 256), 3, dtype=torch.int8), ones, zeros, 32, "Q4_K")
    mixed = QuantizedWeight.cat([parts[0], narrow])
    assert torch.equal(mixed.dequantize(), torch.cat([parts[0].dequantize(), narrow.dequantize()]))
    wide = [QuantizedWeight(*unpack(random_blocks("Q5_0", 4, 256, seed=s), "Q5_0"), "Q5_0") for s in (1, 2)]
    assert torch.equal(QuantizedWeight.cat(wide).dequantize(), torch.cat([p.dequantize() for p in wide]))
    with pytest.raises(ValueError, match="one group, width and kind of scales and offsets; got Q4_K 8x256, Q5_0"):
        QuantizedWeight.cat([parts[0], wide[0]])


@pytest.mark.parametrize("six", [True, False], ids=["six-bits", "bytes"])
def test_formats_with_the_same_factors_stack_where_no_codes_widen(monkeypatch, six):
    """Q5_0 beside Q8_0 (an fp16 d per 32 columns each, no offsets): one weight where both are held a
    byte a code (``fmt`` names both; the same weights), not where Q5_0 is held in 6 bits; never
    Q4_1's nibbles beside Q5_1's bytes (offsets alike, but the nibbles would widen), nor Q5_0 beside
    Q4_1 (offsets against none)."""
    monkeypatch.setattr(qkernel, "six_bits", lambda: six)
    q5 = [QuantizedWeight(*unpack(random_blocks("Q5_0", n, 256, seed=n), "Q5_0"), "Q5_0") for n in (8, 4)]
    q8 = QuantizedWeight(*unpack(random_blocks("Q8_0", 4, 256, seed=9), "Q8_0"), "Q8_0")
    assert q5[0].stacks_with(q8) is (not six) and q5[0].stacks_with(q5[1])
    if six:
        with pytest.raises(ValueError, match="Q5_0 8x256, Q5_0 4x256, Q8_0 4x256"):
            QuantizedWeight.cat(q5 + [q8])
    else:
        fused = QuantizedWeight.cat(q5 + [q8])
        assert fused.fmt == "Q5_0+Q8_0" and fused.out_features == 16
        assert qkernel.kind(fused) == qkernel.WIDE
        assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in q5 + [q8]]))
    q41 = QuantizedWeight(*unpack(random_blocks("Q4_1", 4, 256, seed=3), "Q4_1"), "Q4_1")
    q51 = QuantizedWeight(*unpack(random_blocks("Q5_1", 4, 256, seed=4), "Q5_1"), "Q5_1")
    assert q41.nibbles and not q51.nibbles
    assert not q41.stacks_with(q51) and not q51.stacks_with(q41) and not q5[0].stacks_with(q41)


@pytest.mark.parametrize("fmts, runs", [
    (("Q4_K", "Q4_K", "Q6_K"), [("Q4_K", 12), ("Q6_K", 4)]),  # a Q4_K_M layer: q and k as one, v apart
    (("Q6_K", "Q4_K", "Q4_K"), [("Q6_K", 8), ("Q4_K", 8)]),
    (("Q5_0", "Q5_0", "Q8_0"), [("Q5_0+Q8_0", 16)]),  # Qwen2.5-Coder-0.5B's q, k, v (bytes)
    (("Q4_0", "Q8_0", "Q4_0"), [("Q4_0", 8), ("Q8_0", 4), ("Q4_0", 4)]),  # nibbles never widen
])
def test_fused_linears_hold_each_run_of_stackable_parts_as_one_weight(monkeypatch, fmts, runs):
    """``stored_fused``: the parts in their order, each run of consecutive parts one weight can hold as
    one product (a ConcatLinear of the runs where there are several); the same product either way."""
    from worker.models.llama.linear import ConcatLinear
    from worker.models.llama.weights import stored_fused

    monkeypatch.setattr(qkernel, "six_bits", lambda: False)
    parts = [QuantizedWeight(*unpack(random_blocks(f, n, 256, seed=i), f), f)
             for i, (f, n) in enumerate(zip(fmts, (8, 4, 4)))]
    fused = stored_fused(parts)
    held = fused.parts if isinstance(fused, ConcatLinear) else [fused]
    assert isinstance(fused, ConcatLinear) == (len(runs) > 1)
    assert [(p.fmt, p.out_features) for p in held] == runs
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(5))
    torch.testing.assert_close(fused(x), torch.cat([p(x) for p in parts], dim=-1), rtol=1e-5, atol=1e-5)


def test_an_unread_format_is_refused():
    with pytest.raises(ValueError, match="Q2_K"):
        unpack(np.zeros((1, 84), dtype=np.uint8), gguf.GGMLQuantizationType.Q2_K)


# ---- the compiled read (qkernel.cpp's unpack_blocked, through stored_weight) against numpy's

# (either build: qkernel.cpp, or qkernel_avx2.cpp, whose qkernel_pack.h forms the rows in its scalar loops)
needs_kernel = pytest.mark.skipif(not qkernel.isa(), reason="neither AVX-512 BF16 nor AVX2 on this CPU")


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(qkernel.load, "avx512_bf16", "weights are read by numpy, row-major")


@pytest.fixture(params=[True, False], ids=["six-bits", "bytes"])
def six_bits(request, monkeypatch):
    """6-bit spans held in 6 bits (SIX) and a byte each (MAGIC), whatever this CPU would choose."""
    monkeypatch.setattr(qkernel, "six_bits", lambda: request.param)
    return request.param


def _held(w: QuantizedWeight) -> list:
    """Everything a weight holds: its sizes, code range and packing, and its tensors."""
    factors = [t for f in (w.scales, w.offsets) for t in ((None, None) if f is None else (f.d, f.q))]
    return [(w.fmt, w.group, w.out_features, w.in_features, w.low, w.high, w.nibbles, w.blocked, w.six,
             qkernel.kind(w), w.scales.sub, None if w.offsets is None else w.offsets.sub), w.packed, *factors]


def _assert_same(got: QuantizedWeight, want: QuantizedWeight) -> None:
    for a, b in zip(_held(got), _held(want), strict=True):
        if isinstance(a, torch.Tensor):
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        else:
            assert a == b


def _read_both(fmt: str, raw: np.ndarray) -> QuantizedWeight:
    """``stored_weight(raw)``, checked to hold what numpy's read then ``prepare()`` holds, and to
    dequantise as gguf does."""
    got = gguf_blocks.stored_weight(raw, fmt)
    _assert_same(got, QuantizedWeight(*unpack(raw, fmt), fmt).prepare())
    _assert_bits(got.dequantize(), gguf.dequantize(raw, gguf.GGMLQuantizationType[fmt]))
    return got


# (format, rows, columns): 100 and 37 rows end in a part block (padding); 96 columns (the 32-column
# formats) are rows of codes not whole 64-code vectors and 6-bit units not whole 16-column transposes
READS = [(fmt, n, k) for fmt in FORMATS for n, k in ((48, 512), (100, 512), (37, 96))
         if k % gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]][0] == 0]


@needs_kernel
@pytest.mark.parametrize("fmt, n, k", READS)
def test_the_compiled_read_holds_what_numpy_and_prepare_hold(kernel, six_bits, fmt, n, k):
    w = _read_both(fmt, random_blocks(fmt, n, k, seed=n))
    assert w.blocked and w.six == six_bits


NARROW = {"Q4_0": (2, None, -7), "Q4_K": (16, None, 1), "Q5_0": (2, 6, -16), "Q5_K": (16, 48, 0), "Q6_K": (128, 192, -16)}
"""format -> (a, b, the lowest code then): :func:`_narrow` sets every nibble from byte ``a`` on to 1..15
(``b`` None: no code is the format's lowest), or the high bits in bytes ``[a, b)`` to 0 (Q6_K: pairs of
1), so that the codes span 16 values."""


def _narrow(fmt: str, rows: int = 20, cols: int = 512) -> np.ndarray:
    """Random blocks of ``fmt`` whose codes lack the format's lowest or span 16 values (:data:`NARROW`)."""
    raw = random_blocks(fmt, rows, cols, seed=5)
    blocks = raw.reshape(-1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]][1])  # a view: raw changes
    a, b, _ = NARROW[fmt]
    if b is None:
        low, high = np.random.default_rng(6).integers(1, 16, (2, len(blocks), blocks.shape[1] - a), dtype=np.uint8)
        blocks[:, a:] = low | high << 4
    else:
        blocks[:, a:b] = 0x55 if fmt == "Q6_K" else 0
    return raw


@needs_kernel
@pytest.mark.parametrize("fmt", NARROW)
def test_codes_of_a_narrower_span_are_read_again_in_their_own_layout(kernel, fmt):
    """The first read assumes the format's whole range; codes that span less (a lowest code above
    the format's, or Q5/Q6 codes of 4 bits) are held with their own ``low``, in 4 bits, as numpy's
    read then ``prepare()`` hold them."""
    w = _read_both(fmt, _narrow(fmt))
    assert (qkernel.kind(w), w.low) == (qkernel.NIBBLES, NARROW[fmt][2])


@needs_kernel
@pytest.mark.parametrize("lo, hi, kind", [(-64, 64, qkernel.MAGIC), (-20, 31, qkernel.SIX), (-3, 12, qkernel.NIBBLES)])
def test_q8_0_codes_are_held_in_as_few_bits_as_their_span_needs(kernel, six_bits, lo, hi, kind):
    raw = random_blocks("Q8_0", 20, 512, seed=7)
    blocks = raw.reshape(-1, 34)
    blocks[:, 2:] = np.random.default_rng(8).integers(lo, hi, blocks[:, 2:].shape).astype(np.int8).view(np.uint8)
    assert qkernel.kind(_read_both("Q8_0", raw)) == (kind if kind != qkernel.SIX or six_bits else qkernel.MAGIC)


@needs_kernel
def test_parts_read_as_one_fuse_without_a_copy(kernel):
    """q/k/v-like parts read as one (``stored_weights``) hold what each read alone holds, and fuse
    into a view of their shared tensors holding what fusing numpy's parts, then prepare(), holds."""
    raws = [random_blocks("Q4_K", n, 256, seed=n) for n in (48, 32, 20)]
    parts = gguf_blocks.stored_weights(raws, "Q4_K")
    for raw, part in zip(raws, parts):
        _assert_same(part, gguf_blocks.stored_weight(raw, "Q4_K"))
    fused = QuantizedWeight.cat(parts)
    assert fused.blocked and fused.kernel is not None
    assert fused.packed.data_ptr() == parts[0].packed.data_ptr()  # a view: no copy
    _assert_same(fused, QuantizedWeight.cat([QuantizedWeight(*unpack(r, "Q4_K"), "Q4_K") for r in raws]).prepare())
    apart = QuantizedWeight.cat([gguf_blocks.stored_weight(r, "Q4_K") for r in raws])  # fused by a copy
    assert apart.packed.data_ptr() != fused.packed.data_ptr()
    _assert_same(apart, fused)


@needs_kernel
def test_parts_that_do_not_read_as_one_still_fuse_exactly(kernel):
    """A part whose codes span less is read again alone (its own ``low``), and a first part of rows
    past whole blocks is read apart: either way the parts fuse row-major, as numpy's parts do."""
    narrow = [random_blocks("Q4_K", 48, 256, seed=1), _narrow("Q4_K", 32, 256)]
    uneven = [random_blocks("Q4_K", n, 256, seed=n) for n in (20, 48)]
    for raws, low in ((narrow, 1), (uneven, 0)):
        parts = gguf_blocks.stored_weights(raws, "Q4_K")
        for raw, part in zip(raws, parts):
            _assert_same(part, QuantizedWeight(*unpack(raw, "Q4_K"), "Q4_K").prepare())
        assert parts[1].low == low
        fused = QuantizedWeight.cat(parts)
        assert not fused.blocked
        assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
