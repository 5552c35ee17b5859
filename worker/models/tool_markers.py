"""Tool-call markers that some tokenizers hold as special tokens, kept as the text they stand for.

Mistral's ``[TOOL_CALLS]``, ``[ARGS]`` and ``[CALL_ID]`` and Llama 3's ``<|python_tag|>`` are
special (control) tokens of their tokenizers, so decoding with ``skip_special_tokens`` (the
worker's default, as vLLM's) leaves them out of the text, and the gateway's tool-call parser
(``--tool-call-parser mistral``) never sees a call start; llguidance, likewise, treats a special
token as no text at all, so a grammar's ``"[TOOL_CALLS]"`` never matches the token the model
writes. Both read these tokens as their text instead: llama.cpp's ``preserved_tokens`` of a chat
format (``common/chat.cpp``), and vLLM's ``skip_special_tokens=False`` for its Mistral parser
(``MistralToolParser.adjust_request``), which this does for these tokens only: EOS and the other
control tokens stay out of the text.

gpt-oss's harmony markers (``<|start|>``, ``<|end|>``, ``<|message|>``, ``<|channel|>``,
``<|constrain|>``: :data:`HARMONY_MARKERS`) are kept so too, in a tokenizer that has
``<|channel|>`` only: ``<|end|>`` is another family's end-of-turn token (Phi-3's), which must
stay out of the text. The harmony stop tokens ``<|return|>`` and ``<|call|>`` stay special (they
end the output, as EOS does in every family).
"""

from __future__ import annotations

import json

__all__ = ["HARMONY_MARKERS", "TOOL_MARKERS", "kept_markers", "markers_as_text"]

TOOL_MARKERS = frozenset({"[TOOL_CALLS]", "[ARGS]", "[CALL_ID]", "<|python_tag|>"})
"""Special tokens that are tool-call markers (Mistral v3+/v11+, Llama 3.x), decoded as their text."""
HARMONY_MARKERS = frozenset({"<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>"})
"""gpt-oss's harmony markers, decoded as their text in a tokenizer that has ``<|channel|>``."""


def kept_markers(contents) -> frozenset[str]:
    """The markers kept as text in a tokenizer whose added tokens' texts are ``contents``:
    :data:`TOOL_MARKERS`, and :data:`HARMONY_MARKERS` where ``<|channel|>`` is one of them."""
    return TOOL_MARKERS | HARMONY_MARKERS if "<|channel|>" in set(contents) else TOOL_MARKERS


def markers_as_text(tokenizer_json: str) -> str | None:
    """The tokenizers-library JSON ``tokenizer_json`` with its special added tokens that are
    :func:`kept_markers` marked not special (so ``skip_special_tokens`` keeps them), or None when it
    has none (nothing to change)."""
    data = json.loads(tokenizer_json)
    kept = kept_markers(t.get("content") for t in data.get("added_tokens") or ())
    marked = [t for t in data.get("added_tokens") or () if t.get("special") and t.get("content") in kept]
    for t in marked:
        t["special"] = False
    return json.dumps(data, ensure_ascii=False) if marked else None
