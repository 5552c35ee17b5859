"""Token log-probabilities: what a request that asks for ``logprobs`` or ``prompt_logprobs`` gets back.

One :class:`TokenLogprob` per scored token, carried from the model's sampler
to the engine's handle, on the wire (:class:`protocol.messages.Logprobs`) and
to the client's handle, the gateway's OpenAI shapes and ``slotserve run``
rows. Values are natural logarithms of the model's *raw* distribution: the
``log_softmax`` of its logits before the logits processors, the temperature
and the filters (vLLM's default, ``logprobs_mode="raw_logprobs"``), so they
score the text whatever the request's sampling options.
"""

from __future__ import annotations

from typing import NamedTuple

MAX_LOGPROBS = 20
"""Most alternatives per token a request may ask for (``logprobs``, ``prompt_logprobs``): OpenAI's
``top_logprobs`` bound (chat; 5 for legacy completions, which vLLM lifts to 20 as here)."""


class TokenLogprob(NamedTuple):
    """One scored token.

    - ``logprob``: natural log of the token's probability given the tokens
      before it, from the raw distribution (see the module docstring); a
      float <= 0 (``-inf`` for a token the model gives probability 0).
    - ``top``: the ``N`` most likely tokens at that position as ``(token id,
      logprob)`` pairs, most likely first (ties by lower id), ``N`` being the
      request's ``logprobs`` (generated tokens) or ``prompt_logprobs``
      (prompt tokens); ``()`` when ``N`` is 0. The scored token itself is in
      it only when it ranks among the ``N``.
    """

    logprob: float
    top: tuple[tuple[int, float], ...] = ()
