"""A tiny Llama with a real (byte-level BPE) tokenizer and chat template, made on the spot.

For tests that need text in and out through real processes without loading
SmolLM2: the weights are random (the text is gibberish, but deterministic
under greedy decoding and reproducible under a seed) and the whole model
loads in about a second through the same code path as any Hugging Face
directory (:func:`worker.models.hf.load_hf_model`).
"""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)

CORPUS = [
    "hello world, the quick brown fox jumps over the lazy dog",
    "def add(a, b):\n    return a + b\n",
    "slotserve batches requests into slots; every iteration decodes one token per slot",
]


def make_tiny_text_model(path: str | Path, *, seed: int = 0, max_positions: int = 512) -> str:
    """Write the model and tokenizer to ``path`` (a directory); return it as a str."""
    import tokenizers
    import torch
    import transformers

    tok = tokenizers.Tokenizer(tokenizers.models.BPE())
    tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
    eos = fast.eos_token_id
    torch.manual_seed(seed)
    cfg = transformers.LlamaConfig(
        vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
        initializer_range=0.3, bos_token_id=eos, eos_token_id=eos, pad_token_id=eos,
    )
    model = transformers.LlamaForCausalLM(cfg)
    path = Path(path)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return str(path)
