"""The compiled GGUF product (worker/models/llama/qkernel.cpp) against the pure-torch path, every layout.

Skipped where the kernel cannot run (no avx512_bf16, no compiler). The first
test builds it (about a minute on 2 cores, once per machine: cached).
"""


import re
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.support.kernels import built_or_skip
from worker.models.llama import qkernel
from worker.models.llama.quantized import GroupScales, QuantizedWeight

CPU_SIX_BITS = qkernel.six_bits  # this CPU's choice (the fixture below replaces it in every test)

needs_kernel = pytest.mark.skipif(not qkernel.cpu_has_avx512_bf16(), reason="no avx512_bf16 on this CPU")
needs_any_kernel = pytest.mark.skipif(not qkernel.isa(), reason="neither avx512_bf16 nor AVX2 on this CPU")

# (lowest code, highest + 1, group, offsets, factors): Q4_0, Q4_K, Q6_K, Q8_0, Q5_K, Q4_1, Q5_0, Q5_1's
# ranges and scale layouts, and the edges of the kernel's decodings (4-bit pairs; 6 bits, a span of 64;
# int8 in [-64, 63]; any int8).
# factors: "f16" an fp16 d per group (Q4_0 .. Q8_0; Q4_1's m), "k" an fp16 d per 256 columns times a
# uint8 per group (Q4_K/Q5_K's d * sc and -dmin * m), "k6" times an int8 (Q6_K's d * sc)
LAYOUTS = [(-8, 8, 32, False, "f16"), (0, 16, 32, True, "k"), (-32, 32, 16, False, "k6"),
           (-128, 128, 32, False, "f16"), (0, 32, 32, True, "k"), (0, 16, 32, True, "f16"),
           (-16, 16, 32, False, "f16"), (0, 32, 32, True, "f16"), (-64, 64, 32, True, "f16"), (-65, 64, 16, False, "k6")]
K = 512  # two 256-column super-blocks a row


def factor(kind, n, groups, group, gen, offset=False):
    """A random GroupScales of ``kind`` (see LAYOUTS) for ``[n, groups * group]``."""
    if kind == "f16":
        return GroupScales((torch.randn(n, groups, generator=gen) * 0.01).half())
    sub = 256 // group
    d = (torch.rand(n, groups // sub, generator=gen) * 0.001).half()
    if offset:  # -dmin, and m in 0..63
        return GroupScales(-d, torch.randint(0, 64, (n, groups), dtype=torch.uint8, generator=gen), sub)
    if kind == "k":
        return GroupScales(d, torch.randint(0, 64, (n, groups), dtype=torch.uint8, generator=gen), sub)
    return GroupScales(d, torch.randint(-128, 128, (n, groups), dtype=torch.int8, generator=gen), sub)


def weight(lo, hi, group, offsets, kind, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(lo, hi, (n, k), dtype=torch.int8, generator=gen)
    scales = factor(kind, n, k // group, group, gen)
    return QuantizedWeight(codes, scales, factor(kind, n, k // group, group, gen, True) if offsets else None,
                           group, "test")


@pytest.fixture(scope="module")
def module():
    return built_or_skip(qkernel.load, "avx512_bf16", "quantised products run in pure torch")


@pytest.fixture(autouse=True, params=[True, False], ids=["six-bits", "bytes"])
def six_bits(request, monkeypatch):
    """Every test with 6-bit spans held in 6 bits (SIX, the choice where AMX tiles run) and a byte
    each (MAGIC, the choice elsewhere: qkernel.six_bits), whatever this CPU would choose (on AVX2,
    which never holds 6 bits and whose product does not take them, a byte each only)."""
    if request.param and qkernel.isa() == "avx2":
        pytest.skip("6-bit codes are held only where AMX tiles run; never on AVX2")
    monkeypatch.setattr(qkernel, "six_bits", lambda: request.param)
    return request.param


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [40, 100])  # 100: a last block of 4 rows
def test_blocked_layout_keeps_the_files_weights_and_codes(module, layout, n):
    w = weight(*layout, n, K)
    ref, codes, rows = w.dequantize().clone(), w.codes().clone(), torch.tensor([0, 17, n - 1, 5])
    ref_rows = w.dequantize(rows).clone()
    w.prepare()
    assert w.blocked and w.kernel is not None
    assert torch.equal(w.dequantize().view(torch.int32), ref.view(torch.int32))
    assert torch.equal(w.dequantize(rows).view(torch.int32), ref_rows.view(torch.int32))
    assert torch.equal(w.codes(), codes)
    # the transposed dequantisation for many-row products: the same bits, or their bf16 rounding
    assert torch.equal(w.kernel.transposed(False).t().contiguous().view(torch.int32), ref.view(torch.int32))
    assert torch.equal(w.kernel.transposed(True).t(), ref.bfloat16())


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m", [1, 3, 8, 11, 16, 21])
def test_kernel_product_equals_the_bf16_rounded_activations_times_the_files_weights(module, layout, m):
    w = weight(*layout, 100, K, seed=m)
    ref = w.dequantize().clone()
    w.prepare().kernel.set_activations("bf16")
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(1))
    want = F.linear(x.bfloat16().float().double(), ref.double())
    got = w(x)
    assert got.dtype == torch.float32 and got.shape == (m, 100)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m", [1, 7, 16, 32, 48])
def test_the_amx_and_avx512_products_agree(module, layout, m):
    if not module.has_amx():
        pytest.skip("no AMX tiles in this process")
    w = weight(*layout, 100, K, seed=m).prepare()
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(2)).bfloat16()
    args = (w.packed, qkernel.kind(w), w.low, *qkernel.factor_args(w), w.group, 100)
    a, b = module.qmm(x, *args, False), module.qmm(x, *args, True)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()


@needs_kernel
@pytest.mark.parametrize("amx", [False, True])
def test_no_rows_give_an_empty_product(module, amx):
    if amx and not module.has_amx():
        pytest.skip("no AMX tiles in this process")
    w = weight(0, 16, 32, True, "k", 40, 256).prepare()
    x = torch.empty(0, 256, dtype=torch.bfloat16)
    y = module.qmm(x, w.packed, qkernel.kind(w), w.low, *qkernel.factor_args(w), w.group, 40, amx)
    assert y.shape == (0, 40)


@needs_any_kernel
def test_no_rows_give_an_empty_int8_product(module):
    """qmm8 (AVX-512 VNNI or AVX2) of no rows: an empty [0, N] product, on every code kind."""
    if not module.has_q8():
        pytest.skip("no int8 product on this CPU")
    for layout in (LAYOUTS[1], LAYOUTS[3], LAYOUTS[8]):  # NIB, WIDE, MAGIC (a byte each: the six-bits fixture's)
        w = weight(*layout, 40, 256).prepare()
        y = module.qmm8(torch.empty(0, 256), w.packed, qkernel.kind(w), w.low, *qkernel.factor_args(w), w.group, 40,
                        False, 0)
        assert y.shape == (0, 40)


@needs_kernel
def test_many_rows_and_a_bias(module):
    w = weight(0, 16, 32, True, "k", 64, 256)
    w.bias = torch.randn(64)
    ref = w.dequantize().clone()
    w.prepare().kernel.set_activations("bf16")
    x = torch.randn(qkernel.KERNEL_ROWS + 5, 256)
    # AMX: the exact weights (1e-5); without it, the wide product on their bf16 rounding (1e-2)
    want = x.bfloat16().float() @ ref.t() + w.bias
    assert (w(x) - want).abs().max() <= (1e-5 if w.kernel.amx else 1e-2) * want.abs().max()
    assert w.kernel.wide(x).shape == (x.shape[0], 64)


def test_without_the_kernel_the_weight_multiplies_in_pure_torch(monkeypatch):
    monkeypatch.setenv("SLOTSERVE_NO_KERNELS", "1")
    qkernel.load.cache_clear()
    try:
        w = weight(0, 16, 32, True, "k", 40, 256).prepare()
        assert w.kernel is None and not w.blocked
        x = torch.randn(3, 256)
        assert torch.allclose(w(x), F.linear(x, w.dequantize()), rtol=1e-6, atol=1e-6)
    finally:
        qkernel.load.cache_clear()


@pytest.mark.skipif(not qkernel.isa(), reason="neither AVX-512 BF16 nor AVX2 on this CPU")
def test_a_weight_of_groups_the_kernel_does_not_take_multiplies_in_pure_torch(module):
    """4-bit codes in groups of 64 columns: AVX-512 multiplies them (either activations); the AVX2
    product does not (its int16 sums hold 32 columns), so the weight stays row-major there and
    multiplies in pure torch, not handed to the kernel to be refused at its first product."""
    w = weight(-8, 8, 64, False, "f16", 32, 256).prepare()
    assert (w.kernel is not None) == (qkernel.isa() == "avx512")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(2))
    exact = F.linear(x.double(), w.dequantize().double())
    assert (w(x).double() - exact).norm() <= 0.03 * exact.norm()


def test_a_shape_that_does_not_fit_is_a_value_error():
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedWeight(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3), None, 32, "Q4_0")
    q = torch.zeros(4, 8, dtype=torch.uint8)
    with pytest.raises(ValueError, match="do not fit"):  # a super-block d for 256 columns, 8 groups of 32: 1 a row
        QuantizedWeight(torch.zeros(4, 256, dtype=torch.int8), GroupScales(torch.ones(4, 2).half(), q, 8), None, 32,
                        "Q4_K")


def test_scales_are_held_as_the_file_holds_them():
    """Per-group values must be exact in fp16 (a GGUF file's d); a K format's factors stay fp16 x (u)int8."""
    with pytest.raises(ValueError, match="exact in fp16"):
        QuantizedWeight(torch.zeros(4, 64, dtype=torch.int8), torch.full((4, 2), 0.1), None, 32, "Q4_0")
    with pytest.raises(ValueError, match="power of two"):
        GroupScales(torch.ones(4, 1).half(), torch.zeros(4, 6, dtype=torch.uint8), 6)
    w = weight(0, 16, 32, True, "k", 40, 512)
    assert w.scales.d.dtype == torch.float16 and w.scales.q.dtype == torch.uint8 and w.scales.shift == 3
    # 4-bit codes, then per 32 columns a byte of sc and of m, per 256 two fp16 (d, -dmin): 0.578 B a weight
    assert w.nbytes == 40 * 512 // 2 + 2 * 40 * 16 + 2 * 2 * 40 * 2


@needs_kernel
@pytest.mark.parametrize("lo, hi, kind", [(-32, 32, qkernel.SIX), (0, 32, qkernel.SIX), (-64, 64, qkernel.MAGIC),
                                          (-128, 128, qkernel.WIDE), (-8, 8, qkernel.NIBBLES)])
def test_codes_are_held_in_as_few_bits_as_their_span_needs(module, six_bits, lo, hi, kind):
    """Q6_K (and Q5_*) codes, 64 values or fewer, take 6 bits in the kernel's layout (ggml's 4 + 2
    split), 0.75 bytes a weight as the file's, where 6 bits are chosen; else a byte (MAGIC)."""
    kind = kind if kind != qkernel.SIX or six_bits else qkernel.MAGIC
    w = weight(lo, hi, 16, False, "k6", 48, 512).prepare()
    assert qkernel.kind(w) == kind and w.six == six_bits
    assert w.packed.numel() == 48 * 512 * {qkernel.SIX: 6, qkernel.NIBBLES: 4}.get(kind, 8) // 8


@needs_kernel
def test_six_bits_are_chosen_where_amx_tiles_run(module, monkeypatch):
    """6-bit codes are held in 6 bits where the process may use AMX tiles, else a byte each
    (qkernel.six_bits); a weight keeps the layout it was prepared with when the choice changes."""
    assert CPU_SIX_BITS() == bool(module.has_amx())
    monkeypatch.setattr(qkernel, "six_bits", lambda: True)
    w = weight(-32, 32, 16, False, "k6", 48, 512).prepare()
    x = torch.randn(3, 512, generator=torch.Generator().manual_seed(0))
    before = w(x)
    monkeypatch.setattr(qkernel, "six_bits", lambda: False)
    assert qkernel.kind(w) == qkernel.SIX and torch.equal(w(x), before)
    assert qkernel.kind(weight(-32, 32, 16, False, "k6", 48, 512).prepare()) == qkernel.MAGIC


# ---- int8 activations (qmm8: VNNI, AMX-INT8)

needs_q8 = pytest.mark.skipif(not (qkernel.isa() == "avx2" or qkernel.cpu_has_avx512_bf16() and qkernel.extension.cpu_has(
    "avx512_vnni") and qkernel.extension.cpu_has("avx512vbmi")), reason="no AVX-512 VNNI and VBMI, nor AVX2, here")


def int8_reference(w: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """What qmm8 computes, in float64 from the row-major weight ``w`` (before prepare): x rounded to
    int8 per row and group (xs = max|x| / 127, nearest even), the integer sums of the codes times xq
    (the kernel: of u = code - base, started at base * sum(xq)), then sum_g scale * xs * isum +
    offset * xs * sum(xq): the file's weights times the rounded x."""
    n, k = w.out_features, w.in_features
    group, g = w.group, w.in_features // w.group
    m = x.shape[0]
    xg = x.view(m, g, group)
    mx = xg.abs().amax(-1, keepdim=True)
    # (a true division, as the kernel's: torch computes 127.0 / mx as 127 * (1 / mx), an ulp apart)
    xq = torch.round(xg * torch.where(mx > 0, torch.full_like(mx, 127.0) / mx, torch.zeros_like(mx))).double()
    codes = w.codes().double().view(n, g, group)
    scale = w.scales.values().double()
    const = torch.zeros_like(scale) if w.offsets is None else w.offsets.values().double()
    isum = torch.einsum("mgk,ngk->mng", xq, codes)
    xs = (mx / 127.0).double().squeeze(-1)
    return (isum * scale[None] * xs[:, None, :]).sum(-1) + torch.einsum("mg,ng->mn", xs * xq.sum(-1), const)


@needs_q8
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m", [1, 5, 8, 16, 21])
def test_int8_product_is_the_int8_rounded_activations_times_the_files_codes(module, layout, m):
    w = weight(*layout, 100, K, seed=m)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(3))
    want = int8_reference(w, x)
    w.prepare().kernel.set_activations("int8")
    got = w(x)
    assert got.dtype == torch.float32 and got.shape == (m, 100)
    # the same rounded x (the same division), so the fp32 epilogue's roundings alone
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()
    exact = F.linear(x.double(), w.dequantize().double())
    # what int8 costs against fp64 (seen: up to 1.5 %; 2.6 % with sum(x) for the base term)
    assert (got.double() - exact).norm() <= 0.03 * exact.norm()
    # the file's weights times the rounded x: whatever base the codes are held from
    mx = x.view(m, -1, w.group).abs().amax(-1, keepdim=True)
    rounded = (torch.round(x.view(m, -1, w.group) * torch.where(mx > 0, torch.full_like(mx, 127.0) / mx, 0.0))
               * (mx / 127.0)).view(m, K)
    assert (got.double() - F.linear(rounded.double(), w.dequantize().double())).abs().max() <= 1e-5 * want.abs().max()


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """fp32 ``a * b + c`` rounded once (vfmadd), for finite fp32 tensors: the product is exact in fp64,
    the sum's fp64 rounding error is found exactly (TwoSum), and where the fp64 sum lies on a midpoint
    of two fp32 values that error decides the side (else the fp64 sum rounds as the exact one)."""
    p = a.double() * b.double()
    c = c.double()
    s = p + c
    bb = s - p
    err = (p - (s - bb)) + (c - bb)  # s + err == p + c exactly
    r = s.float()
    towards = torch.where(s > r.double(), torch.full_like(r, float("inf")), torch.full_like(r, -float("inf")))
    other = torch.nextafter(r, towards)  # the fp32 value on s's other side
    tie = (s != r.double()) & ((r.double() + other.double()) / 2 == s) & (err != 0)
    up = (other > r) == (err > 0)  # the other value lies on the exact sum's side of the midpoint
    return torch.where(tie & up, other, r)


def qmm8_bits(w: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """qmm8's result for finite ``x``, operation by operation as qkernel.cpp computes it (qrows' fp32
    rounding of x, the exact integer sums, then per group in order vnni_blocks' epilogue:
    ``tot = fma(fp32(isum), scale * xs, tot)`` and, with offsets, ``tot = fma(xsum, offset - 0 * scale,
    tot)``), from the row-major ``w``: what every instruction set's product must give bit for bit."""
    n, k, group = w.out_features, w.in_features, w.group
    g, m = k // group, x.shape[0]
    xg = x.view(m, g, group)
    mx = xg.abs().amax(-1)
    c127 = torch.full_like(mx, 127.0)
    xs, rcp = mx / c127, c127 / mx
    inv = torch.where((mx > 0) & (rcp <= torch.finfo(torch.float32).max), rcp, torch.zeros_like(rcp))
    xq = torch.round(xg * inv[..., None])
    xsum = xs * xq.double().sum(-1).float()  # (the sum exact: at most 127 * group)
    isum = torch.einsum("mgk,ngk->mng", xq.double(), w.codes().double().view(n, g, group)).float()  # exact
    scale = w.scales.values()
    f = scale[None] * xs[:, None, :]
    offset = None if w.offsets is None else w.offsets.values() + -(0.0 * scale)
    tot = torch.zeros(m, n)
    for i in range(g):
        tot = fma32(isum[..., i], f[..., i], tot)
        if offset is not None:
            tot = fma32(xsum[:, None, i].expand(m, n), offset[None, :, i].expand(m, n), tot)
    return tot


@needs_q8
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m", [1, 5, 13])
def test_int8_product_has_the_bits_of_its_epilogue_computed_exactly(module, layout, m):
    """The int8 product equals, bit for bit, its rounded x, integer sums and fp32 epilogue computed
    one operation at a time (qmm8_bits): AVX-512 VNNI (qkernel.cpp) and AVX2 (qkernel_avx2.cpp, whose
    int16 pair sums and codes held from another base must not change an integer) give one result."""
    w = weight(*layout, 40, K, seed=20 + m)
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    x[0, :64] *= 1e-3  # groups of small and of mixed magnitudes
    want = qmm8_bits(w, x)
    w.prepare().kernel.set_activations("int8")
    got = w(x)
    assert torch.isfinite(want).all()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (got - want).abs().max()


@needs_q8
@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[1], LAYOUTS[2], LAYOUTS[3], LAYOUTS[8]])  # NIB, SIX, WIDE, MAGIC
def test_int8_rows_are_the_same_whatever_rows_run_beside_them(module, layout):
    """VNNI (up to VNNI_ROWS rows) and the AMX-INT8 tiles (more) sum the same integers, and on VNNI
    the quads decoded in registers (two blocks a call, 8 rows at a time: 4-bit codes at every row
    count, byte codes up to 64 rows) sum what a block decoded whole sums (6-bit codes; byte codes
    above 64 rows): every row's result is bit for bit the same alone, in a decode batch or in a
    prefill chunk."""
    w = weight(*layout, 100, K, seed=7).prepare()
    w.kernel.set_activations("int8")
    x = torch.randn(72, K, generator=torch.Generator().manual_seed(4))
    alone = torch.cat([w(x[i:i + 1]) for i in range(72)])
    for m in (3, 8, 9, 16, 21, 40, 64, 65, 72):
        assert torch.equal(w(x[:m]), alone[:m]), m


@needs_any_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [40, 100])  # 100: a last block of 4 rows
def test_prepared_codes_read_back_as_the_files_on_every_build(module, layout, n):
    """Whichever layout this machine's build takes (AVX-512's column pairs; AVX2's quad layout, where
    MAGIC holds u = code - low), the prepared weight's codes and dequantised weights, all rows or
    picked ones, are the file's, bit for bit."""
    w = weight(*layout, n, K, seed=n)
    ref, codes, rows = w.dequantize().clone(), w.codes().clone(), torch.tensor([0, 17, n - 1, 5])
    ref_rows = w.dequantize(rows).clone()
    w.prepare()
    bits = {qkernel.NIBBLES: 4, qkernel.SIX: 6}.get(qkernel.kind(w), 8)
    assert w.blocked and w.packed.numel() == -(-n // 16) * 16 * K * bits // 8
    assert torch.equal(w.codes(), codes) and torch.equal(w.codes(rows), codes[rows])
    assert torch.equal(w.dequantize().view(torch.int32), ref.view(torch.int32))
    assert torch.equal(w.dequantize(rows).view(torch.int32), ref_rows.view(torch.int32))


@needs_q8
@pytest.mark.parametrize("layout", [LAYOUTS[i] for i in (0, 1, 2, 6, 8, 3)])  # NIB; MAGIC u <= 63, 31, 127; WIDE
def test_int8_product_is_the_same_wherever_its_codes_lie(module, layout):
    """AVX2 multiplies MAGIC blocks, and 4-bit and int8 ones up to 32 rows, where they lie in the quad
    layout; the rest decoded into a buffer first. Told the codes' largest u (kernel_kind) or not (found per
    block), and with the codes at an address that is not 32-byte aligned (every block decoded into
    the buffer), the product has the same bits, at 1, 8, 33 and 40 rows."""
    if not qkernel.quad_layout():
        pytest.skip("the quad layout is the AVX2 build's")
    w = weight(*layout, 100, K, seed=3).prepare()
    args = w.kernel.args
    kind = qkernel.kind(w)
    assert args[1] == (kind | (w.high - w.low + 1) << 8 if kind == qkernel.MAGIC else kind)
    moved = torch.empty(args[0].numel() + 1, dtype=torch.uint8)[1:].view(args[0].dtype).view(args[0].shape)
    moved.copy_(args[0])
    for m in (1, 8, 33, 40):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        want = module.qmm8(x, *args, False, 0)
        assert torch.equal(want, w(x))
        assert torch.equal(module.qmm8(x, args[0], kind, *args[2:], False, 0), want), m
        assert torch.equal(module.qmm8(x, moved, *args[1:], False, 0), want), m


def test_a_largest_u_goes_with_magic_codes_alone(module):
    """qmm8's kind carries a largest u for MAGIC only, at most 127 (RuntimeError otherwise)."""
    if not qkernel.quad_layout():
        pytest.skip("the quad layout is the AVX2 build's")
    for layout, told in ((LAYOUTS[0], 16), (LAYOUTS[3], 256), (LAYOUTS[6], 129)):
        w = weight(*layout, 16, K).prepare()
        args = w.kernel.args
        with pytest.raises(RuntimeError, match="largest u"):
            module.qmm8(torch.randn(1, K), args[0], qkernel.kind(w) | told << 8, *args[2:], False, 0)


@needs_q8
@pytest.mark.parametrize("layout", [LAYOUTS[1], LAYOUTS[2], LAYOUTS[3], LAYOUTS[9]])  # NIB, SIX (16), WIDE (32, 16)
@pytest.mark.parametrize("m", [1, 2, 3, 7, 8, 9, 16, 32])
def test_int8_tiles_sum_what_vnni_sums(module, layout, m):
    """The AMX-INT8 paths (two groups a tile product up to 8 rows, a ring of groups up to 16, whole
    blocks above) and VNNI form the same integer sums and one epilogue: the same bits."""
    if not module.has_amx():
        pytest.skip("no AMX tiles here")
    w = weight(*layout, 100, K, seed=11).prepare()
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
    args = w.kernel.args
    tiles = module.qmm8(x, *args, True, 0)
    vnni = module.qmm8(x, *args, False, 0)
    assert torch.equal(tiles, vnni)


@pytest.mark.parametrize("layout", [LAYOUTS[0], LAYOUTS[1], LAYOUTS[2], LAYOUTS[9]])  # 32 and 16 columns a group
def test_bf16_rows_are_the_same_whatever_rows_run_beside_them(module, layout):
    """On AMX every bf16 path (two 16-column groups a tile product up to 8 rows, a ring of groups up
    to 16, whole blocks above) gives a row the same bits as alone."""
    if not module.has_amx():
        pytest.skip("no AMX tiles here")
    w = weight(*layout, 100, K, seed=5).prepare()
    w.kernel.set_activations("bf16")
    x = torch.randn(48, K, generator=torch.Generator().manual_seed(6))
    alone = torch.cat([w(x[i:i + 1]) for i in range(48)])
    for m in (2, 7, 8, 9, 16, 17, 24, 32, 48):
        assert torch.equal(w(x[:m]), alone[:m]), m


@pytest.mark.parametrize("group, k", [(16, 16), (16, 48), (32, 32), (32, 96), (16, 64)])  # 1 or 3 groups, 2, 4
@pytest.mark.parametrize("activations", ["bf16", "int8"])
def test_every_row_path_holds_at_odd_and_single_group_counts(module, group, k, activations):
    """The ring, the stacked tiles (even group counts only), the 32-row ring and whole blocks at K
    of one to four groups: each row as alone, and near the fp64 product of its rounded activations."""
    if not module.has_amx():
        pytest.skip("no AMX tiles here")
    if activations == "int8" and not module.has_q8():
        pytest.skip("no VNNI/VBMI here")
    w = weight(-32, 32, group, False, "f16", 40, k, seed=k).prepare()
    w.kernel.set_activations(activations)
    x = torch.randn(40, k, generator=torch.Generator().manual_seed(group))
    alone = torch.cat([w(x[i:i + 1]) for i in range(40)])
    for m in (3, 8, 16, 24, 32, 40):
        assert torch.equal(w(x[:m]), alone[:m]), m
    exact = F.linear(x.double(), w.dequantize().double())
    assert (alone.double() - exact).norm() <= 0.05 * exact.norm()


def rows_of(w: QuantizedWeight, lo: int, hi: int) -> QuantizedWeight:
    """A weight of ``w``'s rows ``lo .. hi - 1`` (row-major ``w``, before prepare())."""
    def part(f):
        return None if f is None else GroupScales(f.d[lo:hi].clone(), None if f.q is None else f.q[lo:hi].clone(), f.sub)
    return QuantizedWeight(w.codes()[lo:hi].clone(), part(w.scales), part(w.offsets), w.group, "test")


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("m", [1, 5, 8, 13])
def test_a_block_gets_the_same_bits_alone_or_beside_another(module, layout, m):
    """On AVX-512 two 16-row blocks share a call (each broadcast of x feeds both) where the kind
    allows: a block's rows get the bits they get from a weight of that block alone."""
    w = weight(*layout, 48, K, seed=m)  # blocks 0 and 1 together, block 2 alone
    alone = [rows_of(w, 16 * i, 16 * i + 16).prepare() for i in range(3)]
    w.prepare()
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(m)).bfloat16()
    for k in [w.kernel] + [a.kernel for a in alone]:
        k.set_activations("bf16")
    whole = module.qmm(x, *w.kernel.args, False)
    for i, a in enumerate(alone):
        assert torch.equal(whole[:, 16 * i:16 * i + 16], module.qmm(x, *a.kernel.args, False)), i


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
def test_avx512_rows_are_the_same_whether_the_blocks_are_decoded_per_call_or_per_eight_rows(module, layout):
    """On AVX-512 a call of many rows (a prefill chunk) decodes each block once into a buffer that
    every eight rows read (6-bit and wide codes above 8 rows, the others above 48); a few rows
    decode in registers. Either way a row gets the bits it gets alone, on blocks of 16 and of 4."""
    w = weight(*layout, 36, K, seed=7).prepare()  # two blocks together, then one of 4 rows
    x = torch.randn(64, K, generator=torch.Generator().manual_seed(8)).bfloat16()
    alone = torch.cat([module.qmm(x[i:i + 1].contiguous(), *w.kernel.args, False) for i in range(64)])
    for m in (8, 9, 16, 48, 49, 64):
        assert torch.equal(module.qmm(x[:m].contiguous(), *w.kernel.args, False), alone[:m]), m
    exact = F.linear(x.double(), w.dequantize().double())
    assert (alone.double() - exact).norm() <= 0.01 * exact.norm()


SIX_LAYOUTS = [LAYOUTS[2], LAYOUTS[4], LAYOUTS[6], LAYOUTS[7]]  # 6-bit codes: Q6_K, Q5_K, Q5_0, Q5_1


@needs_kernel
@pytest.mark.parametrize("layout", SIX_LAYOUTS)
@pytest.mark.parametrize("amx", [False, True])
def test_six_bit_codes_decode_to_the_same_bits_on_vbmi(module, layout, amx):
    """6-bit codes decoded two pairs at a time by VBMI's byte gathers (SixVbmi) give every product
    the bits of the decode without them (six_u), on every path (AVX-512 up to 8 rows a block, the
    AMX ring, stacked tiles and whole blocks), and equal the bf16 x times the file's weights."""
    if amx and not module.has_amx():
        pytest.skip("no AMX tiles in this process")
    if not qkernel.extension.cpu_has("avx512vbmi"):
        pytest.skip("no VBMI on this CPU")
    w = weight(*layout, 100, K, seed=3).prepare()
    ref = w.dequantize().double()
    x = torch.randn(48, K, generator=torch.Generator().manual_seed(4)).bfloat16()
    args = (w.packed, qkernel.kind(w), w.low, *qkernel.factor_args(w), w.group, 100)
    try:
        for m in (1, 3, 8, 11, 16, 21, 32, 48):
            xm = qkernel._tile_rows(x[:m]) if amx else x[:m].contiguous()  # (tiles: 16 rows or a multiple)
            module.six_vbmi(True)
            fast = module.qmm(xm, *args, amx)[:m]
            module.six_vbmi(False)
            plain = module.qmm(xm, *args, amx)[:m]
            assert torch.equal(fast, plain), m
            want = F.linear(x[:m].double(), ref)
            assert (fast.double() - want).abs().max() <= 1e-5 * want.abs().max(), m
    finally:
        module.six_vbmi(True)


def test_activations_are_checked(module):
    w = weight(0, 16, 32, True, "k", 40, 256).prepare()
    with pytest.raises(ValueError, match="gguf_activations must be one of"):
        w.kernel.set_activations("fp8")
    if qkernel.isa() == "avx2":  # int8 activations only: bf16 is refused in words, and the product stays int8
        with pytest.raises(ValueError, match="needs a CPU with AVX-512 BF16.*use 'int8' or 'auto'"):
            w.kernel.set_activations("bf16")
        assert w.kernel.int8
        return
    w.kernel.set_activations("bf16")
    assert not w.kernel.int8


@needs_q8
@pytest.mark.parametrize("layout", LAYOUTS)
def test_int8_sums_hold_at_the_codes_and_activations_extremes(module, layout):
    """Every code at its format's lowest or highest value and every rounded activation at +-127, signed so
    that each group's products add up (the largest integer sums a group can have): the sums are exact,
    with nothing saturated (AVX2 sums byte products in int16 pairs, vpmaddubsw, before widening)."""
    lo, hi, group, offsets, kind = layout
    gen = torch.Generator().manual_seed(12)
    codes = torch.where(torch.rand(32, K, generator=gen) < 0.5, lo, hi - 1).to(torch.int8)
    codes[4], codes[5] = hi - 1, lo  # rows of the highest and of the lowest code
    w = QuantizedWeight(codes, factor(kind, 32, K // group, group, gen),
                        factor(kind, 32, K // group, group, gen, True) if offsets else None, group, "test")
    x = torch.full((8, K), 2.0)  # rows 4-7: every rounded value 127
    x[:4] = torch.where(codes[:4] >= 0, 1.0, -1.0) * torch.randint(1, 3, (4, K), generator=gen)  # row r: code row r's signs
    want = int8_reference(w, x)
    w.prepare().kernel.set_activations("int8")
    got = w(x)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@needs_q8
@pytest.mark.parametrize("layout", [LAYOUTS[1], LAYOUTS[2], LAYOUTS[3], LAYOUTS[6]])  # NIB, SIX, WIDE, SIX 5-bit
@pytest.mark.parametrize("n", [48, 100])  # 100: a last pair of blocks with one of 4 rows
@pytest.mark.parametrize("activations", ["auto", "int8"])
def test_prefill_rows_run_on_the_bf16_rounded_weights_over_all_of_k(module, layout, n, activations):
    """Above TILE_ROWS rows (activations auto or int8, AMX) the product is bf16 x times the file's
    weight rounded to bf16 (dequant_t's bf16), fp32 sums: one C tile over all of K."""
    if not module.has_amx():
        pytest.skip("no AMX tiles in this process")
    w = weight(*layout, n, K, seed=n).prepare()
    w.kernel.set_activations(activations)
    m = qkernel.TILE_ROWS + 13
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(5))
    want = x.bfloat16().double() @ w.kernel.transposed(True).double()
    got = w(x)
    assert got.shape == (m, n)
    assert (got.double() - want).abs().max() <= 1e-5 * want.abs().max()


@needs_kernel
@pytest.mark.parametrize("layout", [LAYOUTS[1], LAYOUTS[2], (-8, 8, 8, False, "f16")])  # Q4_K, Q6_K, 8 columns a group
def test_auto_is_int8_where_it_runs_else_bf16(module, layout):
    """``auto`` (the default): up to TILE_ROWS rows the product of ``int8`` where the CPU runs it
    (VNNI and VBMI, groups of a multiple of 16 columns), else of ``bf16``, bit for bit."""
    w = weight(*layout, 100, K, seed=3).prepare()
    x = torch.randn(qkernel.TILE_ROWS, K, generator=torch.Generator().manual_seed(6))
    w.kernel.set_activations("auto")
    got = [w(x[:m]) for m in (1, 8, qkernel.TILE_ROWS)]
    int8 = bool(module.has_q8()) and layout[2] % 16 == 0
    assert w.kernel.int8 == int8
    w.kernel.set_activations("int8" if int8 else "bf16")
    for y in got:
        assert torch.equal(y, w(x[:y.shape[0]]))


class _TilesHere:
    """The compiled module as an AMX CPU's process sees it, on any CPU with the kernel: the tile
    product of a prefill chunk gives a marker value, the decode product runs on AVX-512."""

    MARK = 7.0

    def __init__(self, real):
        self.real = real

    def has_amx(self):
        return True

    def has_q8(self):
        return self.real.has_q8()

    def qmm_tiles(self, xb, *args):
        return torch.full((xb.shape[0], args[-1]), self.MARK)

    def qmm(self, x, *args):
        return self.real.qmm(x, *args[:-1], False)

    def qmm8(self, x, *args):  # (..., amx, vnni_rows): on VNNI
        return self.real.qmm8(x, *args[:-2], False, args[-1])


@needs_kernel
def test_a_decode_row_beside_a_prompt_chunk_gets_the_exact_product(module):
    """In a step of more than TILE_ROWS rows (decode rows, then a prompt chunk) the chunk runs on
    the AMX tiles (the weights rounded to bf16), but the step's decode rows (leading_exact_rows)
    get the decode product's bits (auto's: int8 where it runs, else bf16), the same as in a step
    without the chunk."""
    w = weight(0, 16, 32, True, "k", 48, K, seed=9).prepare()
    kernel = qkernel.Kernel(_TilesHere(module), w)
    m = qkernel.TILE_ROWS + 6
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(10))
    decode_alone = w.kernel(x[:5].contiguous())  # this CPU's decode product, the same activations
    assert kernel.int8 == w.kernel.int8
    assert torch.equal(kernel(x), torch.full((m, 48), _TilesHere.MARK))  # no decode rows said
    with qkernel.leading_exact_rows(5):
        y = kernel(x)
        assert torch.equal(kernel(x[:5]), decode_alone)  # a step of decode rows only
    assert torch.equal(y[:5], decode_alone)
    assert torch.equal(y[5:], torch.full((m - 5, 48), _TilesHere.MARK))
    with qkernel.leading_exact_rows(qkernel.TILE_ROWS + 1):  # a decode batch above TILE_ROWS: the tiles'
        assert torch.equal(kernel(x), torch.full((m, 48), _TilesHere.MARK))
    assert qkernel._EXACT_ROWS.get() == 0


class _NoTiles:
    """The compiled module as a CPU without AMX tiles sees it (the products on AVX-512)."""

    def __init__(self, real):
        self.real = real

    def has_amx(self):
        return False

    def __getattr__(self, name):
        return getattr(self.real, name)


@needs_kernel
def test_without_tiles_decode_rows_beside_more_prompt_rows_than_the_kernels_keep_the_kernels_bits(
        module, monkeypatch):
    """Without AMX, bf16 activations: above ``rows`` prompt rows the layer is multiplied dequantised
    (``Kernel.wide``), but a step's decode rows (``leading_exact_rows``) get the kernel's bits, and a
    step of ``rows`` prompt rows with decode rows beside stays on the kernel. int8 activations run
    ``qmm8`` at every row count (no wide product: every row's bits whatever shares its step)."""
    monkeypatch.setattr(qkernel.Kernel, "wide", lambda self, x, bf16=True: torch.full((x.shape[0], 48), 7.0))
    w = weight(0, 16, 32, True, "k", 48, K, seed=11).prepare()
    kernel = qkernel.Kernel(_NoTiles(module), w, rows=8, activations="bf16")
    x = torch.randn(14, K, generator=torch.Generator().manual_seed(12))
    one = torch.cat([kernel(x[i:i + 1].contiguous()) for i in range(14)])  # each row alone: the kernel
    assert torch.equal(kernel(x), torch.full((14, 48), 7.0))  # 14 prompt rows: wide
    with qkernel.leading_exact_rows(5):  # 9 prompt rows: wide, the 5 decode rows the kernel's
        y = kernel(x)
    assert torch.equal(y[:5], one[:5]) and torch.equal(y[5:], torch.full((9, 48), 7.0))
    with qkernel.leading_exact_rows(6):  # 8 prompt rows: the kernel, every row
        assert torch.equal(kernel(x), one)
    with qkernel.leading_exact_rows(10):  # more decode rows than rows: wide, a prompt beside or not
        assert torch.equal(kernel(x[:10]), torch.full((10, 48), 7.0))
        assert torch.equal(kernel(x), torch.full((14, 48), 7.0))
    if module.has_q8():
        kernel.set_activations("int8")
        one = torch.cat([kernel(x[i:i + 1].contiguous()) for i in range(14)])
        assert torch.equal(kernel(x), one)


@pytest.mark.skipif(not qkernel.isa(), reason="neither AVX-512 BF16 nor AVX2 on this CPU")
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("activations", ["int8", "bf16"])
def test_a_non_finite_activation_makes_its_row_non_finite_and_no_other(module, layout, activations):
    """A NaN or an inf in a row of x gives that row no finite output (the engine then ends that
    request alone) and leaves the other rows' bits as they are alone: at a decode step's rows and a
    prefill chunk's. (int8 once rounded a NaN to -128 and returned finite sums.)"""
    if activations == "int8" and not module.has_q8():
        pytest.skip("no AVX-512 VNNI and VBMI here")
    if activations == "bf16" and qkernel.isa() == "avx2":
        pytest.skip("bf16 activations need AVX-512 BF16 (an AVX2 CPU runs int8 ones)")
    w = weight(*layout, 40, K, seed=1).prepare()
    w.kernel.set_activations(activations)
    for m in (3, 8, 20):
        x = torch.randn(m, K, generator=torch.Generator().manual_seed(m))
        x[1, 5], x[2, K - 1] = float("nan"), float("inf")
        y = w(x)
        assert not torch.isfinite(y[1]).any() and not torch.isfinite(y[2]).any(), m
        clean = [i for i in range(m) if i not in (1, 2)]
        assert torch.equal(y[clean], torch.cat([w(x[i:i + 1]) for i in clean])), m


@needs_q8
@pytest.mark.parametrize("layout", [LAYOUTS[5], LAYOUTS[7]])  # offsets: Q4_1 (4-bit codes), Q5_1 (a byte or 6 bits)
def test_an_infinite_scale_with_an_offset_makes_its_output_nan_on_every_instruction_set(module, layout):
    """A weight row whose fp16 scale is inf (a d past fp16's range) with an offset gives NaN at every
    activation row, as AVX-512's epilogue does (its additive term is offset - 0 * scale, one fnmadd:
    NaN), and the other rows' bits are unchanged. (The AVX2 product took the offset alone and gave
    +-inf there: the two instruction sets' results differed.)"""
    plain, broken = weight(*layout, 40, K, seed=2), weight(*layout, 40, K, seed=2)
    broken.scales.d[3, 1] = float("inf")  # row 3, group 1
    x = torch.randn(5, K, generator=torch.Generator().manual_seed(9))
    for w in (plain, broken):
        w.prepare().kernel.set_activations("int8")
    got, want = broken(x), plain(x)
    assert torch.isnan(got[:, 3]).all(), got[:, 3]
    others = [i for i in range(40) if i != 3]
    assert torch.equal(got[:, others], want[:, others])


@needs_q8
@pytest.mark.parametrize("layout", LAYOUTS)
def test_int8_rows_of_denormal_activations_stay_within_their_products_bound(module, layout):
    """A group whose largest |x| is a denormal (127 / max|x| overflows to inf) once rounded every
    value, zeros and positives too, to -128: products far past |x| max * sum|w| and of either sign.
    Such a group now rounds to zeros; every row stays within its bound, the normal row unchanged."""
    w = weight(*layout, 40, K, seed=1).prepare()
    w.kernel.set_activations("int8")
    x = torch.randn(3, K, generator=torch.Generator().manual_seed(0))
    x[1] *= 2.0 ** -130
    x[2] = 1e-40
    y = w(x)
    bound = x.abs().amax(1, keepdim=True).double() * w.dequantize().abs().sum(1).double()[None]
    assert (y.double().abs() <= 1.01 * bound).all()
    assert torch.equal(y[:1], w(x[:1]))


@needs_q8
@pytest.mark.parametrize("m", [1, 8, 99])
def test_q5_0_and_q8_0_stacked_give_each_parts_own_bits(module, six_bits, m):
    """Q5_0 q and k beside a Q8_0 v (Qwen2.5-Coder-0.5B) held as one weight where both are a byte a code
    (``QuantizedWeight.stacks_with``): one product, int8 activations, bit for bit each part's alone,
    since the integer sums are exact whatever base the codes are held from and the epilogue is one."""
    parts = [weight(-16, 16, 32, False, "f16", 64, K, seed=1), weight(-16, 16, 32, False, "f16", 16, K, seed=2),
             weight(-128, 128, 32, False, "f16", 16, K, seed=3)]
    for p, fmt in zip(parts, ("Q5_0", "Q5_0", "Q8_0")):
        p.fmt = fmt
    if six_bits:  # Q5_0 in 6 bits would widen to bytes stacked: kept apart
        assert not parts[0].stacks_with(parts[2])
        return
    fused = QuantizedWeight.cat(parts).prepare()
    assert qkernel.kind(fused) == qkernel.WIDE and fused.kernel is not None
    for p in parts:
        p.prepare().kernel.set_activations("int8")
    fused.kernel.set_activations("int8")
    x = torch.randn(m, K, generator=torch.Generator().manual_seed(6))
    assert torch.equal(fused(x), torch.cat([p(x) for p in parts], dim=-1))


@needs_any_kernel
def test_a_residual_add_is_the_sum_and_leaves_the_residual(module):
    """``QuantizedWeight.add`` sums into the product's own tensor: ``residual + w(x)`` bit for bit, the
    residual unchanged."""
    w = weight(-16, 16, 32, False, "f16", 64, K, seed=4).prepare()
    x, residual = torch.randn(8, K), torch.randn(8, 64)
    before = residual.clone()
    assert torch.equal(w.add(residual, x), residual + w(x))
    assert torch.equal(residual, before)


@needs_q8
@pytest.mark.parametrize("m", [8, 99])
def test_int8_rows_rounded_on_several_threads_keep_each_rows_bits(module, m):
    """qrows rounds the rows on torch's threads where there are enough values (QROWS_GRAIN: here 4,096
    columns, 8 rows a thread): each row's product is the one it gets alone, whatever thread rounded it."""
    w = weight(-16, 16, 32, False, "f16", 48, 4096, seed=5).prepare()
    w.kernel.set_activations("int8")
    x = torch.randn(m, 4096, generator=torch.Generator().manual_seed(8))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(w(x), torch.cat([w(x[i:i + 1]) for i in range(m)]))
    finally:
        torch.set_num_threads(threads)


@needs_q8
def test_the_product_lets_other_python_threads_run_while_it_computes(module):
    """qmm8 lets go of the GIL while it computes (``py::call_guard<py::gil_scoped_release>``, as torch's
    own operators do): a worker's I/O thread sends its heartbeats while a long product runs, where
    holding it had a starved machine's prefill keep the broker from hearing the worker (declared lost,
    its requests requeued). Another thread runs one long product (one torch thread, so a core is
    left); this thread, woken as that one starts it, must run before the product is half done (it
    could run only after the product, were the GIL held)."""
    w = weight(0, 16, 32, True, "k", 8960, 1536).prepare()  # Q4_K's layout
    w.kernel.set_activations("int8")
    x = torch.randn(4096, 1536, generator=torch.Generator().manual_seed(3))
    started, times = threading.Event(), {}

    def product():
        times["start"] = time.perf_counter()
        started.set()
        w(x)
        times["end"] = time.perf_counter()

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        other = threading.Thread(target=product)
        other.start()
        started.wait()
        ran = time.perf_counter()
        other.join()
    finally:
        torch.set_num_threads(threads)
    took = times["end"] - times["start"]
    assert ran - times["start"] < took / 2, (ran - times["start"], took)


def test_every_compiled_entry_that_computes_lets_go_of_the_gil():
    """Each kernel module's functions that take tensors release the GIL (the test above shows why);
    only the ones that answer a question about the CPU or the build keep it."""
    here = Path(qkernel.__file__).parent
    asks = {"has_q8", "has_amx", "quad_layout", "six_vbmi"}
    for source in ("qkernel.cpp", "qkernel_avx2.cpp", "attnkernel.cpp"):
        defs = re.findall(r'm\.def\("(\w+)"(.*)\);', (here / source).read_text())
        assert defs, source
        for name, rest in defs:
            # (unpack_blocked lets go of it inside, around its parallel loop: qkernel_pack.h)
            if name not in asks | {"unpack_blocked"}:
                assert "py::call_guard<py::gil_scoped_release>()" in rest, f"{source}: {name}"
