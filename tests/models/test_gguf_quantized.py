"""Precision ``gguf``: a GGUF file's block-quantised weights served as stored.

Tiny random Llama and Qwen2 GGUF files using every block format slotserve
reads (:mod:`tests.support.tiny_gguf`) are loaded at precision ``gguf``: the
weights stay codes and scales (``QuantizedWeight``, fused where the formats
agree, a ``ConcatLinear`` where they do not; the tied head the embedding's
own object), no tensor is ever dequantised whole at load, and the logits match
transformers' forward on the file (which dequantises it with the same ``gguf``
package) at every position: within fp32 tolerance on the pure-torch product
(fp32 on the dequantised weights), within bf16's on the compiled kernel. ``auto`` picks ``gguf`` for such
a file on CPU; int8 re-quantises only when asked.
"""

from __future__ import annotations

import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

from tests.support.tiny_gguf import write_quantized_gguf  # noqa: E402
from worker.models import ModelOptions, load_model  # noqa: E402
from worker.models.base import SlotInput  # noqa: E402
from worker.models.checkpoint import read_gguf  # noqa: E402
from worker.models.gguf_blocks import FORMATS  # noqa: E402
from worker.models.llama import qkernel  # noqa: E402
from worker.models.llama.linear import ConcatLinear, Int8Linear  # noqa: E402
from worker.models.llama.quantized import QuantizedEmbedding, QuantizedWeight  # noqa: E402

pytestmark = pytest.mark.hf


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def quantized_file(request, tmp_path_factory):
    """``(arch, gguf path, transformers' model loaded from it)``."""
    folder = tmp_path_factory.mktemp(f"q-{request.param}")
    path = str(folder / f"tiny-{request.param}.gguf")
    write_quantized_gguf(path, request.param)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=os.path.basename(path),
                                                            dtype=torch.float32).eval()
    return request.param, path, ref


def test_the_stored_weights_dequantize_to_the_fp32_read(quantized_file):
    """Every quantised tensor read as stored (q/k rows un-permuted as transformers does) gives the
    fp32 read's tensor back bit for bit; F32/F16 tensors are the same tensors."""
    arch, path, _ = quantized_file
    stored, _ = read_gguf(path, quantized=True)
    plain, _ = read_gguf(path)
    pairs = [(stored.embed, plain.embed), (stored.head, plain.head), (stored.norm, plain.norm)]
    pairs += [(s[k], p[k]) for s, p in zip(stored.layers, plain.layers) for k in s]
    formats = set()
    for got, want in pairs:
        if isinstance(got, QuantizedWeight):
            formats.add(got.fmt)
            got = got.dequantize()
        assert (got is None) == (want is None)
        if got is not None:
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert formats == set(FORMATS) - ({"Q5_0"} if arch == "qwen2" else set())


def test_no_quantised_tensor_is_dequantised_at_load(quantized_file, monkeypatch):
    """``gguf.dequantize`` runs only for the F16 tensor: the rest is never made fp32 whole."""
    _, path, _ = quantized_file
    seen = []
    real = gguf.dequantize

    def spy(data, qtype):
        seen.append(gguf.GGMLQuantizationType(qtype).name)
        return real(data, qtype)

    monkeypatch.setattr(gguf, "dequantize", spy)
    load_model(path, precision="gguf")
    assert set(seen) <= {"F32", "F16"}


@pytest.fixture(params=["torch", "kernel", "kernel-int8"])
def product(request, monkeypatch):
    """What multiplies the stored weights: pure torch (fp32 on the dequantised weights: the file's
    weights exactly), or the compiled kernel with bf16 activations, or with int8 ones (skipped where
    it does not run here)."""
    from worker.models.llama import qkernel

    if request.param == "torch":
        monkeypatch.setenv("SLOTSERVE_NO_KERNELS", "1")
    qkernel.load.cache_clear()
    if request.param != "torch" and qkernel.load() is None:
        pytest.skip("the compiled GGUF kernel does not run here (no avx512_bf16 or no compiler)")
    if request.param == "kernel-int8" and not qkernel.load().has_q8():
        pytest.skip("int8 activations need AVX-512 VNNI and VBMI, or AVX2")
    if request.param == "kernel" and qkernel.isa() == "avx2":
        pytest.skip("bf16 activations need AVX-512 BF16 (an AVX2 CPU runs the stored weights on int8 ones)")
    yield request.param
    monkeypatch.delenv("SLOTSERVE_NO_KERNELS", raising=False)
    qkernel.load.cache_clear()


def _close(got, want, product):
    """Pure torch: fp32 tolerance. The kernel rounds activations to bf16 (8 bits of mantissa): within
    2 % of the logits' norm (measured: 0.5 and 0.7 % on these files, AMX); to int8 per group of the
    weight: within 30 % (measured: up to 9 % on the random llama file, 22 % on the random qwen2 one, whose
    activations have the larger outliers; 5-10 % on the real Qwen2.5-Coder-0.5B's HumanEval prompts). A
    broken product is off by ~100 %; the product itself is checked exactly in test_qkernel."""
    if product == "torch":
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    else:
        assert float((got - want).norm() / want.norm()) < (2e-2 if product == "kernel" else 0.3)


def test_gguf_logits_match_transformers_at_every_position(quantized_file, product):
    """A 24-token prompt then 6 decode steps at precision gguf, against transformers' fp32 forward
    (an fp32 KV cache: the products' tolerance; gguf's own default, fp16, rounds the keys and values)."""
    arch, path, ref = quantized_file
    activations = {"torch": "auto", "kernel": "bf16", "kernel-int8": "int8"}[product]
    model = load_model(path, precision="gguf", gguf_activations=activations, kv_cache_dtype="fp32")
    assert ("pure torch" in model.weights.linear_kind) == (product == "torch")
    assert ("int8 activations" in model.weights.linear_kind) == (product == "kernel-int8")
    w = model.weights
    assert w.precision == "gguf" and w.act_dtype == torch.float32 and w.greedy_head is None
    assert isinstance(w.embed, QuantizedEmbedding)
    assert isinstance(w.layers[0].qkv, ConcatLinear if arch == "llama" else QuantizedWeight)
    assert isinstance(w.layers[1].qkv, QuantizedWeight if arch == "llama" else ConcatLinear)
    if arch == "qwen2":  # tied: the head is the embedding's stored weight, held once
        assert w.head is w.embed.weight
        assert w.layers[0].qkv.bias is not None
        assert w.nbytes == sum(x.nbytes for lw in w.layers for x in (lw.qkv, lw.o, lw.gate_up, lw.down)) \
            + w.embed.nbytes
    assert "Q6_K x" in w.linear_kind and ("fp32 x 1" in w.linear_kind) == (arch == "llama")
    assert ("6-bit codes a byte each" in w.linear_kind) == (product != "torch" and not qkernel.six_bits())
    model.bind_slots(1)
    seq = [int(t) for t in torch.randint(2, 300, (24,), generator=torch.Generator().manual_seed(1))]
    with torch.inference_mode():
        want = ref(torch.tensor([seq])).logits[0]
    logits, _ = model.forward_batch([SlotInput(0, list(seq))])
    _close(logits[0], want[-1], product)
    for _ in range(6):
        seq.append(int(logits[0].argmax()))
        logits, _ = model.forward_batch([SlotInput(0, list(seq))])
        with torch.inference_mode():
            want = ref(torch.tensor([seq])).logits[0, -1]
        _close(logits[0], want, product)


def test_a_product_of_no_rows_is_empty_on_every_linear(quantized_file):
    """A step whose plan has no logits to compute multiplies the head by no rows (the compiled
    kernel crashed the process on that: the prefix-cache test at gguf)."""
    _, path, _ = quantized_file
    w = load_model(path, precision="gguf").weights
    widths = {"qkv": 256, "o": 256, "gate_up": 256, "down": 512}
    for linear, k in [(w.head, 256)] + [(getattr(lw, n), k) for lw in w.layers for n, k in widths.items()]:
        assert linear(torch.zeros(0, k)).shape == (0, linear.out_features)


def test_auto_picks_gguf_for_a_quantised_file_and_int8_requantises_only_when_asked(quantized_file):
    _, path, _ = quantized_file
    assert load_model(path).weights.precision == "gguf"
    fp32 = load_model(path, precision="fp32").weights
    assert fp32.precision == "fp32" and not isinstance(fp32.layers[0].qkv, (QuantizedWeight, ConcatLinear))
    assert isinstance(load_model(path, precision="int8").weights.layers[0].o, Int8Linear)


def test_auto_keeps_fp32_where_the_kernel_does_not_run(quantized_file, monkeypatch):
    """Without the compiled kernel (no avx512_bf16, no compiler) the stored weights would multiply
    in pure torch, many times slower than fp32: auto then serves fp32; gguf asked for still runs."""
    from worker.models.llama import qkernel

    _, path, _ = quantized_file
    monkeypatch.setenv("SLOTSERVE_NO_KERNELS", "1")
    qkernel.load.cache_clear()
    try:
        assert load_model(path).weights.precision == "fp32"
        assert load_model(path, precision="gguf").weights.precision == "gguf"
    finally:
        monkeypatch.delenv("SLOTSERVE_NO_KERNELS")
        qkernel.load.cache_clear()


def test_gguf_is_refused_where_it_cannot_run(model_dir):
    """Not a GGUF file (transformers' loader), CUDA, the HF runner: each a ValueError saying what to use."""
    with pytest.raises(ValueError, match="GGUF file"):
        load_model(model_dir, precision="gguf")
    with pytest.raises(ValueError, match="CPU only"):
        ModelOptions(device="cuda", precision="gguf")
    with pytest.raises(ValueError, match="slotserve runner"):
        ModelOptions(runner="hf", precision="gguf")
    assert ModelOptions(precision="gguf").resolve() == ("cpu", "gguf")  # device auto: CPU even with a GPU


def test_gguf_activations_default_to_int8_where_it_runs_and_apply_to_gguf_only(quantized_file, monkeypatch):
    """``gguf_activations``: auto is int8 where the CPU runs it (llama.cpp's Q8), the LM head's product
    too (``weights.HEAD_ACTIVATIONS``), else bf16 (the file's weights exactly); a head set apart is
    said in the linear kind; another precision refuses it."""
    from worker.models.llama import qkernel

    _, path, _ = quantized_file
    module = qkernel.load()
    if module is not None:
        weights = load_model(path, precision="gguf").weights
        kernels = [w.kernel for w in weights.stored_weights() if w.kernel is not None]
        head = getattr(weights.head, "parts", (weights.head,))[0].kernel
        q8 = bool(module.has_q8())
        assert all(k.int8 == q8 for k in kernels) and head in kernels
        assert ("int8 activations" if q8 else "bf16 activations") in weights.linear_kind, weights.linear_kind
        assert "LM head" not in weights.linear_kind
        if q8 and qkernel.isa() == "avx2":  # int8 only: a bf16 head is refused in words
            with pytest.raises(ValueError, match="needs a CPU with AVX-512 BF16"):
                weights.set_gguf_activations("bf16")
        elif q8:
            from worker.models.llama import weights as weights_module

            monkeypatch.setattr(weights_module, "HEAD_ACTIVATIONS", "bf16")
            weights.set_gguf_activations("auto")
            assert not head.int8 and all(k.int8 for k in kernels if k is not head)
            assert "LM head's bf16" in weights.linear_kind, weights.linear_kind
            weights.set_gguf_activations("int8")
            assert all(k.int8 for k in kernels) and "LM head" not in weights.linear_kind
    for precision in ("fp32", "bf16", "int4"):
        with pytest.raises(ValueError, match="applies to precision gguf"):
            load_model(path, precision=precision, gguf_activations="int8")
    with pytest.raises(ValueError, match="gguf_activations must be one of"):
        load_model(path, precision="gguf", gguf_activations="fp8")


def test_a_nan_row_ends_its_request_alone_on_the_default_product(quantized_file, monkeypatch):
    """A request whose activations turn NaN (its embedding row, here) ends with an error at the
    default ``gguf_activations`` (int8 for the layers where the CPU runs it), and the request beside
    it in the same steps gets the tokens it gets alone. (A NaN in part of a row, as an MLP's
    intermediate can hold, is test_qkernel's non-finite test: int8 once made finite sums of it.)"""
    from worker import BatchInferenceEngine, FinishReason

    _, path, _ = quantized_file
    model = load_model(path, precision="gguf")
    poisoned, real = 7, QuantizedEmbedding.__call__
    good, bad = [3, 4, 5, 6], [3, 4, 5, poisoned]
    alone = BatchInferenceEngine(model, batch_size=1)
    ref = alone.submit_request(good, 4)
    alone.run()

    def poisoned_rows(self, ids):
        out = real(self, ids)
        out[ids == poisoned] = float("nan")
        return out

    monkeypatch.setattr(QuantizedEmbedding, "__call__", poisoned_rows)
    engine = BatchInferenceEngine(model, batch_size=2)
    handles = [engine.submit_request(p, 4) for p in (bad, good)]
    engine.run()
    assert handles[0].finish_reason == FinishReason.ERROR and "non-finite" in str(handles[0].error)
    assert handles[1].finish_reason == FinishReason.LENGTH and handles[1].tokens == ref.tokens


@pytest.mark.parametrize("activations", ["auto", "bf16"])
def test_a_prompt_gives_the_same_logits_whole_in_chunks_token_by_token_and_beside_others(quantized_file,
                                                                                         activations):
    """Where the compiled kernels run, a prompt token's attention is its decode's (the compiled
    attention over its row's keys ``0 .. position``, whatever the chunk it came in) and every product
    is row-invariant, so its last token's logits are the same bits whole, in chunks of any size,
    fed token by token as decode steps, and beside another request's prompt and decode rows. (With
    ``F.scaled_dot_product_attention`` over each chunk they moved by up to 0.26 on
    Qwen2.5-Coder-0.5B between 100 tokens whole and in two chunks, and a served model's greedy
    tokens followed the timing that made its chunks.)"""
    from worker.models.llama import attnkernel

    from worker.models.llama.linear import PackedLinear, cpu_linear_candidates

    arch, path, _ = quantized_file
    if qkernel.load() is None or attnkernel.load() is None:
        pytest.skip("the compiled kernels do not run here")
    if activations == "bf16" and qkernel.isa() == "avx2":  # int8 activations only: bf16 refused at load, in words
        with pytest.raises(ValueError, match="gguf_activations='bf16' needs a CPU with AVX-512 BF16.*use 'int8'"):
            load_model(path, precision="gguf", gguf_activations=activations)
        return
    model = load_model(path, precision="gguf", gguf_activations=activations)
    stored_f16 = [p for lw in model.weights.layers for lin in (lw.qkv, lw.o, lw.gate_up, lw.down)
                  for p in getattr(lin, "parts", (lin,)) if isinstance(p, PackedLinear)]
    if "onednn" in cpu_linear_candidates(torch.float32):  # llama's F16 matrix: oneDNN's row-invariant
        assert all(p.kind == "onednn" for p in stored_f16)  # fp32 product, never a timing pick
        assert stored_f16 or arch == "qwen2"
    gen = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, 200, (40,), generator=gen).tolist()
    other = torch.randint(3, 200, (50,), generator=gen).tolist()

    def last_logits(chunk_sizes, beside=None):
        model.bind_slots(3)
        got = None
        for size in chunk_sizes:
            batch, chunks = [SlotInput(0, list(prompt))], {0: size}
            if beside is not None:
                batch.append(beside)
            logits, index = model.forward_batch(batch, chunks=chunks)
            if logits is not None and 0 in index:
                got = logits[index.index(0)].clone()
        return got

    whole = last_logits([40])
    assert torch.isfinite(whole).all()
    for sizes in ([20, 20], [7, 13, 1, 19], [39, 1]):
        assert torch.equal(last_logits(sizes), whole), sizes
    assert torch.equal(last_logits([40], beside=SlotInput(1, list(other))), whole)  # another prompt in the step

    model.bind_slots(3)  # token by token: the first a prompt of one, then each a decode entry
    model.forward_batch([SlotInput(0, prompt[:1]), SlotInput(1, other[:5])])
    for i in range(2, 41):
        beside = SlotInput(1, other[: 4 + i])  # a decode row of another request in every step
        logits, index = model.forward_batch([SlotInput(0, prompt[:i]), beside])
    assert torch.equal(logits[index.index(0)], whole)
