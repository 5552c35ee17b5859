"""A tiny Llama with a real (byte-level BPE) tokenizer and chat template, made on the spot.

For tests that need text in and out through real processes without loading
SmolLM2: the weights are random (the text is gibberish, but deterministic
under greedy decoding and reproducible under a seed) and the whole model
loads in about a second through the same code path as any Hugging Face
directory (:func:`worker.models.hf.load_hf_model`). :class:`ScriptedTextModel`
uses the same tokenizer with an output known exactly (text stops, streaming).
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


FIM_MARKERS = ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
               "<|endoftext|>")
"""Qwen2.5-Coder's fill-in-the-middle tokens (worker/models/fim.py), added by ``fim=``."""


def make_tiny_text_model(path: str | Path, *, seed: int = 0, max_positions: int = 512, fim: str | None = None) -> str:
    """Write the model and tokenizer to ``path`` (a directory); return it as a str. ``fim``:
    ``"special"`` adds :data:`FIM_MARKERS` as special tokens (a FIM model's), ``"plain"`` as
    ordinary added tokens (markers that are not special tokens), None neither."""
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
    if fim is not None:
        fast.add_tokens([tokenizers.AddedToken(m, special=fim == "special", normalized=False) for m in FIM_MARKERS],
                        special_tokens=fim == "special")
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


class ScriptedTextModel:
    """A stateless model with the tiny model's real tokenizer that writes ``text``:
    the token a sequence gets next is the one at position ``len(seq) - prompt_len``
    of ``text``'s encoding (cycling). The output is then known exactly, byte
    tokens of multi-byte characters included (the tiny tokenizer splits "😀"
    into four), and a function of the sequence alone: batch invariant, and a
    migrated or resumed request continues the same script. All prompts must be
    ``prompt_len`` tokens long.

    ``hang_after``: the step after that many steps blocks until ``release`` is
    set (``hanging`` is set meanwhile): a worker stuck right after streaming a
    chosen token. ``hang_at_output`` (with ``hang_rows``): instead, the first
    step of ``hang_rows`` sequences that all have at least that many output
    tokens blocks (requests that joined in different steps are then all past
    the chosen token). ``gate``: when given (an Event), the first step waits
    for it: a test that submits several requests sets it once the broker has
    them all on this worker, so none starts a script ahead of the others.
    ``step_s``: a slower model (seconds per step).
    """

    def __init__(self, model_dir: str, text: str, prompt_len: int, *, hang_after: int | None = None,
                 step_s: float = 0.0) -> None:
        import threading

        from transformers import AutoTokenizer

        from worker.models.hf_text import HFTextCodec

        tok = AutoTokenizer.from_pretrained(model_dir)
        self.tokenizer = HFTextCodec(tok)
        self.vocab_size = len(tok)
        self.eos_token_ids = (tok.eos_token_id,)
        self.script = self.tokenizer.encode(text)
        self.prompt_len = prompt_len
        self.hang_after = hang_after
        self.hang_at_output: int | None = None
        self.hang_rows = 1
        self.step_s = step_s
        self.calls = 0
        self.release = threading.Event()
        self.hanging = threading.Event()
        self.gate: threading.Event | None = None

    def next_tokens(self, sequences):
        import time

        self.calls += 1
        if self.gate is not None and self.calls == 1:
            self.gate.wait()
        at_output = self.hang_at_output is not None and len(sequences) == self.hang_rows and all(
            len(s) - self.prompt_len >= self.hang_at_output for s in sequences)
        if (self.hang_after is not None and self.calls == self.hang_after + 1) or (
                at_output and not self.hanging.is_set()):
            self.hanging.set()
            self.release.wait()
        if self.step_s:
            time.sleep(self.step_s)  # the model's cost, not synchronisation
        n = len(self.script)
        return [self.script[(len(s) - self.prompt_len) % n] for s in sequences]
