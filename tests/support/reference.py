"""Reference runs: what a request must produce, computed another way.

- :func:`spec_reference`: the spec's per-request semantics re-stated as plainly
  as possible (no engine), the oracle for the engine's batch invariance.
- :func:`simulated_references` / :func:`simulated_reference`: the in-process
  engine over :class:`~worker.SimulatedLLM` with the worker's default stop
  token (0), no broker, no faults: what a cluster serving ``"simulated"`` must
  return (SimulatedLLM is a pure function of the sequence, so the batch size
  changes nothing).
- :func:`greedy_generate`: transformers' own ``generate`` for one prompt,
  greedy, batch 1, no padding: the reference for the model backends.
- :func:`gguf_parsed_once`: transformers' loading of a GGUF file (the references'
  models and tokenizers) with the file's metadata parsed once, not once a call.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

from protocol.enums import FinishReason
from worker import BatchInferenceEngine, SimulatedLLM


def spec_reference(model, prompt, max_tokens, stop_tokens=frozenset(), stop_sequences=(),
              resume_tokens=()):
    """The spec's semantics for one request alone, written as plainly as possible.

    Returns (sequence, finish_reason as str). Stop sequences are matched on the
    generated tokens (resume tokens included) by re-checking every suffix.
    """
    seq = list(prompt) + list(resume_tokens)
    generated = list(resume_tokens)
    while True:
        token = model.next_token(seq) if hasattr(model, "next_token") else \
            model.next_tokens([list(seq)])[0]
        seq.append(token)
        generated.append(token)
        if token in stop_tokens:
            return seq, "stop"
        for s in stop_sequences:
            if len(generated) >= len(s) and tuple(generated[-len(s):]) == tuple(s):
                return seq, "stop"
        if len(generated) >= max_tokens:
            return seq, "length"


def simulated_references(requests, *, batch_size: int = 8) -> list[tuple[list[int], FinishReason]]:
    """``(tokens, finish_reason)`` per ``(prompt, max_tokens, options)`` of
    ``requests``, from one in-process engine run over SimulatedLLM (stop token 0)."""
    engine = BatchInferenceEngine(SimulatedLLM(), batch_size=batch_size, stop_token=0)
    handles = [engine.submit_request(prompt, max_tokens, **options) for prompt, max_tokens, options in requests]
    engine.run()
    return [(h.tokens, h.finish_reason) for h in handles]


def simulated_reference(prompt: list[int], max_tokens: int, **options) -> tuple[list[int], str]:
    """Tokens and finish reason (as its wire string) of one request run alone."""
    tokens, reason = simulated_references([(prompt, max_tokens, options)], batch_size=1)[0]
    return tokens, reason.value


def greedy_generate(model, prompt: list[int], max_new_tokens: int, **generate_options) -> list[int]:
    """The tokens transformers' ``model.generate`` appends to ``prompt`` (greedy,
    batch 1, an all-ones attention mask); ``generate_options`` go to ``generate``
    as they are (``eos_token_id``, ``pad_token_id``)."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_new_tokens, do_sample=False, **generate_options)
    return out[0, len(prompt):].tolist()


@contextmanager
def gguf_parsed_once():
    """Within the block, transformers' GGUF loads parse each file's metadata, and build each
    tensor-name map, once.

    ``from_pretrained(..., gguf_file=...)`` parses the file twice (the config, then the weights)
    and ``AutoTokenizer`` once more, each through ``gguf.GGUFReader``, which builds a numpy view
    per element (Qwen2.5's 151,936 tokens and merges: ~12 s a parse, niced on a busy 2-core
    host). Here the reader of a path is made at its first call and handed out again (read-only,
    mode ``r``: transformers converts from it as before, into values and tensors of its own).
    Measured, Qwen2.5-Coder-0.5B's ``from_pretrained`` after its ``AutoTokenizer``: 41.0 -> 18.5 s
    CPU. Its weights' names: transformers asks ``gguf.get_tensor_name_map(arch, layers)`` once
    per submodule of the model (397 times for SmolLM2, each map built anew, 15 % of
    test_structured's time); here each ``(arch, layers)``'s map is built once (transformers only
    looks names up in it). Nothing changes where gguf is not installed."""
    try:
        import gguf
    except ImportError:
        yield
        return
    real_reader, real_name_map, readers, name_maps = gguf.GGUFReader, gguf.get_tensor_name_map, {}, {}

    def reader(path, mode="r"):
        key = (os.path.realpath(path), mode)
        if key not in readers:
            readers[key] = real_reader(path, mode)
        return readers[key]

    def name_map(arch, n_blocks):
        if (arch, n_blocks) not in name_maps:
            name_maps[arch, n_blocks] = real_name_map(arch, n_blocks)
        return name_maps[arch, n_blocks]

    gguf.GGUFReader, gguf.get_tensor_name_map = reader, name_map
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = real_reader, real_name_map
