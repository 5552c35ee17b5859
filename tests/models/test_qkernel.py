"""The compiled GGUF product (worker/models/llama/qkernel.cpp) against the pure-torch path, every layout.

Skipped where the kernel cannot run (no avx512_bf16, no compiler). The first
test builds it (about a minute on 2 cores, once per machine: cached).
"""

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from worker.models.llama import qkernel
from worker.models.llama.quantized import QuantizedWeight

needs_kernel = pytest.mark.skipif(not qkernel.cpu_has_avx512_bf16(), reason="no avx512_bf16 on this CPU")

# (lowest code, highest + 1, group, offsets): Q4_0, Q4_K, Q6_K, Q8_0, Q5_K's ranges, and the edges
# of the kernel's decodings (4-bit pairs; int8 in [-64, 63]; any int8)
LAYOUTS = [(-8, 8, 32, False), (0, 16, 32, True), (-32, 32, 16, False), (-128, 128, 32, False), (0, 32, 32, True),
           (-64, 64, 32, True), (-65, 64, 16, False)]


def weight(lo, hi, group, offsets, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    codes = torch.randint(lo, hi, (n, k), dtype=torch.int8, generator=gen)
    scales = torch.rand(n, k // group, generator=gen) * 0.01
    return QuantizedWeight(codes, scales, torch.randn(n, k // group, generator=gen) * 0.01 if offsets else None,
                           group, "test")


@pytest.fixture(scope="module")
def module():
    m = qkernel.load()
    from torch.utils.cpp_extension import is_ninja_available

    can_build = shutil.which("c++") and is_ninja_available() and not os.environ.get("SLOTSERVE_NO_KERNELS")
    if m is None and can_build:
        pytest.fail("a CPU with avx512_bf16, a C++ compiler and ninja, but the kernel did not build (see the warning)")
    if m is None:
        pytest.skip("no C++ compiler or ninja here, or SLOTSERVE_NO_KERNELS")
    return m


@needs_kernel
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("n", [40, 100])  # 100: a last block of 4 rows
def test_blocked_layout_keeps_the_files_weights_and_codes(module, layout, n):
    w = weight(*layout, n, 256)
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
    w = weight(*layout, 100, 256, seed=m)
    ref = w.dequantize().clone()
    w.prepare()
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(1))
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
    w = weight(*layout, 100, 256, seed=m).prepare()
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(2)).bfloat16()
    args = (w.packed, qkernel.kind(w), w.low, w.scales, w.offsets if w.offsets is not None else torch.empty(0),
            w.group, 100)
    a, b = module.qmm(x, *args, False), module.qmm(x, *args, True)
    assert (a - b).abs().max() <= 1e-5 * a.abs().max()


@needs_kernel
@pytest.mark.parametrize("amx", [False, True])
def test_no_rows_give_an_empty_product(module, amx):
    if amx and not module.has_amx():
        pytest.skip("no AMX tiles in this process")
    w = weight(0, 16, 32, True, 40, 64).prepare()
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    y = module.qmm(x, w.packed, qkernel.kind(w), w.low, w.scales, w.offsets, w.group, 40, amx)
    assert y.shape == (0, 40)


@needs_kernel
def test_many_rows_and_a_bias(module):
    w = weight(0, 16, 32, True, 64, 128)
    w.bias = torch.randn(64)
    ref = w.dequantize().clone()
    w.prepare()
    x = torch.randn(qkernel.KERNEL_ROWS + 5, 128)
    # AMX: the exact weights (1e-5); without it, the wide product on their bf16 rounding (1e-2)
    want = x.bfloat16().float() @ ref.t() + w.bias
    assert (w(x) - want).abs().max() <= (1e-5 if w.kernel.amx else 1e-2) * want.abs().max()
    assert w.kernel.wide(x).shape == (x.shape[0], 64)


def test_without_the_kernel_the_weight_multiplies_in_pure_torch(monkeypatch):
    monkeypatch.setenv("SLOTSERVE_NO_KERNELS", "1")
    qkernel.load.cache_clear()
    try:
        w = weight(0, 16, 32, True, 40, 64).prepare()
        assert w.kernel is None and not w.blocked
        x = torch.randn(3, 64)
        assert torch.allclose(w(x), F.linear(x, w.dequantize()), rtol=1e-6, atol=1e-6)
    finally:
        qkernel.load.cache_clear()


def test_a_shape_that_does_not_fit_is_a_value_error():
    with pytest.raises(ValueError, match="do not fit"):
        QuantizedWeight(torch.zeros(4, 64, dtype=torch.int8), torch.ones(4, 3), None, 32, "Q4_0")
