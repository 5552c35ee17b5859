"""slotserve's Llama runner (worker/models/llama) against transformers.

Tiny randomly initialised Llama models are saved with ``save_pretrained``
and loaded through :func:`worker.models.load_model` (the real loading code);
``initializer_range`` is large so logits are well separated and greedy
argmax is not decided by rounding noise. CUDA tests skip without a GPU.
"""

from __future__ import annotations

import random

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from tests.support.slot_models import (  # noqa: E402
    TINY_LLAMA_VOCAB, generate_alone, random_prompts, scattered_rows_and_reuse, step_tokens,
)
from worker import BatchInferenceEngine, FinishReason  # noqa: E402
from worker.models import ModelOptions, load_model  # noqa: E402
from worker.models.base import SlotInput  # noqa: E402
from worker.models.llama import LlamaRunner  # noqa: E402
from worker.models.llama.linear import cpu_linear_candidates, cpu_linear_kind  # noqa: E402
from worker.models.rows import SlotRows  # noqa: E402

pytestmark = pytest.mark.hf

VOCAB = TINY_LLAMA_VOCAB  # the folder's model_dir (tests/models/conftest.py)
# Relative L2 distance of a precision's logits from fp32's on this tiny model, whose
# random Gaussian weights (std 0.3) are far harder to quantise than trained ones:
# measured 0.014 (bf16), 0.036 (int8), 0.39 (int4); the bounds leave 2-3x room.
# The kernels themselves are checked tightly in test_quantised_linears_*.
TOLERANCE = {"bf16": 0.04, "int8": 0.1, "int4": 0.8}


def run_engine(model, prompts, max_tokens, batch_size=3, **options):
    engine = BatchInferenceEngine(model, batch_size=batch_size)
    handles = [engine.submit_request(p, n, **options) for p, n in zip(prompts, max_tokens)]
    engine.run()
    return handles


FP32_KINDS = cpu_linear_candidates(torch.float32)


@pytest.mark.parametrize("kind", FP32_KINDS)
@pytest.mark.parametrize("max_prefill_tokens", [16, 512])
def test_fp32_greedy_equals_generate(model_dir, reference, max_prefill_tokens, kind):
    """Packed prefill, chunked prefill (16-token chunks) and decode over mixed lengths, slots reused;
    with each fp32 CPU linear kind this torch runs (the one measured fastest is the default)."""
    model = load_model(model_dir, max_prefill_tokens=max_prefill_tokens, cpu_linear=kind)
    assert isinstance(model, LlamaRunner) and model.precision == "fp32" and model.weights.linear_kind == kind
    prompts = random_prompts(10, seed=1)
    max_tokens = [random.Random(i).randint(1, 20) for i in range(10)]
    for p, n, h in zip(prompts, max_tokens, run_engine(model, prompts, max_tokens)):
        assert h.finish_reason == FinishReason.LENGTH
        assert h.tokens == generate_alone(reference, p, n)


@pytest.mark.parametrize("kind", FP32_KINDS)
def test_fp32_logits_match_the_hf_forward(model_dir, reference, kind):
    model = load_model(model_dir, cpu_linear=kind)
    model.bind_slots(2)
    a, b = random_prompts(2, seed=2)
    seqs = {0: list(a), 1: list(b)}
    for _ in range(4):  # a prefill, then decode steps
        logits, index = model.forward_batch([SlotInput(s, t) for s, t in seqs.items()])
        for row, i in zip(logits, index):
            with torch.inference_mode():
                want = reference(torch.tensor([seqs[i]])).logits[0, -1]
            torch.testing.assert_close(row, want, atol=1e-4, rtol=1e-4)
            seqs[i].append(int(want.argmax()))


def test_scattered_rows_and_slot_reuse(model_dir, reference):
    """A middle slot finishes; the others decode around it (padding row); a new prompt takes it."""
    results = scattered_rows_and_reuse(load_model(model_dir), random_prompts(5, seed=7))
    for prompt, got in results.items():
        assert got == generate_alone(reference, list(prompt), len(got))


def test_slot_rows_take_the_lowest_free_row():
    rows = SlotRows(3)
    assert [rows.row(s) for s in (5, 2, 7)] == [0, 1, 2] and rows.row(2) == 1
    assert rows.release(2) == 1 and rows.release(5) == 0 and rows.release(5) is None
    assert rows.row(9) == 0 and rows.row(1) == 1
    with pytest.raises(ValueError, match="no free cache row"):
        rows.row(4)


def test_long_prompt_is_prefilled_in_chunks_while_others_decode(model_dir, reference):
    model = load_model(model_dir, max_prefill_tokens=16)
    model.bind_slots(2)
    short, long = [5, 6, 7], random_prompts(1, seed=9, max_len=100)[0] * 2  # 18 to 200 tokens
    short_seq = list(short)
    short_seq.append(step_tokens(model, [SlotInput(0, short_seq)])[0])
    long_seq, waited = list(long), 0
    while len(long_seq) == len(long):  # the engine's plan: 16 prompt tokens per iteration
        out = step_tokens(model, [SlotInput(0, short_seq), SlotInput(1, long_seq)], {1: 16})
        short_seq.append(out[0])  # the decoding slot gets a token every iteration
        if out[1] is None:
            waited += 1
        else:
            long_seq.append(out[1])
    assert waited == -(-len(long) // 16) - 1
    assert short_seq[len(short):] == generate_alone(reference, short, len(short_seq) - len(short))
    assert long_seq[len(long):] == generate_alone(reference, long, 1)


def test_a_step_names_its_decode_rows_to_the_products(model_dir, monkeypatch):
    """forward tells the GGUF products how many of a step's leading rows are decode rows (those a
    prompt chunk's faster product must not touch: qkernel.leading_exact_rows), at every step: a step
    of decode rows only says all of them (so that more decode rows than a kernel's take the product
    they take beside a prompt too), one of prompts only 0."""
    from worker.models.llama import model as forward_module

    said, real = [], forward_module.qkernel.leading_exact_rows

    def record(n):
        said.append(n)
        return real(n)

    monkeypatch.setattr(forward_module.qkernel, "leading_exact_rows", record)
    model = load_model(model_dir, max_prefill_tokens=16)
    model.bind_slots(3)
    a, b = [5, 6, 7], [8, 9]
    for _ in range(2):  # two prompts (no decode rows), then two decode rows alone
        ta, tb = step_tokens(model, [SlotInput(0, a), SlotInput(1, b)])
        a.append(ta)
        b.append(tb)
    step_tokens(model, [SlotInput(0, a), SlotInput(1, b), SlotInput(2, random_prompts(1, seed=3, max_len=40)[0])])
    assert said == [0, 2, 2]


def test_the_cache_grows_once_for_a_long_prompt_at_its_first_chunk(model_dir, reference):
    """A chunked prompt reserves its whole length when its first chunk runs (one growth while the
    cache is small, not one per capacity step with ever larger copies); tokens stay exact."""
    model = LlamaRunner(load_model(model_dir).weights, max_prefill_tokens=16, capacity_step=32)
    model.bind_slots(2)
    assert model.kv_cache.capacity == 32
    prompt = random_prompts(1, seed=11, max_len=100)[0] * 2
    grown = []
    seq = list(prompt)
    while len(seq) == len(prompt):
        out = step_tokens(model, [SlotInput(1, seq)], {0: 16})[0]
        grown.append(model.kv_cache.capacity)
        if out is not None:
            seq.append(out)
    assert len(prompt) > 32 and grown[0] > len(prompt) and len(set(grown)) == 1
    assert seq[len(prompt):] == generate_alone(reference, prompt, 1)


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_the_whole_cpu_cache_is_mapped_at_once_and_takes_memory_only_where_written(monkeypatch):
    """capacity_step=None (the runner's default): max_len positions from the start, never a
    growth; the mapping's pages cost memory only once written (reads of unwritten ones, as a
    masked decode window does, take none). Where the kernel refuses it: growth instead."""
    from worker.models.llama import cache as cache_module

    before = _rss_mib()
    cache = cache_module.SlotCache(layers=4, rows=8, kv_heads=4, head_dim=64, max_len=32768, dtype=torch.float32,
                                   device="cpu", capacity_step=None)
    assert cache.capacity == 32768 and cache.nbytes == 2**31  # 2 GiB mapped
    assert float(cache.kv[:, :, :, :, :4096].sum()) == 0.0  # 256 MiB of unwritten positions read
    cache.kv[:, :, :, :, :100] = 1.0  # 100 positions of every row: 256 blocks of 25.6 KB (7 pages)
    cache.reserve(32766)
    assert cache.capacity == 32768
    assert _rss_mib() - before < 16
    assert float(cache.kv[0, 1, 7, 3, :101].sum()) == 100 * 64

    def refuse(shape, dtype):
        if shape[4] == 32768:
            raise OSError(12, "Cannot allocate memory")
        return torch.zeros(shape, dtype=dtype)

    monkeypatch.setattr(cache_module, "_anonymous_zeros", refuse)
    small = cache_module.SlotCache(layers=1, rows=1, kv_heads=1, head_dim=4, max_len=32768, dtype=torch.float32,
                                   device="cpu", capacity_step=None)
    assert small.capacity == cache_module.FALLBACK_STEP == small.capacity_step
    small.reserve(100)
    assert small.capacity == 128


def test_the_cache_grows_geometrically_in_whole_steps_and_keeps_its_rows():
    """Growth: to what is needed or 1/8 more, in whole steps, at most max_len; old rows copied."""
    from worker.models.llama.cache import SlotCache

    cache = SlotCache(layers=2, rows=3, kv_heads=1, head_dim=4, max_len=1000, dtype=torch.float32,
                      device="cpu", capacity_step=64)
    assert cache.capacity == 64
    cache.kv[:, :, 1, 0, :64] = torch.arange(64, dtype=torch.float32)[:, None]
    grown = []
    for longest in (63, 64, 100, 130, 700, 998):
        cache.reserve(longest)
        grown.append(cache.capacity)
    # 64 -> 128 (needs 65) -> 128 -> 192 (131 > 128 * 1.125 = 144 -> 192) -> 704 -> 1000 (max_len)
    assert grown == [64, 128, 128, 192, 704, 1000]
    assert torch.equal(cache.kv[:, :, 1, 0, :64, 0], torch.arange(64, dtype=torch.float32).expand(2, 2, 64))
    assert cache.kv[:, :, :, :, 64:].abs().sum() == 0
    cache = SlotCache(layers=1, rows=1, kv_heads=1, head_dim=1, max_len=10_000, dtype=torch.float32,
                      device="cpu", capacity_step=64)
    capacities = set()
    for longest in range(1, 4096):  # decoding one position at a time: geometric steps, not +64 each
        cache.reserve(longest)
        capacities.add(cache.capacity)
    assert len(capacities) <= 25 and 4096 < cache.capacity < 4096 * 1.125 + 64  # fixed 64-steps: 64
    with pytest.raises(ValueError, match="exceeds"):
        cache.reserve(10_000)


@pytest.mark.parametrize("precision", ["bf16", "int8", "int4"])
def test_lower_precisions_run_and_agree_closely(model_dir, precision):
    exact, low = load_model(model_dir), load_model(model_dir, precision=precision)
    assert low.precision == precision
    prompts = random_prompts(4, seed=3)
    for m in (exact, low):
        m.bind_slots(4)
    batch = [SlotInput(i, list(p)) for i, p in enumerate(prompts)]
    want, _ = exact.forward_batch(batch)
    got, _ = low.forward_batch(batch)
    err = float((got - want).norm() / want.norm())
    assert err < TOLERANCE[precision], f"{precision}: relative error {err:.4f}"
    handles = run_engine(low, prompts, [6] * 4, batch_size=2)
    assert all(h.finish_reason == FinishReason.LENGTH and len(h.tokens) == 6 for h in handles)
    assert low.weights.nbytes < exact.weights.nbytes or precision == "bf16"


PACKED = [(kind, torch.float32) for kind in FP32_KINDS if kind != "dense"] + [
    ("onednn", torch.bfloat16)] * ("onednn" in cpu_linear_candidates(torch.bfloat16))


@pytest.mark.parametrize("kind,dtype", PACKED)
def test_packed_linear_is_the_plain_product_at_every_row_count(kind, dtype):
    """One packing (its row hint) serves any number of rows: the packed layout must
    not depend on the row count, so every count from 0 to past the hint is compared
    with the fp64 product of the same (for bf16: bf16-rounded) inputs (a layout
    mismatch gives errors of order 1, fp32 rounding ~1e-6, bf16 output rounding
    ~4e-3); the residual add and the bias too, fp32 in and out."""
    from worker.models.llama.linear import PACK_ROWS, PackedLinear

    torch.manual_seed(0)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 1e-2, "atol": 5e-2}
    for n, k in ((96, 64), (40, 72)):  # odd sizes: partial blocks in the packed layout
        w, bias = torch.randn(n, k), torch.randn(n)
        for lin, b in ((PackedLinear(w, None, kind, dtype), None), (PackedLinear(w, bias, kind, dtype), bias)):
            for rows in list(range(0, 34)) + [63, 64, 65, 200, PACK_ROWS, PACK_ROWS + 3]:
                x, r = torch.randn(rows, k), torch.randn(rows, n)
                rounded = [t.to(dtype).double() for t in (x, w, torch.zeros(n) if b is None else b)]
                want = rounded[0] @ rounded[1].t() + rounded[2]
                got = lin(x)
                assert got.shape == (rows, n) and got.dtype == torch.float32
                assert torch.allclose(got.double(), want, **tol), (n, k, rows, b is None)
                assert torch.allclose(lin.add(r, x).double(), want + r.double(), **tol)


def test_cpu_linear_kind_is_onednn_or_measured_once_or_named(monkeypatch):
    """Unnamed: oneDNN's where torch has it (its rows are batch-invariant), else one of the
    candidates, measured once per shapes and then kept; named: that kind, and a clear error for
    a kind this torch cannot run for the dtype."""
    from worker.models.llama import linear

    shapes = ((48, 32), (32, 48))
    for dtype in (torch.float32, torch.bfloat16):
        if "onednn" in cpu_linear_candidates(dtype):
            assert cpu_linear_kind(dtype, shapes) == "onednn"
    monkeypatch.setattr(linear, "cpu_linear_candidates", lambda dtype: tuple(
        k for k in FP32_KINDS if k != "onednn"))
    misses = linear._fastest.cache_info().misses
    first = cpu_linear_kind(torch.float32, shapes)
    assert first in FP32_KINDS and first != "onednn" and linear._fastest.cache_info().misses == misses + 1
    assert cpu_linear_kind(torch.float32, shapes) == first and linear._fastest.cache_info().misses == misses + 1
    monkeypatch.undo()
    for kind in FP32_KINDS:
        assert cpu_linear_kind(torch.float32, shapes, kind) == kind
    with pytest.raises(ValueError, match="fp32 only" if torch._C.has_mkl else "cpu_linear"):
        cpu_linear_kind(torch.bfloat16, shapes, "mkl")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [576, 1536])  # above 1024 columns oneDNN's one-row path sums differently
def test_a_onednn_row_alone_gets_the_bits_it_gets_beside_other_rows(dtype, k):
    """A decode row's product does not depend on the rows beside it (batch invariance): one row
    runs as two (oneDNN's one-row path differs in the last bits), and from two rows on oneDNN's
    rows are its rows alone. (Where this torch or CPU has no oneDNN product for ``dtype`` -- bf16
    needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT -- the runner never picks it: cpu_linear_candidates.)"""
    from worker.models.llama.linear import PackedLinear

    if "onednn" not in cpu_linear_candidates(dtype):
        pytest.skip(f"no oneDNN product for {dtype} with this torch on this CPU")

    gen = torch.Generator().manual_seed(k)
    lin = PackedLinear(torch.randn(96, k, generator=gen) * 0.02, None, "onednn", dtype)
    x = torch.randn(40, k, generator=gen).to(dtype)
    alone = torch.cat([lin(x[i:i + 1]) for i in range(40)])
    for m in (2, 3, 8, 17, 40):
        assert torch.equal(lin(x[:m]), alone[:m]), m
    assert torch.equal(lin.add(x[:1, :96].float(), x[:1]), lin(x[:1]) + x[:1, :96].float())
    assert torch.equal(lin(x[0]), alone[0]) and torch.equal(lin(x[:1].view(1, 1, k)), alone[:1].view(1, 1, 96))


@pytest.mark.parametrize("value,options", [("blas9000", {}), ("onednn", {"runner": "hf"}),
                                           ("blas9000", {"precision": "int8"}), ("mkl", {"precision": "bf16"})])
def test_a_bad_cpu_linear_fails_the_load_before_any_weight_is_read(model_dir, monkeypatch, value, options):
    from worker.models import checkpoint

    monkeypatch.setattr(checkpoint, "resolve_model_path", lambda *a: pytest.fail("weights were looked up"))
    with pytest.raises(ValueError, match="cpu_linear"):
        load_model(model_dir, cpu_linear=value, **options)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_quantised_linears_match_their_dequantised_weight(kind):
    """Each weight is within half a quantisation step of the original (plus the bf16
    rounding of scales and zeros), and the kernel
    multiplies by exactly that weight (up to bf16 rounding of the activations: < 1 %)."""
    from worker.models.llama.linear import INT4_GROUP, Int4Linear, Int8Linear

    torch.manual_seed(0)
    w, bias = torch.randn(40, 128) * 0.05, torch.randn(40)  # 40 rows: int4 pads them to 48
    lin = Int8Linear(w, bias) if kind == "int8" else Int4Linear(w, bias)
    dq = lin.dequantize()
    if kind == "int8":
        step = w.abs().amax(dim=1, keepdim=True) / 127
    else:
        g = w.reshape(40, -1, INT4_GROUP)
        step = ((g.amax(-1, keepdim=True) - g.amin(-1, keepdim=True)) / 15).expand_as(g).reshape(40, 128)
    assert bool(((dq - w).abs() <= 0.5 * step + 2 ** -7 * (w.abs() + step)).all())  # (+ bf16 scales)
    for rows in (3, lin.KERNEL_ROWS, lin.KERNEL_ROWS + 1):  # the int kernel (bf16 activations) up to
        x = torch.randn(rows, 128)                           # KERNEL_ROWS, then the dequantised weight
        want = x @ dq.t() + bias
        err = float((lin(x) - want).norm() / want.norm())
        bound = 0.01 if rows <= lin.KERNEL_ROWS else 1e-5
        assert err < bound, f"{kind}, {rows} rows: relative error {err:.2e}"


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_a_decode_row_beside_more_prompt_rows_than_the_kernels_keeps_the_kernels_bits(kind):
    """Above ``KERNEL_ROWS`` prompt rows an int kind multiplies by its dequantised weight, but a
    step's decode rows (``leading_exact_rows``, first) get the kernel's bits, as in a step without
    the prompt; a step of no more prompt rows than ``KERNEL_ROWS`` (decode rows beside) stays on the kernel."""
    from worker.models.llama import qkernel
    from worker.models.llama.linear import Int4Linear, Int8Linear

    torch.manual_seed(2)
    w, bias = torch.randn(48, 128) * 0.05, torch.randn(48)
    lin = Int8Linear(w, bias) if kind == "int8" else Int4Linear(w, bias)
    rows = lin.KERNEL_ROWS
    x = torch.randn(rows + 3, 128)
    alone = lin(x[:3])  # the decode rows in a step of their own: the kernel
    wide = lin(x)  # no decode rows said: all on the dequantised weight
    assert not torch.equal(wide[:3], alone)
    with qkernel.leading_exact_rows(3):
        assert torch.equal(lin(x[:3]), alone)
        beside = lin(x)  # rows prompt rows beside the 3: still the kernel, every row
        more = lin(torch.cat([x, x[:1]]))  # rows + 1 prompt rows: the dequantised weight, but the 3
    exact = x @ lin.dequantize().t() + bias
    assert torch.equal(beside[:3], alone) and not torch.allclose(beside[3:], exact[3:], rtol=0, atol=1e-5)
    assert torch.equal(more[:3], alone)
    torch.testing.assert_close(more[3:-1], exact[3:], rtol=1e-5, atol=1e-5)  # the dequantised weight's
    many = rows + 2  # more decode rows than KERNEL_ROWS: the dequantised weight, with a prompt beside or not
    x = torch.randn(many + 4, 128)
    with qkernel.leading_exact_rows(many):
        decode_only, with_prompt = lin(x[:many]), lin(x)
    assert torch.equal(with_prompt[:many], decode_only)  # (a 4-row prompt once put all on the kernel)
    torch.testing.assert_close(decode_only, x[:many] @ lin.dequantize().t() + bias, rtol=1e-5, atol=1e-5)


def test_int4_gets_4_bit_weights_back_exactly():
    """Weights that already were 4-bit with 32-column blocks (a Q4_1 GGUF's) come back exactly,
    up to the bf16 rounding of scales and zeros the kernel needs."""
    from worker.models.llama.linear import Int4Linear

    torch.manual_seed(1)
    codes = torch.randint(0, 16, (32, 4, 32)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # every block uses its whole range, as Q4_1's quantiser makes it
    scale = torch.rand(32, 4, 1).bfloat16().float() / 10
    low = torch.randn(32, 4, 1).bfloat16().float() / 10
    w = (codes * scale + low).reshape(32, 128)
    lin = Int4Linear(w)
    assert torch.equal(lin.unpacked_codes().float(), codes)
    zero = low + 8 * scale
    bound = 2 ** -8 * (zero.abs() + 15 * scale) * 1.01  # bf16 rounding (2^-8) of the zero and the scale
    assert bool(((lin.dequantize() - w).reshape(32, 4, 32).abs() <= bound).all())


def test_int8_embedding_gets_8_bit_blocks_back_exactly():
    """At int8/int4 the embedding is int8 with a scale per 32 columns: exact for a table that was
    8-bit in 32-column blocks (a Q8_0 GGUF's), within half a step otherwise."""
    from worker.models.llama.weights import Embedding

    torch.manual_seed(2)
    codes = torch.randint(-127, 128, (50, 3, 32)).float()
    codes[..., 0] = 127  # Q8_0's quantiser maps each block's largest magnitude to +-127
    scale = torch.rand(50, 3, 1).half().float()
    table = (codes * scale).reshape(50, 96)
    emb = Embedding(table, torch.int8, "cpu", torch.float32)
    ids = torch.tensor([0, 49, 7, 7])
    assert torch.equal(emb(ids), table[ids])
    other = torch.randn(50, 96)
    got = Embedding(other, torch.int8, "cpu", torch.float32)(ids)
    step = other[ids].reshape(4, 3, 32).abs().amax(-1, keepdim=True) / 127
    assert bool(((got - other[ids]).reshape(4, 3, 32).abs() <= step * 0.501).all())


def test_fp32_embedding_is_stored_8_bit_only_where_that_is_exact():
    """fp32 keeps every value bit for bit: int8 blocks for a Q8_0-shaped table (a quarter of the
    memory), fp32 as soon as one block of one chunk would change (the check covers every row)."""
    from worker.models.llama.weights import Embedding

    torch.manual_seed(3)
    rows = Embedding.CHUNK_ROWS + 10  # the table spans two chunks
    codes = torch.randint(-127, 128, (rows, 2, 32)).float()
    codes[..., 0] = -127
    table = (codes * torch.rand(rows, 2, 1).half().float()).reshape(rows, 64)
    ids = torch.tensor([0, rows - 1, 5, Embedding.CHUNK_ROWS])
    exact = Embedding(table, torch.float32, "cpu", torch.float32)
    assert exact.table.dtype == torch.int8 and exact.nbytes < table.numel() * 4 // 3
    assert torch.equal(exact(ids), table[ids])
    spoiled = table.clone()
    spoiled[rows - 1, 7] += 1e-3  # the last chunk's one value no longer on its block's grid
    kept = Embedding(spoiled, torch.float32, "cpu", torch.float32)
    assert kept.table.dtype == torch.float32 and torch.equal(kept(ids), spoiled[ids])
    signed = table.clone()
    signed[5, 40] = -0.0  # code 0 gives +0.0: equal as floats, not as bits
    zero = Embedding(signed, torch.float32, "cpu", torch.float32)
    assert zero.table.dtype == torch.float32 and torch.equal(zero(ids).view(torch.int32), signed[ids].view(torch.int32))


@pytest.mark.parametrize("runner", ["slotserve", "hf"])
def test_freed_heap_goes_back_when_the_last_slot_is_released(model_dir, monkeypatch, runner):
    """Both runners trim glibc's heap once no slot holds a row, never while one still does."""
    import worker.models.hf
    import worker.models.llama.runner

    model = load_model(model_dir, runner=runner)
    trims = []
    module = worker.models.hf if runner == "hf" else worker.models.llama.runner
    monkeypatch.setattr(module, "trim_heap", lambda: trims.append(1))
    model.bind_slots(3)
    prompts = random_prompts(2, seed=5)
    step_tokens(model, [SlotInput(0, prompts[0]), SlotInput(2, prompts[1])])
    model.release_slot(2)
    model.release_slot(1)  # never held a row
    assert trims == []
    model.release_slot(0)
    assert trims == [1]


@pytest.mark.parametrize("runner", ["slotserve", "hf"])
def test_one_requests_sampling_values_never_fail_the_batch(model_dir, reference, runner):
    """Issue 10 item 2: a tiny temperature is greedy; extreme values stay in their own row."""
    model = load_model(model_dir, runner=runner)
    prompt = random_prompts(1, seed=4)[0]
    greedy = generate_alone(reference, prompt, 6)
    engine = BatchInferenceEngine(model, batch_size=6)
    members = [dict(), dict(temperature=1e-40, seed=1), dict(temperature=1e-6), dict(temperature=1e30, seed=2),
               dict(temperature=0.8, top_k=10**6, seed=3), dict(temperature=0.8, top_p=1e-9, seed=4)]
    handles = [engine.submit_request(prompt, 6, **m) for m in members]
    engine.run()
    assert all(h.finish_reason == FinishReason.LENGTH and len(h.tokens) == 6 for h in handles)
    assert handles[0].tokens == handles[1].tokens == handles[2].tokens == handles[5].tokens == greedy


@pytest.mark.parametrize("runner", ["slotserve", "hf"])
def test_nan_in_one_row_is_contained_to_that_row(model_dir, reference, runner):
    """A request whose activations turn NaN (a NaN embedding row here) ends with error;
    its batch neighbours and the next users of its cache row get exactly their greedy tokens.
    The slotserve runner also catches a NaN at an earlier prompt position (the HF runner
    only sees the logits)."""
    model = load_model(model_dir, runner=runner)
    poisoned = 17
    with torch.no_grad():
        table = model.weights.embed.table if runner == "slotserve" else model.model.get_input_embeddings().weight
        table[poisoned] = float("nan")
    good = [p for p in random_prompts(6, seed=5) if poisoned not in p][:4]
    bad = [[3, 4, 5, poisoned]] + ([[3, poisoned, 4, 5]] if runner == "slotserve" else [])
    engine = BatchInferenceEngine(model, batch_size=len(bad) + 1)
    first = [engine.submit_request(p, 5) for p in bad + good[:1]]  # one packed prefill
    engine.run()
    later = [engine.submit_request(p, 5) for p in good[1:]]  # reuse the failed requests' rows
    engine.run()
    for h in first[:-1]:
        assert h.finish_reason == FinishReason.ERROR and "non-finite" in str(h.error)
        assert h.tokens == []
    for p, h in zip(good, first[-1:] + later):
        assert h.finish_reason == FinishReason.LENGTH and h.tokens == generate_alone(reference, p, 5)


def test_options_are_checked():
    with pytest.raises(ValueError):
        ModelOptions(precision="int3")
    with pytest.raises(ValueError):
        ModelOptions(device="tpu")
    with pytest.raises(ValueError):
        ModelOptions(runner="hf", precision="int8")
    with pytest.raises(ValueError):
        ModelOptions(max_prefill_tokens=8)
    with pytest.raises(ValueError):
        load_model("simulated", precision="int8")
    assert load_model("simulated", precision="auto").vocab_size == 1000
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            ModelOptions(device="cuda").resolve()
    assert ModelOptions().resolve()[1] == ("bf16" if torch.cuda.is_available() else "fp32")


def test_other_architectures_fall_back_to_hf(tmp_path):
    from worker.models.hf import HFSlotModel

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2, n_positions=64)
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path)
    assert isinstance(load_model(str(tmp_path)), HFSlotModel)
    with pytest.raises(ValueError, match="slotserve runner"):
        load_model(str(tmp_path), runner="slotserve")
    with pytest.raises(ValueError, match="HF runner"):
        load_model(str(tmp_path), precision="int8")


def test_hf_runner_can_be_forced(model_dir):
    from worker.models.hf import HFSlotModel

    assert isinstance(load_model(model_dir, runner="hf"), HFSlotModel)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_cuda_greedy_matches_cpu(model_dir, precision):
    """CUDA graphs at fixed batch sizes, one host sync per step: same greedy tokens as the CPU runner
    (fp32), or close (bf16: most tokens)."""
    prompts = random_prompts(7, seed=8)
    cpu = [h.tokens for h in run_engine(load_model(model_dir, device="cpu"), prompts, [12] * 7, batch_size=5)]
    cuda = [h.tokens for h in run_engine(load_model(model_dir, device="cuda", precision=precision), prompts,
                                         [12] * 7, batch_size=5)]
    same = sum(a == b for a, b in zip(cpu, cuda))
    assert same == 7 if precision == "fp32" else same >= 4


ONEDNN_GROWTH = r"""
import ctypes, json, os, sys, torch
from worker.models.llama.linear import PackedLinear, DenseLinear
kind = sys.argv[1]
def rss():
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
shapes = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M's layer shapes
if kind == "onednn":
    lins = [PackedLinear(torch.randn(n, k), None, "onednn") for n, k in shapes]
else:
    from worker.models.heap import bound_onednn_caches
    bound_onednn_caches()
    lins = [DenseLinear(torch.randn(n, k).bfloat16()) for n, k in shapes]
dtype = torch.float32 if kind == "onednn" else torch.bfloat16
base = rss()
with torch.inference_mode():
    for m in range(1, 257):  # a new row count each time, as prefill iterations give
        for (n, k), lin in zip(shapes, lins):
            lin(torch.randn(m, k, dtype=dtype))
print(json.dumps({"growth_mib": rss() - base, "env": [os.environ.get(v) for v in
      ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")]}))
"""


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads Linux's /proc")
@pytest.mark.parametrize("kind", ["onednn", "dense-bf16"])
def test_onednn_caches_stay_bounded_as_row_counts_change(kind):
    """oneDNN caches a primitive per input shape (1,024 by default, ~0.5 MiB each here):
    256 row counts through 4 layer shapes grew a process by ~480 MiB before the caches were
    capped; capped (set before the first product, in a fresh process) it stays small."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    if "onednn" not in cpu_linear_candidates(torch.float32 if kind == "onednn" else torch.bfloat16):
        pytest.skip("this torch has no oneDNN path for it")
    env = {k: v for k, v in __import__("os").environ.items()
           if k not in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY")}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])
    done = subprocess.run([sys.executable, "-c", ONEDNN_GROWTH, kind.split("-")[0]], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["env"] == ["32", "32"]
    assert out["growth_mib"] < 80, out
