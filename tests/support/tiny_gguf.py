"""Tiny random Llama and Qwen2 models written as block-quantised GGUF files, for precision ``gguf``.

:func:`write_quantized_gguf` writes, with the ``gguf`` package's ``GGUFWriter``
under llama.cpp's names, a 2-layer model whose weights use every block format
slotserve reads (:data:`worker.models.gguf_blocks.FORMATS`): the 32-column
formats from ``gguf.quantize`` of normal values, the K formats (which gguf
cannot quantise to) as :func:`random_blocks`; one F16 matrix; q/k/v and
gate/up in one format in some layers (fused by ``QuantizedWeight.cat``) and
in mixed formats in others (a ``ConcatLinear``). Llama has an untied head;
Qwen2 a tied one and q/k/v biases. The vocabulary is
:data:`~tests.support.slot_models.TINY_LLAMA_VOCAB` tokens (a byte-level BPE
padded), so the tiny Llama's prompt helpers serve.
"""

from __future__ import annotations

import numpy as np

from tests.support.slot_models import TINY_LLAMA_VOCAB

HIDDEN, HEADS, KV_HEADS, FFN, LAYERS = 256, 4, 2, 512, 2  # the K formats need widths of whole 256s

FP16_FIELDS = {"Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}
"""Byte offsets of each format's fp16 fields in a block (d, and m or dmin)."""

K_SCALE = {"Q4_K": 1e-4, "Q5_K": 5e-5, "Q6_K": 2.5e-5}
"""Standard deviation of d (and dmin) in :func:`random_blocks` for weights of about 0.1 (largest code
times largest sub-block scale: 15 * 63, 31 * 63, 32 * 127)."""

LAYOUTS = {
    # per layer: {llama.cpp tensor: format}; None: F16
    "llama": [dict(attn_q="Q4_K", attn_k="Q4_K", attn_v="Q6_K", attn_output="Q5_K", ffn_gate="Q4_0",
                   ffn_up="Q4_0", ffn_down="Q8_0"),
              dict(attn_q="Q5_0", attn_k="Q5_0", attn_v="Q5_0", attn_output="Q8_0", ffn_gate="Q5_1",
                   ffn_up="Q4_1", ffn_down=None)],
    "qwen2": [dict(attn_q="Q8_0", attn_k="Q8_0", attn_v="Q8_0", attn_output="Q4_K", ffn_gate="Q6_K",
                   ffn_up="Q6_K", ffn_down="Q5_K"),
              dict(attn_q="Q4_1", attn_k="Q4_1", attn_v="Q4_0", attn_output="Q5_1", ffn_gate="Q4_K",
                   ffn_up="Q5_K", ffn_down="Q6_K")],
}
EMBED = {"llama": ("Q6_K", "Q4_1"), "qwen2": ("Q8_0", None)}  # (token_embd, output: None = tied)


def random_blocks(fmt: str, rows: int, cols: int, seed: int = 0, scale: float = 0.01) -> np.ndarray:
    """uint8 ``[rows, row_bytes]`` of ``fmt`` blocks: random bytes, each fp16 field a finite value of
    standard deviation ``scale`` (every 7th zero, some -0.0, some subnormal)."""
    import gguf

    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[fmt]]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in FP16_FIELDS[fmt]:
        values = (rng.standard_normal(len(raw)) * scale).astype(np.float16)
        values[::7] = 0.0
        values[3::11] = np.float16(-0.0)
        values[5::13] = np.float16(3e-7)  # subnormal in fp16
        raw[:, at:at + 2] = values.reshape(-1, 1).view(np.uint8)
    return raw.reshape(rows, -1)


def _tokenizer_fields(writer, specials: tuple[str, ...] = ()) -> int:
    """A byte-level BPE (base bytes, a few merges, padding tokens, ``specials`` and two more
    specials, ``<|end|>`` the EOS and ``<|start|>`` the BOS, last) of TINY_LLAMA_VOCAB tokens;
    returns that size."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    merges = ["Ġ t", "h e", "Ġt he", "Ġ c", "a t", "Ġc at"]
    tokens = list(bytes_to_unicode().values()) + [m.replace(" ", "") for m in merges]
    last = [*specials, "<|end|>", "<|start|>"]
    tokens += [f"Ġpad{i}" for i in range(TINY_LLAMA_VOCAB - len(last) - len(tokens))] + last
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * (len(tokens) - len(last)) + [3] * len(last))
    writer.add_token_merges(merges)
    writer.add_eos_token_id(len(tokens) - 2)
    writer.add_bos_token_id(len(tokens) - 1)
    return len(tokens)


def write_quantized_gguf(path: str, arch: str = "llama", seed: int = 0, specials: tuple[str, ...] = ()) -> None:
    """The tiny ``arch`` (``"llama"`` or ``"qwen2"``) model at ``path`` (see module docstring);
    ``specials``: more special (control) tokens, just before its EOS and BOS, the last ids."""
    import gguf

    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(path, arch)
    vocab = _tokenizer_fields(w, specials)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(10_000.0)
    w.add_vocab_size(vocab)

    def tensor(name, rows, cols, fmt):
        if fmt in K_SCALE:
            raw = random_blocks(fmt, rows, cols, seed=int(rng.integers(1 << 30)), scale=K_SCALE[fmt])
            w.add_tensor(name, raw, raw_dtype=gguf.GGMLQuantizationType[fmt])
            return
        values = (rng.standard_normal((rows, cols)) * 0.1).astype(np.float32)
        if fmt is None:
            w.add_tensor(name, values.astype(np.float16))
        else:
            qtype = gguf.GGMLQuantizationType[fmt]
            w.add_tensor(name, gguf.quantize(values, qtype), raw_dtype=qtype)

    def vector(name, n, offset=0.0):
        w.add_tensor(name, (rng.standard_normal(n) * 0.1 + offset).astype(np.float32))

    embed, head = EMBED[arch]
    tensor("token_embd.weight", vocab, HIDDEN, embed)
    vector("output_norm.weight", HIDDEN, 1.0)
    if head is not None:
        tensor("output.weight", vocab, HIDDEN, head)
    head_dim, kv = HIDDEN // HEADS, KV_HEADS * HIDDEN // HEADS
    rows = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv, HIDDEN), "attn_v": (kv, HIDDEN),
            "attn_output": (HIDDEN, HEADS * head_dim), "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN),
            "ffn_down": (HIDDEN, FFN)}
    for i, layout in enumerate(LAYOUTS[arch]):
        for part, fmt in layout.items():
            tensor(f"blk.{i}.{part}.weight", *rows[part], fmt)
        if arch == "qwen2":
            for part in ("attn_q", "attn_k", "attn_v"):
                vector(f"blk.{i}.{part}.bias", rows[part][0])
        vector(f"blk.{i}.attn_norm.weight", HIDDEN, 1.0)
        vector(f"blk.{i}.ffn_norm.weight", HIDDEN, 1.0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
