"""The interface every reasoning parser has, :class:`SplitStream` (as :mod:`gateway.call_stream`
holds the tool-call parsers'): the parsers are named in :mod:`gateway.reasoning`."""

from __future__ import annotations

__all__ = ["SplitStream"]


class SplitStream:
    """What every reasoning parser is: one choice's output split into reasoning and answer as it is
    generated: :meth:`feed` the text, get ``[("reasoning" | "content", text), ...]`` (only non-empty
    pieces, neighbours of one kind joined), then :meth:`finish` for what was held back. A subclass
    gives :meth:`_step` (consume what ``_buf`` allows; True when its state changed)."""

    __slots__ = ("_state", "_buf")

    def feed(self, text: str) -> list[tuple[str, str]]:
        self._buf += text
        out: list[tuple[str, str]] = []
        while self._step(out, final=False):
            pass
        return out

    def finish(self) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while self._step(out, final=True):
            pass
        return out

    def _step(self, out: list, final: bool) -> bool:
        raise NotImplementedError

    @staticmethod
    def _emit(out: list, kind: str, text: str) -> None:
        if text:
            if out and out[-1][0] == kind:
                out[-1] = (kind, out[-1][1] + text)
            else:
                out.append((kind, text))
