"""Shared helpers for the engine tests (this module holds no tests itself).

- :class:`ScriptedModel`: emits a fixed token script per request, chosen by
  the prompt's first token, so tests control exactly what is generated.
- :class:`FakeClock`: a settable monotonic clock for deadline tests.

(The oracle for batch invariance, :func:`tests.support.reference.spec_reference`,
lives with the other references.)
"""

from __future__ import annotations

import threading


class FakeClock:
    """Monotonic seconds that only move when a test calls :meth:`advance`."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class ScriptedModel:
    """Stateless model: request with prompt ``[k, ...]`` generates ``scripts[k]`` in order.

    Generation index = ``len(seq) - prompt_len``; past the end of a script it
    repeats the script's last token. Records every call's batch (as tuples).
    """

    vocab_size = 100

    def __init__(self, scripts: dict[int, list[int]], prompt_len: int = 1) -> None:
        self.scripts = scripts
        self.prompt_len = prompt_len
        self.calls: list[list[tuple[int, ...]]] = []

    def next_tokens(self, sequences: list[list[int]]) -> list[int]:
        self.calls.append([tuple(s) for s in sequences])
        out = []
        for s in sequences:
            script = self.scripts[s[0]]
            i = len(s) - self.prompt_len
            out.append(script[min(i, len(script) - 1)])
        return out


class GatedModel:
    """Wraps a model; its first ``gated_calls`` calls block until :meth:`release`.

    ``entered`` is set when a gated call has started, so another thread can
    act "while the model runs" without sleeping.
    """

    def __init__(self, inner, gated_calls: int = 1) -> None:
        self.inner = inner
        self.vocab_size = getattr(inner, "vocab_size", None)
        self.gated_calls = gated_calls
        self.entered = threading.Event()
        self._go = threading.Event()
        self.calls = 0

    def release(self) -> None:
        self._go.set()

    def next_tokens(self, sequences):
        self.calls += 1
        if self.calls <= self.gated_calls:
            self.entered.set()
            assert self._go.wait(10), "test never released the gated model"
        return self.inner.next_tokens(sequences)
