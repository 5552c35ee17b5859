"""What the tests of both runners (worker/models/hf.py and worker/models/llama/) share:
the tiny random Llama, random prompts, the greedy reference of a tiny model,
and a scenario that drives a model by hand."""

from __future__ import annotations

import random

from tests.support.reference import greedy_generate
from worker.models.base import BatchPlan, SlotInput

TINY_LLAMA_VOCAB = 320


def tiny_llama(**config):
    """A tiny randomly initialised Llama (2 layers, 64 wide, seed 0) in eval mode.
    ``initializer_range`` is large so logits are well separated and greedy argmax
    is not decided by rounding noise; no EOS, so ``generate`` runs to its length.
    ``config``: LlamaConfig fields to change."""
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**{
        **dict(vocab_size=TINY_LLAMA_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
               initializer_range=0.3, bos_token_id=1, eos_token_id=None, pad_token_id=0),
        **config})
    model = transformers.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    return model


def save_tiny_llama(path, **config):
    """:func:`tiny_llama`, saved at ``path`` with ``save_pretrained``; returned."""
    model = tiny_llama(**config)
    model.save_pretrained(path)
    return model


def save_unfitting_llama(path, key: str, value) -> str:
    """:func:`save_tiny_llama` at ``path`` (a folder: config.json and model.safetensors), then its
    config.json's ``key`` set to ``value``: a config.json that is not its weights' (another size's, or
    edited). Returns ``path`` as a string."""
    import json
    from pathlib import Path

    save_tiny_llama(path)
    config = Path(path) / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), key: value}))
    return str(path)


def random_prompts(count: int, seed: int, max_len: int = 60, vocab: int = TINY_LLAMA_VOCAB) -> list[list[int]]:
    """``count`` prompts of 1 to ``max_len`` tokens in [2, vocab), from ``seed``."""
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


def generate_alone(ref, prompt: list[int], n: int, eos=None) -> list[int]:
    """Greedy continuation of one prompt by a tiny model's transformers ``generate``
    (batch 1, no padding; no EOS unless ``eos``)."""
    return greedy_generate(ref, prompt, n, eos_token_id=eos, pad_token_id=0)


def scattered_rows_and_reuse(model, prompts: list[list[int]], iterations: int = 12) -> dict[tuple, list[int]]:
    """Drive ``model`` (a SlotModel) by hand over 4 slots with ``prompts[:4]``: slot 1 finishes
    after 3 iterations, so the other rows decode around a hole (a padding or gather path), and
    ``prompts[4]`` takes it at iteration 6 (a new occupant of a used row). Returns prompt ->
    generated tokens for all 5 prompts, to compare with a reference."""
    model.bind_slots(4)
    seqs = {slot: list(p) for slot, p in enumerate(prompts[:4])}
    origin = dict(enumerate(prompts[:4]))
    results = {}
    for it in range(iterations):
        if it == 3:
            results[tuple(origin[1])] = seqs.pop(1)[len(origin[1]):]
            model.release_slot(1)
        if it == 6:
            seqs[1], origin[1] = list(prompts[4]), prompts[4]
        batch = [SlotInput(slot=s, tokens=t) for s, t in sorted(seqs.items(), reverse=True)]
        for item, tok in zip(batch, step_tokens(model, batch)):
            assert tok is not None
            item.tokens.append(tok)
    for slot, seq in seqs.items():
        results[tuple(origin[slot])] = seq[len(origin[slot]):]
    assert len(results) == 5
    return results


def step_tokens(model, batch: list[SlotInput], chunks: dict[int, int] | None = None) -> list[int | None]:
    """Drive ``model`` (a SlotModel) by hand for one step of ``batch`` (a :class:`BatchPlan` with
    ``chunks``, None: whole prompts): each entry's token, None for a prompt chunk that did not
    finish its prompt. No entry may fail or come with several tokens."""
    out = model.step(BatchPlan(batch, chunks))
    assert len(out.tokens) == len(batch) and not out.more and not out.errors
    return out.tokens


class CountingSteps:
    """Wraps a runner; counts the entries that came back with several tokens."""

    def __init__(self, runner) -> None:
        self.runner = runner
        if hasattr(runner, "draft_costs"):  # every draft the lookup finds, not the ones that pay: the tests
            runner.draft_costs = None       # verify as many as can be (the policy: test_draft_policy.py)
        for name in ("vocab_size", "max_seq_len", "eos_token_ids", "tokenizer"):
            setattr(self, name, getattr(runner, name))
        self.several = 0  # entries with several tokens (drafts accepted)
        self.drafted = 0  # draft tokens verified
        self.entries: list[tuple[object, object, object]] = []  # (sampling, token, more tokens or None)

    def bind_slots(self, n):
        self.runner.bind_slots(n)

    def release_slot(self, slot):
        self.runner.release_slot(slot)

    @property
    def prefill_budget(self):
        return self.runner.prefill_budget

    def step(self, plan):
        out = self.runner.step(plan)
        self.several += len(out.more or ())
        self.drafted += sum(len(d) for _, _, d in self.runner._drafts.values())
        more = out.more or {}
        self.entries += [(si.sampling, tok, more.get(i)) for i, (si, tok) in enumerate(zip(plan.batch, out.tokens))]
        return out


def repetitive_prompts(count: int, seed: int) -> list[list[int]]:
    """``count`` prompts that repeat a short random phrase 3-8 times: prompt lookup drafts for them,
    and their greedy continuations repeat (where the penalties act)."""
    rng = random.Random(seed)
    return [[rng.randrange(2, 320) for _ in range(rng.randint(2, 6))] * rng.randint(3, 8) for _ in range(count)]
