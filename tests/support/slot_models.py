"""Scenarios shared by the tests of both runners (worker/models/hf.py and worker/models/llama/)."""

from __future__ import annotations

from worker.models.base import SlotInput


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
        for item, tok in zip(batch, model.step(batch)):
            item.tokens.append(tok)
    for slot, seq in seqs.items():
        results[tuple(origin[slot])] = seq[len(origin[slot]):]
    assert len(results) == 5
    return results
