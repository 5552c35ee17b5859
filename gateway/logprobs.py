"""Token logprobs in OpenAI's shapes (checked against the ``openai`` SDK's types).

From the handles' lists of :class:`protocol.logprobs.TokenLogprob` (one per
token: its logprob and the top ``N`` alternatives as ``(id, logprob)``):

- completions, ``choices[].logprobs`` (``openai.types.completion_choice.Logprobs``):
  ``{"tokens": [str], "token_logprobs": [float | null], "top_logprobs":
  [{str: float} | null], "text_offset": [int]}``. As vLLM: ``top_logprobs``
  maps the chosen token first, then the ``N`` most likely (so ``logprobs: 0``
  gives the chosen token alone; two tokens with one string share a key);
  ``text_offset`` is each token's start in the choice's text (the token
  strings' lengths added up from 0, the echoed prompt's tokens included;
  in a stream, from what was sent before). An echoed prompt's first token
  has ``null`` logprob and ``null`` top logprobs (nothing comes before it).
- chat, ``choices[].logprobs.content`` (``ChatCompletionTokenLogprob``):
  ``[{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob",
  "bytes"}]}]``, ``top_logprobs`` exactly the ``N`` most likely (OpenAI's rule);
  ``bytes`` the token's own bytes (a byte-level BPE token holding part of a
  character gives that part, where its string shows U+FFFD).
- vLLM's ``prompt_logprobs`` on a choice: ``[null, {"<id>": {"logprob",
  "rank", "decoded_token"}}, ...]`` (the prompt token first, then its
  alternatives; ``rank``: 1-based among the alternatives, null when it is not
  among them).

JSON has no ``-inf``: a token the model gives probability 0 is ``-9999.0``,
vLLM's choice (``max(logprob, -9999.0)`` in its OpenAI server).

Token strings come from :class:`gateway.tokenizer.Tokenizer` (``token_str``),
else ``"token_id:N"``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from protocol.logprobs import TokenLogprob

FLOOR = -9999.0
"""What ``-inf`` (and anything below) is written as (vLLM's)."""

TokenStr = Callable[[int], str]


def clamp(logprob: float) -> float:
    """``logprob`` as JSON can carry it: at least :data:`FLOOR`."""
    return logprob if logprob >= FLOOR else FLOOR


def completion_logprobs(tokens: Sequence[int], entries: Sequence[TokenLogprob | None], token_str: TokenStr,
                        offset: int = 0) -> tuple[dict, int]:
    """``choices[].logprobs`` for ``tokens`` (``entries[i]`` scores ``tokens[i]``; None: an
    echoed prompt's first token), their text offsets counted from ``offset``. Returns the
    object and the offset after the last token."""
    strs, lps, tops, offsets = [], [], [], []
    for t, e in zip(tokens, entries):
        s = token_str(t)
        strs.append(s)
        offsets.append(offset)
        offset += len(s)
        if e is None:
            lps.append(None)
            tops.append(None)
            continue
        lps.append(clamp(e.logprob))
        top = {s: clamp(e.logprob)}
        for i, lp in e.top:
            top.setdefault(token_str(i), clamp(lp))
        tops.append(top)
    return {"tokens": strs, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}, offset


def merge_completion_logprobs(a: dict, b: dict) -> dict:
    """Two :func:`completion_logprobs` objects one after the other (an echoed prompt's, then the output's)."""
    return {k: a[k] + b[k] for k in a}


def utf8_bytes(token_str: TokenStr) -> Callable[[int], list[int]]:
    """A token's ``bytes`` when only its string is known: the string's UTF-8."""
    return lambda t: list(token_str(t).encode("utf-8", "replace"))


def chat_content(tokens: Sequence[int], entries: Sequence[TokenLogprob], token_str: TokenStr,
                 token_bytes: Callable[[int], list[int]] | None = None) -> list[dict]:
    """``choices[].logprobs.content`` for ``tokens`` (``entries[i]`` scores ``tokens[i]``);
    ``token_bytes``: a token's ``bytes`` (default: its string's UTF-8)."""
    tb = token_bytes or utf8_bytes(token_str)
    out = []
    for t, e in zip(tokens, entries):
        entry = {"token": token_str(t), "logprob": clamp(e.logprob), "bytes": tb(t),
                 "top_logprobs": [{"token": token_str(i), "logprob": clamp(lp), "bytes": tb(i)} for i, lp in e.top]}
        out.append(entry)
    return out


def vllm_prompt_logprobs(prompt: Sequence[int], entries: Sequence[TokenLogprob | None],
                         token_str: TokenStr) -> list[dict | None]:
    """vLLM's ``prompt_logprobs`` of a choice (see the module docstring)."""
    out: list[dict | None] = []
    for t, e in zip(prompt, entries):
        if e is None:
            out.append(None)
            continue
        ranks = {i: r for r, (i, _) in enumerate(e.top, 1)}
        d = {str(t): {"logprob": clamp(e.logprob), "rank": ranks.get(t), "decoded_token": token_str(t)}}
        for r, (i, lp) in enumerate(e.top, 1):
            d.setdefault(str(i), {"logprob": clamp(lp), "rank": r, "decoded_token": token_str(i)})
        out.append(d)
    return out
