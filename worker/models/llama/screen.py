"""Exact greedy picks from an fp32 LM head at about a bf16 product's cost: screen in bf16, decide in fp32.

When it applies: to plain greedy rows only
(:attr:`protocol.request.SamplingParams.is_plain_greedy`: greedy, no
``logit_bias``, no penalty), whose token is the argmax of the raw logits.
A row with a processor can pick a token far from the raw argmax (a bias of
+100), so it gets the full head and the sampler processes all its logits:
the simplest exact choice, and it costs such a row only what a sampled
row pays already.

A greedy row needs only the argmax of its fp32 logits ``f = W h`` (``W``
``[V, K]`` fp32, ``h`` ``[K]`` fp32). A bf16 product ``a`` (``h`` and ``W``
rounded to bf16, products summed in fp32 by oneDNN, the result rounded to
bf16) reads half the bytes, and differs from ``f`` by at most, per entry
``j`` (Cauchy-Schwarz on each rounding; ``u = 2^-8`` bf16's and ``u32 =
2^-24`` fp32's unit roundoff, ``gamma = K u32 / (1 - K u32)`` the bound of
an fp32 sum of ``K`` products, Higham, "Accuracy and Stability of Numerical
Algorithms", 2002, section 3.1):

    |a_j - f_j| <= ||h - bf(h)|| ||bf(w_j)|| + ||h|| ||w_j - bf(w_j)||
                   + gamma (||h|| ||w_j|| + ||bf(h)|| ||bf(w_j)||) + u / (1 - u) |a_j|

plus, because oneDNN's bf16 product flushes subnormal inputs, products,
partial sums and results to zero where the fp32 head keeps them, one term
per flush (each changes the sum by less than ``t = 2^-126``, the smallest
normal number): ``t (2 K + 1 + sqrt(K) (||bf(w_j)|| + ||bf(h)||))`` (a
subnormal input times the other factor, summed over ``K``, is at most
``t ||.||_1 <= t sqrt(K) ||.||``). It is taken with each weight norm at its
maximum over the vocabulary, so one bound ``E`` per row. Every ``j`` whose ``a_j + E`` reaches ``max_k a_k -
E`` is a candidate (the fp32 argmax always is: ``f`` at the argmax is at
least ``f_k >= a_k - E`` for every ``k``), and the candidates' fp32 logits
are computed exactly from ``W``'s own rows; the row's logits are those, and
``-inf`` elsewhere, so ``argmax`` picks what the full fp32 head would (up to
the order of the fp32 sums, as between any two fp32 GEMMs). On SmolLM2 a
row has a few candidates; a row with more than :data:`MAX_CANDIDATES` (a
nearly flat distribution) gets the full fp32 product instead, and so does a
finite row whose bf16 product or bound is not finite (a value past bf16's
range, ~3.39e38, that fp32 still holds).

SmolLM2-135M's LM head is 49,152 x 576 (113 MB in fp32): at 8 rows on a
2-core AMD EPYC (avx512_bf16), 2 threads, oneDNN's packed fp32 product took
4.2 ms and the bf16 one 2.0 ms (24 rows: 7.6 and 4.2 ms).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from worker.models.llama.linear import PackedLinear, best_times

SCREEN_SHARE = 0.75
"""The screen is used when its bf16 product takes at most this share of the fp32 head's time at
8 rows (what remains pays for the bound and the candidates; measured: ~0.4 ms at 8 rows)."""

MAX_CANDIDATES = 256
"""Candidates per row above which the row takes the full fp32 product (a gather of more
rows of ``W`` costs about as much)."""

_U16, _U32 = 2.0 ** -8, 2.0 ** -24
_MIN_NORMAL = 2.0 ** -126  # fp32's and bf16's smallest normal number: what a flush to zero can lose
_SLACK = 1.001  # the bound's own fp64 -> fp32 rounding and the fp32 comparisons, generously


class ScreenedHead:
    """An fp32 LM head's greedy picks: ``head.greedy_logits(x)``, exact at the argmax.

    ``weight`` ``[V, K]`` fp32; ``full`` the fp32 head's own product (whole
    logits, for the rows the screen cannot decide); ``rows(ids)`` returns ``weight[ids]`` as
    fp32, bit for bit (e.g. the embedding, when the head is tied to it and
    stored exactly). Raises ValueError without oneDNN's bf16 product, or
    for a ``weight`` with a non-finite entry (its norms would not bound).
    """

    __slots__ = ("full", "screen", "rows", "_bw_max", "_delta_max", "_w_max", "_gamma", "_flush", "_root_k")

    CHUNK_ROWS = 4096  # vocabulary rows per pass of the norms at load: small temporaries

    def __init__(self, weight: torch.Tensor, full, rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
        if not bf16_product_available():
            raise ValueError("the screened head needs oneDNN's bf16 product, which this CPU or torch lacks")
        if not bool(torch.isfinite(weight).all()):
            raise ValueError("the screened head needs finite weights")
        self.full, self.rows = full, rows
        vocab, k = weight.shape
        self.screen = PackedLinear(weight, None, "onednn", torch.bfloat16)
        w_max = bw_max = delta_max = 0.0
        for start in range(0, vocab, self.CHUNK_ROWS):
            w = weight[start:start + self.CHUNK_ROWS].double()
            bw = weight[start:start + self.CHUNK_ROWS].to(torch.bfloat16).double()
            w_max = max(w_max, w.norm(dim=1).max().item())
            bw_max = max(bw_max, bw.norm(dim=1).max().item())
            delta_max = max(delta_max, (w - bw).norm(dim=1).max().item())
        self._w_max, self._bw_max, self._delta_max = w_max, bw_max, delta_max
        self._gamma = k * _U32 / (1 - k * _U32)
        self._root_k = math.sqrt(k)
        self._flush = _MIN_NORMAL * (2 * k + 1 + self._root_k * bw_max)  # + _MIN_NORMAL sqrt(K) ||bf(h)|| per row

    def greedy_logits(self, x: torch.Tensor) -> torch.Tensor:
        """``[M, V]`` fp32 for ``x`` ``[M, K]`` fp32: each row's fp32 logits at its candidates, ``-inf`` elsewhere.

        A non-finite ``x`` row gives a row with no finite entry (no
        candidate passes a NaN comparison), which the sampler reports.
        """
        xb = x.to(torch.bfloat16)
        approx = self.screen(xb).float()  # the bf16-rounded products
        xd, bh = x.double(), xb.double()
        h = xd.norm(dim=1)
        bh_norm = bh.norm(dim=1)
        bound = ((xd - bh).norm(dim=1) * self._bw_max + h * self._delta_max
                 + self._gamma * (h * self._w_max + bh_norm * self._bw_max)
                 + self._flush + _MIN_NORMAL * self._root_k * bh_norm)  # E without the output rounding
        top = approx.amax(dim=1).double()
        # a finite row the bf16 product or the bound cannot cover (past bf16's range): the full product
        unscreenable = torch.isfinite(x).all(dim=1) & ~(
            torch.isfinite(top) & torch.isfinite(approx.amin(dim=1)) & torch.isfinite(bound))
        # The output rounding adds c |a_j| to entry j's bound: j is a candidate when
        # a_j + E + c |a_j| >= top - E - c |top|, which bounds |a_j| by `size` below; so
        # every candidate passes a_j >= threshold, one comparison per entry.
        c = _U16 / (1 - _U16)
        size = (top.abs() * (1 + c) + 2 * bound) / (1 - c)
        threshold = (top - (2 * bound + c * (top.abs() + size)) * _SLACK).float()
        r, j = entries_at_least(approx, threshold)
        out = approx.fill_(float("-inf"))
        counts = torch.bincount(r, minlength=len(x))
        wide = (counts > MAX_CANDIDATES) | unscreenable
        if bool(wide.any()):
            many = wide.nonzero()[:, 0]
            out[many] = self.full(x[many])
            keep = ~wide[r]
            r, j = r[keep], j[keep]
        if len(j):
            out[r, j] = (self.rows(j) * x[r]).sum(dim=1)
        return out


def entries_at_least(values: torch.Tensor, threshold: torch.Tensor, block: int = 64
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rows, columns)`` of the entries of ``values`` ``[M, V]`` at or above their row's ``threshold`` ``[M]``.

    What ``(values >= threshold[:, None]).nonzero(as_tuple=True)`` returns, in
    the same order, through blocks of ``block`` columns when ``V`` is a
    multiple of it: a block's maximum (a vectorised reduction) decides
    whether its entries are compared at all, so the comparison and the
    nonzero run on a few blocks, not on ``M x V`` entries (measured at 24 x
    49,152 on 2 threads: ~0.1 ms against ~0.75 ms). A NaN hides the other
    entries of its block (``amax`` propagates it), which is the same answer
    for the screen's rows: a NaN there means a non-finite hidden state.
    """
    rows, width = values.shape
    if width % block:
        return (values >= threshold[:, None]).nonzero(as_tuple=True)
    blocks = values.view(rows, width // block, block)
    r, b = (blocks.amax(dim=2) >= threshold[:, None]).nonzero(as_tuple=True)
    k, e = (blocks[r, b] >= threshold[r][:, None]).nonzero(as_tuple=True)
    return r[k], b[k] * block + e


def bf16_product_available() -> bool:
    """Whether oneDNN can multiply bf16 here (natively, or emulated on AVX-512)."""
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def screened_head(weight: torch.Tensor, full, rows: Callable[[torch.Tensor], torch.Tensor],
                  use: bool | None = None, passes: int = 5) -> ScreenedHead | None:
    """A :class:`ScreenedHead` over ``weight`` (``full`` and ``rows`` as there), or None.

    ``use``: True always (ValueError without oneDNN's bf16 product), False
    never, None when the bf16 product at 8 rows takes at most
    :data:`SCREEN_SHARE` of ``full``'s (best of ``passes`` each, taking turns;
    a CPU without native bf16 usually fails this).
    """
    if use is False or (use is None and not bf16_product_available()):
        return None
    try:
        head = ScreenedHead(weight, full, rows)
    except ValueError:
        if use:
            raise
        return None  # (non-finite weights)
    if use:
        return head
    x = torch.randn(8, weight.shape[1], generator=torch.Generator().manual_seed(0))
    best = best_times({"full": lambda: full(x), "screen": lambda: head.screen(x)}, passes)
    return head if best["screen"] <= SCREEN_SHARE * best["full"] else None
