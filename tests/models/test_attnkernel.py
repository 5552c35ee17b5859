"""The compiled decode attention (worker/models/llama/attnkernel.cpp) against the batched path
(:func:`worker.models.llama.attention.decode_attention`): ragged lengths, grouped-query heads,
sliding windows, soft-capping, bf16 caches, several queries per row (speculative decoding), the
KV write it does first, and batch invariance; and the runner's tokens with and without it.

Skipped where the kernel cannot run (neither avx512f nor AVX2 with FMA and F16C, no compiler). The first test builds it (about a
minute on 2 cores, once per machine: cached).
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.support.kernels import built_or_skip  # noqa: E402
from worker.models.llama import attnkernel  # noqa: E402
from worker.models.llama.attention import decode_attention, decode_views  # noqa: E402

needs_kernel = pytest.mark.skipif(not (attnkernel.cpu_has_avx512() or attnkernel.extension.cpu_has_avx2()),
                                  reason="neither avx512f nor AVX2 on this CPU")

# (heads, kv heads, head_dim): SmolLM2-135M (9/3/64), Qwen2.5-0.5B (14/2/64), multi-head, Gemma's 256
SHAPES = [(9, 3, 64), (14, 2, 64), (4, 4, 128), (8, 1, 256), (4, 2, 16), (10, 2, 32), (12, 2, 48), (12, 3, 64)]
# (groups of 3, 7, 1, 8, 2, 5, 6 and 4 query heads a key head: on AVX2 the values run over even runs of at most
# 4 heads, 7 as 3 and 4, 5 as 2 and 3; D of 16 to 256 columns, 48 a last block of 2 vectors)
NO_WRITE = (torch.empty(0, 2, 1, 16), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long))


@pytest.fixture(scope="module")
def kernel():
    return built_or_skip(attnkernel.load, "avx512f or AVX2", "the batched path runs")


def no_write(kv_heads, d):
    return torch.empty(0, 2, kv_heads, d), torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long)


def batched(q, kv, lengths, window, softcap, scaling, layer=0):
    """The batched path over decode rows 0..n-1 (one query each)."""
    n, heads, _ = q.shape
    views = decode_views(kv, n, int(lengths.max()), lengths, group=heads // kv.shape[3], windows={window},
                         dtype=torch.float32)
    return decode_attention(q, views, layer, scaling, window, softcap)


@needs_kernel
@pytest.mark.parametrize("heads, kv_heads, d", SHAPES)
@pytest.mark.parametrize("window, softcap", [(None, None), (7, None), (20, None), (None, 50.0), (5, 30.0)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_it_equals_the_batched_path_over_ragged_rows(kernel, heads, kv_heads, d, window, softcap, dtype):
    gen = torch.Generator().manual_seed(heads * d)
    kv = torch.randn(2, 2, 7, kv_heads, 48, d, generator=gen).to(dtype)  # layers, K/V, rows, heads, capacity, D
    lengths = torch.tensor([1, 17, 40, 3, 33, 16])
    q = torch.randn(len(lengths), heads, d, generator=gen)
    want = batched(q, kv, lengths, window, softcap, 0.125, layer=1)
    got = kernel.decode_attention(q, kv[1], *no_write(kv_heads, d), torch.arange(len(lengths)), lengths, 0.125,
                                  window or 0, softcap or 0.0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_each_row_is_batch_invariant(kernel):
    """A row's result is the same bits alone, next to longer rows, at any batch position."""
    gen = torch.Generator().manual_seed(1)
    kv = torch.randn(2, 6, 3, 64, 64, generator=gen)
    q = torch.randn(6, 9, 64, generator=gen)
    lengths = torch.tensor([5, 60, 17, 33, 2, 48])
    together = kernel.decode_attention(q, kv, *no_write(3, 64), torch.arange(6), lengths, 0.125, 0, 0.0)
    for e in range(6):
        alone = kernel.decode_attention(q[e:e + 1], kv, *no_write(3, 64), torch.tensor([e]), lengths[e:e + 1],
                                        0.125, 0, 0.0)
        assert torch.equal(alone[0], together[e])


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_it_stores_the_new_keys_and_values_first_as_an_indexed_write_does(kernel, dtype):
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(2, 4, 2, 32, 16, generator=gen).to(dtype)
    qkv = torch.randn(5, (4 + 2 * 2) * 16, generator=gen) * 3  # q (4 heads), then k and v (2 heads), per entry
    new_kv = qkv[:, 4 * 16:].view(5, 2, 2, 16)  # a strided view, as the forward passes it
    rows, pos = torch.tensor([0, 1, 2, 3, 3]), torch.tensor([9, 4, 31, 0, 1])
    want = cache.clone()
    want[:, rows, :, pos] = new_kv.to(dtype)
    q = qkv[:2, :4 * 16].view(2, 4, 16)  # two decode entries (rows 0 and 1) see their new keys
    lengths = pos[:2] + 1
    out = kernel.decode_attention(q, cache, new_kv, rows, pos, rows[:2], lengths, 0.25, 0, 0.0)
    assert torch.equal(cache, want)
    torch.testing.assert_close(out, batched(q, want[None], lengths, None, None, 0.25), rtol=1e-5, atol=2e-6)


@needs_kernel
def test_several_queries_of_one_row_each_see_their_own_length(kernel):
    """Speculative decoding: a row's token and its drafts are entries of the same cache row."""
    gen = torch.Generator().manual_seed(3)
    kv = torch.randn(1, 2, 2, 2, 40, 16, generator=gen)
    q = torch.randn(4, 4, 16, generator=gen)
    rows, lengths = torch.tensor([0, 0, 0, 1]), torch.tensor([10, 11, 12, 30])
    got = kernel.decode_attention(q, kv[0], *no_write(2, 16), rows, lengths, 0.5, 0, 0.0)
    for e in range(4):
        r = int(rows[e])
        want = batched(q[e:e + 1], kv[:, :, r:r + 1], lengths[e:e + 1], None, None, 0.5)
        torch.testing.assert_close(got[e:e + 1], want, rtol=1e-5, atol=2e-6)


@needs_kernel
def test_it_refuses_what_it_cannot_run(kernel):
    kv = torch.zeros(2, 1, 1, 8, 16)
    q, rows, lengths = torch.zeros(1, 2, 16), torch.zeros(1, dtype=torch.long), torch.ones(1, dtype=torch.long)
    with pytest.raises(RuntimeError, match="q"):
        kernel.decode_attention(q.double(), kv, *no_write(1, 16), rows, lengths, 1.0, 0, 0.0)
    with pytest.raises(RuntimeError, match="head shapes"):
        kernel.decode_attention(torch.zeros(1, 2, 8), torch.zeros(2, 1, 1, 8, 8), *no_write(1, 8), rows, lengths,
                                1.0, 0, 0.0)
    assert not attnkernel.runs(torch.zeros(1, 2, 1, 1, 8, 8), torch.float32)  # D not a multiple of 16
    assert not attnkernel.runs(torch.zeros(1, 2, 1, 1, 8, 16, dtype=torch.float64), torch.float32)
    assert attnkernel.runs(torch.zeros(1, 2, 1, 1, 8, 16, dtype=torch.float16), torch.float32)
    assert attnkernel.runs(torch.zeros(1, 2, 1, 1, 8, 16, dtype=torch.bfloat16), torch.float32)


@needs_kernel
@pytest.mark.hf
@pytest.mark.parametrize("kv_cache_dtype", ["fp32", "bf16"])
def test_the_runner_gives_the_batched_paths_tokens(kernel, kv_cache_dtype):
    """The tiny Llama (head_dim 16) at 3 slots over ragged prompts: the same greedy tokens with the
    kernel as with the batched path, and the kernel is what ran."""
    pytest.importorskip("transformers")
    from tests.support.slot_models import random_prompts, tiny_llama
    from worker import BatchInferenceEngine
    from worker.models import llama

    model, prompts = tiny_llama(), random_prompts(5, seed=5)
    runs = {}
    for fused in (True, False):
        runner = llama.from_hf(model, max_cache_len=96, kv_cache_dtype=kv_cache_dtype)
        assert runner.weights.attention_kernel is kernel
        if not fused:
            runner.weights.attention_kernel = None
        engine = BatchInferenceEngine(runner, batch_size=3, stop_token=None)
        handles = [engine.submit_request(p, max_tokens=12) for p in prompts]
        engine.run()
        runs[fused] = [h.tokens for h in handles]
    assert runs[True] == runs[False]


@needs_kernel
def test_its_rope_is_the_forwards_bit_for_bit_after_the_keys_and_values_are_made_finite(kernel):
    from worker.models.llama.model import _rope_

    gen = torch.Generator().manual_seed(4)
    n, heads, kv_heads, d = 5, 4, 2, 64
    qkv = torch.randn(n, (heads + 2 * kv_heads) * d, generator=gen) * 3
    qkv[1, heads * d + 3] = float("nan")  # a key
    qkv[2, (heads + kv_heads) * d + 7] = float("-inf")  # a value
    qkv[3, 5] = float("inf")  # a query: RoPE's business, not made finite
    cos, sin = torch.randn(n, 1, d, generator=gen), torch.randn(n, 1, d, generator=gen)
    want = qkv.clone()
    want[:, heads * d:].nan_to_num_(0.0, 0.0, 0.0)
    _rope_(want[:, :(heads + kv_heads) * d].view(n, heads + kv_heads, d), cos, sin)
    got = qkv.clone()
    kernel.rope_finite_(got, cos, sin, heads + kv_heads, d, heads * d)
    assert torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))  # (NaN where RoPE meets the inf query)
    assert torch.isfinite(got[:, heads * d:]).all()


@needs_kernel
@pytest.mark.parametrize("hidden", [576, 100])  # 100: a masked tail of 4 columns
def test_its_rms_norm_is_the_forwards_formula(kernel, hidden):
    from types import SimpleNamespace

    from worker.models.llama.model import _rms_norm
    from worker.models.llama.weights import StepConsts

    gen = torch.Generator().manual_seed(5)
    x, weight = torch.randn(9, hidden, generator=gen) * 4, torch.randn(hidden, generator=gen)
    consts = StepConsts.of(SimpleNamespace(hidden_size=hidden, rms_norm_eps=1e-5), 0.125, on_cpu=True)
    want = _rms_norm(x, weight, consts)
    got = kernel.rms_norm(x, weight, consts.inv_hidden_value, consts.eps_value)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)  # (the sum of squares in another order)
    assert torch.equal(_rms_norm(x, weight, consts, glue=kernel), got)  # the forward calls it where it runs


@needs_kernel
@pytest.mark.parametrize("rows, ffn", [(8, 1536), (3, 4864), (5, 1000), (2, 7)])  # 1000, 7: ATen's scalar tail
def test_its_silu_mul_is_the_forwards_swiglu_bit_for_bit(kernel, rows, ffn):
    import torch.nn.functional as F

    if not attnkernel.swiglu_exact():
        pytest.skip(f"ATen runs {torch.backends.cpu.get_cpu_capability()} kernels here, not the module's width")

    gen = torch.Generator().manual_seed(6)
    for scale in (1.0, 30.0):
        gu = torch.randn(rows, 2 * ffn, generator=gen) * scale
        specials = torch.tensor([float("inf"), -float("inf"), float("nan"), 0.0, -0.0, 1e-40, -88.5, 89.0])
        gu[0, :min(ffn, 8)] = specials[:min(ffn, 8)]  # gates: exp's overflow, underflow and NaN
        gu[-1, -3:] = specials[:3]  # ups
        want = F.silu(gu[:, :ffn]).mul_(gu[:, ffn:])  # model._mlp's SwiGLU in ATen
        got = kernel.silu_mul(gu, ffn)
        assert got.shape == (rows, ffn) and got.dtype == torch.float32
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.nan_to_num(7.0), want.nan_to_num(7.0))
    with pytest.raises(RuntimeError, match="gu: fp32"):
        kernel.silu_mul(torch.randn(2, 9), 4)  # not two halves


@needs_kernel
def test_the_forwards_mlp_calls_silu_mul_where_the_module_runs(kernel):
    from types import SimpleNamespace

    import torch.nn.functional as F

    from worker.models.llama.model import _mlp

    gen = torch.Generator().manual_seed(7)
    gu = torch.randn(4, 2 * 96, generator=gen)
    calls = []

    class Glue:
        def silu_mul(self, t, f):
            calls.append(f)
            return kernel.silu_mul(t, f)

    w = SimpleNamespace(shape=SimpleNamespace(ffn=96), act=F.silu)
    lw = SimpleNamespace(gate_up=lambda h: gu)
    exact = attnkernel.swiglu_exact()
    assert torch.equal(_mlp(w, lw, None, Glue()), _mlp(w, lw, None)) and calls == ([96] if exact else [])
    gelu = SimpleNamespace(shape=w.shape, act=lambda t: F.gelu(t, approximate="tanh"))  # Gemma's GeGLU: ATen's
    assert torch.equal(_mlp(gelu, lw, None, Glue()), _mlp(gelu, lw, None)) and calls == ([96] if exact else [])


def test_swiglu_stays_atens_where_aten_runs_other_kernels():
    import os
    import subprocess
    import sys

    code = "from worker.models.llama import attnkernel; print(attnkernel.swiglu_exact())"
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # ATen's scalar kernels: its exp is not the module's
